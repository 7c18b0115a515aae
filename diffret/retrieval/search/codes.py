"""Search over residual codes in PLAID's order: candidates from the codebook's centroids, exact MaxSim on the rest.

A ``residual:B`` code starts with its vector's centroid id, so the codes are an inverted file already: a centroid's
cell holds the passages with a vector coded against it. :class:`CodesIndex` keeps those lists (the passages of each
cell, corpus positions ascending: at most 4 bytes a vector, no vector). A query is searched in PLAID's order
(Santhanam et al., 2022):

1. each query vector's ``probes`` nearest centroids (largest inner product) name the cells whose passages are the
   candidates;
2. each candidate is scored by centroid interaction, the MaxSim of the query against its vectors' centroids
   (``sum_i max_j <q_i, c(p_j)>``, read from the codes' centroid ids without decoding), and the best ``candidates``
   are kept (ties: the earlier passage);
3. those are decoded and scored by exact MaxSim under the search's rules (:func:`retrieval.search.scoring.maxsim`,
   the exact search's), so a passage both find has the same score as in exact search over the decoded codes. They
   are decoded :data:`DECODE_BLOCK` at a time, so that a block's vectors stay in the CPU's cache between the decode,
   the norms and the scoring (1.4-1.8x faster than decoding them all at once, at 100k passages and 2,048-16,384
   candidates: docs/scale.md); every score is bit for bit the same as decoding them at once.

``probes`` and ``candidates`` are the quality / speed knob; with every cell probed and every passage a candidate the
result is exact search's. PLAID's centroid-pruning threshold is not applied (step 2 reads every centroid of a
candidate). Memory: the pass's codes (:class:`CodedPassages`, held as stored) and the lists.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from diffret.retrieval.search.codecs import ID_BYTES, Codec, decode, parse_store

from .encodings import Encodings, normalised
from .rules import ScoreRules
from .scoring import NEG, TopK, maxsim

DEFAULT_PROBES = 2  # PLAID's nprobe for k = 100 (ColBERTv2's PLAID settings: 1 / 2 / 4 for k = 10 / 100 / 1000)
DEFAULT_CANDIDATES = 1024  # PLAID's candidates re-ranked for k = 100
DECODE_BLOCK = 512  # candidates decoded and scored at a time (at K_p = 16, H = 128: 4 MiB of vectors)
MIN_BLOCK = 16  # the fewest candidates a block scores when the query has more
CENTROID_SCORES = 16 << 20  # the most (query vector, centroid) scores held at once (64 MiB of float32)
IVF_SCHEMA = pa.schema(
    [pa.field("centroid", pa.int32(), nullable=False), pa.field("passages", pa.list_(pa.int32()), nullable=False)]
)


def centroid_ids(codes: np.ndarray) -> np.ndarray:
    """The centroid id of each ``residual:B`` code ([n, B] uint8 -> [n] int64).

    >>> centroid_ids(np.array([[7, 1, 0, 0, 255]], np.uint8)).tolist()
    [263]
    """
    return np.ascontiguousarray(codes[:, :ID_BYTES]).view("<u4")[:, 0].astype(np.int64)


@dataclass
class CodesIndex:
    """For each of ``n_centroids`` cells, the passages (corpus positions, ascending) with a vector in it:
    ``passages[offsets[c]:offsets[c + 1]]``.

    >>> ix = CodesIndex.build([(np.array([2, 0, 2, 1]), np.array([1, 3]))], n_centroids=3)
    >>> [ix.cell(c).tolist() for c in range(3)]   # passage 0: vector in cell 2; passage 1: cells 0, 2, 1
    [[1], [1], [0, 1]]
    >>> CodesIndex.from_table(ix.to_table(), 2).cell(2).tolist()
    [0, 1]
    """

    offsets: np.ndarray  # [C + 1] int64
    passages: np.ndarray  # [nnz] int32
    n_passages: int

    @property
    def n_centroids(self) -> int:
        return len(self.offsets) - 1

    def cell(self, c: int) -> np.ndarray:
        return self.passages[self.offsets[c] : self.offsets[c + 1]]

    @classmethod
    def build(cls, shards: Iterable[tuple[np.ndarray, np.ndarray]], n_centroids: int) -> CodesIndex:
        """From (centroid ids of a block's vectors in text order, the block's vectors per passage) blocks in corpus
        order (a shard at a time: only the (cell, passage) pairs are held)."""
        keys, at = [], 0
        for ids, n_reps in shards:
            n_reps = np.asarray(n_reps, np.int64)
            pos = np.repeat(np.arange(at, at + len(n_reps), dtype=np.int64), n_reps)
            ids = np.asarray(ids, np.int64)
            if len(ids) != len(pos):
                raise ValueError(f"{len(ids)} centroid ids for {len(pos)} vectors")
            if len(ids) and (ids.min() < 0 or ids.max() >= n_centroids):
                raise ValueError(f"a centroid id outside 0..{n_centroids - 1}: the codes are not of this codebook")
            keys.append(np.unique(ids << 32 | pos))
            at += len(n_reps)
        key = np.unique(np.concatenate(keys + [np.zeros(0, np.int64)]))
        counts = np.bincount(key >> 32, minlength=n_centroids)
        offsets = np.zeros(n_centroids + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        return cls(offsets, (key & 0xFFFFFFFF).astype(np.int32), at)

    def to_table(self) -> pa.Table:
        """One row per cell: ``centroid`` and its ``passages`` (:data:`IVF_SCHEMA`)."""
        lists = pa.ListArray.from_arrays(pa.array(self.offsets.astype(np.int32)), pa.array(self.passages, pa.int32()))
        return pa.table(
            {"centroid": pa.array(np.arange(self.n_centroids, dtype=np.int32)), "passages": lists}, schema=IVF_SCHEMA
        )

    @classmethod
    def from_table(cls, table: pa.Table, n_passages: int) -> CodesIndex:
        col = table.column("passages").combine_chunks()
        if not np.array_equal(table.column("centroid").to_numpy(), np.arange(table.num_rows)):
            raise ValueError("codes index: its rows are not the cells 0..C-1 in order")
        offsets = np.asarray(col.offsets, np.int64) - int(col.offsets[0].as_py())
        return cls(offsets, col.flatten().to_numpy(zero_copy_only=False).astype(np.int32), n_passages)


@dataclass
class CodedPassages:
    """A pass's passages as stored: their codes ([V, B] uint8, text order) and each passage's first vector."""

    codes: np.ndarray  # [V, B] uint8
    offsets: np.ndarray  # [N + 1] int64
    codec: Codec
    _ids: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def cells(self) -> np.ndarray:
        """Each vector's centroid id (computed once)."""
        if self._ids is None:
            self._ids = centroid_ids(self.codes)
        return self._ids

    @classmethod
    def from_blocks(cls, blocks: list[tuple[np.ndarray, np.ndarray]], codec: Codec) -> CodedPassages:
        """From (codes [v, B], vectors per passage) blocks in corpus order."""
        codes = [np.asarray(c, np.uint8) for c, _ in blocks]
        reps = np.concatenate([np.asarray(n, np.int64) for _, n in blocks] + [np.zeros(0, np.int64)])
        offsets = np.zeros(len(reps) + 1, np.int64)
        np.cumsum(reps, out=offsets[1:])
        width = codes[0].shape[1] if codes else 1
        return cls(np.concatenate(codes) if codes else np.zeros((0, width), np.uint8), offsets, codec)


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The concatenated ``arange(s, e)`` of each (start, end) pair.

    >>> _ranges(np.array([0, 5]), np.array([2, 8])).tolist()
    [0, 1, 5, 6, 7]
    """
    lengths = ends - starts
    out = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return out + np.arange(int(lengths.sum()))


def _interaction(s_t: np.ndarray, cells: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Centroid interaction: each candidate's ``sum_i max_j s[i, c(p_j)]`` from the query's centroid scores
    (``s_t``: [C, kq], a cell's scores in a row) and its vectors' cells, summed over i in order.

    >>> s_t = np.array([[1.0, 0.0], [0.0, 2.0], [0.5, 0.5]], np.float32)     # 3 cells x 2 query vectors
    >>> _interaction(s_t, np.array([0, 1, 2, 2]), np.array([0, 2]), np.array([2, 4])).tolist()
    [3.0, 1.0]
    """
    lengths = ends - starts
    kp = int(lengths[0]) if len(lengths) else 0
    if kp and (lengths == kp).all():  # every candidate has K_p vectors: the max taken slot by slot (numpy's
        # reduction over a short middle axis is several times slower)
        rows = np.take(s_t, np.take(cells, (starts[:, None] + np.arange(kp)).ravel()), axis=0)
        rows = rows.reshape(len(starts), kp, -1)
        best = rows[:, 0].copy()
        for j in range(1, kp):
            np.maximum(best, rows[:, j], out=best)
    else:
        rows = np.take(s_t, np.take(cells, _ranges(starts, ends)), axis=0)  # [vectors of the candidates, kq]
        best = np.maximum.reduceat(rows, np.concatenate([[0], np.cumsum(lengths)[:-1]]), axis=0)
    out = best[:, 0].copy()
    for i in range(1, best.shape[1]):
        out += best[:, i]
    return out


def _best(scores: np.ndarray, n: int) -> np.ndarray:
    """Positions of the ``n`` largest ``scores`` (ties: the earlier), ascending.

    >>> _best(np.array([0.5, 0.9, 0.5, 0.1, 0.5]), 3).tolist()
    [0, 1, 2]
    """
    if n >= len(scores):
        return np.arange(len(scores))
    cut = -np.partition(-scores, n - 1)[n - 1]  # the n-th largest score
    above = np.flatnonzero(scores > cut)
    tied = np.flatnonzero(scores == cut)[: n - len(above)]
    return np.sort(np.concatenate([above, tied]))


def _exact_scores(
    queries: Encodings, qi: int, passages: CodedPassages, cand: np.ndarray, kp: int, rules: ScoreRules
) -> np.ndarray:
    """Query ``qi``'s MaxSim against the decoded codes of the passages ``cand`` (padded to ``kp`` vectors: the
    widest of all the query's candidates, so a block scores as the whole would), as exact search scores them."""
    starts, ends = passages.offsets[cand], passages.offsets[cand + 1]
    vecs = normalised(
        torch.from_numpy(
            decode(
                passages.codes[_ranges(starts, ends)],
                passages.codec.spec,
                passages.codec.codebook,
                passages.codec.dim,
            )
        ),
        rules,
    )
    lengths = ends - starts
    if (lengths == kp).all():  # every candidate has K_p vectors: a view, as exact search reads them
        multi, mask = vecs.view(len(cand), kp, -1), torch.ones(len(cand), kp, dtype=torch.bool)
    else:
        mask = torch.arange(kp)[None, :] < torch.from_numpy(lengths)[:, None]
        multi = torch.zeros(len(cand), kp, vecs.shape[1])
        multi[mask] = vecs
    return maxsim(
        queries.multi[qi : qi + 1].float(),
        queries.mask[qi : qi + 1],
        multi,
        mask,
        clamp=rules.maxsim_clamp,
        reduce=rules.maxsim_reduce,
        bf16=rules.bf16,
    )[0].numpy()


@dataclass
class CodesSearchStats:
    """Per query: milliseconds, the passages the probed cells held, the candidates decoded."""

    latencies_ms: list[float] = field(default_factory=list)
    probed: list[int] = field(default_factory=list)
    decoded: list[int] = field(default_factory=list)


def search_codes(
    queries: Encodings,
    passages: CodedPassages,
    index: CodesIndex,
    k: int,
    probes: int = DEFAULT_PROBES,
    candidates: int = DEFAULT_CANDIDATES,
    rules: ScoreRules | None = None,
    stats: CodesSearchStats | None = None,
) -> TopK:
    """The top ``k`` passages (corpus positions) of each query by MaxSim, searched over a ``residual:B`` pass's
    codes in PLAID's order (module docstring). ``queries``: normalised as exact search reads them
    (:func:`retrieval.search.encodings.encodings_from_table` under ``rules``). Ties rank the earlier passage first.

    >>> from diffret.retrieval.search.codecs import Codec, encode, train_codebook
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(40, 3, 16)).astype(np.float32)                       # 40 passages x 3 vectors
    >>> cb = train_codebook(x.reshape(-1, 16), "residual:4", seed=0, n_corpus=120)
    >>> coded = CodedPassages.from_blocks([(encode(x.reshape(-1, 16), "residual:4", cb), np.full(40, 3))],
    ...                                   Codec("residual:4", 16, cb))
    >>> index = CodesIndex.build([(coded.cells, np.full(40, 3))], len(cb.arrays["centroids"]))
    >>> q = torch.from_numpy(x[[7, 21], :2] / np.linalg.norm(x[[7, 21], :2], axis=-1, keepdims=True))
    >>> queries = Encodings(["a", "b"], q, torch.ones(2, 2, dtype=torch.bool), q.mean(1), [], [])
    >>> search_codes(queries, coded, index, k=1, probes=1, candidates=8).index.tolist()
    [[7], [21]]
    """
    rules = rules or ScoreRules()
    spec = parse_store(passages.codec.spec)
    if spec.kind != "residual" or passages.codec.codebook is None:
        raise ValueError(f"search over codes needs residual:B codes and their codebook, not {passages.codec.spec}")
    if probes < 1 or candidates < 1 or k < 1:
        raise ValueError(f"probes, candidates and k must be positive (got {probes}, {candidates}, {k})")
    if len(passages) != index.n_passages:
        raise ValueError(f"the codes index covers {index.n_passages:,} passages, the codes {len(passages):,}")
    cents = torch.from_numpy(np.ascontiguousarray(passages.codec.codebook.arrays["centroids"], np.float32))
    if cents.shape[0] != index.n_centroids:
        raise ValueError(f"the codes index has {index.n_centroids:,} cells, the codebook {cents.shape[0]:,} centroids")
    probes = min(probes, index.n_centroids)
    width = min(k, len(passages))
    out_s = np.full((len(queries), width), NEG, np.float32)
    out_i = np.full((len(queries), width), -1, np.int64)
    cells = passages.cells
    seen = np.zeros(len(passages), bool)  # the candidates of the query being searched
    kq_max = queries.multi.shape[1] if len(queries) else 1
    step = max(1, CENTROID_SCORES // max(1, kq_max * index.n_centroids))  # queries whose centroid scores are held
    for a in range(0, len(queries), step):
        t0 = time.perf_counter()
        b = min(a + step, len(queries))
        product = torch.matmul(queries.multi[a:b].float(), cents.T)  # [queries, K_q, C]: every centroid's score
        nearest = torch.topk(product, probes, dim=2).indices.numpy() if probes < index.n_centroids else None
        scores = product.numpy()
        shared = (time.perf_counter() - t0) / (b - a)  # the block's product, shared by its queries
        for qi in range(a, b):
            t0 = time.perf_counter()
            real = queries.mask[qi].numpy()
            s = scores[qi - a][real]  # [kq, C]: the real query vectors
            probed = np.unique(nearest[qi - a][real]) if nearest is not None else np.arange(index.n_centroids)
            seen[index.passages[_ranges(index.offsets[probed], index.offsets[probed + 1])]] = True
            cand = np.flatnonzero(seen)  # the probed cells' passages, ascending, each once
            seen[cand] = False
            n_probed = len(cand)
            if len(cand) > candidates:  # centroid interaction: MaxSim against the candidates' vectors' centroids
                starts, ends = passages.offsets[cand], passages.offsets[cand + 1]
                approx = _interaction(np.ascontiguousarray(s.T), cells, starts, ends)
                cand = cand[_best(approx, candidates)]
            if len(cand):
                sc = np.empty(len(cand), np.float32)
                kp = int((passages.offsets[cand + 1] - passages.offsets[cand]).max())  # every block padded to it
                # decoded and scored a cache-sized block at a time; a short last block joins the one before (BLAS
                # scores a handful of columns another way, which would change a score's last bit)
                cuts = list(range(0, len(cand), DECODE_BLOCK))[1:]
                if cuts and len(cand) - cuts[-1] < MIN_BLOCK:
                    cuts.pop()
                for c0, c1 in zip([0, *cuts], [*cuts, len(cand)], strict=True):
                    sc[c0:c1] = _exact_scores(queries, qi, passages, cand[c0:c1], kp, rules)
                order = np.lexsort((cand, -sc))[:width]
                out_s[qi, : len(order)], out_i[qi, : len(order)] = sc[order], cand[order]
            if stats is not None:
                stats.latencies_ms.append((time.perf_counter() - t0 + shared) * 1000.0)
                stats.probed.append(n_probed)
                stats.decoded.append(len(cand))
    return TopK(out_s, out_i)
