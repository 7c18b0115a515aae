"""Encoded texts as tensors ready to score: L2-normalised multi-vectors, their mean, sparse vectors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import torch

from diffret.retrieval.search.codecs import Codec, vectors_of

from .rules import ScoreRules, round_bf16_


@dataclass
class SparseFlat:
    """Sparse vectors of N texts as three flat arrays: text i's terms are ``ids[offsets[i]:offsets[i + 1]]``.

    >>> s = SparseFlat.from_lists([np.array([4, 2]), np.array([], np.int64)], [np.ones(2), np.ones(0)])
    >>> s.offsets.tolist(), s.ids.tolist(), len(s.rows(1, 2).ids)
    ([0, 2, 2], [4, 2], 0)
    """

    offsets: np.ndarray  # [N + 1] int64, offsets[0] == 0
    ids: np.ndarray  # [nnz] int64 vocabulary ids
    weights: np.ndarray  # [nnz] float32

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def from_lists(cls, ids: list[np.ndarray], weights: list[np.ndarray]) -> SparseFlat:
        lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids))
        offsets = np.zeros(len(ids) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat_ids = np.concatenate([np.asarray(x, np.int64) for x in ids] + [np.zeros(0, np.int64)])
        flat_w = np.concatenate([np.asarray(x, np.float32) for x in weights] + [np.zeros(0, np.float32)])
        return cls(offsets, flat_ids, flat_w)

    def rows(self, start: int, end: int) -> SparseFlat:
        """Texts ``start:end`` (the id and weight arrays are views)."""
        a, b = int(self.offsets[start]), int(self.offsets[end])
        return SparseFlat(self.offsets[start : end + 1] - a, self.ids[a:b], self.weights[a:b])


@dataclass
class Encodings:
    """A block of encoded texts, ready to score (vectors L2-normalised, float32)."""

    ids: list[str]
    multi: torch.Tensor  # [N, K, H]; rows beyond a text's n_reps are zero
    mask: torch.Tensor  # [N, K] bool: real vectors
    single: torch.Tensor  # [N, H]: mean of the normalised vectors (ScoreRules.single_renorm: normalised again)
    sparse_ids: list[np.ndarray]  # per text, int64 vocabulary ids
    sparse_weights: list[np.ndarray]  # per text, float32 weights
    flat: SparseFlat | None = field(default=None, repr=False, compare=False)  # the same sparse vectors, flat

    def __len__(self) -> int:
        return len(self.ids)

    def sparse(self) -> SparseFlat:
        """The sparse vectors as flat arrays (built once, from the per-text lists when not given)."""
        if self.flat is None:
            self.flat = SparseFlat.from_lists(self.sparse_ids, self.sparse_weights)
        return self.flat

    def rows(self, start: int, end: int) -> Encodings:
        """The texts ``start:end`` (views, no copy)."""
        return Encodings(
            self.ids[start:end],
            self.multi[start:end],
            self.mask[start:end],
            self.single[start:end],
            self.sparse_ids[start:end],
            self.sparse_weights[start:end],
            self.flat.rows(start, end) if self.flat is not None else None,
        )


def normalise(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """L2-normalise along ``dim`` (a zero vector stays zero).

    >>> normalise(torch.tensor([[3.0, 4.0], [0.0, 0.0]])).tolist()
    [[0.6000000238418579, 0.800000011920929], [0.0, 0.0]]
    """
    return x / x.norm(dim=dim, keepdim=True).clamp_min(1e-12)


def normalised(vecs: torch.Tensor, rules: ScoreRules) -> torch.Tensor:
    """Rows of ``vecs`` [n, H] float32 L2-normalised as exact search scores them: in place (a shard's vectors are
    decoded with one float32 copy), or in bfloat16 under ``rules.bf16`` (the released evaluator's norm and division).

    >>> normalised(torch.tensor([[3.0, 4.0]]), ScoreRules()).tolist()
    [[0.6000000238418579, 0.800000011920929]]
    """
    if rules.bf16:
        b = vecs.to(torch.bfloat16)
        return (b / torch.linalg.vector_norm(b, dim=-1, keepdim=True).clamp(min=1e-12)).float()
    return vecs.div_(vecs.norm(dim=-1, keepdim=True).clamp_min_(1e-12))


def padded(vectors: list[np.ndarray], device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-text [n_i, H] arrays -> ([N, max n, H] float32 zero-padded, [N, max n] bool mask of real vectors).

    >>> multi, mask = padded([np.ones((1, 2)), np.ones((3, 2))])
    >>> tuple(multi.shape), mask.tolist()
    ((2, 3, 2), [[True, False, False], [True, True, True]])
    """
    n = len(vectors)
    width = max((len(v) for v in vectors), default=1)
    hidden = vectors[0].shape[-1] if n else 1
    multi = torch.zeros(n, width, hidden)
    lengths = torch.as_tensor([len(v) for v in vectors], dtype=torch.long)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    if n:
        multi[mask] = torch.from_numpy(np.concatenate(vectors).astype(np.float32, copy=False))
    dev = torch.device(device)
    return multi.to(dev), mask.to(dev)


def encodings_from_table(
    table: pa.Table,
    device: str | torch.device = "cpu",
    rules: ScoreRules | None = None,
    sparse_factor: float = 1.0,
    codec: Codec | None = None,
) -> Encodings:
    """Convert rows of the encodings schema (diffret.schemas.encodings_schema) into tensors to score.

    Each vector is L2-normalised; ``single`` is the mean of a text's normalised vectors (normalised again with
    ``rules.single_renorm``); ``rules.dtype == "bfloat16"`` rounds the normalised vectors and the mean to
    bfloat16 as the released evaluator does. Sparse weights are multiplied by ``sparse_factor`` (and rounded to
    integers when it is not 1: the reference's stored x100 integers, see ``ScoreRules.sparse_factor``). A compressed
    table (a ``codes`` column) is decoded with ``codec`` (retrieval/search/codecs.py).

    >>> import pyarrow as pa
    >>> from diffret.storage.layout import encodings_schema
    >>> t = pa.Table.from_pylist([{"id": "a", "n_reps": 2, "dense": [[3.0, 4.0], [0.0, 1.0]],
    ...     "sparse_ids": [7], "sparse_weights": [0.69]}], schema=encodings_schema(2))
    >>> e = encodings_from_table(t, sparse_factor=100.0)
    >>> [round(x, 2) for x in e.single[0].tolist()], e.sparse_weights[0].tolist()   # mean of (.6, .8), (0, 1)
    ([0.3, 0.9], [69.0])
    """
    rules = rules or ScoreRules()
    n = table.num_rows
    ids = table.column("id").to_pylist()
    n_reps = table.column("n_reps").to_numpy().astype(np.int64)
    dense_rows = vectors_of(table, codec)  # one row per vector, in text order
    hidden = dense_rows.shape[1]
    if dense_rows.shape[0] != int(n_reps.sum()):
        raise ValueError(f"encodings: {dense_rows.shape[0]} vectors but n_reps sums to {int(n_reps.sum())}")
    if n and int(n_reps.min()) < 1:
        bad = ids[int(np.argmin(n_reps))]
        raise ValueError(f"encodings: text {bad!r} has no vector (n_reps = 0)")
    kmax = int(n_reps.max()) if n else 1
    vecs = normalised(torch.from_numpy(dense_rows), rules)
    mask = torch.arange(kmax)[None, :] < torch.from_numpy(n_reps)[:, None]
    if n and bool((n_reps == kmax).all()):  # every text has K vectors (no slot cut): a view, no second copy
        multi = vecs.view(n, kmax, hidden)
    else:
        multi = torch.zeros(n, kmax, hidden)
        multi[mask] = vecs
    del vecs, dense_rows
    single = multi.sum(1) / torch.from_numpy(n_reps).clamp_min(1)[:, None].float()
    if rules.single_renorm:
        single = normalise(single)
    if rules.bf16:
        round_bf16_(single)
    flat = _sparse_flat(table)
    if sparse_factor != 1.0:
        flat.weights = np.rint(flat.weights * np.float32(sparse_factor)).astype(np.float32)
    if rules.bf16:
        round_bf16_(torch.from_numpy(flat.weights))  # the released evaluator's sparse operands
    sparse_ids = np.split(flat.ids, flat.offsets[1:-1]) if n else []
    sparse_weights = np.split(flat.weights, flat.offsets[1:-1]) if n else []
    dev = torch.device(device)
    return Encodings(ids, multi.to(dev), mask.to(dev), single.to(dev), sparse_ids, sparse_weights, flat)


def _sparse_flat(table: pa.Table) -> SparseFlat:
    """The sparse columns as flat arrays, straight from Arrow's list offsets (a null list is empty)."""
    cols = []
    for name in ("sparse_ids", "sparse_weights"):
        col = table.column(name)
        arr = col.combine_chunks() if col.num_chunks else pa.array([], col.type)
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        cols.append((lengths, arr.flatten().to_numpy(zero_copy_only=False)))
    (lengths, ids), (lengths_w, weights) = cols
    if not np.array_equal(lengths, lengths_w):
        raise ValueError("encodings: sparse_ids and sparse_weights differ in length")
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return SparseFlat(offsets, ids.astype(np.int64), weights.astype(np.float32))


def select(enc: Encodings, ids: list[str]) -> Encodings:
    """The rows of ``ids`` in that order (raises KeyError naming the first unknown id)."""
    pos = {x: i for i, x in enumerate(enc.ids)}
    missing = [x for x in ids if x not in pos]
    if missing:
        raise KeyError(f"{len(missing)} id(s) have no encoding, e.g. {missing[0]!r}")
    return take(enc, [pos[x] for x in ids])


def take(enc: Encodings, rows: Sequence[int] | npt.NDArray[np.integer]) -> Encodings:
    """The texts at positions ``rows``, in that order.

    >>> e = Encodings(["a", "b"], torch.zeros(2, 1, 2), torch.ones(2, 1, dtype=torch.bool), torch.zeros(2, 2),
    ...               [np.zeros(0)] * 2, [np.zeros(0)] * 2)
    >>> take(e, [1]).ids
    ['b']
    """
    idx = [int(i) for i in rows]
    t = torch.tensor(idx, dtype=torch.long, device=enc.multi.device)
    return Encodings(
        [enc.ids[i] for i in idx],
        enc.multi[t],
        enc.mask[t],
        enc.single[t],
        [enc.sparse_ids[i] for i in idx],
        [enc.sparse_weights[i] for i in idx],
    )
