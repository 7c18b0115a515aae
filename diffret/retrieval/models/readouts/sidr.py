"""SIDR's readout: a vocabulary score per position, max-pooled over the text, its top 768."""

from __future__ import annotations

import itertools

import torch

from ..backbones import Backbone, load_backbone, passage_encoder_dir
from ..prompts import special_wrapping
from ..sparse import (
    excluded_ids,
    topk_sparse,
)
from .base import (
    DEFAULT_MAX_LENGTH,
    SIDR_BLOCK_BYTES,
    Encoded,
    Readout,
    pad_rows,
    to_float16,
)
from .config import SIDR_TOPK, ReadoutConfig

SIDR_GROUP_POSITIONS = 1024  # the official head's product: whole texts' positions, up to this many
SIDR_CACHE_BYTES = 1 << 20  # its float32 scores a block: a core's L2 cache (the columns follow: ~256 here)


class SidrReadout(
    Readout,
    name="sidr",
    multi_vector=False,
    has_sparse=True,
    needs_causal_lm=False,
    uses_prompt=False,
    k_values="1",
    k_meaning="always 1: one sparse vector per text",
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
            self.passage_bb = load_backbone(
                src.model_copy(update={"model": str(folder), "adapter": None, "gguf_file": None})
            )

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
        pooled = self.batch_weights(hidden, att, bb)
        dense = to_float16(mean)  # the batch's vectors in one copy to the host
        out = []
        for i in range(len(rows)):  # each text's top k on the device, as it always was (its ties decided there)
            ids, vals = topk_sparse(pooled[i], None, int(self.cfg.sparse_topk or SIDR_TOPK), "none")
            out.append(Encoded(dense[i : i + 1], ids, vals, n_tokens=len(rows[i])))
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
        ids, att, _ = pad_rows(rows, bb.pad_id, self.cfg.padding_side, bb.device)
        return rows, bb.hidden_states(ids, att, bidirectional=True).float(), att.float()

    def weights(self, hidden: torch.Tensor, bb: Backbone | None = None) -> torch.Tensor:
        """[V] pooled vocabulary weights of one text from its positions' last hidden states [L, H] (``bb``: the
        encoder they came from; default the query side's)."""
        bb = bb or self.bb
        return self._activate(self._scores(hidden, bb).max(0).values)

    def batch_weights(
        self, hidden: torch.Tensor, att: torch.Tensor, bb: Backbone | None = None, block: int | None = None
    ) -> torch.Tensor:
        """[B, V] pooled vocabulary weights of a batch ([B, L, H] last hidden states, [B, L] attention mask): each
        text's :meth:`weights` from its real positions only, the padding left out. The head is one product per group
        of whole texts' positions, ``block`` bytes of float32 scores at a time, each block max-pooled per text: for
        the official head, groups of about :data:`SIDR_GROUP_POSITIONS` positions times vocabulary columns, a block
        the size of a core's cache (:data:`SIDR_CACHE_BYTES`: each block is max-pooled while it is in the cache; on a
        GPU :data:`SIDR_BLOCK_BYTES`); for the model's LM head, whole texts' positions times the vocabulary,
        :data:`SIDR_BLOCK_BYTES` at most. The same numbers as text by text; the same bytes where the matrix product's
        rounding does not depend on the rows and columns beside a text's (splade-tiny's: tests/e2e/test_sidr_shared.py
        on a CPU, ``benchmarks/encode.py --readout sidr --device cuda`` on a GPU; the speeds measured:
        docs/operations.md)."""
        bb = bb or self.bb
        real = att.bool()
        lengths = real.sum(1).tolist()
        flat = hidden[real]  # [N, H]: text after text
        official = self.cfg.sidr_head == "official"
        if official:
            width = self._vocab_cut(bb.input_embeddings().shape[0])
            # on a CPU a core's cache sizes the blocks, so each block's scores are max-pooled before they leave the
            # cache; on a GPU cache-sized blocks would be many small kernels, so it takes few large products
            cache = SIDR_BLOCK_BYTES if hidden.is_cuda else SIDR_CACHE_BYTES
            group, block = SIDR_GROUP_POSITIONS, cache if block is None else block
        else:
            block = SIDR_BLOCK_BYTES if block is None else block
            group = max(1, block // (4 * bb.vocab_size))
        tops = []
        for first, last, start, n in _text_groups(lengths, group):  # (a text longer than a group: alone)
            seg, lens = flat[start : start + n], lengths[first:last]
            if not official:
                tops.append(_segment_max(self._scores(seg, bb), lens))
                continue
            u = torch.nn.functional.layer_norm(seg, seg.shape[-1:])  # once a group: every column block reads it
            cols = max(1, block // (4 * n))
            tops.append(
                torch.cat(
                    [_segment_max(self._official(u, bb, slice(c, c + cols)), lens) for c in range(0, width, cols)],
                    dim=1,
                )
            )
        return self._activate(torch.cat(tops))

    def _scores(self, hidden: torch.Tensor, bb: Backbone, cols: slice = slice(None)) -> torch.Tensor:
        """[L, C] scores of positions' last hidden states [L, H] for the vocabulary columns ``cols`` of the
        tokenizer's ids (the official head computes those columns only)."""
        if self.cfg.sidr_head == "lm":
            scores = bb.logits(hidden.to(bb.dtype)).float()
            return scores[:, : self._vocab_cut(scores.shape[-1])][:, cols]
        return self._official(torch.nn.functional.layer_norm(hidden, hidden.shape[-1:]), bb, cols)

    def _official(self, normed: torch.Tensor, bb: Backbone, cols: slice = slice(None)) -> torch.Tensor:
        """[L, C] the official head's scores of positions already layer-normalised [L, H]: their products with the
        input embeddings of the vocabulary columns ``cols``."""
        emb = bb.input_embeddings().float()
        return normed @ emb[: self._vocab_cut(emb.shape[0])][cols].T

    def _activate(self, top: torch.Tensor) -> torch.Tensor:
        """The activation of pooled scores ([..., V]), special ids zeroed. Both activations are non-decreasing, so
        act(max) == max(act); pooling first keeps training from holding an [L, V] activation for the backward pass
        (only the max's indices are kept)."""
        pooled = torch.nn.functional.elu(top) + 1 if self.cfg.sidr_act == "elu1p" else torch.log1p(top.relu())
        keep = torch.ones_like(pooled)
        keep[..., self._banned[self._banned < pooled.shape[-1]].to(pooled.device)] = 0.0
        return pooled * keep  # not in place: training backpropagates through it

    def _vocab_cut(self, width: int) -> int:
        return min(width, len(self.bb.tokenizer))  # padded embedding rows past the tokenizer never score


def _text_groups(lengths: list[int], rows: int) -> list[tuple[int, int, int, int]]:
    """Consecutive texts in groups of at most ``rows`` positions (a longer text alone): (first text, last text + 1,
    first position, positions) each.

    >>> _text_groups([3, 2, 4, 9], 6)
    [(0, 2, 0, 5), (2, 3, 5, 4), (3, 4, 9, 9)]
    """
    out, first, start = [], 0, 0
    while first < len(lengths):
        last, n = first + 1, lengths[first]
        while last < len(lengths) and n + lengths[last] <= rows:
            n, last = n + lengths[last], last + 1
        out.append((first, last, start, n))
        first, start = last, start + n
    return out


def _segment_max(scores: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[B, V] the column maxima of each text's rows of ``scores`` [N, V] (``lengths``: rows a text, in order; every
    text has one at least).

    >>> _segment_max(torch.tensor([[1.0, 5.0], [3.0, 2.0], [0.0, -1.0]]), [2, 1]).tolist()
    [[3.0, 5.0], [0.0, -1.0]]
    """
    bounds = list(itertools.accumulate(lengths, initial=0))
    return torch.stack([scores[a:b].amax(0) for a, b in itertools.pairwise(bounds)])
