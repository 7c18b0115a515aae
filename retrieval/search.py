"""Exact search over stored encodings: the five scoring modes of the paper (section 3.3).

- ``single_dense``: each text's K vectors are L2-normalised, averaged, and the mean normalised again;
  score = inner product (cosine of the means).
- ``multi_dense``: MaxSim on L2-normalised vectors, (1/K_q) * sum_i max_j <q_i, p_j>, where K_q is the
  query's number of vectors (its ``n_reps``).
- ``sparse_max``: inner product of the max-pooled sparse vectors (the encoder already applied
  log(1 + ReLU), max pooling over K and the content filter). A document sharing no term with the query
  is not retrieved (score 0 means no match, as in an inverted index).
- ``fusion_single_sparse_max`` / ``fusion_multi_sparse_max``: per query, min-max normalise each run's
  top ``depth`` (1000), 0.5 / 0.5 over the union; a document missing from one run gets 0 there. When
  all of a run's scores for a query are equal, they normalise to 1.

Search is a chunked matrix product with a running top-k (CPU or GPU), streamed over the passage
encoding shard by shard: one pass over a passage encoding scores every K_q (and every base mode)
against it. It is exact and is the ground truth the LanceDB index is checked against.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from storage.layout import BASE_MODES, FUSIONS, MODES, RUN_SCHEMA

NEG = float("-inf")


# ---------------------------------------------------------------------------------- loading
@dataclass
class Encodings:
    """A block of encoded texts, ready to score (vectors L2-normalised, float32)."""

    ids: list[str]
    multi: torch.Tensor  # [N, K, H]; rows beyond a text's n_reps are zero
    mask: torch.Tensor  # [N, K] bool: real vectors
    single: torch.Tensor  # [N, H]: normalised mean of the normalised vectors
    sparse_ids: list[np.ndarray]  # per text, int32 vocabulary ids
    sparse_weights: list[np.ndarray]  # per text, float32 weights

    def __len__(self) -> int:
        return len(self.ids)


def _normalise(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x / x.norm(dim=dim, keepdim=True).clamp_min(1e-12)


def encodings_from_table(table: pa.Table, device: str | torch.device = "cpu") -> Encodings:
    """Convert rows of the encodings schema (storage.layout.encodings_schema) into tensors."""
    n = table.num_rows
    ids = table.column("id").to_pylist()
    n_reps = table.column("n_reps").to_numpy().astype(np.int64)
    dense_col = table.column("dense").combine_chunks()
    inner = dense_col.flatten()  # FixedSizeList per vector, respecting the list offsets
    hidden = inner.type.list_size
    flat = inner.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, hidden)
    if flat.shape[0] != int(n_reps.sum()):
        raise ValueError(f"encodings: {flat.shape[0]} vectors but n_reps sums to {int(n_reps.sum())}")
    if n and int(n_reps.min()) < 1:
        bad = ids[int(np.argmin(n_reps))]
        raise ValueError(f"encodings: text {bad!r} has no vector (n_reps = 0)")
    kmax = int(n_reps.max()) if n else 1
    vecs = _normalise(torch.from_numpy(flat))
    multi = torch.zeros(n, kmax, hidden)
    mask = torch.arange(kmax)[None, :] < torch.from_numpy(n_reps)[:, None]
    multi[mask] = vecs
    mean = multi.sum(1) / torch.from_numpy(n_reps).clamp_min(1)[:, None].float()
    single = _normalise(mean)
    sid = table.column("sparse_ids").to_pylist()
    sw = table.column("sparse_weights").to_pylist()
    sparse_ids = [np.asarray(x if x is not None else [], dtype=np.int64) for x in sid]
    sparse_weights = [np.asarray(x if x is not None else [], dtype=np.float32) for x in sw]
    dev = torch.device(device)
    return Encodings(ids, multi.to(dev), mask.to(dev), single.to(dev), sparse_ids, sparse_weights)


def select(enc: Encodings, ids: list[str]) -> Encodings:
    """The rows of ``ids`` in that order (raises naming the first unknown id)."""
    pos = {x: i for i, x in enumerate(enc.ids)}
    missing = [x for x in ids if x not in pos]
    if missing:
        raise KeyError(f"{len(missing)} id(s) have no encoding, e.g. {missing[0]!r}")
    idx = [pos[x] for x in ids]
    t = torch.tensor(idx, dtype=torch.long, device=enc.multi.device)
    return Encodings(
        list(ids),
        enc.multi[t],
        enc.mask[t],
        enc.single[t],
        [enc.sparse_ids[i] for i in idx],
        [enc.sparse_weights[i] for i in idx],
    )


# ---------------------------------------------------------------------------------- top-k
@dataclass
class TopK:
    """Per query, the best ``k`` documents: scores (-inf pads) and global document indices (-1 pads)."""

    scores: np.ndarray  # [Q, k] float32, descending
    index: np.ndarray  # [Q, k] int64


class _RunningTopK:
    def __init__(self, n_queries: int, k: int, device: torch.device):
        self.k = k
        self.scores = torch.full((n_queries, 0), NEG, device=device)
        self.index = torch.zeros((n_queries, 0), dtype=torch.long, device=device)

    def update(self, scores: torch.Tensor, offset: int) -> None:
        idx = torch.arange(offset, offset + scores.shape[1], device=scores.device).expand_as(scores)
        allsc = torch.cat([self.scores, scores], 1)
        allix = torch.cat([self.index, idx], 1)
        kk = min(self.k, allsc.shape[1])
        best, pos = torch.topk(allsc, kk, dim=1)
        self.scores, self.index = best, torch.gather(allix, 1, pos)

    def result(self) -> TopK:
        s = self.scores.float().cpu().numpy()
        ix = self.index.cpu().numpy().astype(np.int64)
        ix[~np.isfinite(s)] = -1
        return TopK(s, ix)


# ---------------------------------------------------------------------------------- scoring
class _SparseQueries:
    """Query sparse vectors as a dense [V_sub, Q] matrix over the vocabulary the queries use."""

    def __init__(self, q: Encodings, device: torch.device):
        allids = np.concatenate([x for x in q.sparse_ids] + [np.zeros(0, np.int64)])
        self.vocab = np.unique(allids)
        mat = torch.zeros(max(len(self.vocab), 1), len(q), device=device)
        for j, (ids, w) in enumerate(zip(q.sparse_ids, q.sparse_weights, strict=True)):
            if len(ids):
                rows = torch.from_numpy(np.searchsorted(self.vocab, ids)).to(device)
                mat[rows, j] = torch.from_numpy(w).to(device)
        self.matrix = mat

    def scores(self, p: Encodings) -> torch.Tensor:
        """[Q, N] sparse inner products (exact; zero where no term is shared)."""
        device = self.matrix.device
        crow = [0]
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        for ids, w in zip(p.sparse_ids, p.sparse_weights, strict=True):
            if len(ids) and len(self.vocab):
                pos = np.searchsorted(self.vocab, ids)
                pos_c = np.minimum(pos, len(self.vocab) - 1)
                keep = self.vocab[pos_c] == ids
                order = np.argsort(pos_c[keep], kind="stable")  # CSR: sorted columns within a row
                cols.append(pos_c[keep][order])
                vals.append(w[keep][order])
                crow.append(crow[-1] + int(keep.sum()))
            else:
                crow.append(crow[-1])
        if crow[-1] == 0:
            return torch.zeros(self.matrix.shape[1], len(p), device=device)
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            csr = torch.sparse_csr_tensor(
                torch.tensor(crow, dtype=torch.int64),
                torch.from_numpy(np.concatenate(cols).astype(np.int64)),
                torch.from_numpy(np.concatenate(vals).astype(np.float32)),
                size=(len(p), self.matrix.shape[0]),
                check_invariants=False,  # built sorted and in range above
            ).to(device)
        return (csr @ self.matrix).T


class Workspace:
    """Reused score buffers: a fresh [Q*K_q, N] matrix per block costs page faults (~2x the GEMM on CPU)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < rows * cols or buf.device != like.device or buf.dtype != like.dtype:
            buf = self._bufs[name] = torch.empty(rows * cols, dtype=like.dtype, device=like.device)
        return buf[: rows * cols].view(rows, cols)


# On CPU the documents are scored in tiles whose score buffers stay in cache (2 MB each): 1.26x faster than
# one [Q*K_q, N] buffer per block on a 2-core AVX-512 machine. A GPU gets whole blocks (fewer, larger GEMMs).
CPU_TILE_ELEMS = 1 << 19


def maxsim(
    q_multi: torch.Tensor,
    q_mask: torch.Tensor,
    p_multi: torch.Tensor,
    p_mask: torch.Tensor,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """[Q, N] MaxSim scores: (1/K_q) sum over real query vectors of the max over real passage vectors.

    One GEMM per passage slot j (``[Q*K_q, H] x [H, N]``) folded into a running element-wise max, so the
    [Q*K_q, N*K_p] similarity matrix is never materialised (K_p times less memory, no separate amax pass).
    A passage's padding slots (beyond its n_reps) are -inf before the max.
    """
    nq, kq, _ = q_multi.shape
    n = p_multi.shape[0]
    ws = workspace or Workspace()
    tile = n if q_multi.device.type != "cpu" else max(1, CPU_TILE_ELEMS // max(1, nq * kq))
    if tile >= n:
        return _maxsim_tile(q_multi, q_mask, p_multi, p_mask, ws)
    out = torch.empty(nq, n, dtype=q_multi.dtype, device=q_multi.device)
    for s in range(0, n, tile):
        out[:, s : s + tile] = _maxsim_tile(q_multi, q_mask, p_multi[s : s + tile], p_mask[s : s + tile], ws)
    return out


def _maxsim_tile(
    q_multi: torch.Tensor, q_mask: torch.Tensor, p_multi: torch.Tensor, p_mask: torch.Tensor, ws: Workspace
) -> torch.Tensor:
    nq, kq, h = q_multi.shape
    n, kp, _ = p_multi.shape
    qf = q_multi.reshape(nq * kq, h)
    best = ws.get("best", nq * kq, n, qf)
    tmp = ws.get("tmp", nq * kq, n, qf) if kp > 1 else best
    pad = ~p_mask  # [N, K_p]: True where a slot is padding
    padded_slots = pad.any(0).tolist()  # one host sync per tile, not one per slot
    for j in range(kp):
        out = best if j == 0 else tmp
        torch.mm(qf, p_multi[:, j, :].T, out=out)
        if padded_slots[j]:
            out.masked_fill_(pad[None, :, j], NEG)
        if j:
            torch.maximum(best, tmp, out=best)
    b = best.view(nq, kq, n)
    if bool(q_mask.all()):
        return b.mean(1)
    b.masked_fill_(~q_mask[:, :, None], 0.0)
    return b.sum(1) / q_mask.sum(1, keepdim=True).clamp_min(1).to(b.dtype)


@dataclass
class SearchSettings:
    topk: int = 1000
    ignore_identical_ids: bool = False  # BEIR drops a document whose id equals the query id (ArguAna, Quora)
    chunk_elems: int = 1 << 26  # score-buffer entries per block (bounds memory: 4 bytes each)
    query_block: int = 512


def search_pass(
    queries: dict[int, Encodings],
    passages: Iterable[Encodings],
    modes: Iterable[str] = BASE_MODES,
    settings: SearchSettings | None = None,
) -> tuple[dict[tuple[int, str], TopK], list[str]]:
    """Score every query set (keyed by K_q) in every base mode against one stream of passage blocks.

    Returns ({(K_q, mode): TopK}, passage ids in stream order; TopK.index points into that list).
    """
    st = settings or SearchSettings()
    modes = list(modes)
    unknown = [m for m in modes if m not in BASE_MODES]
    if unknown:
        raise ValueError(f"unknown base mode(s) {unknown}; expected a subset of {list(BASE_MODES)}")
    if not queries:
        raise ValueError("no query encodings to score")
    device = next(iter(queries.values())).multi.device
    n_q = {kq: len(q) for kq, q in queries.items()}
    tops = {(kq, m): _RunningTopK(n_q[kq], st.topk, device) for kq in queries for m in modes}
    sparse_q = {kq: _SparseQueries(q, device) for kq, q in queries.items()} if "sparse_max" in modes else {}
    qpos = {kq: _query_positions(q.ids) for kq, q in queries.items()} if st.ignore_identical_ids else {}
    doc_ids: list[str] = []
    ws = Workspace()
    for block in passages:
        offset = len(doc_ids)
        doc_ids.extend(block.ids)
        for p in _split_block(block, queries, st):
            self_hits = {kq: _self_hits(qpos[kq], p.ids) for kq in qpos}
            for kq, q in queries.items():
                for mode in modes:
                    if mode == "single_dense":
                        sc = q.single @ p.single.T
                    elif mode == "sparse_max":
                        sc = sparse_q[kq].scores(p)
                        sc = sc.masked_fill(sc <= 0, NEG)
                    else:
                        sc = _blocked_maxsim(q, p, st.query_block, ws)
                    if st.ignore_identical_ids and self_hits[kq][0].numel():
                        sc[self_hits[kq][0], self_hits[kq][1]] = NEG
                    tops[(kq, mode)].update(sc, offset + p.offset)
    return {key: t.result() for key, t in tops.items()}, doc_ids


@dataclass
class _Sub:
    ids: list[str]
    multi: torch.Tensor
    mask: torch.Tensor
    single: torch.Tensor
    sparse_ids: list[np.ndarray]
    sparse_weights: list[np.ndarray]
    offset: int

    def __len__(self) -> int:
        return len(self.ids)


def _split_block(block: Encodings, queries: dict[int, Encodings], st: SearchSettings) -> Iterator[_Sub]:
    """Sub-blocks of passages small enough that a [Q*K_q, N*K_p] block fits the budget (maxsim's two
    [Q*K_q, N] buffers fit in it for K_p >= 2; the other modes' [Q, N] scores scale with it)."""
    kp = block.multi.shape[1]
    widest = max(min(len(q), st.query_block) * q.multi.shape[1] for q in queries.values())
    step = max(1, st.chunk_elems // max(1, widest * kp))
    for s in range(0, len(block), step):
        e = min(s + step, len(block))
        yield _Sub(
            block.ids[s:e],
            block.multi[s:e],
            block.mask[s:e],
            block.single[s:e],
            block.sparse_ids[s:e],
            block.sparse_weights[s:e],
            s,
        )


def _blocked_maxsim(q: Encodings, p: _Sub, query_block: int, ws: Workspace) -> torch.Tensor:
    parts = [
        maxsim(q.multi[s : s + query_block], q.mask[s : s + query_block], p.multi, p.mask, ws)
        for s in range(0, len(q), query_block)
    ]
    return torch.cat(parts, 0)


def _query_positions(ids: list[str]) -> dict[str, int]:
    return {x: i for i, x in enumerate(ids)}


def _self_hits(qpos: dict[str, int], doc_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = [], []
    for j, d in enumerate(doc_ids):
        i = qpos.get(d)
        if i is not None:
            rows.append(i)
            cols.append(j)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)


# ----------------------------------------------------------------------------------- fusion
def fuse_minmax(a: TopK, b: TopK, depth: int = 1000, weights: tuple[float, float] = (0.5, 0.5)) -> TopK:
    """Per query: min-max normalise each run's top ``depth``, weighted sum over the union (missing = 0)."""
    if a.scores.shape[0] != b.scores.shape[0]:
        raise ValueError(f"fusion of runs over different query sets ({a.scores.shape[0]} vs {b.scores.shape[0]})")
    out_s, out_i = [], []
    for qi in range(a.scores.shape[0]):
        acc: dict[int, float] = {}
        for run, w in ((a, weights[0]), (b, weights[1])):
            s, ix = run.scores[qi, :depth], run.index[qi, :depth]
            keep = ix >= 0
            s, ix = s[keep].astype(np.float64), ix[keep]
            if not len(s):
                continue
            lo, hi = s.min(), s.max()
            norm = (s - lo) / (hi - lo) if hi > lo else np.ones_like(s)
            for d, v in zip(ix.tolist(), norm.tolist(), strict=True):
                acc[d] = acc.get(d, 0.0) + w * v
        docs = np.fromiter(acc.keys(), np.int64, len(acc))
        vals = np.fromiter(acc.values(), np.float64, len(acc))
        order = np.lexsort((docs, -vals))[:depth]
        out_s.append(vals[order])
        out_i.append(docs[order])
    width = max([len(x) for x in out_s] + [1])
    scores = np.full((len(out_s), width), NEG, np.float32)
    index = np.full((len(out_s), width), -1, np.int64)
    for qi, (s, ix) in enumerate(zip(out_s, out_i, strict=True)):
        scores[qi, : len(s)] = s
        index[qi, : len(ix)] = ix
    return TopK(scores, index)


def all_modes(base: dict[tuple[int, str], TopK], depth: int = 1000) -> dict[tuple[int, str], TopK]:
    """The base runs plus every fusion whose two inputs are present."""
    out = dict(base)
    for kq in sorted({kq for kq, _ in base}):
        for fused, (m1, m2) in FUSIONS.items():
            if (kq, m1) in base and (kq, m2) in base:
                out[(kq, fused)] = fuse_minmax(base[(kq, m1)], base[(kq, m2)], depth)
    return out


# ------------------------------------------------------------------------------------ runs
def run_table(top: TopK, query_ids: list[str], doc_ids: list[str], query_rows: list[int] | None = None) -> pa.Table:
    """A run (RUN_SCHEMA): per query, rank by score descending then doc_id; pads dropped.

    ``query_rows`` selects (and orders) the queries of ``top`` to include (e.g. one split's).
    """
    doc_arr = np.asarray(doc_ids, dtype=object)
    lex = np.empty(len(doc_ids), np.int64)
    lex[np.argsort(doc_arr.astype(str), kind="stable")] = np.arange(len(doc_ids))
    rows = range(len(query_ids)) if query_rows is None else query_rows
    qcol, dcol, rcol, scol = [], [], [], []
    for qi in rows:
        s, ix = top.scores[qi], top.index[qi]
        keep = ix >= 0
        s, ix = s[keep], ix[keep]
        order = np.lexsort((lex[ix], -s.astype(np.float64)))
        s, ix = s[order], ix[order]
        qcol.extend([query_ids[qi]] * len(ix))
        dcol.extend(doc_arr[ix].tolist())
        rcol.extend(range(1, len(ix) + 1))
        scol.extend(s.tolist())
    return pa.table(
        {
            "query_id": pa.array(qcol, pa.string()),
            "doc_id": pa.array(dcol, pa.string()),
            "rank": pa.array(rcol, pa.int32()),
            "score": pa.array(scol, pa.float32()),
        },
        schema=RUN_SCHEMA,
    )


def check_modes(modes: Iterable[str]) -> list[str]:
    modes = list(modes)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad or modes}; expected some of {list(MODES)}")
    return modes
