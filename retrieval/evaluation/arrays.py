"""Per-query measures from Arrow tables, vectorised over queries: trec_eval's definitions, without a Python dict per
run. Equal to :func:`retrieval.evaluation.evaluate` (pytrec_eval) query by query, to the last bit for the measures
it computes (the same operations in the same order; tests/unit/test_evaluation_arrays.py draws random runs
with ties and checks), and tens of times faster on large runs (benchmarks/evaluate.py).

The measures computed here (trec_eval's, ``k`` any positive integer): ``ndcg_cut_k`` and ``ndcg`` (gains are the
positive qrels grades, discounted by ``log2(rank + 1)`` as the trec_eval that pytrec_eval bundles does), ``P_k``,
``recall_k``, ``success_k``, ``recip_rank``, ``mrr_k`` (recip_rank of the run cut to its top k), ``map`` and
``num_ret`` / ``num_rel`` / ``num_rel_ret``. Any other measure, and qrels with negative grades, go to pytrec_eval.

How a query's documents are ordered (``ties``):

* ``"rank"`` (the evaluate stage's default): the stored rank order, whatever the scores;
* ``"trec"``: a measure of depth d (``ndcg_cut_10``: 10) reads the run's first d documents in rank order, in
  trec_eval's order (score descending, ties by doc_id descending), as the reference evaluator passes its top 10;
  a measure of the whole run reads every document in that order;
* ``"score"``: trec_eval's order over the whole run (what ``read_trec_run`` then ``evaluate`` gives).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.layout import METRICS_SCHEMA

Ties = Literal["rank", "trec", "score"]

_CUT = re.compile(r"^(ndcg_cut|P|recall|success|mrr)_([1-9][0-9]*)$")
_WHOLE = ("ndcg", "recip_rank", "map", "num_ret", "num_rel", "num_rel_ret")


def supported(measure: str) -> bool:
    """Whether :func:`evaluate_tables` computes ``measure`` itself (else pytrec_eval does).

    >>> supported("ndcg_cut_10"), supported("mrr_10"), supported("map"), supported("bpref")
    (True, True, True, False)
    """
    return measure in _WHOLE or _CUT.match(measure) is not None


def _depth(measure: str) -> int | None:
    m = _CUT.match(measure)
    return int(m.group(2)) if m else None


@lru_cache(maxsize=8)
def _discounts(n: int) -> np.ndarray:
    """The ndcg discount at positions 0..n-1, ``log2(i + 2)``: C's log2, as math's (numpy's may differ in a bit)."""
    return np.array([math.log2(i + 2) for i in range(n)], dtype=np.float64)


def _key(table: pa.Table) -> pa.Array:
    """query_id and doc_id joined by a separator neither holds (unit separator), as one string per row."""
    return pc.binary_join_element_wise(table.column("query_id"), table.column("doc_id"), "\x1f").combine_chunks()


def _order(run: pa.Table, by: Literal["rank", "score"]) -> pa.Table:
    if by == "rank":
        return run.sort_by([("query_id", "ascending"), ("rank", "ascending")])
    return run.sort_by([("query_id", "ascending"), ("score", "descending"), ("doc_id", "descending")])


class _Judged:
    """The qrels of the judged queries: ids (sorted), positive-grade ideal gains, relevant counts."""

    def __init__(self, qrels: pa.Table, relevance_level: int):
        qrels = qrels.select(["query_id", "doc_id", "relevance"])
        if len(qrels) and pc.count_distinct(_key(qrels)).as_py() != len(qrels):
            qrels = _dedupe_qrels(qrels)
        qrels = qrels.sort_by([("query_id", "ascending"), ("relevance", "descending")])
        self.table = qrels
        qids = qrels.column("query_id").combine_chunks()
        self.ids = pc.unique(qids)
        self.code = pc.index_in(qids, value_set=self.ids).to_numpy()
        grades = qrels.column("relevance").to_numpy().astype(np.int64)
        self.grades = grades
        n = len(self.ids)
        self.num_rel = np.bincount(self.code, weights=grades >= relevance_level, minlength=n).astype(np.int64)
        self.level = relevance_level
        self.keys = _key(qrels)
        # the ideal ranking's gains: each query's positive grades, descending
        pos = grades > 0
        starts = np.searchsorted(self.code[pos], np.arange(n))
        self.ideal_code = self.code[pos]
        self.ideal_pos = np.arange(int(pos.sum())) - starts[self.ideal_code] if pos.any() else np.zeros(0, np.int64)
        self.ideal_gain = grades[pos].astype(np.float64)


def _dedupe_qrels(qrels: pa.Table) -> pa.Table:
    """A repeated judgment is one judgment when its grades agree (as ``qrels_from_table`` takes it), else an error."""
    keys = _key(qrels).to_pylist()
    grades = qrels.column("relevance").to_pylist()
    seen: dict[str, int] = {}
    keep = []
    for i, (k, g) in enumerate(zip(keys, grades, strict=True)):
        if k in seen:
            if seen[k] != g:
                q, d = k.split("\x1f", 1)
                raise ValueError(f"qrels: document {d!r} of query {q!r} judged both {seen[k]} and {g}")
            continue
        seen[k] = g
        keep.append(i)
    return qrels.take(pa.array(keep, pa.int64()))


class _Rows:
    """A run in one evaluated order, as arrays: each row's judged-query code (-1: a query without judgments), its
    document's grade and whether it is judged, and (``ties="trec"``) its place in its query's rank order."""

    def __init__(self, ordered: pa.Table, judged: _Judged):
        code = pc.index_in(ordered.column("query_id"), value_set=judged.ids).to_numpy(zero_copy_only=False)
        self.code = np.where(np.isnan(code), -1, code).astype(np.int64) if code.dtype.kind == "f" else code
        at = pc.index_in(_key(ordered), value_set=judged.keys).to_numpy(zero_copy_only=False)
        self.judged = ~np.isnan(at) if at.dtype.kind == "f" else np.ones(len(at), bool)
        self.grade = np.zeros(len(at), np.int64)
        self.grade[self.judged] = judged.grades[at[self.judged].astype(np.int64)]
        self.rpos = ordered.column("_rpos").to_numpy() if "_rpos" in ordered.column_names else None


class _Ranking:
    """A run's judged queries as dense [queries, depth] matrices in one evaluated order (with ``depth``: each
    query's first ``depth`` documents in rank order, kept in the evaluated order)."""

    def __init__(self, rows: _Rows, judged: _Judged, depth: int | None):
        keep = rows.code >= 0
        if depth is not None:
            keep &= rows.rpos < depth
        code, grade, judged_row = rows.code[keep], rows.grade[keep], rows.judged[keep]
        n = len(judged.ids)
        starts = np.searchsorted(code, np.arange(n))
        pos = np.arange(len(code)) - starts[code] if len(code) else np.zeros(0, np.int64)
        self.num_ret = np.bincount(code, minlength=n)
        width = int(pos.max()) + 1 if len(pos) else 1
        self.gain = np.zeros((n, width))
        self.gain[code, pos] = np.where(grade > 0, grade, 0).astype(np.float64)
        self.rel = np.zeros((n, width), bool)
        self.rel[code, pos] = judged_row & (grade >= judged.level)
        self.width = width


def _sequential_sum(values: np.ndarray) -> np.ndarray:
    """Row sums added left to right (as trec_eval's loops add; numpy's own sum pairs terms up)."""
    out = np.zeros(values.shape[0])
    for j in range(values.shape[1]):
        out += values[:, j]
    return out


def _ndcg(r: _Ranking, judged: _Judged, k: int | None) -> np.ndarray:
    width = r.width if k is None else min(k, r.width)
    disc = _discounts(max(width, 1))
    dcg = _sequential_sum(np.where(r.gain[:, :width] > 0, r.gain[:, :width] / disc[:width], 0.0))
    n = len(judged.ids)
    ideal_w = int(judged.ideal_pos.max()) + 1 if len(judged.ideal_pos) else 1
    ideal_w = ideal_w if k is None else min(k, ideal_w)
    gains = np.zeros((n, ideal_w))
    keep = judged.ideal_pos < ideal_w
    gains[judged.ideal_code[keep], judged.ideal_pos[keep]] = judged.ideal_gain[keep]
    idcg = _sequential_sum(gains / _discounts(ideal_w)[:ideal_w])
    return np.divide(dcg, idcg, out=np.zeros(n), where=idcg > 0)


def _recip_rank(r: _Ranking, k: int | None) -> np.ndarray:
    rel = r.rel if k is None else r.rel[:, :k]
    first = np.argmax(rel, axis=1)
    return np.where(rel.any(axis=1), 1.0 / (first + 1.0), 0.0)


def _map(r: _Ranking, judged: _Judged) -> np.ndarray:
    so_far = np.cumsum(r.rel, axis=1)
    terms = np.where(r.rel, so_far / np.arange(1.0, r.width + 1.0), 0.0)
    total = _sequential_sum(terms)
    return np.divide(total, judged.num_rel, out=np.zeros(len(total)), where=judged.num_rel > 0)


def _measure(name: str, r: _Ranking, judged: _Judged) -> np.ndarray:
    k = _depth(name)
    family = name.rsplit("_", 1)[0] if k is not None else name
    n_rel = judged.num_rel
    if family == "ndcg_cut" or family == "ndcg":
        return _ndcg(r, judged, k)
    if family in ("mrr", "recip_rank"):
        return _recip_rank(r, k)
    if family == "map":
        return _map(r, judged)
    top = r.rel if k is None else r.rel[:, :k]
    hits = top.sum(axis=1).astype(np.float64)
    if family == "P":
        return hits / k
    if family == "recall":
        return np.divide(hits, n_rel, out=np.zeros(len(hits)), where=n_rel > 0)
    if family == "success":
        return (hits > 0).astype(np.float64)
    if family == "num_ret":
        return r.num_ret.astype(np.float64)
    if family == "num_rel":
        return n_rel.astype(np.float64)
    if family == "num_rel_ret":
        return hits
    raise ValueError(f"measure {name!r} is not computed here")  # pragma: no cover (supported() guards)


def evaluate_tables(
    qrels: pa.Table,
    run: pa.Table,
    measures: Sequence[str],
    relevance_level: int = 1,
    ties: Ties = "rank",
) -> pa.Table:
    """Per-query metrics (METRICS_SCHEMA) of a run table (query_id, doc_id, rank, score) against a qrels table
    (query_id, doc_id, relevance), one row per judged query and measure, queries sorted by id: what
    ``evaluate(qrels_from_table(qrels), run_from_table(run), ...)`` gives, without a dict per query.

    Judged queries without results score 0; run queries without judgments are ignored. Measures that
    :func:`supported` does not cover, and qrels with negative grades, are passed to pytrec_eval.

    Parameters
    ----------
    qrels : query_id, doc_id, relevance (other columns ignored; filter the split first).
    run : query_id, doc_id, rank, score (a RUN_SCHEMA table).
    measures : pytrec_eval names (``ndcg_cut_10``, ``recall_100``, ...) or ``mrr_<k>``.
    relevance_level : the lowest grade binary measures count as relevant.
    ties : how a query's documents are ordered (module docstring): ``rank``, ``trec`` or ``score``.

    Examples
    --------
    >>> qrels = pa.table({"query_id": ["q1", "q1", "q2"], "doc_id": ["d1", "d2", "d3"], "relevance": [1, 0, 1]})
    >>> run = pa.table({"query_id": ["q1", "q1"], "doc_id": ["d2", "d1"], "rank": [1, 2], "score": [2.0, 1.0]})
    >>> [(r["query_id"], r["measure"], round(r["value"], 4))
    ...  for r in evaluate_tables(qrels, run, ["ndcg_cut_10", "mrr_10"]).to_pylist()]
    [('q1', 'ndcg_cut_10', 0.6309), ('q1', 'mrr_10', 0.5), ('q2', 'ndcg_cut_10', 0.0), ('q2', 'mrr_10', 0.0)]
    """
    from .measures import _check_measure, evaluate
    from .trec import qrels_from_table, run_from_table

    names = list(dict.fromkeys(measures))
    if not names:
        raise ValueError("no measures to evaluate")
    for name in names:
        _check_measure(name)
    if ties not in ("rank", "trec", "score"):
        raise ValueError(f"ties must be 'rank', 'trec' or 'score', not {ties!r}")
    by_rank = _check_run(run, ties)
    if len(qrels) == 0:
        return METRICS_SCHEMA.empty_table()
    negative = pc.any(pc.less(qrels.column("relevance"), 0)).as_py()
    ours = [m for m in names if supported(m) and not negative]
    theirs = [m for m in names if m not in ours]
    judged = _Judged(qrels, relevance_level)
    values: dict[str, np.ndarray] = {}
    if ours:
        if ties == "rank":
            whole = by_rank
        elif ties == "score":
            whole = _order(run, "score")
        else:  # every row's place in its query's rank order, kept through the sort into trec_eval's order
            whole = _order(by_rank.append_column("_rpos", pa.array(_positions(by_rank))), "score")
        rows = _Rows(whole, judged)
        rankings: dict[int | None, _Ranking] = {}
        for name in ours:
            depth = _depth(name) if ties == "trec" else None
            if depth not in rankings:  # trec: the first d in rank order (a filter keeps trec_eval's order)
                rankings[depth] = _Ranking(rows, judged, depth)
            values[name] = _measure(name, rankings[depth], judged)
    if theirs:
        order = "rank" if ties == "rank" else "score"
        table = run.sort_by([("query_id", "ascending"), ("rank", "ascending")]) if ties == "trec" else run
        other = evaluate(qrels_from_table(qrels), run_from_table(table, order=order), theirs, relevance_level,
                         ranked=ties == "trec")  # fmt: skip
        ids = judged.ids.to_pylist()
        by = {(q, m): v for q, m, v in zip(*(other.column(c).to_pylist() for c in ("query_id", "measure", "value")),
                                           strict=True)}  # fmt: skip
        for name in theirs:
            values[name] = np.array([by[(q, name)] for q in ids], dtype=np.float64)
    n = len(judged.ids)
    q_idx = np.repeat(np.arange(n), len(names))
    vals = np.stack([values[m] for m in names], axis=1).reshape(-1)
    return pa.Table.from_arrays(
        [judged.ids.take(pa.array(q_idx)), pa.array(names * n, pa.string()), pa.array(vals, pa.float64())],
        schema=METRICS_SCHEMA,
    )


def _positions(ordered: pa.Table) -> np.ndarray:
    """Each row's place (0, 1, ...) within its query, in a table sorted by query."""
    if len(ordered) == 0:
        return np.zeros(0, np.int64)
    q = ordered.column("query_id").combine_chunks()
    change = np.r_[True, ~pc.equal(q.slice(1), q.slice(0, len(q) - 1)).to_numpy(zero_copy_only=False)]
    start = np.maximum.accumulate(np.where(change, np.arange(len(change)), 0))
    return np.arange(len(change)) - start


def _adjacent_equal(table: pa.Table, columns: Sequence[str]) -> np.ndarray:
    """Row i + 1 equals row i in every one of ``columns`` (a table sorted by them): a mask of len - 1."""
    same = np.ones(max(len(table) - 1, 0), bool)
    for c in columns:
        col = table.column(c).combine_chunks()
        same &= pc.equal(col.slice(1), col.slice(0, len(col) - 1)).to_numpy(zero_copy_only=False)
    return same


def _check_run(run: pa.Table, ties: Ties) -> pa.Table | None:
    """The errors ``run_from_table`` raises: missing columns or nulls, a document twice in a query, repeated
    ranks within a query (ranks order the evaluation). Sorts and neighbour comparisons: a hash table of every
    (query, document) pair is far slower on millions of rows. Returns the run in rank order where the evaluation
    needs it (``ties`` rank or trec)."""
    from .trec import _require_columns

    _require_columns(run, ("query_id", "doc_id", "rank", "score"), "run")
    if len(run) >= 2:
        pairs = run.select(["query_id", "doc_id"]).sort_by([("query_id", "ascending"), ("doc_id", "ascending")])
        twice = np.flatnonzero(_adjacent_equal(pairs, ("query_id", "doc_id")))
        if len(twice):
            q, d = (pairs.column(c)[int(twice[0])].as_py() for c in ("query_id", "doc_id"))
            raise ValueError(f"run: document {d!r} appears twice for query {q!r}")
    if ties == "score":
        return None
    by_rank = _order(run, "rank")
    again = np.flatnonzero(_adjacent_equal(by_rank, ("query_id", "rank"))) if ties == "rank" else []
    if len(again):
        q = by_rank.column("query_id")[int(again[0])].as_py()
        raise ValueError(f"run: query {q!r} has repeated ranks; ranks must be unique within a query")
    return by_rank
