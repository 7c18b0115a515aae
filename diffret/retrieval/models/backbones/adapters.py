"""peft adapters on a backbone: a model folder holding only an adapter resolved to its base plus that adapter,
the adapter checked against its base, injected (or merged), and a released checkpoint's adapter remapped onto the
native class's module names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from .config import BackboneConfig
from .errors import BackboneError, load_error
from .families import FamilySpec

ADAPTER_CONFIG = "adapter_config.json"
BASE_FILE = "diffret_base.json"  # beside an adapter: how to load its base beyond its name (the GGUF file)


def _same_model(a: str, b: str) -> bool:
    """Whether two model references (hub ids or folders, relative or not) name the same model."""

    def norm(x: str) -> str:
        p = Path(x).expanduser()
        return str(p.resolve()) if p.exists() else x.rstrip("/")

    return norm(a) == norm(b)


def with_adapter(cfg: BackboneConfig) -> BackboneConfig:
    """``cfg`` with its adapter resolved: a ``model`` folder holding only a peft adapter (a LoRA model saved by
    ``diffret train``) becomes its base model plus that adapter; an explicit ``adapter`` must have been trained
    on ``model`` (else a :class:`BackboneError` naming both).

    >>> with_adapter(BackboneConfig(model="org/base")).adapter is None
    True
    """
    from ..released import ReleasedError, read_released

    adapter = cfg.adapter
    try:
        released = read_released(adapter or cfg.model)
    except ReleasedError as exc:
        raise BackboneError(str(exc)) from None
    if adapter is None:
        local = Path(cfg.model).expanduser()
        if released is not None:
            adapter = released.folder
        elif (local / ADAPTER_CONFIG).exists() and not (local / "config.json").exists():
            adapter = cfg.model
        else:
            return cfg
    folder = Path(adapter).expanduser()
    if not (folder / ADAPTER_CONFIG).exists():
        raise BackboneError(
            f"adapter {adapter!r}: no {ADAPTER_CONFIG} there (a folder saved by diffret train "
            "with LoRA, or by peft's save_pretrained)"
        )
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BackboneError(f"adapter {adapter!r}: unreadable {ADAPTER_CONFIG} ({exc})") from None
    if released is not None:  # a released checkpoint: its base as the reference resolves it (released._base)
        base = released.base
    if cfg.adapter is None:
        extra = json.loads((folder / BASE_FILE).read_text()) if (folder / BASE_FILE).exists() else {}
        gguf = cfg.gguf_file or extra.get("gguf_file")
        return cfg.model_copy(update={"model": base, "adapter": str(folder), "gguf_file": gguf})
    if base and not _same_model(base, cfg.model) and released is None:  # a released one's base may be any copy
        raise BackboneError(
            f"adapter {adapter!r} was trained on {base!r}, not on {cfg.model!r}; give --model "
            f"{base} (or the adapter's folder alone as --model)"
        )
    return cfg


def apply_adapter(
    model: torch.nn.Module, cfg: BackboneConfig, raw: dict[str, Any], spec: FamilySpec | None = None
) -> torch.nn.Module:
    """The peft adapter ``cfg.adapter`` injected into ``model`` (in place), or merged into its weights."""
    from peft import PeftModel

    folder = Path(cfg.adapter or "").expanduser()
    try:
        peft = _remapped_adapter(model, folder, cfg, spec) or PeftModel.from_pretrained(model, str(folder))
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
        raise load_error(
            cfg,
            f"the adapter {cfg.adapter!r} onto it",
            exc,
            "The adapter must come from this base model and family.",
            raw,
        ) from exc
    peft.eval()
    return peft.merge_and_unload() if cfg.merge_adapter else model


def _remapped_adapter(model: torch.nn.Module, folder: Path, cfg: BackboneConfig, spec: FamilySpec | None) -> Any:
    """An adapter saved on the checkpoint's own module names (a released LLaDA retriever: ``transformer.blocks``)
    applied to the native class under its names (the weights' ``key_mapping``); None for any other adapter. Every
    adapter tensor must land on a module: a missing or unexpected one is an error, never a silent base model."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from ..released import adapter_state, remap_adapter

    mapping = spec.native.key_mapping if spec is not None and spec.native is not None else None
    if not mapping or cfg.loader != "native":
        return None
    state = adapter_state(folder)
    if not any(re.search(p, k.removeprefix("base_model.model.")) for k in state for p in mapping):
        return None  # already on the native names (diffret train's LoRA)
    lora = LoraConfig.from_pretrained(str(folder))
    state, targets = remap_adapter(state, mapping, list(lora.target_modules or []))
    lora.target_modules = set(targets)
    lora.base_model_name_or_path = cfg.model
    peft = get_peft_model(model, lora)
    result = set_peft_model_state_dict(peft, state)
    unexpected = list(getattr(result, "unexpected_keys", None) or [])
    missing = [k for k in getattr(result, "missing_keys", None) or [] if ".lora_" in k]
    if unexpected or missing:
        raise BackboneError(
            f"the adapter's tensors do not map onto {type(model).__name__}: unexpected "
            f"{unexpected[:3]}, missing {missing[:3]}"
        )
    return peft
