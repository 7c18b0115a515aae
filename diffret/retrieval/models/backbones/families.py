"""The backbone families: how each is detected, loaded natively (Dream as Qwen2, LLaDA as Llama), masked and
adapted (its LoRA targets).

- ``mlm``: any ``AutoModelForMaskedLM`` (BERT, ModernBERT, small diffusion chat models); bidirectional.
- ``dream``: Dream-org/Dream-v0-Instruct-7B (mask ``<|mask|>``, turn end ``<|im_end|>``).
- ``llada``: GSAI-ML/LLaDA-8B-Instruct, LLaDA-1.5 (mask id 126336, turn end ``<|eot_id|>``).
- ``causal``: any ``AutoModelForCausalLM`` (PromptReps, RepLLaMA; also a causal architecture read
  bidirectionally, through a full 4D attention mask, for DiffEmbed / mask readouts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import BackboneError


def _qwen2_config(raw: dict[str, Any]) -> Any:
    """Dream's config.json as a Qwen2Config (Dream is Qwen2's network, read bidirectionally)."""
    from transformers import Qwen2Config

    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "tie_word_embeddings",
        "attention_dropout",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    return Qwen2Config(**{k: raw[k] for k in keys if k in raw})


def _llama_config(raw: dict[str, Any]) -> Any:
    """LLaDA's (OLMo-style) config.json as a LlamaConfig: the same llama block, under other names."""
    from transformers import LlamaConfig

    unsupported = {
        k: raw.get(k) for k in ("alibi", "attention_layer_norm", "input_emb_norm", "scale_logits") if raw.get(k)
    }
    if unsupported or raw.get("block_type", "llama") != "llama" or raw.get("layer_norm_type", "rms") != "rms":
        raise BackboneError(
            f"this LLaDA config has features the native loader does not map ({unsupported or raw.get('block_type')}); "
            "use loader='remote' with trust_remote_code"
        )
    # rope_theta: transformers 5 takes it through **kwargs its typed signature omits (4.x names it)
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=raw.get("embedding_size") or raw["vocab_size"],
        hidden_size=raw["d_model"],
        intermediate_size=raw["mlp_hidden_size"],
        num_hidden_layers=raw["n_layers"],
        num_attention_heads=raw["n_heads"],
        num_key_value_heads=raw.get("n_kv_heads") or raw["n_heads"],
        hidden_act="silu",
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=raw.get("rope_theta", 10000.0),
        max_position_embeddings=raw.get("max_sequence_length", 4096),
        tie_word_embeddings=bool(raw.get("weight_tying")),
        mlp_bias=False,
        attention_bias=bool(raw.get("include_bias") or raw.get("include_qkv_bias")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
    )


# LLaDA checkpoint names -> LlamaForCausalLM names (ff_proj is the activated gate, ff_out the down projection).
_LLADA_KEYS = {
    r"^model\.transformer\.wte\.": "model.embed_tokens.",
    r"^model\.transformer\.ln_f\.": "model.norm.",
    r"^model\.transformer\.ff_out\.": "lm_head.",
    r"^model\.transformer\.blocks\.(\d+)\.attn_out\.": r"model.layers.\1.self_attn.o_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.q_proj\.": r"model.layers.\1.self_attn.q_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.k_proj\.": r"model.layers.\1.self_attn.k_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.v_proj\.": r"model.layers.\1.self_attn.v_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.attn_norm\.": r"model.layers.\1.input_layernorm.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_norm\.": r"model.layers.\1.post_attention_layernorm.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_proj\.": r"model.layers.\1.mlp.gate_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.up_proj\.": r"model.layers.\1.mlp.up_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_out\.": r"model.layers.\1.mlp.down_proj.",
}


@dataclass(frozen=True)
class NativeLoader:
    """How a family that ships its own code loads through transformers' own classes."""

    model_class: str  # a transformers class name
    tokenizer_class: str
    config: Callable[[dict[str, Any]], Any]  # config.json (a dict) -> the transformers config
    key_mapping: dict[str, str] | None = None  # checkpoint names -> the class's names (regex -> replacement)


@dataclass(frozen=True)
class FamilySpec:
    name: str
    auto_class: str  # the transformers auto class of its own (or remote) code
    bidirectional: bool
    mask_token: str | None = None
    mask_token_id: int | None = None
    turn_end: str | None = None
    native: NativeLoader | None = None  # set for families that ship their own code (Dream, LLaDA)
    remote_transformers: tuple[str, str] | None = None  # [min, max) transformers versions its remote code runs on
    remote_mask: Literal["2d", "4d"] = "2d"  # the attention mask its remote code takes
    lora_targets: tuple[str, ...] = field(default=())  # module names of its attention and feed-forward projections
    lora_head: bool = False  # LoRA on the vocabulary head too by default (the reference's LLaDA targets)
    remote_lora_targets: tuple[str, ...] = field(default=())  # the names under its own code (loader remote)


QWEN2_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# BERT (query/key/value, attention output + feed-forward "dense") and ModernBERT (Wqkv, Wo, Wi)
BERT_TARGETS = ("query", "key", "value", "dense", "Wqkv", "Wo", "Wi")
FAMILIES: dict[str, FamilySpec] = {
    "mlm": FamilySpec("mlm", "AutoModelForMaskedLM", bidirectional=True, lora_targets=BERT_TARGETS),
    "dream": FamilySpec(
        "dream",
        "AutoModel",
        bidirectional=True,
        mask_token="<|mask|>",
        turn_end="<|im_end|>",
        native=NativeLoader("Qwen2ForCausalLM", "Qwen2TokenizerFast", _qwen2_config),
        remote_transformers=("4.46", "5"),
        remote_mask="4d",
        lora_targets=QWEN2_TARGETS,
    ),
    "llada": FamilySpec(
        "llada",
        "AutoModel",
        bidirectional=True,
        mask_token_id=126336,
        turn_end="<|eot_id|>",
        native=NativeLoader("LlamaForCausalLM", "PreTrainedTokenizerFast", _llama_config, _LLADA_KEYS),
        remote_transformers=("4.46", "5"),
        remote_mask="2d",
        lora_targets=QWEN2_TARGETS,
        lora_head=True,
        remote_lora_targets=("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"),
    ),
    "causal": FamilySpec("causal", "AutoModelForCausalLM", bidirectional=False, lora_targets=QWEN2_TARGETS),
}

# The choices of ``BackboneConfig.family`` (a dropdown in the Prefect UI): auto or a key of FAMILIES (a test
# checks that the two agree).
Family = Literal["auto", "mlm", "dream", "llada", "causal"]

TURN_END_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def detect_family(model_config: Any) -> str:
    """The family of a model from its config (a transformers config or config.json as a dict)."""
    get = model_config.get if isinstance(model_config, dict) else (lambda k, d=None: getattr(model_config, k, d))
    mtype = (get("model_type", "") or "").lower()
    if mtype in ("dream", "llada"):
        return mtype
    archs = " ".join(get("architectures", None) or [])
    if "MaskedLM" in archs or mtype in ("bert", "modernbert", "roberta", "distilbert", "electra", "deberta-v2"):
        return "mlm"
    if "CausalLM" in archs or "LMHead" in archs or get("is_decoder", False):
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


def mask_token_id(tok: Any, spec: FamilySpec, mask_token: str | None = None, name: str = "the model") -> int:
    """The id a masked readout writes at its slots: ``mask_token`` (an override), the family's, or the tokenizer's;
    :class:`BackboneError` when there is none or it is not in the vocabulary.

    >>> class Tok:
    ...     mask_token_id, unk_token_id = None, 0
    ...     def convert_tokens_to_ids(self, tokens): return [0 for _ in tokens]
    >>> try:
    ...     mask_token_id(Tok(), FAMILIES["causal"], name="gpt")
    ... except BackboneError as exc:
    ...     print(str(exc)[:40])
    gpt has no mask token, so it cannot be r
    """
    if mask_token is not None:
        ids = tok.convert_tokens_to_ids([mask_token])
        if not ids or ids[0] is None or ids[0] == tok.unk_token_id:
            raise BackboneError(f"{name}: mask token {mask_token!r} is not in the vocabulary")
        return int(ids[0])
    if spec.mask_token_id is not None:
        return spec.mask_token_id
    if spec.mask_token is not None:
        return int(tok.convert_tokens_to_ids(spec.mask_token))
    if tok.mask_token_id is None:
        raise BackboneError(
            f"{name} has no mask token, so it cannot be read through [MASK] positions "
            "(use the promptreps or repllama readout for a causal LM, or set --mask-token)"
        )
    return int(tok.mask_token_id)
