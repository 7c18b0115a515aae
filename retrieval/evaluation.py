"""Effectiveness evaluation with pytrec_eval: TREC files, Arrow converters, per-query metrics, paired t-tests.

In memory a run is ``{query_id: {doc_id: score}}`` and qrels are ``{query_id: {doc_id: grade}}``, the dicts
pytrec_eval takes. pytrec_eval (like trec_eval) ignores any rank column: it orders each query's documents by
score descending and breaks ties by doc_id *descending*. Two ways to build a run therefore exist:

* ``read_trec_run`` and ``run_from_table(table, order="score")`` keep the raw scores, so a run is evaluated
  exactly as trec_eval would evaluate it (this is what reproduces trec_eval's reference output);
* ``run_from_table(table)`` (``order="rank"``, the default for our RUN_SCHEMA tables) gives every document the
  score ``-rank``, so the evaluated order is the stored rank order, whatever the scores and their ties (our
  runs break score ties by doc_id ascending, and float32 scores tie more often than the scores they came from).

Measures are pytrec_eval's names as it reports them (``ndcg_cut_10``, ``recall_100``, ``P_5``, ``map``, ...),
plus ``mrr_<k>``: ``recip_rank`` on the run cut to its top k (pytrec_eval has no reciprocal-rank cutoff).

A query with judgments but no results is evaluated as an empty ranking (trec_eval ``-c``): it scores 0 on
every effectiveness measure and is never dropped. Queries in the run but not in the qrels are ignored. A
query whose judgments are all below ``relevance_level`` (e.g. all 0) is kept too: pytrec_eval scores it 0 on
binary measures (recall, MAP, reciprocal rank, P@k) and on NDCG when every grade is <= 0; NDCG uses the raw
grades as gains, so grade-1 documents still earn gain when ``relevance_level`` is 2.
"""

from __future__ import annotations

import heapq
import math
import os
import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np
import pyarrow as pa
import pytrec_eval
from scipy import stats

from storage.layout import METRICS_SCHEMA, RUN_SCHEMA

Qrels = dict[str, dict[str, int]]
Run = dict[str, dict[str, float]]
PathLike = str | os.PathLike[str]

DEFAULT_MEASURES: tuple[str, ...] = ("ndcg_cut_10", "mrr_10", "recall_100", "recall_1000")

_MRR_RE = re.compile(r"^mrr_([1-9][0-9]*)$")
_NON_NUMERIC = ("runid", "relstring")  # pytrec_eval returns garbage floats for these trec_eval text measures

__all__ = [
    "DEFAULT_MEASURES",
    "Qrels",
    "Run",
    "TTest",
    "evaluate",
    "mean_metrics",
    "paired_ttest",
    "qrels_from_table",
    "read_trec_qrels",
    "read_trec_run",
    "run_from_table",
    "run_to_table",
    "trec_order",
    "write_trec_run",
]

# ------------------------------------------------------------------------------------- TREC files


def _records(path: PathLike, n_fields: int, what: str, extra_ok: bool = False) -> Iterator[tuple[int, list[str]]]:
    """(line number, first ``n_fields`` fields) of a whitespace-separated TREC file; blank lines and ``#``
    comment lines are skipped; with ``extra_ok`` further fields are ignored (as trec_eval does for runs)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            fields = text.split()
            if len(fields) < n_fields or (len(fields) > n_fields and not extra_ok):
                need = f"at least {n_fields}" if extra_ok else str(n_fields)
                raise ValueError(
                    f"{path}:{lineno}: a {what} line needs {need} whitespace-separated fields, got "
                    f"{len(fields)}: {text[:200]!r}"
                )
            yield lineno, fields[:n_fields]


def read_trec_run(path: PathLike) -> Run:
    """A TREC run file (``qid Q0 docid rank score tag``) with its raw scores. As in trec_eval, the rank column is
    ignored, fields after the tag are ignored and lines starting with ``#`` are comments."""
    run: Run = {}
    for lineno, (qid, _q0, doc, _rank, score_text, _tag) in _records(path, 6, "run", extra_ok=True):
        try:
            score = float(score_text)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: score {score_text!r} is not a number") from None
        if math.isnan(score):
            raise ValueError(f"{path}:{lineno}: score is NaN")
        docs = run.setdefault(qid, {})
        if doc in docs:
            raise ValueError(f"{path}:{lineno}: document {doc!r} appears twice for query {qid!r}")
        docs[doc] = score
    return run


def read_trec_qrels(path: PathLike) -> Qrels:
    """A TREC qrels file (``qid iter docid relevance``, integer relevance). Lines starting with ``#`` are
    comments; a repeated judgment is accepted only when it has the same grade."""
    qrels: Qrels = {}
    for lineno, (qid, _iter, doc, rel_text) in _records(path, 4, "qrels"):
        try:
            rel = int(rel_text)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: relevance {rel_text!r} is not an integer") from None
        docs = qrels.setdefault(qid, {})
        if docs.get(doc, rel) != rel:
            raise ValueError(f"{path}:{lineno}: document {doc!r} of query {qid!r} judged both {docs[doc]} and {rel}")
        docs[doc] = rel
    return qrels


def trec_order(docs: Mapping[str, float]) -> list[tuple[str, float]]:
    """A query's (doc_id, score) pairs in the order trec_eval/pytrec_eval evaluate them: score descending,
    ties by doc_id descending."""
    return sorted(docs.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)


def _check_token(value: str, what: str) -> str:
    if not value or len(value.split()) != 1 or value.startswith("#"):
        raise ValueError(f"{what} {value!r} cannot be written to a TREC file (empty, whitespace or leading '#')")
    return value


def write_trec_run(
    run: pa.Table | pa.RecordBatch | Mapping[str, Mapping[str, float]] | Iterable[tuple[str, str, int, float]],
    path: PathLike,
    tag: str = "diffret",
) -> int:
    """Write a run as ``qid Q0 docid rank score tag`` lines, queries sorted by id, each in rank order; returns
    the number of lines.

    ``run`` is a RUN_SCHEMA table (its ranks are written as they are), an iterable of (query_id, doc_id, rank,
    score) rows, or a run dict (ranked in trec_order). Scores are written at full precision, but trec_eval will
    read the file by score (ties by doc_id descending), not by the rank column.
    """
    _check_token(tag, "tag")
    if isinstance(run, pa.Table | pa.RecordBatch):
        cols = ("query_id", "doc_id", "rank", "score")
        table = pa.Table.from_batches([run]) if isinstance(run, pa.RecordBatch) else run
        _require_columns(table, cols, "run")
        table = table.select(list(cols)).sort_by([("query_id", "ascending"), ("rank", "ascending")])
        rows: Iterable[tuple] = _rows(table, cols, "run")
    elif isinstance(run, Mapping):
        rows = (
            (qid, doc, rank, score) for qid in sorted(run) for rank, (doc, score) in enumerate(trec_order(run[qid]), 1)
        )
    else:
        rows = sorted(run, key=lambda r: (r[0], r[2]))
    n = 0
    tmp = f"{os.fspath(path)}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            last_qid = None
            for qid, doc, rank, score in rows:
                if qid != last_qid:
                    last_qid = _check_token(qid, "query_id")
                f.write(f"{qid} Q0 {_check_token(doc, 'doc_id')} {int(rank)} {float(score)!r} {tag}\n")
                n += 1
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return n


# ---------------------------------------------------------------------------------- Arrow converters


def _require_columns(table: pa.Table | pa.RecordBatch, names: Sequence[str], what: str) -> None:
    missing = [c for c in names if c not in table.schema.names]
    if missing:
        raise ValueError(f"{what} table lacks column(s) {missing}; it has {table.schema.names}")
    for name in names:
        if table.column(name).null_count:
            raise ValueError(f"{what} table has {table.column(name).null_count} null(s) in column {name!r}")


def _rows(table: pa.Table | pa.RecordBatch, names: Sequence[str], what: str, chunk: int = 65536) -> Iterator[tuple]:
    """The rows of some columns as Python tuples, converted a slice at a time (bounded memory on big runs)."""
    _require_columns(table, names, what)

    def gen() -> Iterator[tuple]:
        for start in range(0, table.num_rows, chunk):
            part = table.slice(start, chunk)
            yield from zip(*(part.column(c).to_pylist() for c in names), strict=True)

    return gen()


def qrels_from_table(table: pa.Table | pa.RecordBatch) -> Qrels:
    """Qrels from a table with query_id, doc_id, relevance (other columns such as split are ignored: filter
    the split first). A repeated (query, doc) pair must carry the same grade."""
    qrels: Qrels = {}
    for qid, doc, rel in _rows(table, ("query_id", "doc_id", "relevance"), "qrels"):
        docs = qrels.setdefault(qid, {})
        rel = int(rel)
        if docs.get(doc, rel) != rel:
            raise ValueError(f"qrels: document {doc!r} of query {qid!r} judged both {docs[doc]} and {rel}")
        docs[doc] = rel
    return qrels


def run_from_table(table: pa.Table | pa.RecordBatch, order: Literal["rank", "score"] = "rank") -> Run:
    """A run dict from a RUN_SCHEMA table.

    ``order="rank"`` (default): each document gets score ``-rank``, so pytrec_eval evaluates the stored rank
    order exactly (ranks must be unique within a query). ``order="score"``: the stored scores, evaluated as
    trec_eval would (score descending, ties by doc_id descending; the rank column is then ignored).
    """
    if order not in ("rank", "score"):
        raise ValueError(f"order must be 'rank' or 'score', not {order!r}")
    run: Run = {}
    sign = -1.0 if order == "rank" else 1.0
    for qid, doc, val in _rows(table, ("query_id", "doc_id", order), "run"):
        docs = run.setdefault(qid, {})
        if doc in docs:
            raise ValueError(f"run: document {doc!r} appears twice for query {qid!r}")
        docs[doc] = sign * float(val)
    if order == "rank":
        for qid, docs in run.items():
            if len(set(docs.values())) != len(docs):
                raise ValueError(f"run: query {qid!r} has repeated ranks; ranks must be unique within a query")
    return run


def run_to_table(run: Mapping[str, Mapping[str, float]]) -> pa.Table:
    """A RUN_SCHEMA table from a run dict, ranked in trec_order (score descending, ties by doc_id descending) so
    that ``run_from_table`` of it evaluates like the dict; queries sorted by id. Scores are cast to float32."""
    qcol: list[str] = []
    dcol: list[str] = []
    rcol: list[int] = []
    scol: list[float] = []
    for qid in sorted(run):
        ranked = trec_order(run[qid])
        qcol.extend([qid] * len(ranked))
        dcol.extend(doc for doc, _ in ranked)
        rcol.extend(range(1, len(ranked) + 1))
        scol.extend(score for _, score in ranked)
    arrays = [pa.array(qcol, pa.string()), pa.array(dcol, pa.string())]
    arrays += [pa.array(rcol, pa.int32()), pa.array(scol, pa.float64()).cast(pa.float32())]
    return pa.Table.from_arrays(arrays, schema=RUN_SCHEMA)


# ----------------------------------------------------------------------------------------- metrics


def _mrr_cut(measure: str) -> int | None:
    m = _MRR_RE.match(measure)
    return int(m.group(1)) if m else None


@lru_cache(maxsize=256)
def _check_measure(measure: str) -> None:
    """Raise ValueError unless pytrec_eval reports ``measure`` under exactly that name, as one number."""
    if _mrr_cut(measure) is not None:
        return
    if measure.split("_")[0] in _NON_NUMERIC:
        raise ValueError(f"measure {measure!r} is not numeric")
    try:
        out = pytrec_eval.RelevanceEvaluator({"q": {"d": 1}}, [measure]).evaluate({"q": {"d": 1.0}})["q"]
    except ValueError as e:
        raise ValueError(f"unknown measure {measure!r} ({e}); use pytrec_eval names such as ndcg_cut_10") from None
    if measure not in out:
        raise ValueError(f"pytrec_eval reports measure {measure!r} as {sorted(out)}; ask for one of those names")


def evaluate(
    qrels: Mapping[str, Mapping[str, int]],
    run: Mapping[str, Mapping[str, float]],
    measures: Sequence[str] = DEFAULT_MEASURES,
    relevance_level: int = 1,
) -> pa.Table:
    """Per-query metrics (METRICS_SCHEMA), one row per judged query and measure, queries sorted by id.

    ``run`` is a dict (see ``read_trec_run`` / ``run_from_table``); it is evaluated by score as pytrec_eval
    does. Binary measures count grades >= ``relevance_level`` as relevant (TREC DL: 2; BEIR: 1); NDCG uses the
    grades as gains. Judged queries absent from the run score 0; run queries without judgments are ignored;
    qrels entries with no judgments at all are skipped (pytrec_eval drops them).
    """
    if isinstance(run, pa.Table | pa.RecordBatch) or isinstance(qrels, pa.Table | pa.RecordBatch):
        raise TypeError("evaluate takes dicts: convert tables with qrels_from_table / run_from_table")
    names = list(dict.fromkeys(measures))
    if not names:
        raise ValueError("no measures to evaluate")
    for name in names:
        _check_measure(name)
    judged = {str(q): {d: int(r) for d, r in docs.items()} for q, docs in qrels.items() if docs}
    if not judged:
        return METRICS_SCHEMA.empty_table()
    # Every judged query is evaluated: those without results as an empty ranking (trec_eval -c).
    # pytrec_eval wants Python floats (it rejects numpy scalars).
    full = {q: {d: float(s) for d, s in (run.get(q) or {}).items()} for q in judged}

    per_query: dict[str, dict[str, float]] = {q: {} for q in judged}
    plain = [m for m in names if _mrr_cut(m) is None]
    if plain:
        result = pytrec_eval.RelevanceEvaluator(judged, plain, relevance_level).evaluate(full)
        for q, values in result.items():
            per_query[q].update(values)
    cuts = sorted({k for m in names if (k := _mrr_cut(m)) is not None})
    if cuts:
        rr = pytrec_eval.RelevanceEvaluator(judged, ["recip_rank"], relevance_level)
        for k in cuts:
            top = {q: dict(heapq.nlargest(k, docs.items(), key=lambda kv: (kv[1], kv[0]))) for q, docs in full.items()}
            for q, values in rr.evaluate(top).items():
                per_query[q][f"mrr_{k}"] = values["recip_rank"]

    qcol: list[str] = []
    mcol: list[str] = []
    vcol: list[float] = []
    for q in sorted(per_query):
        values = per_query[q]
        for m in names:
            if m not in values:  # pytrec_eval evaluates every query it is given; guard all the same
                raise RuntimeError(f"pytrec_eval returned no {m!r} for query {q!r}")
            qcol.append(q)
            mcol.append(m)
            vcol.append(float(values[m]))
    arrays = [pa.array(qcol, pa.string()), pa.array(mcol, pa.string()), pa.array(vcol, pa.float64())]
    return pa.Table.from_arrays(arrays, schema=METRICS_SCHEMA)


def mean_metrics(table: pa.Table, query_ids: Collection[str] | None = None) -> dict[str, float]:
    """Aggregate a metrics table per measure, in first-appearance order, as trec_eval's ``all`` rows do: the
    arithmetic mean, except ``num_*`` (summed) and ``gm_*`` (geometric mean of pytrec_eval's per-query logs).

    ``query_ids`` restricts the queries averaged: pass the run's query ids to get trec_eval's default ``all``
    (queries both judged and retrieved) rather than the ``-c`` average over every judged query.
    """
    keep = None if query_ids is None else set(query_ids)
    values: dict[str, list[float]] = {}
    for q, m, v in _rows(table, ("query_id", "measure", "value"), "metrics"):
        if keep is None or q in keep:
            values.setdefault(m, []).append(float(v))
    return {m: pytrec_eval.compute_aggregated_measure(m, vs) for m, vs in values.items()}


# --------------------------------------------------------------------------------------- t-test


@dataclass(frozen=True)
class TTest:
    """A paired t-test of system a against system b on one measure; ``diff = mean_a - mean_b`` and ``t > 0``
    when a is better; ``p_value`` is two-sided."""

    measure: str
    n: int
    mean_a: float
    mean_b: float
    diff: float
    t: float
    p_value: float


def _per_query(table: pa.Table, measure: str | None, side: str) -> tuple[str, dict[str, float]]:
    rows = list(_rows(table, ("query_id", "measure", "value"), f"metrics ({side})"))
    if measure is None:
        present = sorted({m for _, m, _ in rows})
        if len(present) != 1:
            raise ValueError(f"table {side} holds measures {present}: name the one to test")
        measure = present[0]
    out: dict[str, float] = {}
    for q, m, v in rows:
        if m == measure:
            if q in out:
                raise ValueError(f"table {side} has two {measure!r} values for query {q!r}")
            out[q] = float(v)
    if not out:
        raise ValueError(f"table {side} has no rows for measure {measure!r}")
    return measure, out


def paired_ttest(a: pa.Table, b: pa.Table, measure: str | None = None, *, allow_subset: bool = False) -> TTest:
    """Paired t-test (scipy.stats.ttest_rel) of a's per-query scores against b's on ``measure`` (default: the one
    measure the tables hold).

    Both tables must score the same queries unless ``allow_subset``, which tests the common ones. When every
    difference is the same the test is degenerate: t = 0 and p = 1 if a and b are identical, otherwise t = +-inf
    and p = 0.
    """
    measure, sa = _per_query(a, measure, "a")
    _, sb = _per_query(b, measure, "b")
    return paired_ttest_values(sa, sb, measure, allow_subset=allow_subset)


def paired_ttest_values(
    sa: Mapping[str, float], sb: Mapping[str, float], measure: str = "value", *, allow_subset: bool = False
) -> TTest:
    """``paired_ttest`` on two {query_id: score} maps."""
    only_a, only_b = sa.keys() - sb.keys(), sb.keys() - sa.keys()
    common = sorted(sa.keys() & sb.keys())
    if (only_a or only_b) and not allow_subset:
        raise ValueError(
            f"paired t-test on {measure!r}: query sets differ ({len(only_a)} only in a, e.g. {sorted(only_a)[:3]}; "
            f"{len(only_b)} only in b, e.g. {sorted(only_b)[:3]}); pass allow_subset=True to test the "
            f"{len(common)} common queries"
        )
    if len(common) < 2:
        raise ValueError(f"paired t-test on {measure!r} needs at least 2 common queries, got {len(common)}")
    xa = np.array([sa[q] for q in common], dtype=np.float64)
    xb = np.array([sb[q] for q in common], dtype=np.float64)
    d = xa - xb
    mean_diff = float(d.mean())
    if np.all(d == d[0]):  # zero variance: scipy would return nan
        t, p = (0.0, 1.0) if d[0] == 0 else (math.copysign(math.inf, float(d[0])), 0.0)
    else:
        res = stats.ttest_rel(xa, xb)
        t, p = float(res.statistic), float(res.pvalue)
    return TTest(measure, len(common), float(xa.mean()), float(xb.mean()), mean_diff, t, p)
