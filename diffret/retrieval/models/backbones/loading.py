"""Loading a backbone: the config read without running model code, the family resolved and checked against the
loader (remote code only when allowed and on the transformers it runs on), the tokenizer and weights checked, the
model loaded (natively or through its own code) with its adapter."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import torch

from ... import devices
from ...devices import resolve_device
from .adapters import apply_adapter, with_adapter
from .backbone import Backbone
from .config import BackboneConfig
from .errors import BackboneError, load_error
from .families import FAMILIES, FamilySpec, detect_family
from .files import check_model_files, check_tokenizer_files
from .shapes import shape_config


def _model_ref(cfg: BackboneConfig) -> tuple[str, dict[str, Any]]:
    """The path or hub id to load, and the gguf_file argument; clear errors for missing files."""
    given, cfg = cfg, with_adapter(cfg)
    local = Path(cfg.model).expanduser()
    if not local.exists() and cfg.model.startswith((".", "/", "~")):
        if cfg.adapter and not given.adapter:  # the base an adapter folder records
            raise BackboneError(
                f"model path {cfg.model!r} does not exist: it is the base model that the adapter "
                f"{cfg.adapter} records (adapter_config.json); give a local copy of the base: --model "
                f"BASE_FOLDER --adapter {cfg.adapter}"
            )
        raise BackboneError(f"model path {cfg.model!r} does not exist")
    ref = str(local) if local.exists() else cfg.model
    extra: dict[str, Any] = {}
    if cfg.gguf_file:
        if local.exists() and not (local / cfg.gguf_file).exists():
            found = sorted(p.name for p in local.glob("*.gguf"))
            raise BackboneError(f"GGUF file {cfg.gguf_file!r} not found in {local}; files there: {found or 'none'}")
        extra["gguf_file"] = cfg.gguf_file
    return ref, extra


def check_weights(cfg: BackboneConfig, raw: dict[str, Any] | None = None) -> None:
    """:func:`check_model_files`, failing as a load error that names the model, its architecture and the
    transformers version (as every other load failure does); random weights read no file."""
    if cfg.random_weights:
        return
    try:
        check_model_files(cfg)
    except BackboneError as exc:
        if raw is None:
            with contextlib.suppress(BackboneError):
                raw = raw_config(cfg)
        hint = "Check the folder; download or save the model again."
        raise load_error(cfg, "its weights", exc, hint, raw) from exc


def raw_config(cfg: BackboneConfig) -> dict[str, Any]:
    """The model's config.json as a dict: read without running any of the model's own code."""
    from transformers import PretrainedConfig

    ref, extra = _model_ref(cfg)
    try:
        raw = PretrainedConfig.get_config_dict(ref, **extra)[0]
        if not raw:
            raise BackboneError("no config.json")
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
        raise load_error(cfg, "its config", exc, "Check the hub id or the folder (it needs a config.json).") from exc
    if cfg.random_weights and cfg.shape:  # a published shape: the folder gives the tokenizer (its family's)
        shaped = shape_config(cfg.shape)
        mine, theirs = detect_family(shaped), cfg.family if cfg.family != "auto" else detect_family(raw)
        if mine != theirs:
            raise BackboneError(
                f"{cfg.model}: shape {cfg.shape} is a {mine} network but the folder is of the {theirs} "
                f"family: give a {mine} folder for its tokenizer"
            )
        return shaped
    return raw


def resolve_family(cfg: BackboneConfig, raw: dict[str, Any] | None = None) -> FamilySpec:
    """The family of ``cfg`` (detected from config.json when ``auto``), with the loader checked against it."""
    try:
        family = cfg.family if cfg.family != "auto" else detect_family(raw if raw is not None else raw_config(cfg))
    except BackboneError as exc:
        raise BackboneError(f"{cfg.model}: {exc}") if cfg.model not in str(exc) else exc from None
    spec = FAMILIES[family]
    if cfg.loader == "remote":
        if spec.native is None:
            raise BackboneError(f"{cfg.model}: the {family} family has no remote code of its own; use loader native")
        if not cfg.trust_remote_code:
            raise BackboneError(
                f"{cfg.model}: loader remote runs the checkpoint's own model code; allow it with --trust-remote-code "
                "(or use the native loader, the default, which needs none)"
            )
        import transformers

        lo, hi = spec.remote_transformers or ("0", "999")
        if not (_version(lo) <= _version(transformers.__version__) < _version(hi)):
            raise BackboneError(
                f"{cfg.model}: the {family} remote code runs on transformers >={lo},<{hi}; this is transformers "
                f"{transformers.__version__}. Use the native loader (the default), or install "
                f"'transformers>={lo},<{hi}'"
            )
    return spec


def load_tokenizer(cfg: BackboneConfig, spec: FamilySpec | None = None, raw: dict[str, Any] | None = None) -> Any:
    """The tokenizer of ``cfg``: the native class for Dream / LLaDA unless loader is remote."""
    import transformers

    if spec is None:
        raw = raw_config(cfg)
        spec = resolve_family(cfg, raw)
    ref, extra = _model_ref(cfg)
    try:
        check_tokenizer_files(cfg)
        if spec.native is not None and cfg.loader == "native":
            cls = getattr(transformers, spec.native.tokenizer_class, None) or transformers.AutoTokenizer
            tok = cls.from_pretrained(ref, **extra)
        else:
            tok = transformers.AutoTokenizer.from_pretrained(ref, trust_remote_code=cfg.trust_remote_code, **extra)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
        hint = "Check the hub id or folder and its tokenizer files."
        raise load_error(cfg, "its tokenizer", exc, hint, raw) from exc
    check_tokenizer(cfg, tok, spec, raw if raw is not None else raw_config(cfg))
    return tok


def check_tokenizer(cfg: BackboneConfig, tok: Any, spec: FamilySpec, raw: dict[str, Any]) -> None:
    """Refuse a tokenizer that would degrade silently (:class:`BackboneError` naming what is wrong): a vocabulary
    that does not match the model's embedding matrix (more ids than rows, or fewer than half of them), a named
    special token that is not in its vocabulary, a ``mask_token`` / ``turn_end`` override that is not either.

    >>> class Tok:  # a stand-in: 10 tokens, every string unknown
    ...     unk_token, unk_token_id = "[UNK]", 0
    ...     def __len__(self): return 10
    ...     def convert_tokens_to_ids(self, token): return 0
    >>> try:
    ...     check_tokenizer(BackboneConfig(model="m", mask_token="<m>"), Tok(), FAMILIES["mlm"], {"vocab_size": 10})
    ... except BackboneError as exc:
    ...     print(exc)
    m: mask token '<m>' (--mask-token) is not in its tokenizer's vocabulary
    """
    name = cfg.model
    rows = raw.get("vocab_size") or raw.get("embedding_size") or (raw.get("text_config") or {}).get("vocab_size")
    size = len(tok)
    if rows and (size > int(rows) or size < int(rows) // 2):
        raise BackboneError(
            f"{name}: its tokenizer has {size:,} tokens but the model's embedding has {int(rows):,} rows: not this "
            "model's tokenizer (or its files are incomplete); give the folder the tokenizer it was trained with"
        )
    unk = getattr(tok, "unk_token_id", None)

    def missing(token: str) -> bool:
        tid = tok.convert_tokens_to_ids(token)
        return tid is None or (tid == unk and token != getattr(tok, "unk_token", None))

    for attr in ("bos_token", "eos_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        token = getattr(tok, attr, None)
        if token and missing(str(token)):
            raise BackboneError(
                f"{name}: its {attr} {str(token)!r} is not in its tokenizer's vocabulary (a broken "
                "tokenizer_config.json or special_tokens_map.json?)"
            )
    for token, flag in ((cfg.mask_token, "--mask-token"), (cfg.turn_end, "--turn-end")):
        if token and missing(token):
            raise BackboneError(
                f"{name}: {flag.removeprefix('--').replace('-', ' ')} {token!r} ({flag}) is not in "
                "its tokenizer's vocabulary"
            )


def load_backbone(cfg: BackboneConfig) -> Backbone:
    """Load tokenizer and model (HF hub id or local path; GGUF through ``gguf_file``).

    Every failure is a :class:`BackboneError` naming the model, its architecture, the transformers version
    and what to do; a remote-code family is refused before any of its code runs unless allowed.
    """
    import transformers

    cfg = with_adapter(cfg)
    ref, extra = _model_ref(cfg)
    raw = raw_config(cfg)
    spec = resolve_family(cfg, raw)
    tokenizer = load_tokenizer(cfg, spec, raw)
    check_weights(cfg, raw)
    dtype_kw = "dtype" if _version(transformers.__version__) >= _version("4.56") else "torch_dtype"
    kwargs: dict[str, Any] = {dtype_kw: getattr(torch, cfg.dtype), **extra}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        if cfg.random_weights:
            check_random_memory(cfg, spec, raw)
            model = random_model(cfg, spec, raw)
        elif spec.native is not None and cfg.loader == "native":
            native = spec.native
            cls = getattr(transformers, native.model_class)
            if native.key_mapping:
                kwargs["key_mapping"] = native.key_mapping
            model, info = cls.from_pretrained(ref, config=native.config(raw), output_loading_info=True, **kwargs)
            wrong = {k: sorted(v)[:4] for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
            if wrong:
                raise BackboneError(f"its weights do not map onto {native.model_class}: {wrong}")
        else:
            auto = getattr(transformers, spec.auto_class)
            model = auto.from_pretrained(ref, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except NotEnoughMemory:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
        hint = "Check the family (--family), the dtype and the loader."
        if cfg.loader == "remote":
            hint = "Its remote code may not run on this transformers; the native loader (the default) needs none."
        raise load_error(cfg, f"it as {spec.name} ({cfg.loader} loader)", exc, hint, raw) from exc
    if cfg.adapter:
        model = apply_adapter(model, cfg, raw, spec)
    model.to(resolve_device(cfg.device))  # random weights: built there already
    bb = Backbone(model, tokenizer, spec.name, cfg.mask_token, cfg.turn_end, cfg.model, cfg.loader)
    bb.source = cfg
    return bb


RANDOM_SEED = 0  # random weights are drawn from this seed: the same settings give the same network on a device


def _random_build(cfg: BackboneConfig, spec: FamilySpec, raw: dict[str, Any], device: torch.device) -> Any:
    """``raw``'s network built on ``device`` in ``cfg.dtype`` by transformers' class for the family, its own
    initialisation skipped (its weights are whatever the device's allocator holds; on ``meta``, none)."""
    import transformers

    dtype_kw = "dtype" if _version(transformers.__version__) >= _version("4.56") else "torch_dtype"
    kwargs: dict[str, Any] = {dtype_kw: getattr(torch, cfg.dtype)}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if spec.native is not None:
        build, config = getattr(transformers, spec.native.model_class)._from_config, spec.native.config(raw)
    else:
        build, config = getattr(transformers, spec.auto_class).from_config, transformers.AutoConfig.for_model(**raw)
    skip_init: Any = contextlib.nullcontext()
    with contextlib.suppress(ImportError, AttributeError):  # transformers 5: its own initialisation is skipped
        from transformers import initialization

        skip_init = initialization.no_init_weights()
    with torch.device(device), skip_init:
        return build(config, **kwargs)


def random_model(cfg: BackboneConfig, spec: FamilySpec, raw: dict[str, Any]) -> torch.nn.Module:
    """The network of ``raw`` (a config.json as a dict) with random weights, built directly on ``cfg.device`` in
    ``cfg.dtype`` (no weight file, no copy from the host: a 7B network takes seconds on a GPU, as vLLM's dummy load
    format): transformers' class for the family, its own initialisation skipped, then every matrix drawn from
    N(0, initializer_range) by a generator seeded with :data:`RANDOM_SEED` on that device, norm weights 1, biases 0.

    >>> import transformers
    >>> raw = transformers.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
    ...                               intermediate_size=8).to_dict()
    >>> m = random_model(BackboneConfig(model="m", load_format="random", device="cpu"), FAMILIES["mlm"], raw)
    >>> type(m).__name__, float(m.bert.embeddings.LayerNorm.weight.detach().min())
    ('BertForMaskedLM', 1.0)
    """
    device = resolve_device(cfg.device)
    model = _random_build(cfg, spec, raw, device)
    std = float(getattr(model.config, "initializer_range", None) or 0.02)
    gen = torch.Generator(device=device).manual_seed(RANDOM_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # RMSNorm / LayerNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    return model.eval()


class NotEnoughMemory(BackboneError):
    """Random weights whose parameters the device's free memory cannot hold (:func:`check_random_memory`)."""


def random_weights_bytes(cfg: BackboneConfig, spec: FamilySpec, raw: dict[str, Any]) -> tuple[int, int]:
    """(parameters, bytes) of ``raw``'s network in ``cfg.dtype``, counted on the ``meta`` device (no memory).

    >>> import transformers
    >>> raw = transformers.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
    ...                               intermediate_size=8).to_dict()
    >>> n, size = random_weights_bytes(BackboneConfig(model="m", load_format="random", dtype="bfloat16"),
    ...                                FAMILIES["mlm"], raw)
    >>> size == 2 * n > 0
    True
    """
    model = _random_build(cfg, spec, raw, torch.device("meta"))
    params = {id(p): p for p in model.parameters()}.values()  # a tied head counted once
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def check_random_memory(cfg: BackboneConfig, spec: FamilySpec | None = None, raw: dict[str, Any] | None = None) -> None:
    """Refuse, in one line and before anything is allocated, random weights (``load_format`` random) whose
    parameters in ``cfg.dtype`` do not fit in the free memory of ``cfg.device`` (``devices.free_memory``): the
    bytes needed and free. Nothing to check for a checkpoint, or where the free memory cannot be read.

    >>> check_random_memory(BackboneConfig(model="m"))  # a checkpoint: its loader reports what it lacks
    """
    if not cfg.random_weights:
        return
    device = resolve_device(cfg.device)
    have = devices.free_memory(device)
    if have is None:
        return
    raw = raw_config(cfg) if raw is None else raw
    spec = resolve_family(cfg, raw) if spec is None else spec
    params, need = random_weights_bytes(cfg, spec, raw)
    if need > have:
        shape = f"shape {cfg.shape}" if cfg.shape else "the folder's shape"
        raise NotEnoughMemory(
            f"{cfg.model}: random weights of {shape} need {need:,} bytes ({params:,} parameters in {cfg.dtype}) "
            f"but {devices.gpu_name(device)} has {have:,} bytes free: use a device with more memory, a smaller "
            "dtype, or a smaller network (e.g. --shape dream-7b:num_hidden_layers=2)"
        )


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])
