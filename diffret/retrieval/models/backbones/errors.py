"""The error every backbone failure becomes: one paragraph naming the model, its architecture, the transformers
version, the cause and what to do."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import BackboneConfig


class BackboneError(ValueError):
    """A backbone that cannot be loaded or used as asked; the message says why and what to do."""


def load_error(
    cfg: BackboneConfig, what: str, exc: Exception, hint: str, raw: dict[str, Any] | None = None
) -> BackboneError:
    """One paragraph: the model, its architecture, the transformers version, the cause and what to do."""
    import transformers

    if isinstance(exc, BackboneError):
        cause = str(exc)
    else:
        cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    through = adapter_base(cfg)
    if through is not None and raw is None and not Path(through[1]).expanduser().exists():
        return missing_base(through, _unreachable(exc), cause)
    if raw is None and not Path(cfg.model).expanduser().exists() and _unreachable(exc):
        return BackboneError(
            f"cannot reach the Hugging Face hub for {cfg.model!r} (offline, or no cached copy): give a local folder "
            "with --model PATH (config.json, weights and tokenizer files), or set HF_HOME to a cache that holds it"
        )
    arch = ", ".join((raw or {}).get("architectures") or []) or (raw or {}).get("model_type") or "unknown architecture"
    return BackboneError(
        f"cannot load {what} from {cfg.model!r} ({arch}) with transformers {transformers.__version__}: {cause}. {hint}"
    )


def _unreachable(exc: BaseException) -> bool:
    """Whether a load failed because the hub could not be reached (not because the model is wrong)."""
    text = " ".join(str(e) for e in (exc, exc.__cause__, exc.__context__) if e is not None).lower()
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    return bool(names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectionError", "ConnectError"}) or any(
        m in text
        for m in (
            "couldn't connect",
            "could not connect",
            "offline",
            "name or service not known",
            "connection error",
            "failed to resolve",
        )
    )


def adapter_base(cfg: BackboneConfig) -> tuple[str, str, str] | None:
    """For a model loaded through an adapter (a released checkpoint's folder or hub id, a LoRA folder diffret train
    saved, or ``--adapter``): the adapter's folder, the base model it is applied to, and the base its
    ``adapter_config.json`` records; None for any other model."""
    import json

    from .adapters import ADAPTER_CONFIG, with_adapter

    try:
        resolved = with_adapter(cfg)
    except BackboneError:
        return None
    if not resolved.adapter:
        return None
    try:
        recorded = json.loads((Path(resolved.adapter) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        recorded = None
    return resolved.adapter, resolved.model, str(recorded or "")


def missing_base(through: tuple[str, str, str], unreachable: bool, cause: str) -> BackboneError:
    """The base model of an adapter is not here: the error names the base, where it was looked for, and how to give
    a local copy.

    >>> print(missing_base(("/m/ft", "org/base", "/cluster/base"), True, "OSError: offline"))  # doctest: +ELLIPSIS
    cannot load the base model 'org/base' of /m/ft (an adapter: the base's weights are not in it): its \
adapter_config.json records the base '/cluster/base', not a folder on this machine, so it was looked for on the \
Hugging Face hub as 'org/base', which cannot be reached (...) and whose cache (...) holds no copy. Give a local \
copy of the base: --model BASE_FOLDER --adapter /m/ft (from Python: diffret.load(BASE_FOLDER, adapter=...)), or \
set HF_HOME to a cache that holds 'org/base'
    """
    adapter, base, recorded = through
    if recorded and recorded != base and not Path(recorded).expanduser().is_dir():
        where = (
            f"its adapter_config.json records the base {recorded!r}, not a folder on this machine, so it was "
            f"looked for on the Hugging Face hub as {base!r}"
        )
    else:
        where = f"it was looked for on the Hugging Face hub as {base!r}"
    if unreachable:
        from huggingface_hub import constants

        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "offline, or the hub is unreachable"
        where += f", which cannot be reached ({why}) and whose cache ({constants.HF_HUB_CACHE}) holds no copy"
    else:
        where += f", which failed ({cause})"
    return BackboneError(
        f"cannot load the base model {base!r} of {adapter} (an adapter: the base's weights are not in it): {where}. "
        f"Give a local copy of the base: --model BASE_FOLDER --adapter {adapter} (from Python: "
        f"diffret.load(BASE_FOLDER, adapter=...)), or set HF_HOME to a cache that holds {base!r}"
    )
