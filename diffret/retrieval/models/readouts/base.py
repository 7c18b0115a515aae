"""The readouts' shared parts: what a readout returns (``Encoded``, ``TrainReps``), batching and padding, the
``Readout`` base class (prompt pieces, fitting to ``max_length``, the sparse readout of logits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np
import torch

from ...traits import Declared
from ..backbones import Backbone, BackboneError
from ..prompts import PromptPieces, build_pieces, chat_tail, default_variant, load_prompt, special_wrapping
from ..released import CHECKPOINT_PROMPT, RELEASED_CONFIG, read_released
from ..sparse import (
    make_filter,
    per_position_sparse,
    pooled_weights,
    topk_sparse,
)
from .config import ContentFilter, ReadoutConfig

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


def all_real(h: torch.Tensor) -> torch.Tensor:
    return torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)


@dataclass
class Batch:
    """One forward pass's inputs: padded token ids, their mask, and the K readout slots of each row."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor  # [B, K] indices of the K slots (masks / last token)
    lengths: list[int] = field(default_factory=list)


def pad_rows(
    rows: list[list[int]], pad_id: int, side: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    att = np.zeros((len(rows), width), dtype=np.int64)
    offsets = []
    for i, r in enumerate(rows):
        off = width - len(r) if side == "left" else 0
        ids[i, off : off + len(r)] = r
        att[i, off : off + len(r)] = 1
        offsets.append(off)
    return to_device(torch.from_numpy(ids), device), to_device(torch.from_numpy(att), device), offsets


def staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor ready to go to ``device``: in page-locked memory when that is a GPU (so that its copy is
    asynchronous: :func:`to_device`), as it is for the CPU."""
    return t.pin_memory() if device.type == "cuda" else t


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; from page-locked host memory without waiting (the copy is queued on the stream)."""
    return t.to(device, non_blocking=t.is_pinned())


class HostCopy:
    """Device tensors on their way to the host: one page-locked buffer each, copied without waiting, and one event
    that :meth:`wait` waits for (a single synchronisation for a batch's results); on a CPU, the tensors themselves.

    >>> HostCopy([torch.arange(3)]).wait()[0].tolist()
    [0, 1, 2]
    """

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.event = None
        if not any(t.is_cuda for t in tensors):
            self.host = list(tensors)
            return
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


class Pending:
    """A batch whose device work is queued (:meth:`Readout.launch`); :meth:`result` waits for it and returns its
    encodings. ``encode_rows`` launches the next batch before it asks for this one's result, so that the host's
    share of a batch (the copy back, the encodings' arrays) runs while the device computes the next."""

    def __init__(self, finish: Callable[[], list[Encoded]]):
        self._finish: Callable[[], list[Encoded]] | None = finish
        self._out: list[Encoded] | None = None

    def result(self) -> list[Encoded]:
        if self._finish is not None:
            self._out, self._finish = self._finish(), None
        return self._out  # type: ignore[return-value]


@dataclass
class Prepared:
    """A batch as :meth:`Readout.prepare` leaves it for :meth:`Readout.run`."""

    token_ids: list[list[int]]  # cut to fit
    texts: Sequence[str | Sequence[int]] | None  # raw texts, or their filter ids
    side: str
    k: int
    mask_batch: Batch | None = None  # the mask readout's padded inputs (on the host, staged for the device)
    # and its texts' candidate vocabulary ids, a chunk of texts at a time: (first text, the chunk's union of ids,
    # sorted [U], each text's ids padded with -1 [b, C]), on the host, staged for the device
    chunks: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None
    head_stats: bool = False  # the mask readout also reads the head's entropy and max probability at each slot


HEAD_CHUNK_BYTES = 256 << 20  # float32 logits of the candidate ids held at once while encoding ([texts, K, C])
SIDR_BLOCK_BYTES = 64 << 20  # float32 SIDR head scores held at once ([positions, vocabulary block])


def to_float16(x: torch.Tensor) -> np.ndarray:
    """Vectors as stored (float16), brought to the host in one copy."""
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
    def filter_kind(cls, config: ReadoutConfig) -> ContentFilter:
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
                self._pieces[key] = build_pieces(
                    self.bb.tokenizer, load_prompt(variant), side, adapt, turn_end, use_chat
                )
        return self._pieces[key]

    def _checkpoint_pieces(self, side: str, turn_end: int | None) -> PromptPieces:
        """A released checkpoint's own prompt: its stored ids around the text, its tail after the masks (the
        reference's: quote, end of turn, EOS, ``n_tail`` of them), whatever K is encoded."""
        source = self.bb.source
        ckpt = read_released(source.adapter or source.model) if source is not None else None
        if ckpt is None:
            raise BackboneError(
                f"{self.bb.name}: prompt {CHECKPOINT_PROMPT!r} reads a released checkpoint's "
                f"{RELEASED_CONFIG}; this model has none (give --prompt auto or a variant)"
            )
        if ckpt.mask_token_id != self.bb.mask_id:
            raise BackboneError(
                f"{ckpt.folder}: mask_token_id {ckpt.mask_token_id} is not the base model's mask "
                f"token ({self.bb.mask_id}): the adapter was trained on another base"
            )
        tail = (
            chat_tail(
                self.bb.tokenizer,
                turn_end if turn_end is not None else self.bb.turn_end_id,
                self.bb.tokenizer.eos_token_id,
            )[: ckpt.n_tail]
            if ckpt.n_tail
            else []
        )
        return PromptPieces(ckpt.prefix[side], ckpt.suffix[side], tuple(tail))

    adapts_prompt: ClassVar[bool] = False  # the prompt's number words follow K (the mask readout's)

    # ------------------------------------------------------------------------------ encode
    def encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        """Encode one batch. ``texts`` (the raw, untruncated texts) feed the sparse content-word filter; in their
        place, the filter's ids of each text computed before (``Readout.allowed``)."""
        return self.run(self.prepare(token_ids, texts, side, k))

    def prepare(
        self, token_ids: list[list[int]], texts: Sequence[str | Sequence[int]] | None, side: str, k: int
    ) -> Prepared:
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

    def launch(self, batch: Prepared) -> Pending:
        """:meth:`run`, its device work queued and its result asked for later (:class:`Pending`); a readout that
        reads values back while it decodes runs at once."""
        out = self.run(batch)
        return Pending(lambda: out)

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

    def sparse_from(
        self, logits_k_v: torch.Tensor, text: str | Sequence[int] | None, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The sparse vector of one text from the logits at its kept slots [n, V] of K (see ``ReadoutConfig.sparse``
        and ``sparse_quantise``)."""
        allowed = self.allowed(text, logits_k_v.device)
        topk, quantise = int(self.cfg.sparse_topk or 128), str(self.cfg.sparse_quantise)
        if self.cfg.sparse == "pooled":
            return topk_sparse(
                pooled_weights(logits_k_v), None if allowed is None else allowed.tolist(), topk, quantise
            )
        if allowed is None:
            allowed = torch.arange(logits_k_v.shape[-1], device=logits_k_v.device)
            mask_id = getattr(self, "_mask_id", None)
            if mask_id is not None:
                allowed = allowed[allowed != mask_id]
        return per_position_sparse(allowed, logits_k_v[:, allowed], topk, quantise, pooled_bf16=k > 1)
