"""Released DiffRetriever checkpoints (``ielabgroup/diffretriever-*``): a LoRA adapter beside the retriever's settings.

The reference's save code (ielab/diffretriever, ``src/models/diffretriever_trainable.py`` at 1689527) writes a
fine-tuned retriever as a folder holding:

- ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``): peft's LoRA adapter, no base weights and
  no ``config.json`` (the reference then loads the base from its family's hub model and attaches the adapter);
- ``retriever_config.json``: ``model_type`` (``dream``, ``llada1``, ``llada15``), ``n_gen_q_tokens`` /
  ``n_gen_p_tokens`` (the trained K_q, K_p; ``n_gen_tokens`` when both are one), ``num_denoise_steps``,
  ``max_length``, ``mask_token_id``, the prompt as token ids (``query_prefix_ids``, ``query_suffix_ids``,
  ``passage_prefix_ids``, ``passage_suffix_ids``, rendered through the chat template at training time with the
  prompt's number words at the trained K) and ``n_tail`` (tokens after the masks: quote, end of turn, EOS);
- the tokenizer files.

diffret loads such a folder (or hub id) natively: the base through transformers' own classes, the adapter applied
by peft (LLaDA's adapter names mapped onto the Llama modules), the prompt from the ids above and the budget from
the trained K, so ``--model ielabgroup/diffretriever-llada-8b-single`` needs no remote code and no other option.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RELEASED_CONFIG = "retriever_config.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
CHECKPOINT_PROMPT = "checkpoint"  # ReadoutConfig.prompt: the checkpoint's own prompt ids

# the reference's model_type -> (diffret family, the base model its loader takes from the hub: backbone_adapters.py)
MODEL_TYPES: dict[str, tuple[str, str]] = {
    "dream": ("dream", "Dream-org/Dream-v0-Instruct-7B"),
    "llada1": ("llada", "GSAI-ML/LLaDA-8B-Instruct"),
    "llada15": ("llada", "GSAI-ML/LLaDA-1.5"),
}
_UNSUPPORTED = ("use_k_adapter", "use_k_pre_encoder")  # the K-router heads: not part of the released models
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ReleasedError(ValueError):
    """A released-layout folder that cannot be read as one; the message names the file and what is wrong."""


class ReleasedUnreadable(ReleasedError):
    """A hub id that may be a released checkpoint whose settings cannot be read: the hub cannot be reached and the hub
    cache holds no copy. Its trained budget and prompt are unknown, so nothing is assumed silently."""


_UNREADABLE_TTL = 60.0  # seconds an unreachable hub answer is reused before the hub is asked again
_UNREADABLE: dict[str, tuple[float, str]] = {}  # repo -> (when, why): one wait on an unreachable hub per command
_ASSUMED: ContextVar[list[str] | None] = ContextVar("released_assumed", default=None)


@contextlib.contextmanager
def assume_unreadable_not_released() -> Iterator[list[str]]:
    """Within this block a checkpoint whose settings cannot be read (:class:`ReleasedUnreadable`) counts as not a
    released one, and each such message is collected in the list it yields: for a plan that loads and writes nothing
    (``diffret run --dry-run``) and says what it assumed. Everywhere else the error is raised.

    >>> with assume_unreadable_not_released() as unread:
    ...     read_released("org/some-base") is None, unread
    (True, [])
    """
    notes: list[str] = []
    token = _ASSUMED.set(notes)
    try:
        yield notes
    finally:
        _ASSUMED.reset(token)


@dataclass(frozen=True)
class ReleasedCheckpoint:
    """What a released checkpoint's ``retriever_config.json`` fixes: the trained budget, the prompt ids, the base."""

    folder: str
    model_type: str
    family: str
    base: str  # the base model the adapter applies to (a local folder or hub id)
    kq: int
    kp: int
    max_length: int
    denoise_steps: int
    mask_token_id: int
    prefix: dict[str, tuple[int, ...]]  # side -> the prompt ids before the text
    suffix: dict[str, tuple[int, ...]]  # side -> the prompt ids after it, through the assistant prefix
    n_tail: int

    def budget(self, side: str) -> int:
        """The trained K of a side (``query`` or ``passage``)."""
        return self.kq if side == "query" else self.kp


def is_released_folder(folder: Path) -> bool:
    """Whether a local folder has the released layout: the retriever's settings and a LoRA adapter, no base config.

    >>> import tempfile
    >>> is_released_folder(Path(tempfile.mkdtemp()))
    False
    """
    return (
        (folder / RELEASED_CONFIG).is_file()
        and (folder / ADAPTER_CONFIG).is_file()
        and any((folder / w).is_file() for w in ADAPTER_WEIGHTS)
        and not (folder / "config.json").exists()
    )


def released_folder(model: str | None) -> Path | None:
    """The local folder of a released checkpoint named by ``model`` (a folder, or a hub id fetched into the hub
    cache), or None when ``model`` is not one.

    A hub id is looked up once per process (:func:`_hub_snapshot`): its ``retriever_config.json`` first (a base model
    has none, and is left alone), then the whole repository (adapter, settings, tokenizer: small beside the base).
    A hub id the hub cannot be asked about (offline, no cached copy) raises :class:`ReleasedUnreadable`, except
    within :func:`assume_unreadable_not_released`.

    >>> released_folder("org/not-a-released-model") is None or True
    True
    """
    if not model:
        return None
    local = Path(model).expanduser()
    if local.exists():
        return local if local.is_dir() and is_released_folder(local) else None
    if not _HUB_ID.match(model):
        return None
    try:
        return _hub_snapshot(model)
    except ReleasedUnreadable as exc:
        assumed = _ASSUMED.get()
        if assumed is None:
            raise
        if str(exc) not in assumed:
            assumed.append(str(exc))
        return None


def _hub_snapshot(repo: str) -> Path | None:
    """The repository's snapshot when it is a released checkpoint, None when it is not one (the hub says the
    repository or its ``retriever_config.json`` does not exist; the cache holds the repository's ``config.json``: a
    full model); :class:`ReleasedUnreadable` when the hub cannot tell (offline, unreachable) and the cache holds no
    copy. The hub is asked only for a repository whose name says so (``*diffretriever*``, as the released ones are
    named) or whose settings file is in the hub cache already: every other hub id (a base model) costs no network
    round trip. An unreachable hub is asked again after a minute, not at every call of one command."""
    from huggingface_hub import file_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo, RELEASED_CONFIG)
    known_absent = cached is getattr(file_download, "_CACHED_NO_EXIST", object())  # the cache recorded: no such file
    if known_absent or (not isinstance(cached, str) and "diffretriever" not in repo.lower()):
        return None
    failed = _UNREADABLE.get(repo)
    if failed is not None and time.monotonic() - failed[0] < _UNREADABLE_TTL:
        raise ReleasedUnreadable(failed[1])
    try:
        return _hub_fetch(repo)
    except ReleasedUnreadable as exc:
        _UNREADABLE[repo] = (time.monotonic(), str(exc))
        raise


@functools.lru_cache(maxsize=32)
def _hub_fetch(repo: str) -> Path | None:
    """:func:`_hub_snapshot`'s download (its answers kept for the process; an unreachable hub's is not)."""
    from huggingface_hub import constants, errors, hf_hub_download, snapshot_download, try_to_load_from_cache

    not_there = (
        getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError),
        errors.RepositoryNotFoundError,
        errors.RevisionNotFoundError,
    )

    try:
        hf_hub_download(repo, RELEASED_CONFIG)
        folder = Path(snapshot_download(repo))
    except errors.LocalEntryNotFoundError as exc:  # offline or unreachable, and not in the cache
        if isinstance(try_to_load_from_cache(repo, "config.json"), str):
            return None  # a full model in the cache (a released checkpoint has no config.json)
        why = (
            "HF_HUB_OFFLINE is set"
            if constants.HF_HUB_OFFLINE
            else f"the Hugging Face hub cannot be reached ({_first_line(exc.__cause__ or exc)})"
        )
        raise ReleasedUnreadable(
            f"cannot read the settings of {repo!r} ({RELEASED_CONFIG}: a released checkpoint's trained K_q, K_p and "
            f"prompt): {why} and the hub cache ({constants.HF_HUB_CACHE}) holds no copy; connect once (it is then "
            f"cached), or give a local copy as --model (`hf download {repo} --local-dir DIR` where the hub is "
            "reachable)"
        ) from None
    except not_there as exc:
        if isinstance(exc, errors.GatedRepoError):  # there, but not readable with this token
            raise ReleasedUnreadable(
                f"cannot read the settings of {repo!r} ({RELEASED_CONFIG}): the repository is "
                "gated; log in (`hf auth login`) with access to it"
            ) from None
        return None  # the hub says: no such repository, or no settings file in it
    except Exception as exc:  # noqa: BLE001 - any other hub failure (refused, server error): cannot tell
        raise ReleasedUnreadable(
            f"cannot read the settings of {repo!r} ({RELEASED_CONFIG}) from the Hugging Face hub: {_first_line(exc)}"
        ) from None
    return folder if is_released_folder(folder) else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def read_released(model: str | None) -> ReleasedCheckpoint | None:
    """The released checkpoint ``model`` names (see :func:`released_folder`), parsed; None when it is not one.

    >>> read_released("org/some-base") is None
    True
    """
    folder = released_folder(model)
    if folder is None:
        return None
    st = (folder / RELEASED_CONFIG).stat()
    return _parse(str(folder.resolve()), st.st_size, st.st_mtime_ns)


def _ids(cfg: dict[str, Any], key: str, path: Path) -> tuple[int, ...]:
    value = cfg.get(key)
    if not isinstance(value, list) or not all(isinstance(i, int) and i >= 0 for i in value):
        raise ReleasedError(f"{path}: {key} must be a list of token ids, got {str(value)[:80]}")
    return tuple(value)


@functools.lru_cache(maxsize=32)
def _parse(folder: str, _size: int, _mtime: int) -> ReleasedCheckpoint:
    path = Path(folder) / RELEASED_CONFIG
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ReleasedError(f"{path}: unreadable ({exc})") from None
    if not isinstance(cfg, dict):
        raise ReleasedError(f"{path}: not a JSON object")
    mtype = str(cfg.get("model_type", "dream"))
    if mtype not in MODEL_TYPES:
        raise ReleasedError(
            f"{path}: model_type {mtype!r} is not one diffret loads natively ({', '.join(MODEL_TYPES)})"
        )
    on = [k for k in _UNSUPPORTED if cfg.get(k)]
    if on:
        raise ReleasedError(f"{path}: {on[0]} is set; the K-router heads of the reference are not supported")
    k = cfg.get("n_gen_tokens")
    kq = _slots(cfg.get("n_gen_q_tokens") or k, "n_gen_q_tokens", path)
    kp = _slots(cfg.get("n_gen_p_tokens") or k, "n_gen_p_tokens", path)
    try:
        max_length, steps = int(cfg.get("max_length", 512)), int(cfg.get("num_denoise_steps") or 1)
        mask = int(cfg["mask_token_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ReleasedError(
            f"{path}: mask_token_id, max_length and num_denoise_steps must be integers ({exc})"
        ) from None
    family, hub = MODEL_TYPES[mtype]
    n_tail = cfg["n_tail"] if "n_tail" in cfg else (1 if cfg.get("use_eos") else 0)  # the reference's legacy rule
    return ReleasedCheckpoint(
        folder=folder,
        model_type=mtype,
        family=family,
        base=_base(Path(folder), hub),
        kq=kq,
        kp=kp,
        max_length=max_length,
        denoise_steps=min(steps, max(kq, kp)),
        mask_token_id=mask,
        prefix={s: _ids(cfg, f"{s}_prefix_ids", path) for s in ("query", "passage")},
        suffix={s: _ids(cfg, f"{s}_suffix_ids", path) for s in ("query", "passage")},
        n_tail=int(n_tail),
    )


def _slots(v: Any, name: str, path: Path) -> int:
    """``v``, a mask count of the config (``name``), when it is a positive integer (else ReleasedError)."""
    if not isinstance(v, int) or v < 1:
        raise ReleasedError(f"{path}: {name} (or n_gen_tokens) must be a positive integer, got {v!r}")
    return v


def _base(folder: Path, hub: str) -> str:
    """The base model: the adapter's ``base_model_name_or_path`` where it names a folder here or a hub id; else (a
    path on the machine it was trained on) the family's hub model, as the reference's loader takes it."""
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    except (OSError, ValueError, AttributeError):
        raise ReleasedError(f"{folder / ADAPTER_CONFIG}: unreadable") from None
    if base and Path(base).expanduser().is_dir():
        return os.path.realpath(Path(base).expanduser())
    if base and _HUB_ID.match(base) and not base.startswith((".", "/", "~")):
        return base
    return hub


def released_fingerprint(model: str | None) -> str | None:
    """A content fingerprint of a released checkpoint: its adapter's weights and config and its retriever settings
    (the trained budget and prompt ids), or None when ``model`` is not one.

    >>> released_fingerprint("org/some-base") is None
    True
    """
    import hashlib

    from .backbones import weights_fingerprint

    folder = released_folder(model)
    if folder is None:
        return None
    h = hashlib.sha256((weights_fingerprint(str(folder)) or "").encode())
    h.update((folder / RELEASED_CONFIG).read_bytes())
    return h.hexdigest()[:16]


def adapter_state(folder: Path) -> dict[str, Any]:
    """The adapter's tensors as peft saved them (safetensors, else the ``.bin`` pickle)."""
    import torch

    if (folder / ADAPTER_WEIGHTS[0]).is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / ADAPTER_WEIGHTS[0]))
    return torch.load(str(folder / ADAPTER_WEIGHTS[1]), map_location="cpu", weights_only=True)


def remap_adapter(
    state: dict[str, Any], key_mapping: dict[str, str], targets: list[str]
) -> tuple[dict[str, Any], list[str]]:
    """An adapter saved on a checkpoint's own module names (LLaDA's ``transformer.blocks.N.attn_out``, ...) renamed
    onto transformers' classes with the loader's ``key_mapping`` (the weights' own mapping), and the target module
    names it then wraps.

    >>> sd = {"base_model.model.model.transformer.blocks.0.attn_out.lora_A.weight": 1,
    ...       "base_model.model.model.transformer.ff_out.lora_B.weight": 2}
    >>> keys = {r"^model\\.transformer\\.ff_out\\.": "lm_head.",
    ...         r"^model\\.transformer\\.blocks\\.(\\d+)\\.attn_out\\.": r"model.layers.\\1.self_attn.o_proj."}
    >>> out, names = remap_adapter(sd, keys, ["attn_out", "ff_out"])
    >>> for key in sorted(out):
    ...     print(key)
    base_model.model.lm_head.lora_B.weight
    base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight
    >>> names
    ['lm_head', 'o_proj']
    """
    prefix = "base_model.model."
    out: dict[str, Any] = {}
    modules: set[str] = set()
    for key, value in state.items():
        inner = key.removeprefix(prefix)
        new = inner
        for pattern, repl in key_mapping.items():
            new, n = re.subn(pattern, repl, inner)
            if n:
                break
        out[prefix + new] = value
        module = new.split(".lora_")[0]
        modules.add(module.rsplit(".", 1)[-1])
    return out, sorted(modules) or list(targets)
