"""Readouts: token ids of a text -> dense vectors [n, H] (+ sparse vocabulary weights).

- ``diffretriever`` (paper §3.2, eq. 1): prompt + text + K masks + closing, ONE bidirectional forward
  pass (S = 1); hidden states at the K mask positions = dense multi-vector; logits at those
  positions only -> sparse. ``denoise_steps`` S > 1 unmasks by confidence over S passes (appendix
  A.1), each position's hidden state and logits frozen at the step that reveals it.
- ``promptreps``: greedy decoding after the assistant prefix with a KV cache until the closing quote
  or the cap N (= K); each generated step's hidden state and logits are a representative.
- ``diffembed``: mean of the last hidden states over the text (no prompt), bidirectional.
- ``repllama``: hidden state of the final EOS after ``query: `` / ``passage: `` (causal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import BaseModel, Field

from ..traits import Declared
from .backbones import Backbone, BackboneError
from .prompts import PromptPieces, build_pieces, default_variant, load_prompt, special_wrapping
from .sparse import ContentFilter, pooled_weights, topk_pairs, topk_sparse


@dataclass
class Encoded:
    dense: np.ndarray  # [n, H] float16
    sparse_ids: np.ndarray | None = None  # int32, sorted by weight, descending
    sparse_weights: np.ndarray | None = None  # float32
    n_tokens: int = 0  # model input length
    stopped: bool | None = None  # promptreps: stopped at the closing quote (not at the cap)


@dataclass
class _Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor  # [B, K] indices of the K slots (masks / last token)
    lengths: list[int] = field(default_factory=list)


def _pad(
    rows: list[list[int]], pad_id: int, side: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    offsets = []
    for i, r in enumerate(rows):
        off = width - len(r) if side == "left" else 0
        ids[i, off : off + len(r)] = torch.as_tensor(r, dtype=torch.long)
        att[i, off : off + len(r)] = 1
        offsets.append(off)
    return ids.to(device), att.to(device), offsets


class Readout(Declared):
    """Encodes batches of tokenized texts with one backbone and one readout config.

    A subclass per readout declares what it produces and what K means for it; ``READOUTS`` maps names to
    subclasses and :func:`make_reader` picks one for a config.
    """

    name: ClassVar[str]
    multi_vector: ClassVar[bool]  # up to K vectors per text (else exactly one)
    has_sparse: ClassVar[bool]  # a sparse vocabulary vector besides the dense ones
    needs_causal_lm: ClassVar[bool]  # reads a causal (autoregressive) model only
    uses_prompt: ClassVar[bool]  # wraps the text in the PromptReps prompt
    k_values: ClassVar[Literal["grid", "one value", "1"]]  # the budgets one encode takes
    k_meaning: ClassVar[str]  # what K is for this readout (shown in errors and docs)

    def __init__(self, backbone: Backbone, config: ReadoutConfig):
        if self.needs_causal_lm and backbone.spec.bidirectional:
            raise BackboneError(f"the {self.name} readout needs a causal LM; {backbone.name} is {backbone.family}")
        self.bb = backbone
        self.cfg = config
        self.filter = ContentFilter(backbone.tokenizer) if (config.content_filter and self.has_sparse) else None
        self._pieces: dict[tuple[str, str], PromptPieces] = {}

    @classmethod
    def check_k(cls, ks: list[int]) -> None:
        """Refuse budgets this readout cannot take (ValueError naming what K means here)."""
        bad = [k for k in ks if not isinstance(k, int) or k <= 0]
        if bad or not ks:
            raise ValueError(f"K must be positive integers, got {ks}")
        if cls.k_values == "one value" and len(ks) != 1:
            raise ValueError(f"the {cls.name} readout takes one K, {cls.k_meaning}: give one value (got {ks})")
        if cls.k_values == "1" and ks != [1]:
            raise ValueError(f"the {cls.name} readout has one vector per text; use --k 1 (got {ks})")

    # ------------------------------------------------------------------------------ prompt
    def variant(self, k: int) -> str:
        return default_variant(k) if self.cfg.prompt == "auto" else self.cfg.prompt

    def pieces(self, side: str, k: int) -> PromptPieces:
        variant = self.variant(k)
        key = (side, variant)
        if key not in self._pieces:
            use_chat = {"yes": True, "no": False}.get(self.cfg.chat_template, self.bb.has_chat_template)
            turn_end = self.bb.turn_end_id if use_chat else None
            self._pieces[key] = build_pieces(self.bb.tokenizer, load_prompt(variant), side, turn_end, use_chat)
        return self._pieces[key]

    # ------------------------------------------------------------------------------ encode
    @torch.inference_mode()
    def encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        """Encode one batch. ``texts`` (the raw texts) feed the sparse content-word filter."""
        if k <= 0:
            raise ValueError(f"K must be a positive integer, got {k}")
        if not token_ids:
            return []
        return self._encode(self._fit(token_ids, side, k), texts, side, k)

    def _encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        raise NotImplementedError

    def max_positions(self) -> int | None:
        cfg = self.bb.model.config
        return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)

    def overhead(self, side: str, k: int) -> int:
        """Input tokens around a text (prompt pieces, masks, special tokens)."""
        head, tail = special_wrapping(self.bb.tokenizer)
        return len(head) + len(tail)

    def _fit(self, token_ids: list[list[int]], side: str, k: int) -> list[list[int]]:
        """Cut texts so that prompt + text + masks fit the model's positions (BERT: 512)."""
        limit = self.max_positions()
        if not limit:
            return token_ids
        room = limit - self.overhead(side, k)
        if room <= 0:
            raise ValueError(f"{self.bb.name}: the prompt and K={k} masks alone exceed its {limit} positions")
        return [t if len(t) <= room else list(t[:room]) for t in token_ids]

    def _sparse(self, logits_k_v: torch.Tensor, text: str | None) -> tuple[np.ndarray, np.ndarray]:
        allowed = self.filter.allowed_ids(text) if (self.filter is not None and text is not None) else None
        return topk_sparse(pooled_weights(logits_k_v), allowed, self.cfg.sparse_topk)


class MaskReadout(
    Readout, name="diffretriever", multi_vector=True, has_sparse=True, needs_causal_lm=False, uses_prompt=True,
    k_values="grid", k_meaning="the number of [MASK] slots appended to the prompt (one vector each)",
):
    """DiffRetriever (paper section 3.2, eq. 1-2): K [MASK] slots after the prompt, one bidirectional pass.

    The hidden states at the K mask positions are the dense multi-vector; the LM head is applied at those
    positions only (and, with the content filter, only to the rows of the text's content words) for the
    sparse vector. ``denoise_steps`` S > 1 unmasks by confidence over S passes (appendix A.1).
    """

    def __init__(self, backbone: Backbone, config: ReadoutConfig):
        super().__init__(backbone, config)
        _ = backbone.mask_id  # fail early: a masked readout needs a mask token

    def overhead(self, side: str, k: int) -> int:
        p = self.pieces(side, k)
        return len(p.prefix) + len(p.suffix) + k + len(p.closing)

    def _mask_batch(self, token_ids: list[list[int]], side: str, k: int) -> _Batch:
        p = self.pieces(side, k)
        mask = self.bb.mask_id
        rows = [list(p.prefix) + list(t) + list(p.suffix) + [mask] * k + list(p.closing) for t in token_ids]
        ids, att, offs = _pad(rows, self.bb.pad_id, self.cfg.padding_side, self.bb.device)
        starts = [off + len(p.prefix) + len(t) + len(p.suffix) for off, t in zip(offs, token_ids, strict=True)]
        positions = torch.as_tensor([[s + j for j in range(k)] for s in starts], device=self.bb.device)
        return _Batch(ids, att, positions, [len(r) for r in rows])

    def _encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        b = self._mask_batch(token_ids, side, k)
        rows = torch.arange(len(token_ids), device=self.bb.device)[:, None]
        steps = self.cfg.denoise_steps
        if steps == 1:
            hidden = self.bb.hidden_states(b.input_ids, b.attention_mask, bidirectional=True)
            h = hidden[rows, b.positions]  # [B, K, H]
            # the head at the mask positions only; restricted to content words when the filter applies
            logits = None if (self.filter is not None and texts is not None) else self.bb.logits(h)
        else:
            h, logits = self._denoise(b, k, steps)
        out = []
        for i in range(len(token_ids)):
            if logits is None:  # the head only at the K masks and only over the text's content words
                ids, w = self._sparse_restricted(h[i], texts[i])  # type: ignore[index]
            else:
                ids, w = self._sparse(logits[i], texts[i] if texts else None)
            out.append(Encoded(h[i].float().cpu().numpy().astype(np.float16), ids, w, b.lengths[i]))
        return out

    def _sparse_restricted(self, h_k: torch.Tensor, text: str) -> tuple[np.ndarray, np.ndarray]:
        assert self.filter is not None
        allowed = torch.as_tensor(self.filter.allowed_ids(text), dtype=torch.long, device=h_k.device)
        if allowed.numel() == 0:
            return np.zeros(0, np.int32), np.zeros(0, np.float32)
        return topk_pairs(allowed, pooled_weights(self.bb.logits_at(h_k, allowed)), self.cfg.sparse_topk)

    def _denoise(self, b: _Batch, k: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Confidence-based unmasking over ``steps`` passes; revealed positions are frozen."""
        ids = b.input_ids.clone()
        bsz = ids.shape[0]
        rows = torch.arange(bsz, device=ids.device)[:, None]
        hidden_buf: torch.Tensor | None = None
        logit_buf: torch.Tensor | None = None
        revealed = torch.zeros((bsz, k), dtype=torch.bool, device=ids.device)
        for s in range(steps):
            hidden = self.bb.hidden_states(ids, b.attention_mask, bidirectional=True)
            h = hidden[rows, b.positions]
            logits = self.bb.logits(h)
            if hidden_buf is None:
                hidden_buf, logit_buf = torch.zeros_like(h), torch.zeros_like(logits)
            remaining = k - int(revealed[0].sum())
            n_now = -(-remaining // (steps - s))  # ceil: everything is revealed by the last step
            conf, tok = logits.float().softmax(-1).max(-1)  # [B, K]
            conf = conf.masked_fill(revealed, -1.0)
            pick = torch.topk(conf, n_now, dim=-1).indices  # [B, n_now]
            new = torch.zeros_like(revealed).scatter_(1, pick, True) & ~revealed
            hidden_buf = torch.where(new[..., None], h, hidden_buf)
            logit_buf = torch.where(new[..., None], logits, logit_buf)
            ids[rows, b.positions] = torch.where(new, tok, ids[rows, b.positions])
            revealed |= new
        assert hidden_buf is not None and logit_buf is not None
        return hidden_buf, logit_buf


class PromptRepsReadout(
    Readout, name="promptreps", multi_vector=True, has_sparse=True, needs_causal_lm=True, uses_prompt=True,
    k_values="one value", k_meaning="the cap N on the words decoded one by one (e.g. --k 20 zero-shot)",
):
    """PromptReps: greedy decoding after the assistant prefix (KV cache) until the closing quote or the cap N.

    Each generated step's hidden state and logits are a representative (paper's autoregressive baseline).
    """

    def overhead(self, side: str, k: int) -> int:
        p = self.pieces(side, k)
        return len(p.prefix) + len(p.suffix) + k

    def quote_ids(self) -> set[int]:
        """Vocabulary ids whose text contains the closing quote (e.g. ``"``, ``",``, ``."``)."""
        if getattr(self, "_quote_ids", None) is None:
            tok = self.bb.tokenizer
            closing = load_prompt(self.variant(1)).closing.strip() or '"'
            vocab = tok.get_vocab()
            self._quote_ids = {i for t, i in vocab.items() if closing in tok.convert_tokens_to_string([t])}
        return self._quote_ids

    def _encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        """Greedy decoding with a KV cache (left padding); at most K steps (the cap N: 20 zero-shot, 4 fine-tuned)."""
        p = self.pieces(side, k)
        rows = [list(p.prefix) + list(t) + list(p.suffix) for t in token_ids]
        ids, att, _ = _pad(rows, self.bb.pad_id, "left", self.bb.device)
        bsz = len(rows)
        quote = torch.zeros(self.bb.model.config.vocab_size, dtype=torch.bool, device=ids.device)
        qi = [i for i in self.quote_ids() if i < quote.numel()]
        quote[qi] = True
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        past = None
        cur_ids, cur_pos = ids, pos
        hs: list[torch.Tensor] = []
        lg: list[torch.Tensor] = []
        active = torch.ones(bsz, dtype=torch.bool, device=ids.device)
        n_reps = torch.zeros(bsz, dtype=torch.long, device=ids.device)
        stopped = torch.zeros(bsz, dtype=torch.bool, device=ids.device)
        for _ in range(k):
            out = self.bb.trunk(
                input_ids=cur_ids, attention_mask=att, position_ids=cur_pos, past_key_values=past, use_cache=True
            )
            past = out.past_key_values
            h = out.last_hidden_state[:, -1]
            logits = self.bb.logits(h)
            nxt = logits.argmax(-1)
            is_quote = quote[nxt]
            # a step that predicts the closing quote ends the words; it counts only if it is the first step
            counts = active & (~is_quote | (n_reps == 0))
            hs.append(h)
            lg.append(logits)
            n_reps += counts.long()
            stopped |= active & is_quote
            active &= ~is_quote
            if not bool(active.any()):
                break
            cur_ids = nxt[:, None]
            att = torch.cat([att, torch.ones((bsz, 1), dtype=att.dtype, device=att.device)], dim=1)
            cur_pos = cur_pos[:, -1:] + 1
        H = torch.stack(hs, dim=1)  # [B, T, H]
        L = torch.stack(lg, dim=1)  # [B, T, V]
        out_list = []
        for i in range(bsz):
            n = int(n_reps[i])
            ids_i, w_i = self._sparse(L[i, :n], texts[i] if texts else None)
            out_list.append(
                Encoded(H[i, :n].float().cpu().numpy().astype(np.float16), ids_i, w_i, len(rows[i]), bool(stopped[i]))
            )
        return out_list


class _SingleVector(
    Readout, multi_vector=False, has_sparse=False, uses_prompt=False, k_values="1",
    k_meaning="always 1: one vector per text",
):
    """A readout with one dense vector per text and no prompt (K must be 1)."""

    def encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        if k > 1:
            raise ValueError(f"the {self.name} readout has one vector per text; use K = 1 (got {k})")
        return super().encode(token_ids, texts, side, k)


class DiffEmbedReadout(_SingleVector, name="diffembed", needs_causal_lm=False):
    """DiffEmbed: the mean of the last hidden states over the text (no prompt), bidirectional."""

    def _encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        head, tail = special_wrapping(self.bb.tokenizer)
        rows = [head + list(t) + tail for t in token_ids]
        ids, att, _ = _pad(rows, self.bb.pad_id, self.cfg.padding_side, self.bb.device)
        hidden = self.bb.hidden_states(ids, att, bidirectional=True).float()
        m = att[..., None].float()
        mean = (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)
        return [
            Encoded(mean[i : i + 1].cpu().numpy().astype(np.float16), n_tokens=len(rows[i])) for i in range(len(rows))
        ]


class RepLlamaReadout(_SingleVector, name="repllama", needs_causal_lm=True):
    """RepLLaMA: the hidden state of the final EOS after ``query: `` / ``passage: `` (causal attention)."""

    def overhead(self, side: str, k: int) -> int:
        return super().overhead(side, k) + 8

    def _encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        tok = self.bb.tokenizer
        prefix = tok(f"{side}: ", add_special_tokens=False)["input_ids"]
        head, _ = special_wrapping(tok)
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        rows = [head + list(prefix) + list(t) + eos for t in token_ids]
        ids, att, offs = _pad(rows, self.bb.pad_id, self.cfg.padding_side, self.bb.device)
        hidden = self.bb.hidden_states(ids, att, bidirectional=False)
        last = torch.as_tensor([o + len(r) - 1 for o, r in zip(offs, rows, strict=True)], device=ids.device)
        h = hidden[torch.arange(len(rows), device=ids.device), last]
        return [
            Encoded(h[i : i + 1].float().cpu().numpy().astype(np.float16), n_tokens=len(rows[i]))
            for i in range(len(rows))
        ]


READOUTS: dict[str, type[Readout]] = {
    cls.name: cls for cls in (MaskReadout, PromptRepsReadout, DiffEmbedReadout, RepLlamaReadout)
}
ReadoutName = Literal["diffretriever", "promptreps", "diffembed", "repllama"]
assert set(ReadoutName.__args__) == set(READOUTS)  # the config's choices are the registry's


class ReadoutConfig(BaseModel):
    """How a text becomes vectors: the readout (see READOUTS) and its settings."""

    readout: ReadoutName = Field(
        default="diffretriever", description="diffretriever | promptreps | diffembed | repllama"
    )
    prompt: str = Field(
        default="auto", description="auto (one_word at K=1, few_words at K>1), a variant, or a YAML path"
    )
    chat_template: Literal["auto", "yes", "no"] = Field(
        default="auto", description="Wrap the prompt in the model's chat template (auto: when it has one)."
    )
    denoise_steps: int = Field(default=1, ge=1, description="S: forward passes for the mask readout (1 = the paper's)")
    sparse_topk: int = Field(default=256, ge=1, description="Sparse entries kept per text.")
    content_filter: bool = Field(default=True, description="Keep only the input's content words in sparse vectors")
    padding_side: Literal["left", "right"] = Field(default="left", description="left | right")


def readout_class(name: str) -> type[Readout]:
    """The registered readout called ``name`` (ValueError listing the known ones)."""
    try:
        return READOUTS[name]
    except KeyError:
        raise ValueError(f"unknown readout {name!r}; expected one of {', '.join(READOUTS)}") from None


def make_reader(backbone: Backbone, config: ReadoutConfig) -> Readout:
    """The readout of ``config`` over a loaded backbone."""
    return readout_class(config.readout)(backbone, config)
