"""Backbones: a loaded model + tokenizer with what the readouts need to know about its family.

Families (``family`` in the config; ``auto`` picks one from the model's config):
- ``mlm``: any ``AutoModelForMaskedLM`` (BERT, ModernBERT, small diffusion chat models); bidirectional.
- ``dream``: Dream-org/Dream-v0-Instruct-7B (remote code; mask ``<|mask|>``, turn end ``<|im_end|>``).
- ``llada``: GSAI-ML/LLaDA-8B-Instruct (remote code; mask id 126336, turn end ``<|eot_id|>``).
- ``causal``: any ``AutoModelForCausalLM`` (PromptReps, RepLLaMA; also a causal architecture read
  bidirectionally, through a full 4D attention mask, for DiffEmbed / mask readouts).

The LM head is split from the trunk so that logits are computed only where they are needed
(the K mask positions), never over the whole sequence (a 152k vocabulary over every position
costs ~600 MB per batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field, field_validator

from ..devices import resolve_device


class BackboneError(ValueError):
    """A backbone that cannot be loaded or used as asked; the message says why and what to do."""


@dataclass(frozen=True)
class FamilySpec:
    name: str
    auto_class: str
    bidirectional: bool
    mask_token: str | None = None
    mask_token_id: int | None = None
    turn_end: str | None = None
    needs_remote_code: bool = False


FAMILIES: dict[str, FamilySpec] = {
    "mlm": FamilySpec("mlm", "AutoModelForMaskedLM", bidirectional=True),
    "dream": FamilySpec(
        "dream", "AutoModel", bidirectional=True, mask_token="<|mask|>", turn_end="<|im_end|>", needs_remote_code=True
    ),
    "llada": FamilySpec(
        "llada", "AutoModel", bidirectional=True, mask_token_id=126336, turn_end="<|eot_id|>", needs_remote_code=True
    ),
    "causal": FamilySpec("causal", "AutoModelForCausalLM", bidirectional=False),
}

TURN_END_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class BackboneConfig(BaseModel):
    """Which model to load and how."""

    model: str = Field(description="HF hub id or local folder.")
    family: str = Field(default="auto", description="auto | mlm | dream | llada | causal")
    gguf_file: str | None = Field(default=None, description="GGUF file name inside the model folder.")
    trust_remote_code: bool = Field(default=False, description="Allow the model's own code (Dream, LLaDA).")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    attn_implementation: str | None = Field(default=None, description="eager | sdpa | flash_attention_2")
    mask_token: str | None = Field(default=None, description="Override the mask token (string).")
    turn_end: str | None = Field(default=None, description="Override the end-of-turn token (string).")

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        if v != "auto" and v not in FAMILIES:
            raise ValueError(f"unknown backbone family {v!r}; expected auto or one of {', '.join(FAMILIES)}")
        return v


def detect_family(model_config: Any) -> str:
    mtype = (getattr(model_config, "model_type", "") or "").lower()
    if mtype in ("dream", "llada"):
        return mtype
    archs = " ".join(getattr(model_config, "architectures", None) or [])
    if "MaskedLM" in archs or mtype in ("bert", "modernbert", "roberta", "distilbert", "electra", "deberta-v2"):
        return "mlm"
    if "CausalLM" in archs or "LMHead" in archs or getattr(model_config, "is_decoder", False):
        return "causal"
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if mtype in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # e.g. GGUF configs carry no architectures
        return "causal"
    if mtype in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "mlm"
    raise BackboneError(
        f"cannot tell the backbone family of model_type {mtype!r} (architectures: {archs or 'none'}); "
        f"set family to one of {', '.join(FAMILIES)}"
    )


class Backbone:
    """A model, its tokenizer and family facts; ``trunk`` gives hidden states, ``head`` logits from them."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        family: str,
        mask_token: str | None = None,
        turn_end: str | None = None,
        name: str = "",
    ):
        if family not in FAMILIES:
            raise BackboneError(f"unknown backbone family {family!r}; expected one of {', '.join(FAMILIES)}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.spec = FAMILIES[family]
        self.family = family
        self.name = name or getattr(model.config, "_name_or_path", "") or model.__class__.__name__
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._mask_token = mask_token
        self._turn_end = turn_end
        self.trunk, self.head = _split_head(model)
        self._projection = _vocab_projection(model)
        self.pad_id = _pad_id(tokenizer)

    # ------------------------------------------------------------------------------- tokens
    @property
    def mask_id(self) -> int:
        tok = self.tokenizer
        if self._mask_token is not None:
            ids = tok.convert_tokens_to_ids([self._mask_token])
            if not ids or ids[0] is None or ids[0] == tok.unk_token_id:
                raise BackboneError(f"{self.name}: mask token {self._mask_token!r} is not in the vocabulary")
            return int(ids[0])
        if self.spec.mask_token_id is not None:
            return self.spec.mask_token_id
        if self.spec.mask_token is not None:
            return int(tok.convert_tokens_to_ids(self.spec.mask_token))
        if tok.mask_token_id is None:
            raise BackboneError(
                f"{self.name} has no mask token, so it cannot be read through [MASK] positions "
                "(use the promptreps or repllama readout for a causal LM, or set mask_token)"
            )
        return int(tok.mask_token_id)

    @property
    def turn_end_id(self) -> int | None:
        tok = self.tokenizer
        name = self._turn_end or self.spec.turn_end
        candidates = [name] if name else [t for t in TURN_END_CANDIDATES if t in tok.get_vocab()]
        for t in candidates:
            tid = tok.convert_tokens_to_ids(t)
            if tid is not None and tid != tok.unk_token_id:
                return int(tid)
        if name:
            raise BackboneError(f"{self.name}: end-of-turn token {name!r} is not in the vocabulary")
        return None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def hidden_size(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "hidden_size", None) or cfg.d_model)

    # ------------------------------------------------------------------------------ forward
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        """Last hidden states [B, L, H]; ``bidirectional`` forces full attention on causal architectures."""
        kwargs: dict[str, Any] = {}
        mask: torch.Tensor = attention_mask
        back: torch.Tensor | None = None
        if bidirectional and _is_causal_arch(self.model):
            mask = bidirectional_mask(attention_mask, self.dtype)
            # positions count real tokens only, so left padding does not shift them
            kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        else:
            # the model numbers positions from the first column (absolute position embeddings: BERT), so left
            # padding would shift them: run left-padded rows rotated to right padding and rotate the states back
            width = input_ids.shape[1]
            lead = (attention_mask.cumsum(-1) == 0).sum(-1, keepdim=True) % width  # [B, 1] leading pads
            if bool(lead.any()):
                cols = torch.arange(width, device=input_ids.device)[None, :]
                fwd, back = (cols + lead) % width, (cols - lead) % width
                input_ids, mask = input_ids.gather(1, fwd), attention_mask.gather(1, fwd)
        out = self.trunk(input_ids=input_ids, attention_mask=mask, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if back is not None:
            hidden = hidden.gather(1, back[..., None].expand(-1, -1, hidden.shape[-1]))
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def logits_at(self, hidden: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the vocabulary ids ``vocab_ids`` only: [..., H] -> [..., len(vocab_ids)].

        Equal to ``logits(hidden)[..., vocab_ids]`` but multiplies by those rows of the output matrix
        only, so the cost no longer grows with the vocabulary (152k for Qwen-based LMs).
        """
        if self._projection is None:
            return self.head(hidden)[..., vocab_ids]
        pre, weight, bias = self._projection
        out = pre(hidden) @ weight[vocab_ids].T
        return out + bias[vocab_ids] if bias is not None else out


def bidirectional_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, L] padding mask -> [B, 1, L, L] additive mask: every query sees every real key."""
    keys = attention_mask[:, None, None, :].to(torch.bool)
    full = keys.expand(-1, 1, attention_mask.shape[1], -1)
    out = torch.zeros(full.shape, dtype=dtype, device=attention_mask.device)
    return out.masked_fill(~full, torch.finfo(dtype).min)


def _is_causal_arch(model: torch.nn.Module) -> bool:
    cfg = model.config
    return (
        bool(getattr(cfg, "is_decoder", False))
        or any(a.endswith("ForCausalLM") for a in (getattr(cfg, "architectures", None) or [model.__class__.__name__]))
        or model.__class__.__name__.endswith("ForCausalLM")
    )


def _pad_id(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if tid is not None:
            return int(tid)
    return 0


def _split_head(model: torch.nn.Module) -> tuple[Callable[..., Any], Callable[[torch.Tensor], torch.Tensor]]:
    """(trunk, head) such that head(trunk(x).last_hidden_state) == model(x).logits."""
    name = model.__class__.__name__
    if hasattr(model, "cls") and hasattr(model, "bert"):  # BertForMaskedLM and relatives
        return model.bert, model.cls
    if hasattr(model, "head") and hasattr(model, "decoder") and hasattr(model, "model"):  # ModernBertForMaskedLM
        return model.model, lambda h: model.decoder(model.head(h))
    if hasattr(model, "lm_head") and hasattr(model, "model"):  # Llama, Qwen2, Dream, ...
        return model.model, model.lm_head
    for prefix, head_name in (("roberta", "lm_head"), ("distilbert", "vocab_projector")):
        if hasattr(model, prefix) and hasattr(model, head_name):
            if prefix == "distilbert":
                return model.distilbert, lambda h: model.vocab_projector(
                    model.vocab_layer_norm(model.activation(model.vocab_transform(h)))
                )
            return getattr(model, prefix), getattr(model, head_name)
    raise BackboneError(
        f"{name}: do not know how to apply its LM head to selected positions only; "
        "add the family to retrieval.backbones._split_head"
    )


def _vocab_projection(model: torch.nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any, Any] | None:
    """(pre, weight, bias) with head(h) == pre(h) @ weight.T + bias, when the head has that form."""
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return None  # a non-linear or scaled output: use the full head
    if hasattr(model, "cls") and hasattr(model, "bert") and hasattr(model.cls, "predictions"):
        pred = model.cls.predictions
        dec = pred.decoder
        bias = dec.bias if getattr(dec, "bias", None) is not None else getattr(pred, "bias", None)
        return pred.transform, dec.weight, bias
    if hasattr(model, "head") and hasattr(model, "decoder") and hasattr(model, "model"):
        return model.head, model.decoder.weight, model.decoder.bias
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, torch.nn.Linear) and hasattr(model, "model"):
        return (lambda h: h), lm_head.weight, lm_head.bias
    return None


# ------------------------------------------------------------------------------------------- loading
def _model_ref(cfg: BackboneConfig) -> tuple[str, dict[str, Any]]:
    """The path or hub id to load, and the gguf_file argument; clear errors for missing files."""
    local = Path(cfg.model).expanduser()
    if not local.exists() and cfg.model.startswith((".", "/", "~")):
        raise BackboneError(f"model path {cfg.model!r} does not exist")
    ref = str(local) if local.exists() else cfg.model
    extra: dict[str, Any] = {}
    if cfg.gguf_file:
        if local.exists() and not (local / cfg.gguf_file).exists():
            found = sorted(p.name for p in local.glob("*.gguf"))
            raise BackboneError(f"GGUF file {cfg.gguf_file!r} not found in {local}; files there: {found or 'none'}")
        extra["gguf_file"] = cfg.gguf_file
    return ref, extra


def load_tokenizer(cfg: BackboneConfig) -> Any:
    import transformers

    ref, extra = _model_ref(cfg)
    try:
        return transformers.AutoTokenizer.from_pretrained(ref, trust_remote_code=cfg.trust_remote_code, **extra)
    except (OSError, ValueError) as exc:
        raise BackboneError(f"cannot load the tokenizer of {cfg.model!r}: {exc}") from exc


def load_backbone(cfg: BackboneConfig) -> Backbone:
    """Load tokenizer and model (HF hub id or local path; GGUF through ``gguf_file``)."""
    import transformers

    ref, extra = _model_ref(cfg)
    tokenizer = load_tokenizer(cfg)
    try:
        mconfig = transformers.AutoConfig.from_pretrained(ref, trust_remote_code=cfg.trust_remote_code, **extra)
    except (OSError, ValueError) as exc:
        raise BackboneError(f"cannot load {cfg.model!r}: {exc}") from exc
    family = cfg.family if cfg.family != "auto" else detect_family(mconfig)
    spec = FAMILIES[family]
    if spec.needs_remote_code and not cfg.trust_remote_code:
        raise BackboneError(f"{cfg.model}: the {family} family ships its own model code; set trust_remote_code")
    auto = getattr(transformers, spec.auto_class)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, cfg.dtype), "trust_remote_code": cfg.trust_remote_code, **extra}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        model = auto.from_pretrained(ref, **kwargs)
    except (OSError, ValueError) as exc:
        raise BackboneError(f"cannot load {cfg.model!r} as {spec.auto_class}: {exc}") from exc
    model.to(resolve_device(cfg.device))
    return Backbone(model, tokenizer, family, mask_token=cfg.mask_token, turn_end=cfg.turn_end, name=cfg.model)
