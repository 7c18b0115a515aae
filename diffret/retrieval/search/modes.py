"""The scoring modes of the paper (section 3.3), as one table: each mode's name, scorer and needs.

How each mode computes its scores follows ``rules.ScoreRules`` (by default the reference evaluator's):

- ``single_dense``: inner product of the means of each text's L2-normalised vectors.
- ``multi_dense``: MaxSim on L2-normalised vectors, sum over the query's vectors (its ``n_reps``) of the best
  passage-vector score clamped at 0.
- ``sparse_max``: inner product of the max-pooled sparse vectors (the encoder already applied log(1 + ReLU),
  max pooling over K and the content filter), over the x100 integers the reference stores; documents
  sharing no term score 0 and fill the run to its depth.
- ``fusion_single_sparse_max`` / ``fusion_multi_sparse_max``: per query, min-max normalise each run's top
  ``depth`` (1000) as ``(s - min) / max(max - min, 1e-9)``, 0.5 / 0.5 over the union; a document missing from
  one run gets 0 there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import scoring
from .encodings import Encodings
from .rules import ScoreRules, round_bf16_
from .scoring import MAXSIM_QUERIES, NEG, SparsePassages, SparseQueries, TopK, Workspace, maxsim


@dataclass
class ScoreContext:
    """What scorers share within one pass: reused buffers, the queries' sparse vocabulary, MaxSim's tiles."""

    workspace: Workspace
    vocab: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    tile_elems: int | None = None  # CPU MaxSim tile buffer entries (None: scoring.CPU_TILE_ELEMS)
    rules: ScoreRules = field(default_factory=ScoreRules)


# A scorer gets query rows ``start:end`` and a passage block (with what was prepared once per query set and
# once per passage block) and returns their [end - start, N] scores, which the caller may modify.
def _single(q: Encodings, start: int, end: int, p: Encodings, _qp: Any, _pp: Any, ctx: ScoreContext) -> torch.Tensor:
    out = ctx.workspace.get("score", end - start, len(p), p.single)
    torch.mm(q.single[start:end], p.single.T, out=out)
    return round_bf16_(out) if ctx.rules.bf16 else out


def _multi(q: Encodings, start: int, end: int, p: Encodings, _qp: Any, _pp: Any, ctx: ScoreContext) -> torch.Tensor:
    out = ctx.workspace.get("score", end - start, len(p), p.multi)
    kq = q.multi.shape[1]
    if q.multi.device.type == "cpu":  # cache-sized tiles: a few hundred queries per GEMM
        tile = ctx.tile_elems or scoring.CPU_TILE_ELEMS
        step = max(1, min(MAXSIM_QUERIES, tile // max(1, kq)))
    else:
        step = end - start
    for s in range(start, end, step):
        e = min(s + step, end)
        maxsim(
            q.multi[s:e],
            q.mask[s:e],
            p.multi,
            p.mask,
            workspace=ctx.workspace,
            out=out[s - start : e - start],
            tile_elems=ctx.tile_elems,
            clamp=ctx.rules.maxsim_clamp,
            reduce=ctx.rules.maxsim_reduce,
            bf16=ctx.rules.bf16,
        )
    return out


def _prepare_sparse(q: Encodings, ctx: ScoreContext, device: torch.device) -> SparseQueries:
    return SparseQueries(q.sparse(), ctx.vocab, device)


def _prepare_sparse_passages(p: Encodings, ctx: ScoreContext, device: torch.device) -> SparsePassages:
    return SparsePassages(p.sparse(), ctx.vocab, device)


def _sparse(
    _q: Encodings, start: int, end: int, p: Encodings, qp: SparseQueries, pp: SparsePassages, ctx: ScoreContext
) -> torch.Tensor:
    sc = qp.scores(pp, start, end, out=ctx.workspace.get("score", end - start, len(p), pp.dense))
    if ctx.rules.bf16:
        round_bf16_(sc)
    if ctx.rules.sparse_floor == "positive":
        sc.masked_fill_(sc <= 0, NEG)  # no shared term: not retrieved
    return sc


Scorer = Callable[[Encodings, int, int, Encodings, Any, Any, ScoreContext], torch.Tensor]


@dataclass(frozen=True)
class Mode:
    """A scoring mode: a base mode scores query and passage blocks; a fusion combines two base runs."""

    name: str
    needs_sparse: bool
    score: Scorer | None = None
    prepare: Callable[[Encodings, ScoreContext, torch.device], Any] | None = None  # once per query set
    prepare_passages: Callable[[Encodings, ScoreContext, torch.device], Any] | None = None  # once per block
    fuses: tuple[str, str] | None = None

    @property
    def is_fusion(self) -> bool:
        return self.fuses is not None


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("single_dense", needs_sparse=False, score=_single),
        Mode("multi_dense", needs_sparse=False, score=_multi),
        Mode(
            "sparse_max",
            needs_sparse=True,
            score=_sparse,
            prepare=_prepare_sparse,
            prepare_passages=_prepare_sparse_passages,
        ),
        Mode("fusion_single_sparse_max", needs_sparse=True, fuses=("single_dense", "sparse_max")),
        Mode("fusion_multi_sparse_max", needs_sparse=True, fuses=("multi_dense", "sparse_max")),
    )
}
MODE_NAMES: tuple[str, ...] = tuple(MODES)
BASE_MODES: tuple[str, ...] = tuple(n for n, m in MODES.items() if not m.is_fusion)
FUSIONS: dict[str, tuple[str, str]] = {n: m.fuses for n, m in MODES.items() if m.fuses is not None}


def check_modes(modes: Iterable[str]) -> list[str]:
    """The modes as a list, or ValueError naming the unknown ones.

    >>> check_modes(["multi_dense", "sparse_max"])
    ['multi_dense', 'sparse_max']
    """
    modes = list(modes)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {bad or modes}; expected some of {list(MODES)}")
    return modes


def modes_for(modes: Iterable[str], has_sparse: bool) -> list[str]:
    """The modes a representation supports (no sparse vector: the dense modes only), in table order.

    >>> modes_for(MODE_NAMES, has_sparse=False)
    ['single_dense', 'multi_dense']
    """
    wanted = set(modes)
    return [n for n, m in MODES.items() if n in wanted and (has_sparse or not m.needs_sparse)]


def cell_modes(modes: Iterable[str], kq: int, kp: int, q1p1_multi: str = "skip") -> list[str]:
    """The modes a (K_q, K_p) cell is scored in. At K_q = K_p = 1 the reference evaluator skips multi_dense and its
    fusion (one slot a side: MaxSim is single_dense clamped at 0; evaluate_sweep.py L687-694), and so does diffret by
    default; ``q1p1_multi="keep"`` scores them.

    >>> cell_modes(MODE_NAMES, 1, 1)
    ['single_dense', 'sparse_max', 'fusion_single_sparse_max']
    >>> cell_modes(MODE_NAMES, 1, 1, "keep") == cell_modes(MODE_NAMES, 1, 4) == list(MODE_NAMES)
    True
    """
    if kq == kp == 1 and q1p1_multi == "skip":
        return [m for m in modes if "multi_dense" not in (MODES[m].fuses or (m,))]
    return list(modes)


def base_modes_needed(modes: Iterable[str]) -> list[str]:
    """The base modes to score so that every requested mode (fusions included) can be built, in table order."""
    need: set[str] = set()
    for name in modes:
        need.update(MODES[name].fuses or (name,))
    return [n for n in BASE_MODES if n in need]


# ----------------------------------------------------------------------------------- fusion
def fuse_minmax(
    a: TopK, b: TopK, depth: int = 1000, weights: tuple[float, float] = (0.5, 0.5), flat: str = "zero"
) -> TopK:
    """Per query: min-max normalise each run's top ``depth``, weighted sum over the union (missing = 0).

    Each run's scores become ``(s - min) / max(max - min, 1e-9)`` (the reference's ``normalized_fusion``), so
    a run whose scores for a query are all equal gives 0 (``flat="one"``: 1). Ties rank by
    document index (the earlier passage first).

    Parameters
    ----------
    a, b : two runs over the same queries (``TopK.index`` -1 marks padding).
    depth : documents of each run that are normalised, and documents kept.
    weights : the weight of each run.
    flat : what a run whose scores are all equal normalises to: ``zero`` or ``one``.

    Examples
    --------
    >>> a = TopK(np.array([[3.0, 1.0]], np.float32), np.array([[7, 8]]))   # doc 7 best in a
    >>> b = TopK(np.array([[5.0, 4.0]], np.float32), np.array([[8, 9]]))   # doc 8 best in b
    >>> f = fuse_minmax(a, b)
    >>> f.index.tolist(), f.scores.tolist()   # 8: 0.5*0 + 0.5*1; 7: 0.5*1; 9: 0
    ([[7, 8, 9]], [[0.5, 0.5, 0.0]])
    """
    return fuse_runs([a, b], depth, weights, flat)


def fuse_runs(
    runs: Sequence[TopK], depth: int = 1000, weights: Sequence[float] | None = None, flat: str = "zero"
) -> TopK:
    """:func:`fuse_minmax` of any number of runs over the same queries (``weights``: default equal, summing to 1).

    >>> a = TopK(np.array([[3.0, 1.0]], np.float32), np.array([[7, 8]]))
    >>> fuse_runs([a, a, a]).scores.round(4).tolist()
    [[1.0, 0.0]]
    """
    weights = list(weights) if weights is not None else [1.0 / len(runs)] * len(runs)
    if len(weights) != len(runs):
        raise ValueError(f"{len(weights)} fusion weights for {len(runs)} runs")
    if len({r.scores.shape[0] for r in runs}) > 1:
        raise ValueError(f"fusion of runs over different query sets ({[r.scores.shape[0] for r in runs]})")
    if flat not in ("zero", "one"):
        raise ValueError(f"fusion flat must be zero or one, not {flat!r}")
    n = runs[0].scores.shape[0]
    # vectorised over queries; each value is summed in the order a loop over the queries sums it:
    # 0.0 + w_1 * norm_1 (+ w_2 * norm_2 ..., in run order, for the runs that hold the document): identical runs
    parts_d, parts_v = [], []
    for run, w in zip(runs, weights, strict=True):
        s, ix = run.scores[:, :depth].astype(np.float64), run.index[:, :depth]
        valid = ix >= 0
        lo = np.min(np.where(valid, s, np.inf), axis=1, keepdims=True)
        hi = np.max(np.where(valid, s, -np.inf), axis=1, keepdims=True)
        with np.errstate(invalid="ignore"):
            norm = (s - lo) / np.maximum(hi - lo, 1e-9)
        if flat == "one":
            norm = np.where(hi <= lo, 1.0, norm)
        parts_d.append(np.where(valid, ix, _NO_DOC))
        parts_v.append(np.where(valid, w * norm, 0.0))
    docs, vals = np.concatenate(parts_d, axis=1), np.concatenate(parts_v, axis=1)
    order = np.argsort(docs, axis=1, kind="stable")  # a document's entries together, in run order
    docs, vals = np.take_along_axis(docs, order, 1), np.take_along_axis(vals, order, 1)
    cols = np.arange(docs.shape[1])[None, :]
    new = np.ones(docs.shape, bool)
    new[:, 1:] = (docs[:, 1:] != docs[:, :-1]) | (docs[:, 1:] == _NO_DOC)
    start = np.maximum.accumulate(np.where(new, cols, 0), axis=1)  # each entry's first entry of its document
    member = cols - start  # 0 for the first run holding the document, 1 for the next, ...
    fused = 0.0 + vals
    rows = np.broadcast_to(np.arange(n)[:, None], docs.shape)
    for t in range(1, len(runs)):  # add the later runs' values one run at a time, as the loop did
        at = member == t
        fused[rows[at], start[at]] = fused[rows[at], start[at]] + vals[at]
    keep = new & (docs != _NO_DOC)
    key = np.where(keep, -fused, np.inf)
    rank = np.argsort(key, axis=1, kind="stable")  # by fused score descending, then document (already ascending)
    docs, fused, keep = (np.take_along_axis(x, rank, 1) for x in (docs, fused, keep))
    counts = np.minimum(keep.sum(axis=1), depth)
    width = max(int(counts.max()) if n else 0, 1)
    inside = np.arange(width)[None, :] < counts[:, None]
    scores = np.where(inside, fused[:, :width], NEG).astype(np.float32)
    index = np.where(inside, docs[:, :width], -1).astype(np.int64)
    return TopK(scores, index)


_NO_DOC = np.iinfo(np.int64).max  # padding, sorted after every document


def all_modes(
    base: dict[tuple[int, str], TopK], depth: int = 1000, rules: ScoreRules | None = None
) -> dict[tuple[int, str], TopK]:
    """The base runs plus every fusion whose two inputs are present (keys: (K_q, mode))."""
    flat = (rules or ScoreRules()).fusion_flat
    out = dict(base)
    for kq in sorted({kq for kq, _ in base}):
        for fused, (m1, m2) in FUSIONS.items():
            if (kq, m1) in base and (kq, m2) in base:
                out[(kq, fused)] = fuse_minmax(base[(kq, m1)], base[(kq, m2)], depth, flat=flat)
    return out
