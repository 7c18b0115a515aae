"""Scoring primitives: MaxSim (the one implementation, used by exact search and the LanceDB re-rank),
sparse inner products over the queries' vocabulary, a running top-k, and the block plan that bounds the
memory of all three by one byte budget."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .encodings import SparseFlat
from .rules import round_bf16_

NEG = float("-inf")


# ---------------------------------------------------------------------------------- top-k
@dataclass
class TopK:
    """Per query, the best ``k`` documents: scores (-inf pads) and global document indices (-1 pads)."""

    scores: np.ndarray  # [Q, k] float32, descending
    index: np.ndarray  # [Q, k] int64


_LOW = 0xFFFFFFFF  # the low 32 bits of a key hold (_LOW - document index): a lower index ranks first
_MAX_DOCS = _LOW  # document indices 0 .. _LOW - 1


def _sortable(bits: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns (as int64, sign-extended) -> int64 whose order is the floats' order (an involution)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def score_keys(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One int64 per (score, document index), ordered by score descending then index ascending: the total
    order of the running top-k, so that which tied document makes the cut never depends on block shapes.

    ``scores`` is float32 (-0.0 counts as 0.0); ``index`` broadcasts against it (0 <= index < 2**32 - 1).

    >>> k = score_keys(torch.tensor([0.5, 0.5, -1.0]), torch.tensor([7, 3, 1]))
    >>> torch.argsort(k, descending=True).tolist()   # 0.5 of doc 3, 0.5 of doc 7, then -1.0
    [1, 0, 2]
    >>> s, i = key_parts(k)
    >>> s.tolist(), i.tolist()
    ([0.5, 0.5, -1.0], [7, 3, 1])
    """
    keys = (scores.float() + 0.0).view(torch.int32).to(torch.int64)  # -0.0 -> 0.0
    t = keys >> 31  # in place from here on: 4 + 16 bytes per entry at most
    t &= 0x7FFFFFFF
    keys ^= t
    del t
    keys <<= 32
    keys |= _LOW - index
    return keys


def key_parts(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 scores, int64 document indices) of :func:`score_keys`."""
    bits = _sortable(keys >> 32).to(torch.int32).view(torch.float32)
    return bits, _LOW - (keys & _LOW)


RESULT_BYTES = 16 << 20  # RunningTopK.result's temporaries
PAD_KEY = int(score_keys(torch.tensor([NEG]), torch.tensor([_LOW]))[0])  # below every real (score, index)


class RunningTopK:
    """The best ``k`` columns per row over score blocks seen one after another, exactly.

    Rows are ranked by score, ties by document index (lower first), whatever the blocks' shapes: a row's
    state is ``k`` int64 keys (:func:`score_keys`). A later document never wins a tie, so a block only
    needs its entries above the row's current k-th score: a row maximum, then a top-m of the block with m
    just above the number of such entries (about k n / S after S documents), merged by key. The first blocks
    take their top k + 1 by score; where the k-th and (k + 1)-th tie, that row is ranked by key.
    Blocks must come in increasing ``offset`` order (several row ranges of one block share its offset).

    >>> t = RunningTopK(1, 2, torch.device("cpu"))
    >>> t.update(torch.tensor([[0.1, 0.9]]), offset=0)
    >>> t.update(torch.tensor([[0.5, 0.9]]), offset=2)   # 0.9 of doc 3 ties 0.9 of doc 1: doc 1 first
    >>> t.result().index.tolist()
    [[1, 3]]
    """

    def __init__(self, n_queries: int, k: int, device: torch.device):
        if k < 1:
            raise ValueError(f"top-k needs k >= 1, got {k}")
        self.k = k
        self.keys = torch.full((n_queries, k), PAD_KEY, dtype=torch.int64, device=device)
        self.threshold = torch.full((n_queries,), NEG, device=device)  # each row's k-th score (-inf: not full)
        self.columns = 0  # documents seen (the result's width is min(k, columns))
        self._offset = 0

    def update(self, scores: torch.Tensor, offset: int, row: int = 0) -> None:
        """Merge ``scores`` [r, n] of documents ``offset .. offset + n - 1`` into rows ``row .. row + r - 1``.

        ``scores`` may be modified in place.
        """
        r, n = scores.shape
        if offset < self._offset:
            raise ValueError(f"blocks must come in increasing offset order ({offset} after {self._offset})")
        if offset + n > _MAX_DOCS:
            raise ValueError(f"at most {_MAX_DOCS:,} documents per pass")
        self._offset = offset
        self.columns = max(self.columns, offset + n)
        if r == 0 or n == 0:
            return
        thr = self.threshold[row : row + r]
        live = scores.amax(1) > thr  # a row with nothing above its k-th score is done with this block
        if not bool(live.any()):
            return
        rows = None if bool(live.all()) else live.nonzero().squeeze(1)
        if rows is not None:
            scores, thr = scores[rows], thr[rows]
        cand = self._candidates(scores, thr, offset)
        state = self.keys[row : row + r] if rows is None else self.keys[rows + row]
        merged = torch.topk(torch.cat([state, cand], 1), self.k, dim=1, sorted=False).values
        new_thr = key_parts(merged.amin(1))[0]
        if rows is None:
            self.keys[row : row + r] = merged
            self.threshold[row : row + r] = new_thr
        else:
            self.keys[rows + row] = merged
            self.threshold[rows + row] = new_thr

    def _candidates(self, scores: torch.Tensor, thr: torch.Tensor, offset: int) -> torch.Tensor:
        """Keys holding, per row, every entry above ``thr`` (or, where there are more than k, the top k)."""
        n = scores.shape[1]
        # after S documents a row's k-th score is about its (k / S) quantile: a new block of n has ~k n / S above
        m = min(self.k, max(16, -(-3 * self.k * n // max(1, 2 * offset))))
        while True:
            take = min(n, m + 1)
            vals, pos = torch.topk(scores, take, dim=1, sorted=False)
            if take == n:  # the whole block
                return score_keys(vals, pos + offset)
            low = vals.amin(1)  # each row's (m + 1)-th score: below it, every entry above thr is in vals
            over = low > thr
            if not bool(over.any()):
                return score_keys(vals, pos + offset)
            if m >= self.k:
                break
            m = min(self.k, m * 8)
        # rows with more than k entries above thr: the top k + 1 by score, exact unless the k-th ties the
        # (k + 1)-th, where a lower-index tied entry may have been left out: rank those rows by key
        cand = score_keys(vals, pos + offset)
        tied = over & ((vals == low[:, None]).sum(1) > 1)
        if bool(tied.any()):
            t = tied.nonzero().squeeze(1)
            exact = _block_keys(scores[t], offset, self.k)
            cand[t] = torch.cat([exact, torch.full_like(cand[t, : cand.shape[1] - exact.shape[1]], PAD_KEY)], 1)
        return cand

    def result(self) -> TopK:
        """The top k per row, ranked (decoded a few rows at a time: the temporaries stay ~16 MB)."""
        width = min(self.k, self.columns)
        n = self.keys.shape[0]
        scores = np.full((n, width), NEG, np.float32)
        index = np.full((n, width), -1, np.int64)
        step = max(1, RESULT_BYTES // (64 * self.k))
        for a in range(0, n, step):
            keys = torch.sort(self.keys[a : a + step], dim=1, descending=True).values[:, :width]
            s, ix = (x.cpu().numpy() for x in key_parts(keys))
            ok = np.isfinite(s)
            scores[a : a + step][ok] = s[ok]
            index[a : a + step][ok] = ix[ok]
        return TopK(scores, index)


def merge_topk(parts: Sequence[TopK], k: int, columns: int | None = None) -> TopK:
    """The top ``k`` per row over the documents of several :class:`TopK` of the same rows (each over other documents,
    indices global), ranked exactly as :class:`RunningTopK` ranks one pass over all of them: by score, ties by the
    lower document index. So the top k of the top k's of contiguous passage blocks is the top k of the whole stream.

    ``columns``: the documents the parts cover together (the result is ``min(k, columns)`` wide, as one pass's
    result; default: as wide as the parts allow). Pads (index -1) are left out; rows are merged a few at a time.

    >>> a = TopK(np.array([[0.9, 0.5]], np.float32), np.array([[1, 0]]))      # documents 0, 1
    >>> b = TopK(np.array([[0.9, -np.inf]], np.float32), np.array([[2, -1]]))  # documents 2, 3 (3 is a pad)
    >>> m = merge_topk([b, a], k=3, columns=4)
    >>> m.index.tolist(), m.scores.tolist()   # 0.9 of document 1 before 0.9 of document 2
    ([[1, 2, 0]], [[0.8999999761581421, 0.8999999761581421, 0.5]])
    """
    if not parts:
        raise ValueError("no top-k to merge")
    n = parts[0].scores.shape[0]
    if any(p.scores.shape[0] != n for p in parts):
        raise ValueError(f"top-k of different row counts: {[p.scores.shape[0] for p in parts]}")
    total = sum(p.scores.shape[1] for p in parts)
    width = min(k, total if columns is None else columns)
    scores = np.full((n, width), NEG, np.float32)
    index = np.full((n, width), -1, np.int64)
    if width == 0 or total == 0:
        return TopK(scores, index)
    step = max(1, RESULT_BYTES // (32 * total))
    for a in range(0, n, step):
        s = torch.from_numpy(np.concatenate([p.scores[a : a + step] for p in parts], 1))
        ix = torch.from_numpy(np.concatenate([p.index[a : a + step] for p in parts], 1))
        keys = score_keys(s, ix.clamp_min(0))
        keys[(ix < 0) | ~torch.isfinite(s)] = PAD_KEY
        keys = torch.topk(keys, min(width, keys.shape[1]), dim=1).values  # sorted, descending
        got_s, got_i = (x.numpy() for x in key_parts(keys))
        ok = np.isfinite(got_s)
        block_s, block_i = scores[a : a + step, : keys.shape[1]], index[a : a + step, : keys.shape[1]]
        block_s[ok], block_i[ok] = got_s[ok], got_i[ok]
    return TopK(scores, index)


def _block_keys(scores: torch.Tensor, offset: int, k: int) -> torch.Tensor:
    """The top ``k`` keys of each row of a score block (4 + 16 bytes per entry)."""
    keys = score_keys(scores, torch.arange(offset, offset + scores.shape[1], device=scores.device))
    return torch.topk(keys, min(k, scores.shape[1]), dim=1, sorted=False).values


# ---------------------------------------------------------------------------------- MaxSim
class Workspace:
    """Reused score buffers: a fresh [Q*K_q, N] matrix per block costs page faults (~2x the GEMM on CPU)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < rows * cols or buf.device != like.device or buf.dtype != like.dtype:
            self._bufs.pop(name, None)  # free the old one before allocating the new one
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
    *,
    workspace: Workspace | None = None,
    out: torch.Tensor | None = None,
    tile_elems: int | None = None,
    clamp: bool = True,
    reduce: str = "sum",
    bf16: bool = False,
) -> torch.Tensor:
    """[Q, N] MaxSim scores (paper eq. 3) as the reference evaluator computes them: over the real query vectors,
    the sum of each one's best score against the real passage vectors, clamped at 0.

    Vectors are expected L2-normalised, so each inner product is a cosine. One GEMM per passage slot j
    (``[Q*K_q, H] x [H, N]``) is folded into a running element-wise max, so the [Q*K_q, N*K_p] similarity
    matrix is never materialised (K_p times less memory, no separate amax pass). A passage's padding
    slots (``p_mask`` False) are -inf before the max; a query's padding slots are left out of the sum.
    ``clamp=False, reduce="mean"`` gives (1/K_q) sum_i max_j, unclamped; ``bf16`` rounds each slot's best score
    to bfloat16 (the released evaluator's bfloat16 matmul and max; see ``rules.ScoreRules``).

    Parameters
    ----------
    q_multi, q_mask : [Q, K_q, H] query vectors and [Q, K_q] bool mask of the real ones.
    p_multi, p_mask : [N, K_p, H] passage vectors and [N, K_p] bool mask of the real ones.
    workspace : reused buffers across calls (optional).
    out : a [Q, N] tensor to write the scores into (optional).
    tile_elems : on CPU, entries of each of the two tile buffers (default ``CPU_TILE_ELEMS``).

    Examples
    --------
    >>> q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])            # one query, K_q = 2
    >>> p = torch.tensor([[[1.0, 0.0], [0.6, 0.8]],             # passage 0: both slots real
    ...                   [[0.0, 1.0], [9.0, 9.0]]])            # passage 1: second slot is padding
    >>> pm = torch.tensor([[True, True], [True, False]])
    >>> maxsim(q, torch.ones(1, 2, dtype=torch.bool), p, pm).tolist()   # 1 + 0.8, 0 + 1
    [[1.7999999523162842, 1.0]]
    >>> maxsim(q, torch.ones(1, 2, dtype=torch.bool), p, pm, reduce="mean").tolist()
    [[0.8999999761581421, 0.5]]
    """
    if reduce not in ("sum", "mean"):
        raise ValueError(f"MaxSim reduce must be sum or mean, not {reduce!r}")
    opts = (clamp, reduce, bf16)
    nq, kq, _ = q_multi.shape
    n = p_multi.shape[0]
    ws = workspace or Workspace()
    elems = CPU_TILE_ELEMS if tile_elems is None else tile_elems
    tile = n if q_multi.device.type != "cpu" else max(1, elems // max(1, nq * kq))
    if tile >= n and out is None:
        return _maxsim_tile(q_multi, q_mask, p_multi, p_mask, ws, *opts)
    if out is None:
        out = torch.empty(nq, n, dtype=q_multi.dtype, device=q_multi.device)
    for s in range(0, n, tile):
        out[:, s : s + tile] = _maxsim_tile(q_multi, q_mask, p_multi[s : s + tile], p_mask[s : s + tile], ws, *opts)
    return out


def _maxsim_tile(
    q_multi: torch.Tensor,
    q_mask: torch.Tensor,
    p_multi: torch.Tensor,
    p_mask: torch.Tensor,
    ws: Workspace,
    clamp: bool,
    reduce: str,
    bf16: bool,
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
    if bf16:
        round_bf16_(best)
    if clamp:
        best.clamp_(min=0.0)
    b = best.view(nq, kq, n)
    full = bool(q_mask.all())
    if not full:
        b.masked_fill_(~q_mask[:, :, None], 0.0)
    if reduce == "sum":
        return b.sum(1)
    if full:
        return b.mean(1)
    return b.sum(1) / q_mask.sum(1, keepdim=True).clamp_min(1).to(b.dtype)


# ---------------------------------------------------------------------------------- sparse
def query_vocab(*sparse: SparseFlat) -> np.ndarray:
    """The sorted vocabulary ids the query sets use: the only terms a passage can score on.

    >>> query_vocab(SparseFlat.from_lists([np.array([9, 5])], [np.ones(2, np.float32)])).tolist()
    [5, 9]
    """
    return np.unique(np.concatenate([s.ids for s in sparse] + [np.zeros(0, np.int64)]))


class SparseQueries:
    """Query sparse vectors as CSR rows over a vocabulary (the pass's :func:`query_vocab`), built once.

    A block of rows scores against :class:`SparsePassages` in one sparse x dense product: the query side
    is the short one (content words of a query), so the work is ``nnz(queries) x passages``.

    >>> q = SparseFlat.from_lists([np.array([5, 9])], [np.array([1.0, 2.0], np.float32)])
    >>> p = SparseFlat.from_lists([np.array([9, 7]), np.array([3])], [np.array([0.5, 3.0], np.float32),
    ...                                                               np.array([1.0], np.float32)])
    >>> vocab = query_vocab(q)
    >>> dev = torch.device("cpu")
    >>> SparseQueries(q, vocab, dev).scores(SparsePassages(p, vocab, dev)).tolist()   # doc 0 shares term 9
    [[1.0, 0.0]]
    """

    def __init__(self, sparse: SparseFlat, vocab: np.ndarray, device: torch.device):
        n = len(sparse)
        cols = np.searchsorted(vocab, sparse.ids)
        if len(cols) and (cols.max() >= len(vocab) or not np.array_equal(vocab[cols], sparse.ids)):
            raise ValueError("sparse queries: a query term is missing from the vocabulary")
        rows = np.repeat(np.arange(n), np.diff(sparse.offsets))
        order = np.lexsort((cols, rows))  # CSR: sorted columns within a row (ascending vocabulary order)
        self.n_vocab = len(vocab)
        self.crow = torch.from_numpy(sparse.offsets.astype(np.int64)).to(device)
        self.col = torch.from_numpy(cols[order].astype(np.int64)).to(device)
        self.val = torch.from_numpy(sparse.weights[order].astype(np.float32)).to(device)
        self.crow_host = sparse.offsets.astype(np.int64)

    def __len__(self) -> int:
        return len(self.crow_host) - 1

    def scores(
        self, passages: SparsePassages, start: int = 0, end: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[end - start, N] inner products of query rows ``start:end`` with the passages (0: no shared term)."""
        end = len(self) if end is None else end
        n = passages.dense.shape[1]
        if out is None:
            out = torch.empty(end - start, n, device=passages.dense.device)
        a, b = int(self.crow_host[start]), int(self.crow_host[end])
        if a == b or self.n_vocab == 0:
            return out.zero_()
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            csr = torch.sparse_csr_tensor(
                self.crow[start : end + 1] - a,
                self.col[a:b],
                self.val[a:b],
                size=(end - start, self.n_vocab),
                check_invariants=False,  # built sorted and in range above
            )
            try:
                torch.mm(csr, passages.dense, out=out)
            except RuntimeError:  # a backend without out= for sparse x dense: one [r, N] temporary
                out.copy_(csr @ passages.dense)
        return out


class SparsePassages:
    """A block of passage sparse vectors as a dense [V, N] matrix over the query vocabulary (terms no query
    uses are dropped: they score nothing), built once per block in one scatter and shared by every query set."""

    def __init__(self, sparse: SparseFlat, vocab: np.ndarray, device: torch.device):
        n = len(sparse)
        self.dense = torch.zeros(len(vocab), n, device=device)
        if not len(vocab) or not len(sparse.ids):
            return
        pos = np.searchsorted(vocab, sparse.ids)
        pos_c = np.minimum(pos, len(vocab) - 1)
        keep = vocab[pos_c] == sparse.ids
        docs = np.repeat(np.arange(n), np.diff(sparse.offsets))
        r = torch.from_numpy(pos_c[keep].astype(np.int64)).to(device)
        c = torch.from_numpy(docs[keep].astype(np.int64)).to(device)
        self.dense[r, c] = torch.from_numpy(sparse.weights[keep].astype(np.float32)).to(device)

    @staticmethod
    def bytes_per_passage(vocab_size: int) -> int:
        return 4 * vocab_size


# ---------------------------------------------------------------------------------- block plan
SCORE_BYTES = 32  # per (query, passage) of a score block: the scores, a copy of some rows, masks, a key pass
MERGE_BYTES = 96  # per (query, top-k slot): the running top-k's merge (candidates, their keys, state, top-k)
MAXSIM_QUERIES = 512  # queries per MaxSim GEMM on CPU (so that its tiles stay cache-sized)


@dataclass(frozen=True)
class BlockPlan:
    """How one passage block is cut: ``passages`` per sub-block, ``queries`` rows per score block, and
    MaxSim's CPU ``tile_elems``; ``bytes`` is the most the blocks hold at once (at most the budget)."""

    passages: int
    queries: int
    tile_elems: int
    bytes: int


def plan_blocks(
    block_bytes: int,
    n_passages: int,
    n_queries: int,
    kq_max: int,
    topk: int,
    modes: set[str],
    vocab_size: int,
    device: torch.device,
) -> BlockPlan:
    """The largest sub-blocks whose scoring memory fits ``block_bytes``, or ValueError when one query row
    against one passage does not fit.

    Within the budget: on CPU MaxSim's two tile buffers (at most a quarter of it); half of the rest for the
    passage side (sparse: a [V, N] matrix over the query vocabulary); the rest for the score blocks, each
    query row costing ``SCORE_BYTES`` per passage (plus, on a GPU, MaxSim's two [K_q, N] buffers and its
    mean) and ``MERGE_BYTES`` per top-k slot.

    >>> p = plan_blocks(64 << 20, 10_000, 7_000, 16, 1000, {"single_dense"}, 0, torch.device("cpu"))
    >>> p.passages, p.queries, p.bytes <= 64 << 20
    (10000, 161, True)
    """
    cpu = device.type == "cpu"
    multi = "multi_dense" in modes
    tiles = 8 * min(CPU_TILE_ELEMS, block_bytes // 32) if (multi and cpu) else 0
    rest = block_bytes - tiles
    per_pair = SCORE_BYTES + (8 * kq_max + 4 if (multi and not cpu) else 0)
    per_passage = SparsePassages.bytes_per_passage(vocab_size) if "sparse_max" in modes else 0
    row_fixed = MERGE_BYTES * topk
    cap = (rest // 2 - row_fixed) // per_pair
    if per_passage:
        cap = min(cap, (rest // 2) // per_passage)
    if multi and cpu and tiles // 8 < kq_max:
        cap = 0  # not even one query's K_q rows fit a tile
    if cap < 1 or n_queries < 1:
        need = 2 * (row_fixed + per_pair + per_passage) + (8 * kq_max if multi and cpu else 0)
        raise ValueError(
            f"score block budget of {block_bytes:,} bytes is too small: one query against one passage "
            f"needs about {need:,} bytes here (top-k {topk}, K_q {kq_max}, query vocabulary "
            f"{vocab_size:,}); raise --block-mb"
        )
    n = max(1, min(n_passages, cap))
    passage_side = per_passage * n
    rows = max(1, min(n_queries, (rest - passage_side) // (per_pair * n + row_fixed)))
    return BlockPlan(
        n, rows, tiles // 8 if tiles else CPU_TILE_ELEMS, tiles + passage_side + rows * (per_pair * n + row_fixed)
    )
