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
from typing import Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from diffret.schemas import METRICS_SCHEMA

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


class _Judged:
    """The qrels of the judged queries: ids (sorted), positive-grade ideal gains, relevant counts, and each
    judgment as an integer key (query index x documents + document index, sorted) with its grade."""

    def __init__(self, qrels: pa.Table, relevance_level: int):
        qrels = qrels.select(["query_id", "doc_id", "relevance"])
        if len(qrels) and pc.count_distinct(_key(qrels)).as_py() != len(qrels):
            qrels = _dedupe_qrels(qrels)
        qrels = qrels.sort_by([("query_id", "ascending"), ("relevance", "descending")])
        qids = qrels.column("query_id").combine_chunks()
        self.ids = pc.unique(qids)
        self.code = pc.index_in(qids, value_set=self.ids).to_numpy()
        grades = qrels.column("relevance").to_numpy().astype(np.int64)
        n = len(self.ids)
        self.num_rel = np.bincount(self.code, weights=grades >= relevance_level, minlength=n).astype(np.int64)
        self.level = relevance_level
        docs = qrels.column("doc_id").combine_chunks()
        self.docs = pc.unique(docs)
        keys = self.code.astype(np.int64) * len(self.docs) + pc.index_in(docs, value_set=self.docs).to_numpy()
        by_key = np.argsort(keys)
        self.pair_keys, self.pair_grades = keys[by_key], grades[by_key]
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


# ----------------------------------------------------------------------------------------- the run as arrays
# A run is handled as integer arrays: its query ids once through a hash table (a code per row), its rows grouped by
# query (already so when stored in rank order: no sort at all), document ids read only to find repeats (64-bit
# hashes of the bytes, sorted within each query), to break score ties (the tied rows only) and to find the judged
# rows (a hash lookup in the qrels' few documents). Nothing sorts millions of strings or builds a key per row.

_MUL = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it is a bijection of 64-bit words
_LOW_BYTES = np.array([(1 << (8 * i)) - 1 for i in range(8)] + [2**64 - 1], dtype=np.uint64)
_LAST = np.uint64(2**64 - 1)


def _hash_strings(column: pa.ChunkedArray, block: int = 1 << 20) -> np.ndarray:
    """A 64-bit hash of each string, from the Arrow buffers 8 bytes at a time (``block`` rows at a time): equal
    strings hash equal, so distinct hashes prove distinct strings (equal hashes prove nothing: the strings are
    compared then)."""
    parts = [_hash_block(chunk.slice(i, block)) for chunk in column.chunks for i in range(0, len(chunk), block)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


def _hash_block(chunk: pa.Array) -> np.ndarray:
    if not any(
        f(chunk.type)
        for f in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
    ):
        chunk = chunk.cast(pa.large_string())
    wide = pa.types.is_large_string(chunk.type) or pa.types.is_large_binary(chunk.type)
    itype = np.dtype(np.int64 if wide else np.int32)
    _, offsets, data = chunk.buffers()
    off = np.frombuffer(offsets, itype, count=len(chunk) + 1, offset=chunk.offset * itype.itemsize)
    lo, hi = int(off[0]), int(off[-1])
    padded = np.zeros(hi - lo + 8, np.uint8)
    if hi > lo:
        padded[: hi - lo] = np.frombuffer(data, np.uint8, count=hi - lo, offset=lo)
    words = np.ndarray((hi - lo + 1,), np.uint64, buffer=padded, strides=(1,))  # the 8 bytes from each byte on
    start, length = off[:-1].astype(np.int64) - lo, np.diff(off).astype(np.int64)
    h = length.astype(np.uint64)
    rows: np.ndarray | None = None  # None: every row (its first 8 bytes); then the rows longer than `at`
    at = 0
    while True:
        s, rem = (start, length) if rows is None else (start[rows], length[rows])
        rem = rem - at
        part = h if rows is None else h[rows]
        part ^= words[s + at] & _LOW_BYTES[np.minimum(rem, 8)]
        part *= _MUL
        part ^= part >> np.uint64(29)
        if rows is not None:
            h[rows] = part
        longer = rem > 8
        if not longer.any():
            return h
        rows = np.flatnonzero(longer) if rows is None else rows[longer]
        at += 8


def _matrix(values: np.ndarray, starts: np.ndarray, counts: np.ndarray, fill: object) -> np.ndarray | None:
    """Rows grouped by query as a [queries, longest] matrix (each query's row left-aligned, ``fill`` after its
    end), or None where that would be much larger than the rows themselves."""
    groups, width = len(counts), int(counts.max())
    if groups * width == len(values):
        return values.reshape(groups, width)
    if groups * width > 2 * len(values) + 4096:
        return None
    out = np.full((groups, width), fill, values.dtype)
    out[np.arange(width) < counts[:, None]] = values
    return out


def _has_repeats(keys: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> bool:
    """Whether some query's rows (grouped) hold a key twice: each query's keys sorted (one small sort a query)."""
    m = _matrix(keys, starts, counts, _LAST)
    if m is None:  # queries of very unequal lengths: one sort of all, keys mixed with their query
        mixed = np.sort(keys ^ (np.repeat(np.arange(len(counts), dtype=np.uint64), counts) * _MUL))
        return bool(np.any(mixed[1:] == mixed[:-1]))
    m = np.sort(m, axis=1)  # the fill (the largest key) sorts last: a row's first `count` keys are its own
    same = m[:, 1:] == m[:, :-1]
    if m.size != len(keys):
        same &= np.arange(1, m.shape[1]) < counts[:, None]
    return bool(same.any())


def _argsort_within(keys: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The grouped rows reordered by ``keys`` within each query (stably), as row positions."""
    m = _matrix(keys, starts, counts, _LAST)
    if m is None:
        return np.lexsort((keys, np.repeat(np.arange(len(counts)), counts)))
    order = np.argsort(m, axis=1, kind="stable") + starts[:, None]  # the fill stays after a row's own keys
    return order.reshape(-1) if m.size == len(keys) else order[np.arange(m.shape[1]) < counts[:, None]]


def _descending(scores: np.ndarray) -> np.ndarray:
    """Unsigned keys whose ascending order is the scores' descending order (0.0 and -0.0 one key; NaN last, as
    Arrow sorts them)."""
    bits = (scores + 0.0).view(np.uint64)  # -0.0 + 0.0 is 0.0
    up = np.where(bits >> np.uint64(63) == 1, ~bits, bits | np.uint64(1 << 63))
    down = ~up
    down[np.isnan(scores)] = _LAST
    return down


def _check_pairs(run: pa.Table) -> None:
    """Raise on a document twice in a query, as ``run_from_table`` does (the first in (query, doc) order)."""
    pairs = run.select(["query_id", "doc_id"]).sort_by([("query_id", "ascending"), ("doc_id", "ascending")])
    twice = np.flatnonzero(_adjacent_equal(pairs, ("query_id", "doc_id")))
    if len(twice):
        q, d = (pairs.column(c)[int(twice[0])].as_py() for c in ("query_id", "doc_id"))
        raise ValueError(f"run: document {d!r} appears twice for query {q!r}")


class _Run:
    """A run's rows grouped by query in one evaluated order (``ties``), with the checks ``run_from_table`` makes
    (missing columns or nulls, a document twice in a query, repeated ranks within a query where ranks order).

    ``order``: the rows in rank order (``ties="score"``: grouped by query), as row numbers, or None where the
    table is so already; ``perm``: the evaluated order as positions in ``order`` (None: the same); ``starts`` and
    ``counts``: each query's first position and number of rows; ``query``: each query's index in ``ids``."""

    def __init__(self, run: pa.Table, ties: Ties):
        from .trec import require_columns

        require_columns(run, ("query_id", "doc_id", "rank", "score"), "run")
        self.table = run
        self.n = n = run.num_rows
        column = run.column("query_id")
        self.ids = pc.unique(column)
        q = pc.index_in(column, value_set=self.ids).to_numpy().astype(np.int64) if n else np.zeros(0, np.int64)
        self.q = q
        new = np.r_[True, q[1:] != q[:-1]] if n else np.zeros(0, bool)
        grouped = int(new.sum()) == len(self.ids)
        order: np.ndarray | None = None
        if ties == "score":
            order = None if grouped else np.argsort(q, kind="stable")
        else:
            rank = run.column("rank").to_numpy() if n else np.zeros(0, np.int64)
            up = rank[1:] > rank[:-1] if ties == "rank" else rank[1:] >= rank[:-1]
            if not (grouped and bool(np.all(up | new[1:]))):
                order = np.lexsort((rank, q))  # stable: repeated ranks (trec) keep the table's order
        g = q if order is None else q[order]
        same = g[1:] == g[:-1]
        self.starts = np.flatnonzero(np.r_[True, ~same]) if n else np.zeros(0, np.int64)
        self.counts = np.diff(np.r_[self.starts, n])
        self.query = g[self.starts]
        self.order = order
        if n >= 2:
            h = _hash_strings(run.column("doc_id"))
            if _has_repeats(h if order is None else h[order], self.starts, self.counts):
                _check_pairs(run)  # equal hashes: compare the strings (raises unless the hashes merely collide)
        if ties == "rank" and order is not None:
            r = rank[order]
            again = np.flatnonzero(same & (r[1:] == r[:-1]))
            if len(again):
                q0 = min(self.ids.take(pa.array(g[again])).to_pylist())
                raise ValueError(f"run: query {q0!r} has repeated ranks; ranks must be unique within a query")
        self.perm = None if ties == "rank" or n == 0 else self._by_score(run, order, same)

    def _by_score(self, run: pa.Table, order: np.ndarray | None, same: np.ndarray) -> np.ndarray | None:
        """trec_eval's order within each query: score descending, ties by doc_id descending."""
        s = run.column("score").to_numpy().astype(np.float64)
        s = s if order is None else s[order]
        if not np.isnan(s).any() and not np.any(same & (s[1:] > s[:-1])):  # in score order already, but ties
            perm, tied = None, same & (s[1:] == s[:-1])
        else:
            key = _descending(s)
            perm = _argsort_within(key, self.starts, self.counts)
            key = key[perm]
            tied = same & (key[1:] == key[:-1])
        if not tied.any():
            return perm
        # the tied rows only (runs of equal scores) are sorted by doc_id, descending, within their run
        t = np.flatnonzero(tied)
        at = np.union1d(t, t + 1)
        run_id = np.cumsum(~np.isin(at - 1, t))
        src = at if perm is None else perm[at]
        docs = run.column("doc_id").take(pa.array(src if order is None else order[src]))
        by_doc = pc.sort_indices(
            pa.table({"run": run_id, "doc": docs}), sort_keys=[("run", "ascending"), ("doc", "descending")]
        ).to_numpy()
        perm = np.arange(self.n) if perm is None else perm.copy()
        perm[at] = src[by_doc]
        return perm

    def judged(self, judged: _Judged) -> _Found:
        """The rows the qrels judge (a hash lookup of each document in the qrels' documents, then the pairs)."""
        if self.n == 0:
            empty = np.zeros(0, np.int64)
            return _Found(empty, empty, empty, empty, empty, empty)
        column = self.table.column("doc_id")
        at = pc.index_in(column, value_set=_like(judged.docs, column.type))
        rows = np.flatnonzero(pc.is_valid(at).to_numpy())  # documents judged for some query
        doc = at.take(pa.array(rows)).to_numpy().astype(np.int64)
        of_query = self.judged_query(judged)
        jq = of_query[self.q[rows]]
        key = jq * len(judged.docs) + doc
        i = np.minimum(np.searchsorted(judged.pair_keys, key), len(judged.pair_keys) - 1)
        hit = (jq >= 0) & (judged.pair_keys[i] == key)
        rows, grade = rows[hit], judged.pair_grades[i[hit]]
        full = self.order if self.perm is None else (self.perm if self.order is None else self.order[self.perm])
        if full is not None:  # the rows' positions in the evaluated order
            where = np.empty(self.n, np.int64)
            where[full] = np.arange(self.n)
            rows = where[rows]
        group = np.searchsorted(self.starts, rows, side="right") - 1
        place = rows - self.starts[group]
        rplace = place if self.perm is None else self.perm[rows] - self.starts[group]
        return _Found(of_query[self.query[group]], place, rplace, grade, rows, group)

    def judged_query(self, judged: _Judged) -> np.ndarray:
        """Each run query's index among the judged queries (-1: not judged)."""
        at = pc.index_in(self.ids, value_set=_like(judged.ids, self.ids.type))
        return pc.fill_null(at, -1).to_numpy().astype(np.int64)

    def ranking(self, found: _Found, judged: _Judged, depth: int | None) -> _Ranking:
        """The judged queries' ranking in the evaluated order; with ``depth`` (``trec``): of each query's first
        ``depth`` documents by rank, kept in trec_eval's order."""
        num_ret = np.zeros(len(judged.ids), np.int64)
        of_query = self.judged_query(judged)[self.query]
        num_ret[of_query[of_query >= 0]] = self.counts[of_query >= 0]
        if depth is None:
            return _Ranking(found.query, found.place, found.grade, num_ret, judged.level)
        keep = found.rplace < depth
        place = found.place
        if self.perm is not None and depth < self.counts.max():  # a moved row: count the kept rows before each
            kept = (self.perm - np.repeat(self.starts, self.counts)) < depth
            so_far = np.cumsum(kept)
            before: np.ndarray = so_far[self.starts] - kept[self.starts]
            place = so_far[found.at] - 1 - before[found.group]
        return _Ranking(found.query[keep], place[keep], found.grade[keep], np.minimum(num_ret, depth), judged.level)


def _like(values: pa.Array, type_: pa.DataType) -> pa.Array:
    """``values`` as the type of the column they are looked up in (string or large_string)."""
    return values if values.type == type_ else values.cast(type_)


class _Found(NamedTuple):
    """A run's judged rows: judged-query index, place in the evaluated order of its query, place in its query's
    rank order (``trec``), grade; position in the evaluated order (all queries), index of its run query."""

    query: np.ndarray
    place: np.ndarray
    rplace: np.ndarray
    grade: np.ndarray
    at: np.ndarray
    group: np.ndarray


class _Ranking:
    """A run's judged queries in one evaluated order (with ``depth``: each query's first ``depth`` documents in
    rank order, kept in the evaluated order), as its judged documents only: query index, place, grade, sorted by
    query then place (the unjudged ones add nothing to a measure but their count, ``num_ret``)."""

    def __init__(self, q: np.ndarray, place: np.ndarray, grade: np.ndarray, num_ret: np.ndarray, level: int):
        by = np.lexsort((place, q))
        self.q, self.place, self.grade = q[by], place[by], grade[by]
        self.rel = self.grade >= level
        self.num_ret = num_ret
        self.n = len(num_ret)

    def top(self, mask: np.ndarray, k: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The query, place and grade of the documents in ``mask`` within the first ``k`` places."""
        if k is not None:
            mask = mask & (self.place < k)
        return self.q[mask], self.place[mask], self.grade[mask]


def _sequential_sum(values: np.ndarray) -> np.ndarray:
    """Row sums added left to right (as trec_eval's loops add; numpy's own sum pairs terms up)."""
    out = np.zeros(values.shape[0])
    for j in range(values.shape[1]):
        out += values[:, j]
    return out


def _per_query(q: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Each query's values (``q`` sorted) added left to right: trec_eval's sum over a ranking, whose documents
    that add 0 are left out (adding 0.0 to a float changes no bit)."""
    if len(q) == 0:
        return np.zeros(n)
    first = _firsts(q)
    starts = np.flatnonzero(first)
    place = np.arange(len(q)) - np.repeat(starts, np.diff(np.r_[starts, len(q)]))
    m = np.zeros((n, int(place.max()) + 1))
    m[q, place] = values
    return _sequential_sum(m)


def _firsts(q: np.ndarray) -> np.ndarray:
    return np.r_[True, q[1:] != q[:-1]] if len(q) else np.zeros(0, bool)


def _ndcg(r: _Ranking, judged: _Judged, k: int | None) -> np.ndarray:
    q, place, gain = r.top(r.grade > 0, k)
    disc = _discounts(int(place.max()) + 1 if len(place) else 1)
    dcg = _per_query(q, gain.astype(np.float64) / disc[place], r.n)
    n = len(judged.ids)
    ideal_w = int(judged.ideal_pos.max()) + 1 if len(judged.ideal_pos) else 1
    ideal_w = ideal_w if k is None else min(k, ideal_w)
    gains = np.zeros((n, ideal_w))
    keep = judged.ideal_pos < ideal_w
    gains[judged.ideal_code[keep], judged.ideal_pos[keep]] = judged.ideal_gain[keep]
    idcg = _sequential_sum(gains / _discounts(ideal_w)[:ideal_w])
    return np.divide(dcg, idcg, out=np.zeros(n), where=idcg > 0)


def _recip_rank(r: _Ranking, k: int | None) -> np.ndarray:
    q, place, _ = r.top(r.rel, k)
    first = _firsts(q)
    out = np.zeros(r.n)
    out[q[first]] = 1.0 / (place[first] + 1.0)
    return out


def _map(r: _Ranking, judged: _Judged) -> np.ndarray:
    q, place, _ = r.top(r.rel, None)
    starts = np.flatnonzero(_firsts(q))
    so_far = np.arange(1, len(q) + 1) - np.repeat(starts, np.diff(np.r_[starts, len(q)]))  # relevant so far
    total = _per_query(q, so_far / (place + 1.0), r.n)
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
    hits = np.bincount(r.top(r.rel, k)[0], minlength=r.n).astype(np.float64)
    if family == "P":
        assert k is not None  # P is measured at a cut only (P_k)
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
    from .measures import check_measure, evaluate
    from .trec import qrels_from_table, run_from_table

    names = list(dict.fromkeys(measures))
    if not names:
        raise ValueError("no measures to evaluate")
    for name in names:
        check_measure(name)
    if ties not in ("rank", "trec", "score"):
        raise ValueError(f"ties must be 'rank', 'trec' or 'score', not {ties!r}")
    rows = _Run(run, ties)  # the run's checks first, whatever the qrels
    if len(qrels) == 0:
        return METRICS_SCHEMA.empty_table()
    negative = pc.any(pc.less(qrels.column("relevance"), 0)).as_py()
    ours = [m for m in names if supported(m) and not negative]
    theirs = [m for m in names if m not in ours]
    judged = _Judged(qrels, relevance_level)
    values: dict[str, np.ndarray] = {}
    if ours:
        found = rows.judged(judged)
        rankings: dict[int | None, _Ranking] = {}
        for name in ours:
            depth = _depth(name) if ties == "trec" else None  # trec: the first d in rank order, trec_eval's order
            if depth not in rankings:
                rankings[depth] = rows.ranking(found, judged, depth)
            values[name] = _measure(name, rankings[depth], judged)
    if theirs:
        order: Literal["rank", "score"] = "rank" if ties == "rank" else "score"
        table = run.sort_by([("query_id", "ascending"), ("rank", "ascending")]) if ties == "trec" else run
        other = evaluate(
            qrels_from_table(qrels), run_from_table(table, order=order), theirs, relevance_level, ranked=ties == "trec"
        )
        ids = judged.ids.to_pylist()
        by = {
            (q, m): v
            for q, m, v in zip(*(other.column(c).to_pylist() for c in ("query_id", "measure", "value")), strict=True)
        }
        for name in theirs:
            values[name] = np.array([by[(q, name)] for q in ids], dtype=np.float64)
    n = len(judged.ids)
    q_idx = np.repeat(np.arange(n), len(names))
    vals = np.stack([values[m] for m in names], axis=1).reshape(-1)
    return pa.Table.from_arrays(
        [judged.ids.take(pa.array(q_idx)), pa.array(names * n, pa.string()), pa.array(vals, pa.float64())],
        schema=METRICS_SCHEMA,
    )


def _adjacent_equal(table: pa.Table, columns: Sequence[str]) -> np.ndarray:
    """Row i + 1 equals row i in every one of ``columns`` (a table sorted by them): a mask of len - 1."""
    same = np.ones(max(len(table) - 1, 0), bool)
    for c in columns:
        col = table.column(c).combine_chunks()
        same &= pc.equal(col.slice(1), col.slice(0, len(col) - 1)).to_numpy(zero_copy_only=False)
    return same
