"""Backbones: a loaded model + tokenizer with what the readouts need to know about its family.

Families (``family`` in the config; ``auto`` picks one from the model's config.json):
- ``mlm``: any ``AutoModelForMaskedLM`` (BERT, ModernBERT, small diffusion chat models); bidirectional.
- ``dream``: Dream-org/Dream-v0-Instruct-7B (mask ``<|mask|>``, turn end ``<|im_end|>``).
- ``llada``: GSAI-ML/LLaDA-8B-Instruct, LLaDA-1.5 (mask id 126336, turn end ``<|eot_id|>``).
- ``causal``: any ``AutoModelForCausalLM`` (PromptReps, RepLLaMA; also a causal architecture read
  bidirectionally, through a full 4D attention mask, for DiffEmbed / mask readouts).

Dream and LLaDA ship their own model code. By default (``loader="native"``) they load through transformers'
own classes instead: Dream is a Qwen2 network and LLaDA a Llama network (its weights renamed on load), read
with a bidirectional 4D attention mask. That needs no remote code, works on current transformers and honours
padding. ``loader="remote"`` runs the checkpoint's own code (``trust_remote_code``; transformers 4.46-4.57).

The LM head is split from the trunk so that logits are computed only where they are needed
(the K mask positions), never over the whole sequence (a 152k vocabulary over every position
costs ~600 MB per batch).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field, field_validator

from ..devices import resolve_device


class BackboneError(ValueError):
    """A backbone that cannot be loaded or used as asked; the message says why and what to do."""


def _qwen2_config(raw: dict[str, Any]) -> Any:
    """Dream's config.json as a Qwen2Config (Dream is Qwen2's network, read bidirectionally)."""
    from transformers import Qwen2Config

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
            "rope_scaling", "tie_word_embeddings", "attention_dropout", "sliding_window", "use_sliding_window",
            "max_window_layers", "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
    return Qwen2Config(**{k: raw[k] for k in keys if k in raw})


def _llama_config(raw: dict[str, Any]) -> Any:
    """LLaDA's (OLMo-style) config.json as a LlamaConfig: the same llama block, under other names."""
    from transformers import LlamaConfig

    unsupported = {k: raw.get(k) for k in ("alibi", "attention_layer_norm", "input_emb_norm", "scale_logits")
                   if raw.get(k)}  # fmt: skip
    if unsupported or raw.get("block_type", "llama") != "llama" or raw.get("layer_norm_type", "rms") != "rms":
        raise BackboneError(
            f"this LLaDA config has features the native loader does not map ({unsupported or raw.get('block_type')}); "
            "use loader='remote' with trust_remote_code"
        )
    return LlamaConfig(
        vocab_size=raw.get("embedding_size") or raw["vocab_size"], hidden_size=raw["d_model"],
        intermediate_size=raw["mlp_hidden_size"], num_hidden_layers=raw["n_layers"],
        num_attention_heads=raw["n_heads"], num_key_value_heads=raw.get("n_kv_heads") or raw["n_heads"],
        hidden_act="silu", rms_norm_eps=raw.get("rms_norm_eps", 1e-5), rope_theta=raw.get("rope_theta", 10000.0),
        max_position_embeddings=raw.get("max_sequence_length", 4096),
        tie_word_embeddings=bool(raw.get("weight_tying")), mlp_bias=False,
        attention_bias=bool(raw.get("include_bias") or raw.get("include_qkv_bias")),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
    )  # fmt: skip


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
        "dream", "AutoModel", bidirectional=True, mask_token="<|mask|>", turn_end="<|im_end|>",
        native=NativeLoader("Qwen2ForCausalLM", "Qwen2TokenizerFast", _qwen2_config),
        remote_transformers=("4.46", "5"), remote_mask="4d", lora_targets=QWEN2_TARGETS,
    ),  # fmt: skip
    "llada": FamilySpec(
        "llada", "AutoModel", bidirectional=True, mask_token_id=126336, turn_end="<|eot_id|>",
        native=NativeLoader("LlamaForCausalLM", "PreTrainedTokenizerFast", _llama_config, _LLADA_KEYS),
        remote_transformers=("4.46", "5"), remote_mask="2d", lora_targets=QWEN2_TARGETS, lora_head=True,
        remote_lora_targets=("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"),
    ),  # fmt: skip
    "causal": FamilySpec("causal", "AutoModelForCausalLM", bidirectional=False, lora_targets=QWEN2_TARGETS),
}

# The choices of ``BackboneConfig.family`` (a dropdown in the Prefect UI): auto or a key of FAMILIES (a test
# checks that the two agree).
Family = Literal["auto", "mlm", "dream", "llada", "causal"]

TURN_END_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class BackboneConfig(BaseModel):
    """Which model to load and how."""

    model: str = Field(description="HF hub id or local folder.")
    family: Family = Field(default="auto", description="auto (read from the model's config.json) | mlm | dream | "
                           "llada | causal")  # fmt: skip
    loader: Literal["native", "remote"] = Field(
        default="native", description="Dream / LLaDA: native (transformers' Qwen2 / Llama classes, no remote code) "
        "or remote (the checkpoint's own code; needs --trust-remote-code and transformers 4.46-4.57)."
    )
    gguf_file: str | None = Field(default=None, description="GGUF file name inside the model folder.")
    trust_remote_code: bool = Field(default=False, description="Allow the model's own code (loader remote).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="float32 | bfloat16 | "
                                                             "float16")  # fmt: skip
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    attn_implementation: str | None = Field(default=None, description="eager | sdpa | flash_attention_2")
    mask_token: str | None = Field(default=None, description="Override the mask token (string).")
    turn_end: str | None = Field(default=None, description="Override the end-of-turn token (string).")
    adapter: str | None = Field(default=None, description="A peft LoRA adapter folder (diffret train) applied to "
                                "--model; refused when it was trained on another base model.")  # fmt: skip
    merge_adapter: bool = Field(default=False, description="Merge the adapter into the weights once loaded (faster; "
                                "float rounding differs).")  # fmt: skip

    @field_validator("model", "adapter")
    @classmethod
    def _canonical_path(cls, v: str | None) -> str | None:
        """A local folder by its canonical path (absolute, symlinks resolved), however it was typed: the same
        folder is one system. Hub ids stay as they are."""
        return canonical_model(v) if v else v


def canonical_model(model: str) -> str:
    """``model`` as an absolute path with symlinks resolved when it names an existing local folder or file, else
    unchanged (a hub id).

    >>> canonical_model("org/name-on-the-hub")
    'org/name-on-the-hub'
    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     canonical_model(os.path.join(d, ".", "")) == os.path.realpath(d)
    True
    """
    path = Path(model).expanduser()
    return os.path.realpath(path) if path.exists() else model


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


def softmax_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entropy (nats) and the largest probability of the softmax over the last axis of ``logits``.

    >>> h, p = softmax_stats(torch.zeros(1, 4))
    >>> round(float(h[0]), 4), float(p[0])
    (1.3863, 0.25)
    """
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1), logp.max(-1).values.exp()


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
        loader: Literal["native", "remote"] = "native",
    ):
        if family not in FAMILIES:
            raise BackboneError(f"unknown backbone family {family!r}; expected one of {', '.join(FAMILIES)}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.spec = FAMILIES[family]
        self.family = family
        self.loader = loader
        self.name = name or getattr(model.config, "_name_or_path", "") or model.__class__.__name__
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._mask_token = mask_token
        self._turn_end = turn_end
        self.trunk, self.head = _split_head(model)
        self._projection: Any = False  # not looked for yet (projection())
        self.source: BackboneConfig | None = None  # the config it was loaded from (load_backbone)
        self.pad_id = _pad_id(tokenizer)
        # a causal architecture (or Dream's remote code) takes a 4D mask: every real token sees every real token
        self._causal_arch = _is_causal_arch(model)
        self._mask_4d = loader == "remote" and self.spec.remote_mask == "4d"

    # ------------------------------------------------------------------------------- tokens
    @property
    def mask_id(self) -> int:
        return mask_token_id(self.tokenizer, self.spec, self._mask_token, self.name)

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
    def stop_ids(self) -> set[int]:
        """Special-token ids that end a readout's words (the mask excepted).

        The tokenizer's named special tokens (bos, eos, unk, sep, pad, cls, mask) and its additional special
        tokens: what ``all_special_ids`` meant in transformers 4 (5 also counts custom named tokens).
        """
        tok = self.tokenizer
        names = [getattr(tok, a, None) for a in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                                                  "cls_token", "mask_token")]  # fmt: skip
        extra = getattr(tok, "additional_special_tokens", None) or getattr(tok, "extra_special_tokens", None) or []
        names += list(extra.values()) if isinstance(extra, dict) else list(extra)
        ids = {tok.convert_tokens_to_ids(str(t)) for t in names if t}
        out = {int(i) for i in ids if i is not None and i != tok.unk_token_id}
        try:
            out.discard(self.mask_id)
        except BackboneError:  # no mask token: nothing to except
            pass
        return out

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def hidden_size(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "hidden_size", None) or cfg.d_model)

    @property
    def vocab_size(self) -> int:
        """The LM head's output size (logits per position)."""
        out = self.model.get_output_embeddings()
        return int(out.weight.shape[0]) if out is not None else int(self.model.config.vocab_size)

    # ------------------------------------------------------------------------------ forward
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        """Last hidden states [B, L, H]; ``bidirectional`` forces full attention on causal architectures."""
        kwargs: dict[str, Any] = {}
        mask: torch.Tensor = attention_mask
        back: torch.Tensor | None = None
        if bidirectional and self._causal_arch:
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
        if self._mask_4d and mask.dim() == 2:
            mask = bidirectional_mask(mask, self.dtype)
        out = self.trunk(input_ids=input_ids, attention_mask=mask, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if back is not None:
            hidden = hidden.gather(1, back[..., None].expand(-1, -1, hidden.shape[-1]))
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def read_head(self, hidden: torch.Tensor, columns: torch.Tensor,
                  stats: bool = False) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """What a readout takes from the LM head at ``hidden`` [..., H]: the argmax token over the vocabulary
        [...] and the float32 logits at ``columns`` [C] ([..., C]), equal to those of :meth:`logits`; with
        ``stats``, also the entropy (nats) and the maximum probability of the softmax over the vocabulary [...]
        (a running log-sum-exp over the blocks; the query features of adaptive budgets).

        On a CPU the vocabulary is projected a block at a time (``VOCAB_BLOCK_BYTES`` of logits, which stay in
        the cache) with a running maximum, so the [..., V] logits are never held: the matrix product of each
        block is the same product as the whole head's (a test checks the values bit for bit). A head that is not
        a transform followed by one linear map (or a GPU) takes the full head.

        >>> import transformers
        >>> cfg = transformers.BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
        ...                               intermediate_size=8)
        >>> tok = SimpleNamespace(pad_token_id=0, eos_token_id=None, unk_token_id=None)
        >>> bb = Backbone(transformers.BertForMaskedLM(cfg), tok, "mlm")
        >>> h = torch.randn(2, 3, 8)
        >>> top, at = bb.read_head(h, torch.tensor([4, 7]))
        >>> bool((top == bb.logits(h).argmax(-1)).all()), bool(torch.equal(at, bb.logits(h)[..., [4, 7]]))
        (True, True)
        """
        proj = self.projection() if hidden.device.type == "cpu" else None
        if proj is None:
            full = self.logits(hidden).float()
            if not stats:
                return full.argmax(-1), full[..., columns]
            return full.argmax(-1), full[..., columns], *softmax_stats(full)
        pre, weight, bias = proj
        x = pre(hidden)
        flat = x.reshape(-1, x.shape[-1])
        vocab = weight.shape[0]
        block = max(32, VOCAB_BLOCK_BYTES // (4 * max(1, flat.shape[0])))
        best = torch.full((flat.shape[0],), float("-inf"), device=x.device)
        top = torch.zeros(flat.shape[0], dtype=torch.long, device=x.device)
        columns = columns.to(x.device)
        picked = torch.empty((flat.shape[0], columns.numel()), dtype=torch.float32, device=x.device)
        sorted_cols, order = torch.sort(columns)
        # with stats: sum exp(l - best) and sum exp(l - best) * l over the blocks so far, rescaled as best grows
        s0 = torch.zeros(flat.shape[0], dtype=torch.float64, device=x.device) if stats else None
        s1 = torch.zeros_like(s0) if stats else None
        for s in range(0, vocab, block):
            e = min(vocab, s + block)
            lg = torch.nn.functional.linear(flat, weight[s:e], None if bias is None else bias[s:e]).float()
            m, i = lg.max(-1)
            better = m > best  # strictly: the first of equal maxima wins, as argmax's
            if stats:
                new_best = torch.maximum(m, best).double()
                scale = torch.exp(best.double() - new_best)
                w = torch.exp(lg.double() - new_best[:, None])
                s0 = s0 * scale + w.sum(-1)
                s1 = s1 * scale + (w * lg.double()).sum(-1)
            best = torch.where(better, m, best)
            top = torch.where(better, i + s, top)
            lo, hi = torch.searchsorted(sorted_cols, torch.tensor([s, e], device=x.device)).tolist()
            if hi > lo:
                picked[:, order[lo:hi]] = lg[:, sorted_cols[lo:hi] - s]
        lead = x.shape[:-1]
        if not stats:
            return top.reshape(lead), picked.reshape(*lead, columns.numel())
        lse = best.double() + torch.log(s0)  # log of the softmax's normaliser
        entropy = (lse - s1 / s0).float()  # H = lse - E[l]
        maxprob = torch.exp(best.double() - lse).float()
        return top.reshape(lead), picked.reshape(*lead, columns.numel()), entropy.reshape(lead), maxprob.reshape(lead)

    def projection(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor | None] | None:
        """(transform, weight [V, H], bias) with ``logits(h) == linear(transform(h), weight, bias)`` bit for bit
        (checked once on random states), or None when the head is not of that shape (a wrapped or custom head)."""
        if self._projection is False:
            self._projection = _find_projection(self)
        return self._projection  # type: ignore[return-value]

    def rebind_head(self) -> None:
        """Bind the trunk and head again from the model (after peft wrapped some of its modules in place)."""
        self.trunk, self.head = _split_head(self.model)
        self._projection = False


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


def _split_head(model: torch.nn.Module) -> tuple[Callable[..., Any], Callable[[torch.Tensor], torch.Tensor]]:
    """(trunk, head) such that head(trunk(x).last_hidden_state) == model(x).logits."""
    name = model.__class__.__name__
    if hasattr(model, "cls") and hasattr(model, "bert"):  # BertForMaskedLM and relatives
        return model.bert, model.cls
    if hasattr(model, "head") and hasattr(model, "decoder") and hasattr(model, "model"):  # ModernBertForMaskedLM
        return model.model, lambda h: model.decoder(model.head(h))
    if hasattr(model, "lm_head") and hasattr(model, "model"):  # Llama, Qwen2, Dream, ...
        return model.model, model.lm_head
    transformer = getattr(getattr(model, "model", None), "transformer", None)
    if transformer is not None and "ln_f" in transformer and "blocks" in transformer:  # LLaDA's own code
        return _llada_trunk(model.model), _llada_head(model.model)
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


VOCAB_BLOCK_BYTES = 4 << 20  # float32 logits of one vocabulary block (read_head on a CPU): about a core's L2


def _find_projection(bb: Backbone) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor,
                                            torch.Tensor | None] | None:  # fmt: skip
    """The head as a transform and one linear map (Backbone.projection): a decoder after BERT's prediction
    transform or ModernBERT's head, an lm_head (LLaDA's ff_out) alone, or LLaDA's tied input embeddings."""
    head, model = bb.head, bb.model
    candidates: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor | None]] = []
    if type(head) is torch.nn.Linear:
        candidates.append((lambda h: h, head.weight, head.bias))
    predictions = getattr(head, "predictions", None)  # BERT's MLM head: transform, then decoder
    decoder = getattr(predictions, "decoder", None)
    if type(decoder) is torch.nn.Linear:
        candidates.append((predictions.transform, decoder.weight, decoder.bias))
    decoder = getattr(model, "decoder", None)  # ModernBERT's: head, then decoder
    if type(decoder) is torch.nn.Linear and isinstance(getattr(model, "head", None), torch.nn.Module):
        candidates.append((model.head, decoder.weight, decoder.bias))
    transformer = getattr(getattr(model, "model", None), "transformer", None)
    if transformer is not None and "wte" in transformer and "ff_out" not in transformer:
        candidates.append((lambda h: h, transformer["wte"].weight, None))
    if not candidates:
        return None
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn((3, 2, bb.hidden_size), generator=gen).to(device=bb.device, dtype=bb.dtype)
    with torch.inference_mode():
        want = bb.logits(probe)
        for pre, weight, bias in candidates:
            if weight.shape[0] != want.shape[-1]:
                continue
            got = torch.cat([torch.nn.functional.linear(pre(probe), weight[s : s + 1000],
                                                        None if bias is None else bias[s : s + 1000])
                             for s in range(0, weight.shape[0], 1000)], -1)  # fmt: skip
            if torch.equal(got, want):
                return pre, weight, bias
    return None


def _llada_trunk(llada: torch.nn.Module) -> Callable[..., Any]:
    """LLaDA's own model without its output projection: its "logits" are the final hidden states."""
    trunk = copy.copy(llada)
    trunk._modules = dict(llada._modules)
    transformer = torch.nn.ModuleDict(dict(llada.transformer.items()))
    if "ff_out" in transformer:
        transformer["ff_out"] = torch.nn.Identity()
    trunk._modules["transformer"] = transformer
    tied = bool(getattr(llada.config, "weight_tying", False))

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> Any:
        out = trunk(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=tied)
        return SimpleNamespace(last_hidden_state=out.hidden_states[-1] if tied else out.logits)

    return forward


def _llada_head(llada: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    t = llada.transformer
    if "ff_out" in t:
        return t.ff_out
    return lambda h: torch.nn.functional.linear(h, t.wte.weight)


# ------------------------------------------------------------------------------------------- loading
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
    from .released import ReleasedError, read_released

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
        raise BackboneError(f"adapter {adapter!r}: no {ADAPTER_CONFIG} there (a folder saved by diffret train "
                            "with LoRA, or by peft's save_pretrained)")  # fmt: skip
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
        raise BackboneError(f"adapter {adapter!r} was trained on {base!r}, not on {cfg.model!r}; give --model "
                            f"{base} (or the adapter's folder alone as --model)")  # fmt: skip
    return cfg


def _model_ref(cfg: BackboneConfig) -> tuple[str, dict[str, Any]]:
    """The path or hub id to load, and the gguf_file argument; clear errors for missing files."""
    cfg = with_adapter(cfg)
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


WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_SAMPLES, _SAMPLE_BYTES = 64, 1 << 16  # a weights fingerprint reads at most 4 MiB per file


def weights_fingerprint(model: str, gguf_file: str | None = None) -> str | None:
    """A content fingerprint of a local model (or adapter) folder: its weight files and config, each by size
    and 64 evenly spaced 64 KiB samples (the whole file when smaller); a copy of the folder elsewhere has the
    same one, a checkpoint retrained in place another. ``None`` for a hub id or a folder without weights.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = open(f"{d}/model.safetensors", "wb").write(b"a" * 100)
    >>> fp = weights_fingerprint(d)
    >>> _ = open(f"{d}/model.safetensors", "wb").write(b"b" * 100)
    >>> weights_fingerprint(d) != fp, weights_fingerprint("org/some-hub-id")
    (True, None)
    """
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return None
    weights = [p for p in folder.iterdir() if p.is_file() and (p.name == gguf_file if gguf_file else
                                                                 p.suffix in WEIGHT_SUFFIXES)]  # fmt: skip
    if not weights:  # nothing to fingerprint (the weights are elsewhere, or not downloaded)
        return None
    extra = [p for p in folder.iterdir() if p.is_file() and p.name in ("config.json", "adapter_config.json")]
    if (sub := folder / PASSAGE_ENCODER).is_dir():  # a separately trained passage encoder is part of the model
        extra += [p for p in sub.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")]
    files = sorted(weights + extra)
    stats = tuple((str(p.relative_to(folder)), str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _fingerprint(stats)


@functools.lru_cache(maxsize=64)
def _fingerprint(stats: tuple[tuple[str, str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, path, size, _mtime in stats:  # the mtime only keys the cache: a copy keeps its fingerprint
        h.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= _SAMPLES * _SAMPLE_BYTES:
                h.update(f.read())
                continue
            step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
            for i in range(_SAMPLES):
                f.seek(i * step)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]




def check_model_files(cfg: BackboneConfig) -> None:
    """Refuse a local model folder without weights, with a missing shard, or with a truncated or corrupt
    safetensors file, before any work is done (only the safetensors headers are read). Hub ids pass.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = open(f"{d}/config.json", "w").write("{}")
    >>> try:
    ...     check_model_files(BackboneConfig(model=d))
    ... except BackboneError as e:
    ...     print(str(e).split(": ", 1)[1])
    no weights (model.safetensors, pytorch_model.bin, a sharded index or a .gguf file); is the download complete?
    """
    cfg = with_adapter(cfg)
    for saved in (cfg.model, cfg.adapter):
        if saved:
            check_saved_model(Path(saved).expanduser())
    folder = Path(cfg.model).expanduser()
    if not folder.is_dir():
        return
    if cfg.gguf_file:
        gguf = folder / cfg.gguf_file
        if gguf.exists():
            with open(gguf, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise BackboneError(f"{gguf}: not a GGUF file (bad magic bytes)")
        return
    files = list(folder.glob("*.safetensors"))
    for index in WEIGHT_INDEXES:
        if (folder / index).exists():
            try:
                names = set(json.loads((folder / index).read_text())["weight_map"].values())
            except (ValueError, KeyError, TypeError) as exc:
                raise BackboneError(f"{folder / index}: unreadable weight index ({exc})") from None
            missing = sorted(n for n in names if not (folder / n).exists())
            if missing:
                raise BackboneError(f"{folder}: weight shards named by {index} are missing: {missing[:4]}")
    if not files and not list(folder.glob("*.bin")) and not list(folder.glob("*.gguf")):
        raise BackboneError(
            f"{folder}: no weights (model.safetensors, pytorch_model.bin, a sharded index or a .gguf file); "
            "is the download complete?"
        )
    for path in files:
        _check_safetensors(path)


_SAVED_STORES: dict[str, Any] = {}  # store root -> ArtifactStore: a file hashed once per process (size, mtime)


def check_saved_model(folder: Path) -> None:
    """Refuse a model folder diffret saved (``diffret train``, ``train-reranker``: a ``_manifest.json`` of stage
    ``models`` in it, or in its parent for a ``passage_encoder/``) whose files do not match their manifest's sha256,
    as an encoding's shards are checked before they are read; a :class:`storage.ChecksumError` naming the file and
    the repair. Other folders and hub ids pass.

    >>> check_saved_model(Path("org/some-hub-id"))
    """
    from storage import ArtifactStore
    from storage.layout import MANIFEST_NAME

    home = folder if folder.name != PASSAGE_ENCODER else folder.parent
    if not (home / MANIFEST_NAME).is_file():  # a model from elsewhere
        return
    try:
        stage = json.loads((home / MANIFEST_NAME).read_text()).get("stage")
    except (OSError, ValueError, AttributeError):
        stage = "models"  # unreadable: verify() below names it and the repair
    if stage != "models":  # another tool's file of that name
        return
    # inside a store (``models/model=<name>``) the error names the stage that rebuilds it
    root, rel = (home.parent.parent, f"models/{home.name}") if home.parent.name == "models" else (home.parent,
                                                                                                  home.name)
    store = _SAVED_STORES.setdefault(str(root), ArtifactStore(str(root)))
    store.verify(rel)


def check_weights(cfg: BackboneConfig, raw: dict[str, Any] | None = None) -> None:
    """:func:`check_model_files`, failing as a load error that names the model, its architecture and the
    transformers version (as every other load failure does)."""
    try:
        check_model_files(cfg)
    except BackboneError as exc:
        if raw is None:
            with contextlib.suppress(BackboneError):
                raw = raw_config(cfg)
        hint = "Check the folder; download or save the model again."
        raise _load_error(cfg, "its weights", exc, hint, raw) from exc


def _check_safetensors(path: Path) -> None:
    """The header parses and the file holds every tensor it lists (a truncated download fails here)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or 8 + n > size:
            raise BackboneError(f"{path}: corrupt safetensors file (header length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            raise BackboneError(f"{path}: corrupt safetensors file (unreadable header)") from None
    if 8 + n + end > size:
        raise BackboneError(f"{path}: truncated safetensors file ({size} bytes, its header needs {8 + n + end})")


def raw_config(cfg: BackboneConfig) -> dict[str, Any]:
    """The model's config.json as a dict: read without running any of the model's own code."""
    from transformers import PretrainedConfig

    ref, extra = _model_ref(cfg)
    try:
        raw = PretrainedConfig.get_config_dict(ref, **extra)[0]
        if not raw:
            raise BackboneError("no config.json")
        return raw
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
        raise _load_error(cfg, "its config", exc, "Check the hub id or the folder (it needs a config.json).") from exc


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
        _check_tokenizer_files(cfg)
        if spec.native is not None and cfg.loader == "native":
            cls = getattr(transformers, spec.native.tokenizer_class, None) or transformers.AutoTokenizer
            tok = cls.from_pretrained(ref, **extra)
        else:
            tok = transformers.AutoTokenizer.from_pretrained(ref, trust_remote_code=cfg.trust_remote_code, **extra)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
        hint = "Check the hub id or folder and its tokenizer files."
        raise _load_error(cfg, "its tokenizer", exc, hint, raw) from exc
    check_tokenizer(cfg, tok, spec, raw if raw is not None else raw_config(cfg))
    return tok


# a tokenizer's vocabulary lives in one of these (a GGUF file holds its own; an adapter folder names its base)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.model")  # fmt: skip


def _check_tokenizer_files(cfg: BackboneConfig) -> None:
    """A local model folder must hold its tokenizer's vocabulary: without it transformers builds an empty
    tokenizer and every word becomes [UNK] (a run that succeeds on garbage)."""
    folder = Path(cfg.model).expanduser()
    if cfg.gguf_file or not folder.is_dir():
        return
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise BackboneError(
            f"the folder has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}), so every word would become "
            "[UNK]; copy the tokenizer files of the model it was saved from into it"
        )


def check_tokenizer(cfg: BackboneConfig, tok: Any, spec: FamilySpec, raw: dict[str, Any]) -> None:
    """Refuse a tokenizer that would degrade silently (:class:`BackboneError` naming what is wrong): a vocabulary
    that does not match the model's embedding matrix (more ids than rows, or fewer than half of them), a named
    special token that is not in its vocabulary, a ``mask_token`` / ``turn_end`` override that is not either.

    >>> class Tok:  # a stand-in: 10 tokens, every string unknown
    ...     unk_token, unk_token_id = "[UNK]", 0
    ...     def __len__(self): return 10
    ...     def convert_tokens_to_ids(self, token): return 0
    >>> check_tokenizer(BackboneConfig(model="m", mask_token="<m>"), Tok(), FAMILIES["mlm"], {"vocab_size": 10})
    Traceback (most recent call last):
    ...
    retrieval.models.backbones.BackboneError: m: mask token '<m>' (--mask-token) is not in its tokenizer's vocabulary
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
            raise BackboneError(f"{name}: its {attr} {str(token)!r} is not in its tokenizer's vocabulary (a broken "
                                "tokenizer_config.json or special_tokens_map.json?)")  # fmt: skip
    for token, flag in ((cfg.mask_token, "--mask-token"), (cfg.turn_end, "--turn-end")):
        if token and missing(token):
            raise BackboneError(f"{name}: {flag.removeprefix('--').replace('-', ' ')} {token!r} ({flag}) is not in "
                                "its tokenizer's vocabulary")  # fmt: skip


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
        if spec.native is not None and cfg.loader == "native":
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
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
        hint = "Check the family (--family), the dtype and the loader."
        if cfg.loader == "remote":
            hint = "Its remote code may not run on this transformers; the native loader (the default) needs none."
        raise _load_error(cfg, f"it as {spec.name} ({cfg.loader} loader)", exc, hint, raw) from exc
    if cfg.adapter:
        model = _apply_adapter(model, cfg, raw, spec)
    model.to(resolve_device(cfg.device))
    bb = Backbone(model, tokenizer, spec.name, cfg.mask_token, cfg.turn_end, cfg.model, cfg.loader)
    bb.source = cfg
    return bb


PASSAGE_ENCODER = "passage_encoder"  # a model folder's sub-folder: its passage encoder, when trained apart (SIDR)


def passage_encoder_dir(model: str) -> Path | None:
    """The separately trained passage encoder a local model folder holds (``passage_encoder/``), if any.

    >>> passage_encoder_dir("org/some-hub-id") is None
    True
    """
    folder = Path(model).expanduser() / PASSAGE_ENCODER
    return folder if (folder / "config.json").is_file() else None


def _apply_adapter(model: torch.nn.Module, cfg: BackboneConfig, raw: dict[str, Any],
                   spec: FamilySpec | None = None) -> torch.nn.Module:  # fmt: skip
    """The peft adapter ``cfg.adapter`` injected into ``model`` (in place), or merged into its weights."""
    from peft import PeftModel

    folder = Path(cfg.adapter or "").expanduser()
    try:
        peft = _remapped_adapter(model, folder, cfg, spec) or PeftModel.from_pretrained(model, str(folder))
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
        raise _load_error(cfg, f"the adapter {cfg.adapter!r} onto it", exc,
                          "The adapter must come from this base model and family.", raw) from exc  # fmt: skip
    peft.eval()
    return peft.merge_and_unload() if cfg.merge_adapter else model


def _remapped_adapter(model: torch.nn.Module, folder: Path, cfg: BackboneConfig, spec: FamilySpec | None) -> Any:
    """An adapter saved on the checkpoint's own module names (a released LLaDA retriever: ``transformer.blocks``)
    applied to the native class under its names (the weights' ``key_mapping``); None for any other adapter. Every
    adapter tensor must land on a module: a missing or unexpected one is an error, never a silent base model."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from .released import adapter_state, remap_adapter

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
        raise BackboneError(f"the adapter's tensors do not map onto {type(model).__name__}: unexpected "
                            f"{unexpected[:3]}, missing {missing[:3]}")  # fmt: skip
    return peft


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


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
