"""The error every backbone failure becomes: one paragraph naming the model, its architecture, the transformers
version, the cause and what to do."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import BackboneConfig


class BackboneError(ValueError):
    """A backbone that cannot be loaded or used as asked; the message says why and what to do."""


def _load_error(cfg: BackboneConfig, what: str, exc: Exception, hint: str,
                raw: dict[str, Any] | None = None) -> BackboneError:  # fmt: skip
    """One paragraph: the model, its architecture, the transformers version, the cause and what to do."""
    import transformers

    if isinstance(exc, BackboneError):
        cause = str(exc)
    else:
        cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
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
        m in text for m in ("couldn't connect", "could not connect", "offline", "name or service not known",
                            "connection error", "failed to resolve")
    )  # fmt: skip
