"""SIDR's in-training retrieval of hard negatives (Zhou et al., ICLR 2025; jzhoubu/sidr).

At every step the current query encoder, detached, searches the training corpus's *fixed* binary bag-of-tokens
index (beta search: the query's top-k plus its own tokens against the passages' bags); the judged-relevant
passages are dropped from its top ``depth`` and the step's negatives are drawn at random from the rest. No
passage is encoded to search: the index is the tokenizer's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..data.training import Passage, sample_fill
from ..search.bot import beta_search, bot_blocks
from ..search.encodings import SparseFlat


def sparse_rows(vectors: torch.Tensor) -> SparseFlat:
    """Dense [B, V] vectors as :class:`SparseFlat` (their non-zero entries).

    >>> sparse_rows(torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 3.0]])).ids.tolist()
    [1, 0, 2]
    """
    v = vectors.detach().float().cpu()
    rows, cols = v.nonzero(as_tuple=True)
    offsets = np.zeros(v.shape[0] + 1, np.int64)
    np.cumsum(np.bincount(rows.numpy(), minlength=v.shape[0]), out=offsets[1:])
    return SparseFlat(offsets, cols.numpy().astype(np.int64), v[rows, cols].numpy().astype(np.float32))


@dataclass
class RetrievedNegatives:
    """Negatives drawn from a beta search over a fixed bag-of-tokens index.

    ``bags``: the corpus's bags of tokens (:func:`retrieval.search.bot.binary_flat`), ``doc_ids`` their ids in
    the same order, ``passages``: corpus rows -> passages ({"docid", "title", "text"}), ``depth``: the top of the
    search a negative is drawn from. ``drawn`` / ``fallback`` count the negatives taken from the search and the
    queries whose top ``depth`` held nothing but judged-relevant passages (they keep the training set's own).

    >>> import pyarrow as pa
    >>> from diffret.retrieval.search.bot import binary_flat
    >>> bags = binary_flat(pa.array([[3], [3, 4], [5]], pa.list_(pa.int32())))
    >>> docs = [{"docid": d, "title": "", "text": d} for d in ("a", "b", "c")]
    >>> r = RetrievedNegatives(bags, ["a", "b", "c"], lambda rows: [docs[i] for i in rows], depth=2)
    >>> q = SparseFlat.from_lists([np.array([3, 4])], [np.array([1.0, 1.0], np.float32)])
    >>> [p["docid"] for p in r.draw(q, [{"b"}], 1, [random.Random(0)])[0]]  # "b" is judged relevant
    ['a']
    """

    bags: SparseFlat
    doc_ids: Sequence[str]
    passages: Callable[[list[int]], list[Passage]]
    depth: int = 100
    drawn: int = field(default=0, init=False)
    fallback: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.depth <= 0:
            raise ValueError(f"retrieved negatives: the depth must be positive (got {self.depth})")
        if len(self.doc_ids) != len(self.bags):
            raise ValueError(f"retrieved negatives: {len(self.doc_ids)} ids for {len(self.bags)} bags of tokens")

    def draw(
        self, queries: SparseFlat, relevant: Sequence[set[str]], n: int, rngs: Sequence[random.Random]
    ) -> list[list[Passage] | None]:
        """``n`` negatives per query from its top ``depth`` without its ``relevant`` ids; None for a query whose
        top holds no other passage sharing a token with it (its stored negatives stay)."""
        extra = max((len(r) for r in relevant), default=0)
        k = min(self.depth + extra, len(self.bags))
        top = beta_search(queries, bot_blocks(self.bags), k)
        out: list[list[Passage] | None] = []
        for i, rel in enumerate(relevant):
            hits = zip(top.index[i].tolist(), top.scores[i].tolist(), strict=True)  # no overlap: not retrieved
            rows = [j for j, s in hits if j >= 0 and s > 0 and self.doc_ids[j] not in rel][: self.depth]
            if not rows:
                self.fallback += 1
                out.append(None)
                continue
            chosen = sample_fill(rngs[i], rows, n)
            self.drawn += len(chosen)
            out.append(self.passages(chosen))
        return out
