"""Per-query metrics with pytrec_eval.

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
import re
from collections.abc import Collection, Mapping, Sequence
from functools import lru_cache
from itertools import islice

import pyarrow as pa
import pytrec_eval

from diffret.schemas import MEASURES, METRICS_SCHEMA

from .trec import table_rows

# What evaluate computes by default: the headline measures (storage.schemas.MEASURES).
DEFAULT_MEASURES: tuple[str, ...] = tuple(m.pytrec for m in MEASURES)

_MRR_RE = re.compile(r"^mrr_([1-9][0-9]*)$")
_DEPTH_RE = re.compile(r"^(?:ndcg_cut|P|recall|success|map_cut|mrr)_([1-9][0-9]*)$")  # measures of a run's top d
_NON_NUMERIC = ("runid", "relstring")  # pytrec_eval returns garbage floats for these trec_eval text measures

# ----------------------------------------------------------------------------------------- metrics


def _mrr_cut(measure: str) -> int | None:
    m = _MRR_RE.match(measure)
    return int(m.group(1)) if m else None


@lru_cache(maxsize=256)
def check_measure(measure: str) -> None:
    """Raise ValueError unless pytrec_eval reports ``measure`` under exactly that name, as one number."""
    if _mrr_cut(measure) is not None:
        return
    if measure.split("_")[0] in _NON_NUMERIC:
        raise ValueError(f"measure {measure!r} is not numeric")
    try:
        out = pytrec_eval.RelevanceEvaluator({"q": {"d": 1}}, [measure]).evaluate({"q": {"d": 1.0}})["q"]
    except ValueError:
        names = sorted(set(pytrec_eval.supported_measures) - set(_NON_NUMERIC), key=str.lower)
        raise ValueError(
            f"unknown measure {measure!r}: measures are pytrec_eval's ({', '.join(names)}; those with "
            "a cutoff as NAME_<k>, e.g. ndcg_cut_10, recall_100, P_5) and mrr_<k>"
        ) from None
    if measure not in out:
        raise ValueError(f"pytrec_eval reports measure {measure!r} as {sorted(out)}; ask for one of those names")


def check_measures(measures: list[str]) -> list[str]:
    """``measures`` when each is one pytrec_eval reports (or ``mrr_<k>``), else a ValueError naming the measures there
    are: a config's measures are checked before anything is read or written.

    >>> check_measures(["ndcg_cut_10", "mrr_10"])
    ['ndcg_cut_10', 'mrr_10']
    >>> check_measures(["nosuch"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown measure 'nosuch': measures are pytrec_eval's (11pt_avg, binG, bpref, G, ..., utility; those ...
    """
    if not measures:
        raise ValueError("no measures: give one or more (--measure ndcg_cut_10)")
    for m in measures:
        check_measure(m)
    return measures


def measure_depth(measure: str) -> int | None:
    """The run depth a measure reads (``ndcg_cut_10`` -> 10, ``mrr_10`` -> 10), or None for the whole run.

    >>> measure_depth("ndcg_cut_10"), measure_depth("recall_1000"), measure_depth("map")
    (10, 1000, None)
    """
    m = _DEPTH_RE.match(measure)
    return int(m.group(1)) if m else None


def evaluate(
    qrels: Mapping[str, Mapping[str, int]],
    run: Mapping[str, Mapping[str, float]],
    measures: Sequence[str] = DEFAULT_MEASURES,
    relevance_level: int = 1,
    ranked: bool = False,
) -> pa.Table:
    """Per-query metrics (METRICS_SCHEMA), one row per judged query and measure, queries sorted by id.

    ``run`` is a dict (see ``read_trec_run`` / ``run_from_table``); it is evaluated by score as pytrec_eval
    does. Binary measures count grades >= ``relevance_level`` as relevant (TREC DL: 2; BEIR: 1); NDCG uses the
    grades as gains. Judged queries absent from the run score 0; run queries without judgments are ignored;
    qrels entries with no judgments at all are skipped (pytrec_eval drops them).

    With ``ranked`` each query's documents are in rank order in its dict, and a measure of depth d
    (:func:`measure_depth`) sees the first d of them with their scores, as the reference evaluator passes its
    top 10 to pytrec_eval: which documents are in the top d is the run's choice, their order within it
    pytrec_eval's (score descending, ties by doc_id descending).

    Parameters
    ----------
    qrels : {query_id: {doc_id: grade}}
    run : {query_id: {doc_id: score}}
    measures : pytrec_eval names (``ndcg_cut_10``, ``recall_100``, ...) or ``mrr_<k>``.
    relevance_level : the lowest grade binary measures count as relevant.
    ranked : cut each measure's run at its depth in the dicts' order first.

    Examples
    --------
    >>> qrels = {"q1": {"d1": 1, "d2": 0}, "q2": {"d3": 1}}
    >>> run = {"q1": {"d2": 2.0, "d1": 1.0}}              # q2 retrieved nothing: it scores 0
    >>> [(r["query_id"], r["measure"], round(r["value"], 4))
    ...  for r in evaluate(qrels, run, ["ndcg_cut_10", "mrr_10"]).to_pylist()]
    [('q1', 'ndcg_cut_10', 0.6309), ('q1', 'mrr_10', 0.5), ('q2', 'ndcg_cut_10', 0.0), ('q2', 'mrr_10', 0.0)]
    """
    if isinstance(run, pa.Table | pa.RecordBatch) or isinstance(qrels, pa.Table | pa.RecordBatch):
        raise TypeError("evaluate takes dicts: convert tables with qrels_from_table / run_from_table")
    names = list(dict.fromkeys(measures))
    if not names:
        raise ValueError("no measures to evaluate")
    for name in names:
        check_measure(name)
    judged = {str(q): {d: int(r) for d, r in docs.items()} for q, docs in qrels.items() if docs}
    if not judged:
        return METRICS_SCHEMA.empty_table()
    # Every judged query is evaluated: those without results as an empty ranking (trec_eval -c).
    # pytrec_eval wants Python floats (it rejects numpy scalars).
    full = {q: {d: float(s) for d, s in (run.get(q) or {}).items()} for q in judged}

    per_query: dict[str, dict[str, float]] = {q: {} for q in judged}
    if ranked:
        by_depth: dict[int | None, list[str]] = {}
        for m in names:
            by_depth.setdefault(measure_depth(m), []).append(m)
        for depth, group in by_depth.items():
            cut = full if depth is None else {q: dict(islice(docs.items(), depth)) for q, docs in full.items()}
            mrr = [m for m in group if _mrr_cut(m) is not None]  # recip_rank of the cut run
            asked = [m for m in group if _mrr_cut(m) is None] + (["recip_rank"] if mrr else [])
            result = pytrec_eval.RelevanceEvaluator(judged, asked, relevance_level).evaluate(cut)
            for q, values in result.items():
                per_query[q].update({m: values[m] for m in group if m in values})
                per_query[q].update({m: values["recip_rank"] for m in mrr})
        return _table(per_query, names)
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
    return _table(per_query, names)


def _table(per_query: dict[str, dict[str, float]], names: list[str]) -> pa.Table:
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
    for q, m, v in table_rows(table, ("query_id", "measure", "value"), "metrics"):
        if keep is None or q in keep:
            values.setdefault(m, []).append(float(v))
    return {m: pytrec_eval.compute_aggregated_measure(m, vs) for m, vs in values.items()}
