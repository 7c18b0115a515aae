"""retrieval.evaluation reproduces trec_eval's own reference output (../shared/data/trec_eval_test)."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import SHARED

from diffret.retrieval.evaluation import DEFAULT_MEASURES, evaluate, mean_metrics, read_trec_qrels, read_trec_run
from diffret.retrieval.evaluation.arrays import evaluate_tables

TREC_EVAL_TEST = SHARED / "data" / "trec_eval_test"

# Measures compared with trec_eval: the brief's five, plus the counts and gm_map that check the aggregation.
REF_MEASURES = ("map", "P_5", "ndcg_cut_10", "recip_rank", "recall_1000", "num_ret", "num_rel", "num_rel_ret", "gm_map")

pytestmark = pytest.mark.e2e


def as_dict(table: pa.Table) -> dict[tuple[str, str], float]:
    rows = zip(*(table.column(c).to_pylist() for c in ("query_id", "measure", "value")), strict=True)
    return {(q, m): v for q, m, v in rows}


@pytest.fixture
def trec_eval_test() -> Path:
    if not (TREC_EVAL_TEST / "CASES.tsv").exists() or not (TREC_EVAL_TEST / "test" / "out.test.aq").exists():
        pytest.skip(f"trec_eval reference data not found at {TREC_EVAL_TEST}")
    return TREC_EVAL_TEST


def read_cases(base: Path) -> dict[tuple[str, str], tuple[str, str]]:
    """CASES.tsv: (expected output, qrels) -> (run, trec_eval options)."""
    lines = (base / "CASES.tsv").read_text().splitlines()
    header = lines[0].split("\t")
    cases = {}
    for line in lines[1:]:
        fields = (line.split("\t") + [""] * len(header))[: len(header)]  # the options field may be empty
        row = dict(zip(header, fields, strict=True))
        if row["expected_output"]:
            cases[(row["expected_output"], row["qrels"])] = (row["run"], row["trec_eval_options"])
    return cases


def qrels_table(qrels: dict) -> pa.Table:
    rows = [(q, d, g) for q, docs in qrels.items() for d, g in docs.items()]
    return pa.table({c: [r[j] for r in rows] for j, c in enumerate(("query_id", "doc_id", "relevance"))})


def run_table(run: dict) -> pa.Table:
    """A run dict as a table with its raw (float64) scores; ranks in file order (``ties="score"`` reads scores)."""
    rows = [(q, d, i, s) for q, docs in run.items() for i, (d, s) in enumerate(docs.items(), 1)]
    return pa.table({c: [r[j] for r in rows] for j, c in enumerate(("query_id", "doc_id", "rank", "score"))})


def read_reference(path: Path) -> dict[tuple[str, str], str]:
    """trec_eval output lines ``measure <ws> qid <ws> value`` -> {(measure, qid): value text}."""
    out = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        assert len(fields) == 3, f"{path}:{lineno}: {line!r}"
        out[(fields[0], fields[1])] = fields[2]
    return out


@pytest.mark.parametrize(
    ("expected", "qrels_name"),
    [
        ("test/out.test.aq", "test/qrels.test"),  # -m all_trec -q: the main reference
        ("test/out.test.aql", "test/qrels.rel_level"),  # -l2: graded qrels (-1..4), relevance level 2
        ("test/out.test.aqc", "test/qrels.test"),  # -c on a truncated run: query 302 retrieved nothing
        ("test/out.test", "test/qrels.test.with-comments"),  # comment lines, '#' inside a docno
        ("test/out.comment.test", "test/qrels.comment.test"),  # 301 run queries, 31 judged; comments in the run
    ],
)
def test_reproduces_trec_eval_reference(trec_eval_test: Path, expected: str, qrels_name: str) -> None:
    run_name, options = read_cases(trec_eval_test)[(expected, qrels_name)]
    level_opt = re.search(r"-l\s*(\d+)", options)
    level = int(level_opt.group(1)) if level_opt else 1
    complete = re.search(r"(^|\s)-c(\s|$)", options) is not None  # -c: average over every judged query

    qrels = read_trec_qrels(trec_eval_test / qrels_name)
    run = read_trec_run(trec_eval_test / run_name)  # raw scores: trec_eval ranks by score, not by rank column
    table = evaluate(qrels, run, REF_MEASURES, relevance_level=level)
    ours = as_dict(table)
    # the vectorised evaluator (the evaluate stage's) on the same run as a table, by score: the same values
    assert evaluate_tables(qrels_table(qrels), run_table(run), REF_MEASURES, level, ties="score").equals(table)
    ref = read_reference(trec_eval_test / expected)

    # per-query rows (present with -q)
    per_query = {k: float(v) for k, v in ref.items() if k[1] != "all" and k[0] in REF_MEASURES}
    assert ("-q" in options) == bool(per_query)
    for (measure, qid), value in per_query.items():
        assert ours[(qid, measure)] == pytest.approx(value, abs=1e-4), (measure, qid)
    if per_query:
        averaged = set(qrels) if complete else set(qrels) & set(run)
        assert {qid for _, qid in per_query} == averaged
        assert {"map", "P_5", "ndcg_cut_10", "recip_rank", "recall_1000"} <= {m for m, _ in per_query}

    # 'all' rows: trec_eval averages over the run's judged queries, or over all judged queries with -c
    means = mean_metrics(table, query_ids=None if complete else run.keys())
    compared = [m for m in REF_MEASURES if (m, "all") in ref]
    assert {"map", "P_5", "recip_rank"} <= set(compared)
    for measure in compared:
        assert means[measure] == pytest.approx(float(ref[(measure, "all")]), abs=1e-4), measure
    n_averaged = len(set(qrels) if complete else set(qrels) & set(run))
    assert int(ref[("num_q", "all")]) == n_averaged
    if complete:
        assert n_averaged == len(table) // len(REF_MEASURES)


def test_missing_query_matches_trec_eval_c(trec_eval_test: Path) -> None:
    """Query 302 has judgments but no results in results.trunc: it is kept and scores 0 (trec_eval -c)."""
    qrels = read_trec_qrels(trec_eval_test / "test" / "qrels.test")
    run = read_trec_run(trec_eval_test / "test" / "results.trunc")
    assert "302" in qrels and "302" not in run
    ours = as_dict(evaluate(qrels, run, (*DEFAULT_MEASURES, "map", "P_5", "recip_rank")))
    for measure in (*DEFAULT_MEASURES, "map", "P_5", "recip_rank"):
        assert ours[("302", measure)] == 0.0
