"""Readouts: token ids of a text -> dense vectors [n, H] (+ sparse vocabulary weights).

- ``diffretriever`` (paper §3.2, eq. 1-2): prompt + text + K masks + tail, ONE bidirectional forward
  pass (S = 1); the hidden states at the K mask positions are the dense multi-vector, the logits there the
  sparse vector. As the reference encoder does, the argmax token of every slot is read and the slots from
  the first special token on are dropped (``stop_cut``). ``denoise_steps`` S > 1 unmasks by confidence
  (negative entropy) on the reference's schedule over S passes (appendix A.1), each slot's hidden state and
  logits frozen at the step that reveals it.
- ``promptreps``: greedy decoding after the assistant prefix with a KV cache, at most K (the cap N) slots:
  the hidden state at the opening quote, then at each generated token; it stops at the closing quote.
- ``diffembed``: mean of the last hidden states over the text (no prompt), bidirectional.
- ``repllama``: hidden state of the final EOS after ``query: `` / ``passage: `` (causal).
- ``sidr``: SIDR's V_theta: a vocabulary score per position (the official head or the model's LM head), elu1p or
  log(1 + ReLU), max-pooled over the text's positions, top 768 (the sparse vector; the dense one is the mean).

Every choice where diffret 0.1 differed from the reference is a named setting of ``ReadoutConfig``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import BaseModel, Field

from ..traits import Declared
from .backbones import Backbone, BackboneError, load_backbone, passage_encoder_dir, softmax_stats
from .prompts import PromptPieces, build_pieces, chat_tail, default_variant, load_prompt, special_wrapping
from .released import CHECKPOINT_PROMPT, RELEASED_CONFIG, read_released
from .sparse import (
    excluded_ids,
    make_filter,
    per_position_sparse,
    per_position_sparse_batch,
    pooled_weights,
    topk_sparse,
)

# Tokens per input, the prompt counted (truncation="prompt"): run_encode.sh's 256, which produced the paper's
# encodings; scripts/encode.py's own default (and the reference-parity fixtures') is 512.
DEFAULT_MAX_LENGTH = 256


@dataclass
class Encoded:
    dense: np.ndarray  # [n, H] float16
    sparse_ids: np.ndarray | None = None  # int32, sorted by weight, descending
    sparse_weights: np.ndarray | None = None  # float32
    n_tokens: int = 0  # model input length
    stopped: bool | None = None  # cut before K: at a special token (mask readout) or the closing quote (promptreps)
    tokens: np.ndarray | None = None  # int32: the token read at each slot (argmax / generated), all K
    entropy: np.ndarray | None = None  # float32 [K]: the LM head's softmax entropy (nats) at each slot (head stats)
    maxprob: np.ndarray | None = None  # float32 [K]: and its largest probability


@dataclass
class TrainReps:
    """What training reads from a batch of texts, with gradients: the dense slots, which are real, and the
    logits at them (None for readouts without a sparse side)."""

    dense: torch.Tensor  # [B, n, H]
    mask: torch.Tensor  # [B, n] bool
    logits: torch.Tensor | None = None  # [B, n, V]


def _all_real(h: torch.Tensor) -> torch.Tensor:
    return torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)


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


@dataclass
class Prepared:
    """A batch as :meth:`Readout.prepare` leaves it for :meth:`Readout.run`."""

    token_ids: list[list[int]]  # cut to fit
    texts: Sequence[str | Sequence[int]] | None  # raw texts, or their filter ids
    side: str
    k: int
    mask_batch: _Batch | None = None  # the mask readout's padded inputs
    candidates: list[torch.Tensor] | None = None  # and each text's candidate vocabulary ids
    head_stats: bool = False  # the mask readout also reads the head's entropy and max probability at each slot


HEAD_CHUNK_BYTES = 256 << 20  # float32 logits of the candidate ids held at once while encoding ([texts, K, C])


def _f16(x: torch.Tensor) -> np.ndarray:
    return x.float().cpu().numpy().astype(np.float16)


class Readout(Declared):
    """Encodes batches of tokenized texts with one backbone and one readout config.

    A subclass per readout declares what it produces and what K means for it; ``READOUTS`` maps names to
    subclasses and :func:`make_reader` picks one for a config. ``max_length`` bounds the input: the prompt and
    the text (``truncation="prompt"``, the reference's), or the text alone (``"text"``).
    """

    name: ClassVar[str]
    multi_vector: ClassVar[bool]  # up to K vectors per text (else exactly one)
    has_sparse: ClassVar[bool]  # a sparse vocabulary vector besides the dense ones
    needs_causal_lm: ClassVar[bool]  # reads a causal (autoregressive) model only
    uses_prompt: ClassVar[bool]  # wraps the text in the PromptReps prompt
    k_values: ClassVar[Literal["grid", "one value", "1"]]  # the budgets one encode takes
    k_meaning: ClassVar[str]  # what K is for this readout (shown in errors and docs)

    def __init__(self, backbone: Backbone, config: ReadoutConfig, max_length: int = DEFAULT_MAX_LENGTH):
        if self.needs_causal_lm and backbone.spec.bidirectional:
            raise BackboneError(f"the {self.name} readout needs a causal LM; {backbone.name} is {backbone.family}")
        self.bb = backbone
        self.cfg = config.resolved()  # settings left at auto: the zero-shot path unless finetuned says otherwise
        self.max_length = max_length
        self.filter = make_filter(backbone.tokenizer, self.filter_kind(config))
        self._pieces: dict[tuple[str, str, int], PromptPieces] = {}

    reads_filter: ClassVar[bool] = True  # its sparse vector keeps the content words' ids only (when it has one)

    @classmethod
    def filter_kind(cls, config: ReadoutConfig) -> str:
        """The content filter this readout applies with ``config`` (``none``: none), known before any model loads:
        the tokenize stage computes it once per text for the encode stage to read."""
        return config.content_filter if cls.has_sparse and cls.reads_filter else "none"

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

    def train_forward(self, token_ids: list[list[int]], side: str, k: int) -> TrainReps:
        """With gradients, for training: the dense slots the scorer reads (and the logits for the sparse side)."""
        raise NotImplementedError(f"training does not cover the {self.name} readout")

    # ------------------------------------------------------------------------------ prompt
    def variant(self, k: int) -> str:
        return default_variant(k) if self.cfg.prompt == "auto" else self.cfg.prompt

    def pieces(self, side: str, k: int) -> PromptPieces:
        variant = self.variant(k)
        adapt = k if self.adapts_prompt else 1
        key = (side, variant, adapt)
        if key not in self._pieces:
            use_chat = {"yes": True, "no": False}.get(self.cfg.chat_template, self.bb.has_chat_template)
            turn_end = self.bb.turn_end_id if use_chat else None
            if variant == CHECKPOINT_PROMPT:
                self._pieces[key] = self._checkpoint_pieces(side, turn_end)
            else:
                self._pieces[key] = build_pieces(self.bb.tokenizer, load_prompt(variant), side, adapt, turn_end,
                                                 use_chat)  # fmt: skip
        return self._pieces[key]

    def _checkpoint_pieces(self, side: str, turn_end: int | None) -> PromptPieces:
        """A released checkpoint's own prompt: its stored ids around the text, its tail after the masks (the
        reference's: quote, end of turn, EOS, ``n_tail`` of them), whatever K is encoded."""
        source = self.bb.source
        ckpt = read_released(source.adapter or source.model) if source is not None else None
        if ckpt is None:
            raise BackboneError(f"{self.bb.name}: prompt {CHECKPOINT_PROMPT!r} reads a released checkpoint's "
                                f"{RELEASED_CONFIG}; this model has none (give --prompt auto or a variant)")
        if ckpt.mask_token_id != self.bb.mask_id:
            raise BackboneError(f"{ckpt.folder}: mask_token_id {ckpt.mask_token_id} is not the base model's mask "
                                f"token ({self.bb.mask_id}): the adapter was trained on another base")  # fmt: skip
        tail = chat_tail(self.bb.tokenizer, turn_end if turn_end is not None else self.bb.turn_end_id,
                         self.bb.tokenizer.eos_token_id)[: ckpt.n_tail] if ckpt.n_tail else []  # fmt: skip
        return PromptPieces(ckpt.prefix[side], ckpt.suffix[side], tuple(tail))

    adapts_prompt: ClassVar[bool] = False  # the prompt's number words follow K (the mask readout's)

    # ------------------------------------------------------------------------------ encode
    def encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        """Encode one batch. ``texts`` (the raw, untruncated texts) feed the sparse content-word filter; in their
        place, the filter's ids of each text computed before (``Readout.allowed``)."""
        return self.run(self.prepare(token_ids, texts, side, k))

    def prepare(self, token_ids: list[list[int]], texts: Sequence[str | Sequence[int]] | None, side: str,
                k: int) -> Prepared:  # fmt: skip
        """The part of :meth:`encode` that needs no model (cutting, and for the mask readout the padded batch and
        the filter's candidates): ``encode_rows`` prepares the next batch in a thread while the model runs one."""
        if k <= 0:
            raise ValueError(f"K must be a positive integer, got {k}")
        return Prepared(self._fit(token_ids, side, k), texts, side, k)

    @torch.inference_mode()
    def run(self, batch: Prepared) -> list[Encoded]:
        """The model's part of :meth:`encode`, on a batch from :meth:`prepare`."""
        if not batch.token_ids:
            return []
        return self._encode(batch.token_ids, batch.texts, batch.side, batch.k)  # type: ignore[arg-type]

    def _encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        raise NotImplementedError

    def max_positions(self) -> int | None:
        cfg = self.bb.model.config
        return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)

    def overhead(self, side: str, k: int) -> tuple[int, int]:
        """(tokens around the text that ``max_length`` counts, tokens on top of them): the prompt pieces, then
        the masks and the tail (or the special tokens around a text)."""
        head, tail = special_wrapping(self.bb.tokenizer)
        return len(head) + len(tail), 0

    def _fit(self, token_ids: list[list[int]], side: str, k: int) -> list[list[int]]:
        """Cut texts to ``max_length`` (counting the prompt, or not), and so that everything fits the model's
        positions (BERT: 512)."""
        counted, extra = self.overhead(side, k)
        room = self.max_length - counted if self.cfg.truncation == "prompt" else self.max_length
        limit = self.max_positions()
        if limit:
            room = min(room, limit - counted - extra)
        if room <= 0:
            raise ValueError(f"{self.bb.name}: the prompt and K={k} masks alone exceed its positions or max_length")
        return [t if len(t) <= room else list(t[:room]) for t in token_ids]

    def allowed(self, text: str | Sequence[int] | None, device: torch.device) -> torch.Tensor | None:
        """The vocabulary ids a sparse vector may hold (content words, never the mask), or None for all. ``text``
        is the raw text, or its filter ids computed before (the tokenize stage stores them: ``filters/``)."""
        if self.filter is None or text is None:
            return None
        found = self.filter.allowed_ids(text) if isinstance(text, str) else text
        ids = [int(i) for i in found if i != getattr(self, "_mask_id", None)]
        return torch.as_tensor(ids, dtype=torch.long, device=device)

    def sparse_from(self, logits_k_v: torch.Tensor, text: str | Sequence[int] | None, k: int) -> tuple[np.ndarray,
                                                                                                    np.ndarray]:
        """The sparse vector of one text from the logits at its kept slots [n, V] of K (see ``ReadoutConfig.sparse``
        and ``sparse_quantise``)."""
        allowed = self.allowed(text, logits_k_v.device)
        topk, quantise = int(self.cfg.sparse_topk or 128), str(self.cfg.sparse_quantise)
        if self.cfg.sparse == "pooled":
            return topk_sparse(pooled_weights(logits_k_v), None if allowed is None else allowed.tolist(), topk,
                               quantise)  # fmt: skip
        if allowed is None:
            allowed = torch.arange(logits_k_v.shape[-1], device=logits_k_v.device)
            mask_id = getattr(self, "_mask_id", None)
            if mask_id is not None:
                allowed = allowed[allowed != mask_id]
        return per_position_sparse(allowed, logits_k_v[:, allowed], topk, quantise, pooled_bf16=k > 1)


class MaskReadout(
    Readout, name="diffretriever", multi_vector=True, has_sparse=True, needs_causal_lm=False, uses_prompt=True,
    k_values="grid", k_meaning="the number of [MASK] slots appended to the prompt (one vector each)",
    adapts_prompt=True,
):
    """DiffRetriever (paper section 3.2, eq. 1-2): K [MASK] slots after the prompt, one bidirectional pass.

    The hidden states at the K mask positions are the dense multi-vector; the LM head is applied at those
    positions only, for the sparse vector and the argmax token of each slot. ``denoise_steps`` S > 1 unmasks
    by confidence over S passes (appendix A.1).
    """

    def __init__(self, backbone: Backbone, config: ReadoutConfig, max_length: int = DEFAULT_MAX_LENGTH):
        super().__init__(backbone, config, max_length)
        self._mask_id = backbone.mask_id  # fail early: a masked readout needs a mask token
        self._stop = torch.zeros(0, dtype=torch.long)
        if self.cfg.stop_cut:
            self._stop = torch.as_tensor(sorted(backbone.stop_ids), dtype=torch.long, device=backbone.device)

    def overhead(self, side: str, k: int) -> tuple[int, int]:
        p = self.pieces(side, k)
        return len(p.prefix) + len(p.suffix), k + len(p.closing)

    def _mask_batch(self, token_ids: list[list[int]], side: str, k: int) -> _Batch:
        p = self.pieces(side, k)
        masks = [self._mask_id] * k
        rows = [list(p.prefix) + list(t) + list(p.suffix) + masks + list(p.closing) for t in token_ids]
        ids, att, offs = _pad(rows, self.bb.pad_id, self.cfg.padding_side, self.bb.device)
        starts = [off + len(p.prefix) + len(t) + len(p.suffix) for off, t in zip(offs, token_ids, strict=True)]
        positions = torch.as_tensor([[s + j for j in range(k)] for s in starts], device=self.bb.device)
        return _Batch(ids, att, positions, [len(r) for r in rows])

    def train_forward(self, token_ids: list[list[int]], side: str, k: int) -> TrainReps:
        """With gradients, for training: the hidden states and logits at the K masks (all K slots, no stop cut,
        as the reference trains). With S > 1 denoising steps the first S - 1 run without gradients and the
        loss reads the final step: the slots it reveals carry gradients, the ones frozen earlier do not."""
        b = self._mask_batch(self._fit(token_ids, side, k), side, k)
        if self.cfg.denoise_steps > 1:
            h, logits, _ = self._denoise(b, k, self.cfg.denoise_steps, grad_final=True)
            return TrainReps(h, _all_real(h), logits)
        hidden = self.bb.hidden_states(b.input_ids, b.attention_mask, bidirectional=True)
        h = hidden[torch.arange(len(token_ids), device=hidden.device)[:, None], b.positions]
        return TrainReps(h, _all_real(h), self.bb.logits(h))

    def prepare(self, token_ids: list[list[int]], texts: Sequence[str | Sequence[int]] | None, side: str,
                k: int) -> Prepared:  # fmt: skip
        out = super().prepare(token_ids, texts, side, k)
        if out.token_ids:
            out.mask_batch = self._mask_batch(out.token_ids, side, k)
            out.candidates = self._candidates(texts, len(out.token_ids), self.bb.device)
        return out

    @torch.inference_mode()
    def run(self, batch: Prepared) -> list[Encoded]:
        if not batch.token_ids:
            return []
        b, cands, k, n_texts = batch.mask_batch, batch.candidates, batch.k, len(batch.token_ids)
        assert b is not None and cands is not None
        if self.cfg.denoise_steps == 1:
            hidden = self.bb.hidden_states(b.input_ids, b.attention_mask, bidirectional=True)
            rows = torch.arange(n_texts, device=self.bb.device)[:, None]
            h = hidden[rows, b.positions]  # [B, K, H]
            logits, decoded = None, None  # the head below: the argmax and the candidates' logits only
        else:
            h, logits, decoded = self._denoise(b, k, self.cfg.denoise_steps)
        dense = h.float().cpu().numpy().astype(np.float16)  # [B, K, H], one copy off the device
        out: list[Encoded] = []
        width = max(1, max(c.numel() for c in cands))
        step = max(1, HEAD_CHUNK_BYTES // (k * width * 4))  # a bounded number of texts' candidate logits at once
        for s in range(0, n_texts, step):
            chunk = cands[s : s + step]
            union = torch.unique(torch.cat(chunk))  # sorted
            ent = top_p = None
            if logits is None and batch.head_stats:
                toks, at, ent, top_p = self.bb.read_head(h[s : s + step], union, stats=True)
            elif logits is None:
                toks, at = self.bb.read_head(h[s : s + step], union)  # [b, K], [b, K, U]
            else:
                toks, at = decoded[s : s + step], logits[s : s + step][..., union].float()
                if batch.head_stats:
                    ent, top_p = softmax_stats(logits[s : s + step])
            stats = None if ent is None else (ent.float().cpu().numpy(), top_p.float().cpu().numpy())
            cuts = self._cutoffs(toks, k)
            ids = torch.nn.utils.rnn.pad_sequence(chunk, batch_first=True, padding_value=-1)  # [b, C], -1: none
            cols = torch.searchsorted(union, ids.clamp(min=0))  # each text's candidates, as columns of the union
            cand_logits = at.gather(2, cols[:, None, :].expand(-1, k, -1))  # [b, K, C]
            sparse = self._sparse_batch(ids, cand_logits, torch.as_tensor(cuts), k)
            tokens = toks.cpu().numpy().astype(np.int32)
            for j, (n, (sp_ids, sp_w)) in enumerate(zip(cuts, sparse, strict=True)):
                i = s + j
                e = Encoded(dense[i, :n], sp_ids, sp_w, b.lengths[i], stopped=n < k, tokens=tokens[j])
                if stats is not None:
                    e.entropy, e.maxprob = stats[0][j], stats[1][j]
                out.append(e)
        return out

    def _candidates(self, texts: Sequence[str | Sequence[int]] | None, n: int, device: torch.device) -> list[
            torch.Tensor]:  # fmt: skip
        """Each text's candidate vocabulary ids, sorted: its content words' (:meth:`allowed`), or the whole
        vocabulary when there is no filter."""
        out = [self.allowed(texts[i] if texts else None, device) for i in range(n)]
        if all(c is not None for c in out):
            return out  # type: ignore[return-value]
        every = torch.arange(self.bb.vocab_size, device=device)
        if self.cfg.sparse == "per_position":  # the per-slot path never keeps the mask; the pooled one reads all
            every = every[every != self._mask_id]
        return [every if c is None else c for c in out]

    def _sparse_batch(self, ids: torch.Tensor, logits: torch.Tensor, slots: torch.Tensor, k: int) -> list[
            tuple[np.ndarray, np.ndarray]]:  # fmt: skip
        """The sparse vectors of a chunk of texts from their candidates' logits (see :meth:`sparse_from`)."""
        topk, quantise = int(self.cfg.sparse_topk or 128), str(self.cfg.sparse_quantise)
        if self.cfg.sparse == "per_position":
            return per_position_sparse_batch(ids, logits, slots, topk, quantise, pooled_bf16=k > 1)
        out = []
        for j, n in enumerate(slots.tolist()):
            real = ids[j] >= 0
            sp_ids, sp_w = topk_sparse(pooled_weights(logits[j, :n][:, real]), None, topk, quantise)
            out.append((ids[j, real].cpu().numpy().astype(np.int32)[sp_ids], sp_w))
        return out

    def _cutoffs(self, tokens: torch.Tensor, k: int) -> list[int]:
        """The slots each text keeps ([B, K] tokens read): up to its first special token (none read, or at the
        first slot: all K)."""
        if not self._stop.numel():
            return [k] * tokens.shape[0]
        hit = torch.isin(tokens, self._stop)
        first = torch.where(hit.any(-1), hit.int().argmax(-1), k)  # argmax: the first of the maxima
        return torch.where(first > 0, first, k).tolist()

    def _denoise(self, b: _Batch, k: int, steps: int, grad_final: bool = False) -> tuple[torch.Tensor, torch.Tensor,
                                                                                          torch.Tensor]:  # fmt: skip
        """The reference's S-step unmasking: at each step the most confident masked slots (negative entropy of the
        prediction) take their argmax token, ``max(1, int(n_masked * (1 - s / t)))`` of them on the timesteps
        ``linspace(1, 1e-3, S + 1)``, all that remain at the last step; a slot's hidden state and logits are
        frozen at the step that reveals it. Returns (hidden [B, K, H], logits [B, K, V], tokens [B, K]).
        ``grad_final``: the steps before the last run without gradients (training reads the last one)."""
        ids = b.input_ids.clone()
        bsz = ids.shape[0]
        rows = torch.arange(bsz, device=ids.device)[:, None]
        times = torch.linspace(1, 1e-3, steps + 1)
        hidden_buf: torch.Tensor | None = None
        logit_buf: torch.Tensor | None = None
        for s in range(steps):
            with torch.set_grad_enabled(torch.is_grad_enabled() and (not grad_final or s == steps - 1)):
                step_ids = ids.clone() if torch.is_grad_enabled() else ids  # ids change in place below
                hidden = self.bb.hidden_states(step_ids, b.attention_mask, bidirectional=True)
                h = hidden[rows, b.positions]
                logits = self.bb.logits(h).float()  # [B, K, V]
            if hidden_buf is None:
                hidden_buf = torch.zeros(h.shape, dtype=h.dtype, device=h.device)
                logit_buf = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
            probs = logits.detach().softmax(-1)
            tok = probs.argmax(-1)
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)  # negative entropy
            slot_ids = ids[rows, b.positions]
            masked = slot_ids == self._mask_id
            for i in range(bsz):
                n_masked = int(masked[i].sum())
                if not n_masked:
                    continue
                take = n_masked if s == steps - 1 else max(1, int(n_masked * (1 - float(times[s + 1] / times[s]))))
                cand = conf[i].masked_fill(~masked[i], float("-inf"))
                pick = torch.topk(cand, min(take, n_masked)).indices
                hidden_buf[i, pick] = h[i, pick]  # in place: with gradients, the buffer joins the graph
                logit_buf[i, pick] = logits[i, pick]  # type: ignore[index]
                ids[i, b.positions[i, pick]] = tok[i, pick]
        assert hidden_buf is not None and logit_buf is not None
        return hidden_buf, logit_buf, ids[rows, b.positions]


class PromptRepsReadout(
    Readout, name="promptreps", multi_vector=True, has_sparse=True, needs_causal_lm=True, uses_prompt=True,
    k_values="one value", k_meaning="the cap N on the slots decoded one by one (e.g. --k 20 zero-shot)",
):
    """PromptReps: greedy decoding after the assistant prefix (KV cache), at most K slots (the cap N).

    Slot 0 is the hidden state at the opening quote (the last prompt token), slot t the hidden state at the
    t-th generated token; each slot's logits give the sparse vector. ``promptreps_stop``: ``reference`` keeps
    the slots up to the one that predicts the closing quote (the single-token ``"``) or a special token (the
    zero-shot encoder's); ``none`` decodes exactly K - 1 words and keeps all K slots (the reference's fine-tuned
    model, in training and in encoding); ``quote_in_token`` (diffret 0.1) drops the slot that predicts any token
    containing the quote (unless it is the first).
    """

    def overhead(self, side: str, k: int) -> tuple[int, int]:
        p = self.pieces(side, k)
        return len(p.prefix) + len(p.suffix), k

    def stop_tokens(self, stop: str | None = None) -> set[int]:
        """The tokens whose prediction ends the words (see ``promptreps_stop``; ``stop`` overrides it)."""
        stop = stop or self.cfg.promptreps_stop
        if stop == "none":
            return set()
        cache = self.__dict__.setdefault("_stop_tokens", {})
        if stop not in cache:
            tok = self.bb.tokenizer
            if stop == "reference":
                quote = tok('"', add_special_tokens=False)["input_ids"]
                cache[stop] = self.bb.stop_ids | (set(quote) if len(quote) == 1 else set())
            else:
                vocab = tok.get_vocab().items()
                cache[stop] = {i for t, i in vocab if '"' in tok.convert_tokens_to_string([t])}
        return cache[stop]

    def _encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        """Greedy decoding with a KV cache (left padding); at most K steps (the cap N: 20 zero-shot, 4 fine-tuned)."""
        rows, H, L, G, n_reps, stopped = self._decode(token_ids, side, k)
        out_list = []
        for i in range(len(rows)):
            n = int(n_reps[i])
            sp_ids, sp_w = self.sparse_from(L[i, :n].float(), texts[i] if texts else None, k)
            tokens = G[i].cpu().numpy().astype(np.int32)
            out_list.append(Encoded(_f16(H[i, :n]), sp_ids, sp_w, len(rows[i]), bool(stopped[i]), tokens))
        return out_list

    def train_forward(self, token_ids: list[list[int]], side: str, k: int, stop: str = "none") -> TrainReps:
        """With gradients: the words are decoded greedily without gradients (the cap N = 4 of the paper's
        fine-tuning), then one causal pass over the prompt and the decoded words gives every slot's hidden state and
        logits at once (the states the KV-cached decoding reads). ``stop="none"`` (the reference's trainer,
        promptreps_trainable.py L493-529): exactly K - 1 words, all K slots; ``reference``: the words end at the
        closing quote and the slots after it are masked out (diffret 0.1)."""
        token_ids = self._fit(token_ids, side, k)
        with torch.no_grad():
            rows, _, _, G, n_reps, _ = self._decode(token_ids, side, k, stop)
        t = G.shape[1]
        full = [r + G[i, : t - 1].tolist() for i, r in enumerate(rows)]  # the last decoded word is never read
        ids, att, offs = _pad(full, self.bb.pad_id, "left", self.bb.device)
        hidden = self.bb.hidden_states(ids, att, bidirectional=False)
        pos = torch.as_tensor([[o + len(r) - 1 + j for j in range(t)] for o, r in zip(offs, rows, strict=True)],
                              device=ids.device)  # fmt: skip
        h = hidden[torch.arange(len(rows), device=ids.device)[:, None], pos]
        mask = torch.arange(t, device=ids.device)[None, :] < n_reps[:, None]
        return TrainReps(h, mask, self.bb.logits(h))

    def _decode(self, token_ids: list[list[int]], side: str, k: int, stop_rule: str | None = None) -> tuple[
            list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(input rows, hidden [B, T, H], logits [B, T, V], decoded [B, T], slots kept [B], stopped [B]);
        ``stop_rule`` overrides ``promptreps_stop``."""
        p = self.pieces(side, k)
        rows = [list(p.prefix) + list(t) + list(p.suffix) for t in token_ids]
        ids, att, _ = _pad(rows, self.bb.pad_id, "left", self.bb.device)
        bsz = len(rows)
        stop = torch.zeros(self.bb.model.config.vocab_size, dtype=torch.bool, device=ids.device)
        stop[[i for i in self.stop_tokens(stop_rule) if i < stop.numel()]] = True
        reference = (stop_rule or self.cfg.promptreps_stop) != "quote_in_token"
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        past = None
        cur_ids, cur_pos = ids, pos
        hs: list[torch.Tensor] = []
        lg: list[torch.Tensor] = []
        gen: list[torch.Tensor] = []
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
            is_stop = stop[nxt]
            # reference: the slot that predicts the stop is kept; diffret 0.1: it is kept only if it is the first
            counts = active & (~is_stop | (n_reps == 0) | reference)
            hs.append(h)
            lg.append(logits)
            gen.append(nxt)
            n_reps += counts.long()
            stopped |= active & is_stop
            active &= ~is_stop
            if not bool(active.any()):
                break
            cur_ids = nxt[:, None]
            att = torch.cat([att, torch.ones((bsz, 1), dtype=att.dtype, device=att.device)], dim=1)
            cur_pos = cur_pos[:, -1:] + 1
        return rows, torch.stack(hs, dim=1), torch.stack(lg, dim=1), torch.stack(gen, dim=1), n_reps, stopped


class _SingleVector(
    Readout, multi_vector=False, has_sparse=False, uses_prompt=False, k_values="1",
    k_meaning="always 1: one vector per text",
):
    """A readout with one dense vector per text and no prompt (K must be 1)."""

    def _one(self, k: int) -> None:
        if k > 1:
            raise ValueError(f"the {self.name} readout has one vector per text; use K = 1 (got {k})")

    def prepare(self, token_ids: list[list[int]], texts: Sequence[str | Sequence[int]] | None, side: str,
                k: int) -> Prepared:  # fmt: skip
        self._one(k)
        return super().prepare(token_ids, texts, side, k)

    def _encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        rows, h = self._vectors(token_ids, side, texts)
        return [Encoded(_f16(h[i : i + 1]), n_tokens=len(rows[i])) for i in range(len(rows))]

    def _vectors(self, token_ids: list[list[int]], side: str = "query",
                 texts: list[str] | None = None) -> tuple[list[list[int]], torch.Tensor]:  # fmt: skip
        """(input rows, one vector per text [B, H])."""
        raise NotImplementedError

    def train_forward(self, token_ids: list[list[int]], side: str, k: int,
                      texts: list[str] | None = None) -> TrainReps:  # fmt: skip
        """With gradients: the one vector per text (no sparse side); ``texts``: the texts of ``token_ids`` (RepLLaMA
        tokenizes its prefix with them)."""
        self._one(k)
        _, h = self._vectors(self._fit(token_ids, side, k), side, texts)
        return TrainReps(h[:, None], _all_real(h[:, None]))


class DiffEmbedReadout(_SingleVector, name="diffembed", needs_causal_lm=False):
    """DiffEmbed: the mean of the last hidden states over the text and its special tokens (no prompt),
    bidirectional."""

    def _vectors(self, token_ids: list[list[int]], side: str = "query",
                 texts: list[str] | None = None) -> tuple[list[list[int]], torch.Tensor]:  # fmt: skip
        head, tail = special_wrapping(self.bb.tokenizer)
        rows = [head + list(t) + tail for t in token_ids]
        ids, att, _ = _pad(rows, self.bb.pad_id, self.cfg.padding_side, self.bb.device)
        hidden = self.bb.hidden_states(ids, att, bidirectional=True).float()
        m = att[..., None].float()
        return rows, (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


class RepLlamaReadout(_SingleVector, name="repllama", needs_causal_lm=True):
    """RepLLaMA: the hidden state of the final EOS after ``query: `` / ``passage: `` (causal attention). The prefix
    and the text are tokenized as one string (repllama.py L194-209; ``repllama_prefix`` ``separate``: the prefix's
    ids before the text's, diffret 0.1)."""

    def _prefix(self, side: str) -> list[int]:
        return list(self.bb.tokenizer(f"{side}: ", add_special_tokens=False)["input_ids"])

    def overhead(self, side: str, k: int) -> tuple[int, int]:
        counted, extra = super().overhead(side, k)
        eos = 1 if self.bb.tokenizer.eos_token_id is not None else 0
        return counted + len(self._prefix(side)) + eos, extra

    def _vectors(self, token_ids: list[list[int]], side: str = "query",
                 texts: list[str] | None = None) -> tuple[list[list[int]], torch.Tensor]:  # fmt: skip
        tok = self.bb.tokenizer
        prefix = self._prefix(side)
        head, _ = special_wrapping(tok)
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        if self.cfg.repllama_prefix == "joined" and texts is not None:  # as many tokens as prefix + (cut) text
            joined = tok([f"{side}: {t}" for t in texts], add_special_tokens=False)["input_ids"]
            body = [list(j[: len(prefix) + len(t)]) for j, t in zip(joined, token_ids, strict=True)]
        else:
            body = [prefix + list(t) for t in token_ids]
        rows = [head + b + eos for b in body]
        ids, att, offs = _pad(rows, self.bb.pad_id, self.cfg.padding_side, self.bb.device)
        hidden = self.bb.hidden_states(ids, att, bidirectional=False)
        last = torch.as_tensor([o + len(r) - 1 for o, r in zip(offs, rows, strict=True)], device=ids.device)
        return rows, hidden[torch.arange(len(rows), device=ids.device), last]


class SidrReadout(
    Readout, name="sidr", multi_vector=False, has_sparse=True, needs_causal_lm=False, uses_prompt=False,
    k_values="1", k_meaning="always 1: one sparse vector per text",
):
    """SIDR's parametric encoder V_theta (Zhou et al., ICLR 2025; jzhoubu/sidr): one bidirectional pass over the
    text and its special tokens, a vocabulary score per position, max-pooled over the text's own positions
    (padding excluded, so a vector does not depend on its batch), the top ``sparse_topk`` (768) kept.

    ``sidr_head``: ``official`` (a LayerNorm of the last hidden states, without affine weights before training,
    times the input-embedding matrix, no bias) or ``lm`` (the model's own MLM / LM head: SPLADE's). ``sidr_act``:
    ``elu1p`` (elu(x) + 1, SIDR's) or ``log1p_relu`` (SPLADE's). Special and ``[unusedN]`` ids never score; no
    content-word filter. The dense vector is the mean of the last hidden states (single_dense works; SIDR's own
    numbers are ``sparse_max``).

    Query and passage encoders are one model (shared) unless the model folder holds a separately trained passage
    encoder (``passage_encoder/``, what ``diffret train --readout sidr`` writes by default, as SIDR trains): it is
    loaded with the same settings and encodes the passages (:meth:`separate` makes one for training)."""

    PASSAGE_MODULE = "diffret_passage_encoder"  # the passage encoder's name as a sub-module while training
    reads_filter = False  # SIDR keeps every token but the special ones

    def __init__(self, backbone: Backbone, config: ReadoutConfig, max_length: int = DEFAULT_MAX_LENGTH):
        super().__init__(backbone, config, max_length)
        self._banned = torch.as_tensor(sorted(excluded_ids(backbone.tokenizer)), dtype=torch.long)
        self.passage_bb: Backbone | None = None
        src = backbone.source
        if src is not None and (folder := passage_encoder_dir(src.model)) is not None:
            self.passage_bb = load_backbone(src.model_copy(update={"model": str(folder), "adapter": None,
                                                                   "gguf_file": None}))  # fmt: skip

    def separate(self) -> None:
        """Give the passage side its own encoder for training: a copy of the model, attached to it as a
        sub-module so that one optimizer, checkpoint and gradient average cover both (no-op when it has one)."""
        if self.passage_bb is not None:
            if self.PASSAGE_MODULE not in self.bb.model._modules:  # loaded apart: train both
                self.bb.model.add_module(self.PASSAGE_MODULE, self.passage_bb.model)
            return
        import copy

        twin = copy.deepcopy(self.bb.model)
        self.bb.model.add_module(self.PASSAGE_MODULE, twin)
        bb = self.bb
        self.passage_bb = Backbone(twin, bb.tokenizer, bb.family, bb._mask_token, bb._turn_end, bb.name, bb.loader)

    def detach_passage_encoder(self) -> torch.nn.Module | None:
        """The passage encoder taken off the query model (to save the two apart); None when shared."""
        return self.bb.model._modules.pop(self.PASSAGE_MODULE, None)

    def _side(self, side: str) -> Backbone:
        return self.passage_bb if side == "passage" and self.passage_bb is not None else self.bb

    def _encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        if k != 1:
            raise ValueError(f"the sidr readout has one vector per text; use K = 1 (got {k})")
        bb = self._side(side)
        rows, hidden, att = self._forward(token_ids, bb)
        mean = (hidden * att[..., None]).sum(1) / att.sum(1, keepdim=True).clamp(min=1.0)
        out = []
        for i in range(len(rows)):
            w = self.weights(hidden[i][att[i].bool()], bb)  # the text's own positions only
            ids, vals = topk_sparse(w, None, int(self.cfg.sparse_topk or SIDR_TOPK), "none")
            out.append(Encoded(_f16(mean[i : i + 1]), ids, vals, n_tokens=len(rows[i])))
        return out

    def train_vectors(self, token_ids: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
        """With gradients, for SIDR's objective: each text's pooled vocabulary vector [B, V] (every id, before
        top-k) and its binary bag of tokens [B, V] (its own ids, special ids excluded)."""
        bb = self._side(side)
        rows, hidden, att = self._forward(self._fit(token_ids, side, 1), bb)
        vecs = torch.stack([self.weights(hidden[i][att[i].bool()], bb) for i in range(len(rows))])
        bags = torch.zeros_like(vecs)
        for i, t in enumerate(token_ids):
            ids = torch.as_tensor([x for x in t if x < vecs.shape[1]], dtype=torch.long, device=vecs.device)
            bags[i, ids] = 1.0
        banned = self._banned[self._banned < vecs.shape[1]].to(vecs.device)
        bags[:, banned] = 0.0
        return vecs, bags

    def _forward(self, token_ids: list[list[int]], bb: Backbone) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        head, tail = special_wrapping(bb.tokenizer)
        rows = [head + list(t) + tail for t in token_ids]
        ids, att, _ = _pad(rows, bb.pad_id, self.cfg.padding_side, bb.device)
        return rows, bb.hidden_states(ids, att, bidirectional=True).float(), att.float()

    def weights(self, hidden: torch.Tensor, bb: Backbone | None = None) -> torch.Tensor:
        """[V] pooled vocabulary weights of one text from its positions' last hidden states [L, H] (``bb``: the
        encoder they came from; default the query side's)."""
        bb = bb or self.bb
        if self.cfg.sidr_head == "lm":
            scores = bb.logits(hidden.to(bb.dtype)).float()
        else:
            emb = bb.model.get_input_embeddings().weight.float()
            scores = torch.nn.functional.layer_norm(hidden, hidden.shape[-1:]) @ emb.T
        top = scores[:, : self._vocab_cut(scores.shape[-1])].max(0).values
        # both activations are non-decreasing, so act(max) == max(act); pooling first keeps training from holding
        # an [L, V] activation for the backward pass (only the max's indices are kept)
        pooled = torch.nn.functional.elu(top) + 1 if self.cfg.sidr_act == "elu1p" else torch.log1p(top.relu())
        keep = torch.ones_like(pooled)
        keep[self._banned[self._banned < pooled.shape[0]].to(pooled.device)] = 0.0
        return pooled * keep  # not in place: training backpropagates through it

    def _vocab_cut(self, width: int) -> int:
        return min(width, len(self.bb.tokenizer))  # padded embedding rows past the tokenizer never score


READOUTS: dict[str, type[Readout]] = {
    cls.name: cls for cls in (MaskReadout, PromptRepsReadout, DiffEmbedReadout, RepLlamaReadout, SidrReadout)
}
ReadoutName = Literal["diffretriever", "promptreps", "diffembed", "repllama", "sidr"]
SIDR_TOPK = 768  # SIDR's top-k at index and search time
SIDR_ONLY = ("sidr_head", "sidr_act")  # settings only the sidr readout reads (not in other systems' slugs)
assert set(ReadoutName.__args__) == set(READOUTS)  # the config's choices are the registry's


class ReadoutConfig(BaseModel):
    """How a text becomes vectors: the readout and its settings.

    The defaults are the reference encoder's (ielab/diffretriever, whose code produced the paper's numbers);
    every other value is a named deviation (diffret 0.1's behaviour among them). The reference encodes a
    fine-tuned model another way than a zero-shot one (scripts/encode.py's `trained_*` path): `finetuned`
    chooses the path, and the settings left at None / `auto` take that path's value; a system's slug records
    the resolved values.
    """

    # the readouts: READOUTS; the resolved values: resolved()

    readout: ReadoutName = Field(
        default="diffretriever", description="diffretriever | promptreps | diffembed | repllama | sidr"
    )
    finetuned: Literal["auto", "yes", "no"] = Field(
        default="auto", description="Encode as the reference encodes a fine-tuned model (all K slots, sparse top 256 "
        "rounded; PromptReps: exactly K slots, pooled top 256); auto: a model `diffret train` saved or a reference "
        "checkpoint (retriever_config.json)."
    )
    prompt: str = Field(
        default="auto", description="auto (one_word at K=1, few_words at K>1; a released checkpoint's own), a "
        "variant, a YAML path, or checkpoint (a released checkpoint's prompt ids)"
    )
    chat_template: Literal["auto", "yes", "no"] = Field(
        default="auto", description="Wrap the prompt in the model's chat template (auto: when it has one)."
    )
    truncation: Literal["prompt", "text"] = Field(
        default="prompt", description="max_length counts the prompt and the text (prompt) or the text only (text)."
    )
    denoise_steps: int = Field(default=1, ge=1, description="S: forward passes for the mask readout (1 = the paper's)")
    stop_cut: bool | None = Field(default=None, description="Mask readout: drop the slots from the first special "
                                  "token read (default: zero-shot yes, fine-tuned no, as the reference).")  # fmt: skip
    promptreps_stop: Literal["auto", "reference", "quote_in_token", "none"] = Field(
        default="auto", description="PromptReps: when the words end (see PromptRepsReadout; auto: reference "
        "zero-shot, none (exactly K slots) fine-tuned)."
    )
    sparse: Literal["auto", "per_position", "pooled"] = Field(
        default="auto", description="per_position: top-k per slot, x100 integers, max over slots; pooled: max over "
        "slots, then top-k (auto: the reference's per readout and path)."
    )
    sparse_topk: int | None = Field(default=None, ge=1, description="Sparse terms kept per slot (per_position) or in "
                                    "all (default: 128 zero-shot mask readout, else 256, as the reference).")
    sparse_quantise: Literal["auto", "truncate", "round", "none"] = Field(
        default="auto", description="Sparse weights as x100 integers, truncated (zero-shot mask readout) or rounded "
        "(fine-tuned), or unquantised (zero-shot PromptReps); auto: the reference's."
    )
    content_filter: Literal["nltk", "regex", "none"] = Field(
        default="nltk", description="Sparse: keep the text's content words (nltk: the reference's; regex: 0.1's)."
    )
    padding_side: Literal["left", "right"] = Field(default="left", description="left | right")
    sidr_head: Literal["official", "lm"] = Field(
        default="official", description="SIDR: LayerNorm x input embeddings (official) or the model's own MLM head "
        "(lm, SPLADE's)."
    )
    sidr_act: Literal["elu1p", "log1p_relu"] = Field(
        default="elu1p", description="SIDR: elu(x) + 1 (SIDR's) or log(1 + ReLU(x)) (SPLADE's)."
    )
    repllama_prefix: Literal["joined", "separate"] = Field(
        default="joined", description="RepLLaMA: tokenize 'query: ' + text as one string (the reference's) or the "
        "prefix and the text apart (diffret 0.1)."
    )

    def resolved(self, finetuned: bool | None = None) -> ReadoutConfig:
        """Every ``auto`` / None setting replaced by its path's value (``finetuned``: the detected path when
        ``finetuned`` is ``auto``; None: zero-shot).

        >>> r = ReadoutConfig().resolved(finetuned=True)
        >>> (r.finetuned, r.stop_cut, r.sparse, r.sparse_topk, r.sparse_quantise)
        ('yes', False, 'per_position', 256, 'round')
        >>> r = ReadoutConfig(readout="promptreps").resolved(finetuned=False)
        >>> (r.promptreps_stop, r.sparse, r.sparse_topk, r.sparse_quantise)
        ('reference', 'per_position', 256, 'none')
        """
        ft = {"yes": True, "no": False}.get(self.finetuned, bool(finetuned))
        mask = self.readout == "diffretriever"
        if self.readout == "sidr":  # floats, the top 768 of the pooled vector (SIDR's)
            return self.model_copy(update={
                "finetuned": "yes" if ft else "no", "stop_cut": False, "promptreps_stop": "none", "sparse": "pooled",
                "sparse_topk": SIDR_TOPK if self.sparse_topk is None else self.sparse_topk, "sparse_quantise": "none",
            })  # fmt: skip
        if self.sparse != "auto":
            sparse = self.sparse
        elif ft and (self.readout == "promptreps" or self.denoise_steps > 1):
            sparse = "pooled"  # encode.py L449-458: the pooled vector's top-k (trained PromptReps, S > 1)
        else:
            sparse = "per_position"
        if self.sparse_quantise != "auto":
            quantise = self.sparse_quantise
        else:
            quantise = "round" if ft else ("truncate" if mask else "none")
        return self.model_copy(update={
            "finetuned": "yes" if ft else "no",
            "stop_cut": (not ft) if self.stop_cut is None else self.stop_cut,
            "promptreps_stop": ("none" if ft else "reference") if self.promptreps_stop == "auto"
            else self.promptreps_stop,
            "sparse": sparse,
            "sparse_topk": ((128 if mask and not ft else 256) if self.sparse_topk is None else self.sparse_topk),
            "sparse_quantise": quantise,
        })  # fmt: skip

    def numbers(self) -> dict:
        """The settings as a system's slug and a training's hash record them: another readout's SIDR-only
        settings left out (their slugs are what they were before the sidr readout).

        >>> "sidr_act" in ReadoutConfig().numbers(), "sidr_act" in ReadoutConfig(readout="sidr").numbers()
        (False, True)
        """
        return self.model_dump(exclude=None if self.readout == "sidr" else set(SIDR_ONLY))

    @property
    def is_resolved(self) -> bool:
        return self.finetuned != "auto" and self == self.resolved()


def readout_class(name: str) -> type[Readout]:
    """The registered readout called ``name`` (ValueError listing the known ones)."""
    try:
        return READOUTS[name]
    except KeyError:
        raise ValueError(f"unknown readout {name!r}; expected one of {', '.join(READOUTS)}") from None


def sparse_quantised(readout: str | None, settings: dict | None) -> bool:
    """Whether a system's stored sparse weights are multiples of 0.01 (the reference stores them as x100
    integers): ``sparse_quantise`` truncate or round. Zero-shot PromptReps' are stored unscaled, as the reference's.

    >>> sparse_quantised("diffretriever", {}), sparse_quantised("promptreps", {"finetuned": "no"})
    (True, False)
    """
    if readout is None or not readout_class(readout).has_sparse:
        return False
    cfg = ReadoutConfig.model_validate({**(settings or {}), "readout": readout}).resolved()
    return cfg.sparse_quantise != "none"


def make_reader(backbone: Backbone, config: ReadoutConfig, max_length: int = DEFAULT_MAX_LENGTH) -> Readout:
    """The readout of ``config`` over a loaded backbone; ``max_length`` bounds each input (see ``truncation``)."""
    return readout_class(config.readout)(backbone, config, max_length)
