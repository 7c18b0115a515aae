"""retrieval.evaluation on small hand-computed cases (trec_eval's own reference output: tests/e2e)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from scipy import stats

from diffret.retrieval.evaluation import (
    DEFAULT_MEASURES,
    TTest,
    evaluate,
    mean_metrics,
    paired_ttest,
    qrels_from_table,
    read_trec_qrels,
    read_trec_run,
    run_from_table,
    run_to_table,
    trec_order,
    write_trec_run,
)
from diffret.schemas import METRICS_SCHEMA, RUN_SCHEMA


def run_table(rows: list[tuple[str, str, int, float]]) -> pa.Table:
    q, d, r, s = (list(c) for c in zip(*rows, strict=True))
    return pa.table(
        {
            "query_id": pa.array(q, pa.string()),
            "doc_id": pa.array(d, pa.string()),
            "rank": pa.array(r, pa.int32()),
            "score": pa.array(s, pa.float32()),
        },
        schema=RUN_SCHEMA,
    )


def metrics_table(values: dict[str, float], measure: str = "ndcg_cut_10") -> pa.Table:
    q = list(values)
    return pa.Table.from_arrays(
        [pa.array(q, pa.string()), pa.array([measure] * len(q), pa.string()), pa.array(list(values.values()))],
        schema=METRICS_SCHEMA,
    )


def as_dict(table: pa.Table) -> dict[tuple[str, str], float]:
    rows = zip(*(table.column(c).to_pylist() for c in ("query_id", "measure", "value")), strict=True)
    return {(q, m): v for q, m, v in rows}


# ------------------------------------------------------------------------- trec_eval reference output


# ------------------------------------------------------------------------------- measures, by hand


def test_mrr_is_recip_rank_cut_at_10() -> None:
    rows = [("q1", f"d{i:02d}", i, 1.0 - i / 100) for i in range(1, 16)]
    rows += [("q2", f"d{i:02d}", i, 1.0 - i / 100) for i in range(1, 16)]
    qrels = {"q1": {"d11": 1, "d01": 0}, "q2": {"d03": 1}}
    m = as_dict(evaluate(qrels, run_from_table(run_table(rows)), ("mrr_10", "recip_rank", "mrr_2", "mrr_5")))
    assert m[("q1", "mrr_10")] == 0.0
    assert m[("q1", "recip_rank")] == pytest.approx(1 / 11)
    assert m[("q2", "mrr_10")] == pytest.approx(1 / 3)
    assert m[("q2", "recip_rank")] == pytest.approx(1 / 3)
    assert m[("q2", "mrr_5")] == pytest.approx(1 / 3)
    assert m[("q2", "mrr_2")] == 0.0


def test_relevance_level_two_binary_measures_but_graded_ndcg() -> None:
    # ranking a (grade 1), c (grade 0), b (grade 2); e (grade 1) not retrieved
    qrels = {"q": {"a": 1, "b": 2, "c": 0, "e": 1}}
    run = {"q": {"a": 3.0, "c": 2.0, "b": 1.0}}
    measures = ("ndcg_cut_10", "mrr_10", "recall_100", "recall_1000", "P_5")
    lvl2 = as_dict(evaluate(qrels, run, measures, relevance_level=2))
    lvl1 = as_dict(evaluate(qrels, run, measures, relevance_level=1))
    # only b counts as relevant at level 2
    assert lvl2[("q", "mrr_10")] == pytest.approx(1 / 3)
    assert lvl2[("q", "recall_100")] == pytest.approx(1.0)
    assert lvl2[("q", "P_5")] == pytest.approx(1 / 5)
    assert lvl1[("q", "mrr_10")] == pytest.approx(1.0)
    assert lvl1[("q", "recall_100")] == pytest.approx(2 / 3)
    assert lvl1[("q", "P_5")] == pytest.approx(2 / 5)
    # NDCG keeps graded gains (grade 1 earns gain at level 2 too): DCG = 1/log2(2) + 2/log2(4); ideal b, a, e
    ndcg = (1 + 2 / 2) / (2 + 1 / math.log2(3) + 1 / 2)
    assert lvl2[("q", "ndcg_cut_10")] == pytest.approx(ndcg)
    assert lvl1[("q", "ndcg_cut_10")] == pytest.approx(ndcg)


def test_missing_query_scores_zero_and_unjudged_query_ignored() -> None:
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}}
    run = {"q1": {"a": 1.0}, "q3": {"b": 1.0}}
    measures = (*DEFAULT_MEASURES, "map", "P_5", "recip_rank")
    table = evaluate(qrels, run, measures)
    m = as_dict(table)
    assert {q for q, _ in m} == {"q1", "q2"}
    assert all(m[("q1", name)] == pytest.approx(1.0 if name != "P_5" else 0.2) for name in measures)
    assert all(m[("q2", name)] == 0.0 for name in measures)
    assert mean_metrics(table)["ndcg_cut_10"] == pytest.approx(0.5)  # q2 is never dropped from the mean
    assert mean_metrics(table, query_ids=run.keys())["ndcg_cut_10"] == pytest.approx(1.0)  # trec_eval without -c


def test_all_zero_judgments_kept_and_empty_judgments_skipped() -> None:
    """pytrec_eval keeps a query whose judgments are all 0 (every measure 0) but drops one with no judgments."""
    qrels = {"zero": {"a": 0, "b": 0}, "ok": {"a": 1}, "empty": {}}
    run = {"zero": {"a": 2.0, "b": 1.0}, "ok": {"a": 1.0}, "empty": {"a": 1.0}}
    m = as_dict(evaluate(qrels, run, (*DEFAULT_MEASURES, "map")))
    assert {q for q, _ in m} == {"zero", "ok"}
    assert all(m[("zero", name)] == 0.0 for name in (*DEFAULT_MEASURES, "map"))
    assert evaluate({"empty": {}}, run).num_rows == 0


def test_rank_order_wins_over_score_ties_and_disagreeing_scores() -> None:
    # our runs break score ties by doc_id ascending; pytrec_eval on raw scores breaks them by doc_id descending
    tied = run_table([("q", "a", 1, 1.0), ("q", "b", 2, 1.0), ("q", "c", 3, 1.0)])
    qrels = {"q": {"a": 1}}
    assert run_from_table(tied) == {"q": {"a": -1.0, "b": -2.0, "c": -3.0}}
    assert as_dict(evaluate(qrels, run_from_table(tied), ("mrr_10",)))[("q", "mrr_10")] == 1.0
    by_score = as_dict(evaluate(qrels, run_from_table(tied, order="score"), ("mrr_10",)))
    assert by_score[("q", "mrr_10")] == pytest.approx(1 / 3)  # c, b, a
    # ranks that disagree with the scores: the ranks win by default
    odd = run_table([("q", "x", 1, 0.1), ("q", "y", 2, 0.9)])
    assert as_dict(evaluate({"q": {"x": 1}}, run_from_table(odd), ("recip_rank",)))[("q", "recip_rank")] == 1.0
    raw = as_dict(evaluate({"q": {"x": 1}}, run_from_table(odd, order="score"), ("recip_rank",)))
    assert raw[("q", "recip_rank")] == 0.5


def test_trec_order_and_run_to_table() -> None:
    run = {"q2": {"a": 1.0, "b": 1.0, "c": 2.0}, "q1": {"z": 0.5}}
    assert trec_order(run["q2"]) == [("c", 2.0), ("b", 1.0), ("a", 1.0)]
    table = run_to_table(run)
    assert table.schema == RUN_SCHEMA
    assert table.column("query_id").to_pylist() == ["q1", "q2", "q2", "q2"]
    assert table.column("doc_id").to_pylist() == ["z", "c", "b", "a"]
    assert table.column("rank").to_pylist() == [1, 1, 2, 3]
    qrels = {"q2": {"a": 1, "b": 2}, "q1": {"z": 1}}
    measures = ("ndcg_cut_10", "mrr_10", "map")
    assert evaluate(qrels, run_from_table(table), measures).equals(evaluate(qrels, run, measures))


def test_run_from_table_rejects_bad_tables() -> None:
    with pytest.raises(ValueError, match="document 'a' appears twice for query 'q'"):
        run_from_table(run_table([("q", "a", 1, 1.0), ("q", "a", 2, 0.5)]))
    with pytest.raises(ValueError, match="repeated ranks"):
        run_from_table(run_table([("q", "a", 1, 1.0), ("q", "b", 1, 0.5)]))
    with pytest.raises(ValueError, match="lacks column"):
        run_from_table(pa.table({"query_id": ["q"], "doc_id": ["a"]}))
    with pytest.raises(ValueError, match="null"):
        run_from_table(pa.table({"query_id": ["q", None], "doc_id": ["a", "b"], "rank": [1, 2]}))
    with pytest.raises(ValueError, match="order must be"):
        run_from_table(run_table([("q", "a", 1, 1.0)]), order="doc")  # type: ignore[arg-type]


def test_qrels_from_table() -> None:
    table = pa.table(
        {
            "query_id": ["q1", "q1", "q2", "q2"],
            "doc_id": ["a", "b", "a", "a"],
            "relevance": pa.array([2, 0, 1, 1], pa.int32()),
            "split": ["test"] * 4,
        }
    )
    assert qrels_from_table(table) == {"q1": {"a": 2, "b": 0}, "q2": {"a": 1}}
    conflicting = table.set_column(2, "relevance", pa.array([2, 0, 1, 3], pa.int32()))
    with pytest.raises(ValueError, match="judged both 1 and 3"):
        qrels_from_table(conflicting)


def test_evaluate_output_and_measure_checks() -> None:
    qrels = {"b": {"x": 1}, "a": {"x": 1}}
    table = evaluate(qrels, {"a": {"x": 1.0}})
    assert table.schema == METRICS_SCHEMA
    assert table.column("query_id").to_pylist() == ["a"] * 4 + ["b"] * 4
    assert table.column("measure").to_pylist() == list(DEFAULT_MEASURES) * 2
    assert evaluate({}, {"a": {"x": 1.0}}).num_rows == 0
    with pytest.raises(ValueError, match="unknown measure 'mrr'"):
        evaluate(qrels, {}, ("mrr",))
    with pytest.raises(ValueError, match="ndcg_cut_10"):
        evaluate(qrels, {}, ("ndcg_cut.10",))
    with pytest.raises(ValueError, match="P_5"):
        evaluate(qrels, {}, ("P",))
    with pytest.raises(ValueError, match="not numeric"):
        evaluate(qrels, {}, ("runid",))
    with pytest.raises(TypeError, match="run_from_table"):
        evaluate(qrels, run_table([("a", "x", 1, 1.0)]))  # type: ignore[arg-type]


def test_mean_metrics_aggregates_like_trec_eval() -> None:
    table = pa.Table.from_arrays(
        [
            pa.array(["a", "a", "b", "b", "c"], pa.string()),
            pa.array(["ndcg_cut_10", "num_ret", "ndcg_cut_10", "num_ret", "ndcg_cut_10"], pa.string()),
            pa.array([1.0, 10.0, 0.5, 5.0, 0.0]),
        ],
        schema=METRICS_SCHEMA,
    )
    assert mean_metrics(table) == {"ndcg_cut_10": pytest.approx(0.5), "num_ret": 15.0}
    assert mean_metrics(table, query_ids=["a", "b"]) == {"ndcg_cut_10": pytest.approx(0.75), "num_ret": 15.0}


# ------------------------------------------------------------------------------------- TREC files


def test_trec_run_round_trip(tmp_path: Path) -> None:
    table = run_table(
        [("q2", "d9", 2, 0.25), ("q1", "d1", 1, 3.14159), ("q2", "d3", 1, 0.25), ("q1", "d2", 2, 1e-7)]
    )  # unordered rows, a score tie, float32 scores
    path = tmp_path / "run.trec"
    assert write_trec_run(table, path, "mytag") == 4
    lines = [line.split() for line in path.read_text().splitlines()]
    assert [(f[0], f[1], f[2], f[3], f[5]) for f in lines] == [
        ("q1", "Q0", "d1", "1", "mytag"),
        ("q1", "Q0", "d2", "2", "mytag"),
        ("q2", "Q0", "d3", "1", "mytag"),
        ("q2", "Q0", "d9", "2", "mytag"),
    ]
    back = read_trec_run(path)
    assert back == run_from_table(table, order="score")  # float32 scores come back exactly
    assert back["q1"]["d1"] == float(np.float32(3.14159)) != 3.14159
    # a run dict is written in trec_order (the 0.25 tie: d9 before d3); rows by their given ranks
    write_trec_run(back, path, "t")
    ranked = [line.split()[2:4] for line in path.read_text().splitlines()]
    assert ranked == [["d1", "1"], ["d2", "2"], ["d9", "1"], ["d3", "2"]]
    write_trec_run([("q", "b", 2, 0.5), ("q", "a", 1, 0.5)], path, "t")
    assert path.read_text() == "q Q0 a 1 0.5 t\nq Q0 b 2 0.5 t\n"
    with pytest.raises(ValueError, match="doc_id 'a b'"):
        write_trec_run([("q", "a b", 1, 0.5)], path, "t")
    assert path.read_text() == "q Q0 a 1 0.5 t\n" + "q Q0 b 2 0.5 t\n"  # a failed write leaves the old file
    with pytest.raises(ValueError, match="tag"):
        write_trec_run(table, path, "two words")


def test_read_trec_run_format(tmp_path: Path) -> None:
    path = tmp_path / "run.txt"
    path.write_text("# comment\nq1 Q0 d#1 7 1.5 tag extra fields ignored\n\n  q1\tQ0\td2\t1\t-2e-3\ttag\n")
    assert read_trec_run(path) == {"q1": {"d#1": 1.5, "d2": -0.002}}


@pytest.mark.parametrize(
    ("body", "line", "message"),
    [
        ("q1 Q0 d1 1 1.0 t\nq1 Q0 d2 2 t\n", 2, "needs at least 6"),
        ("q1 Q0 d1 1 1.0 t\n\n# c\nq1 Q0 d2 2 high t\n", 4, "score 'high' is not a number"),
        ("q1 Q0 d1 1 nan t\n", 1, "NaN"),
        ("q1 Q0 d1 1 1.0 t\nq1 Q0 d1 2 0.5 t\n", 2, "appears twice"),
    ],
)
def test_read_trec_run_errors_name_file_and_line(tmp_path: Path, body: str, line: int, message: str) -> None:
    path = tmp_path / "bad.run"
    path.write_text(body)
    with pytest.raises(ValueError, match=re.escape(f"{path}:{line}: ") + ".*" + re.escape(message)):
        read_trec_run(path)


def test_read_trec_qrels(tmp_path: Path) -> None:
    path = tmp_path / "qrels.txt"
    path.write_text("# header\n1 0 a 2\n1 0 CR#93 0\n2 Q0 b -1\n1 0 a 2\n")
    assert read_trec_qrels(path) == {"1": {"a": 2, "CR#93": 0}, "2": {"b": -1}}
    for body, line, message in [
        ("1 0 a 1\n1 0 b\n", 2, "needs 4"),
        ("1 0 a 1 extra\n", 1, "needs 4"),
        ("1 0 a 1\n1 0 b 0.5\n", 2, "relevance '0.5' is not an integer"),
        ("1 0 a 1\n1 0 a 2\n", 2, "judged both 1 and 2"),
    ]:
        path.write_text(body)
        with pytest.raises(ValueError, match=re.escape(f"{path}:{line}: ") + ".*" + re.escape(message)):
            read_trec_qrels(path)


# ------------------------------------------------------------------------------------------ t-test


def test_paired_ttest_hand_computed() -> None:
    a = {"q1": 0.3, "q2": 0.5, "q3": 0.9, "q4": 0.1}
    b = {"q1": 0.2, "q2": 0.5, "q3": 0.4, "q4": 0.0}
    res = paired_ttest(metrics_table(a), metrics_table(b))  # the one measure in the tables
    # differences 0.1, 0, 0.5, 0.1: mean 0.175, sample variance 0.1475 / 3, t = 0.175 / sqrt(0.1475 / 12)
    t = 0.175 / math.sqrt(0.1475 / 12)
    assert isinstance(res, TTest)
    assert (res.measure, res.n) == ("ndcg_cut_10", 4)
    assert res.mean_a == pytest.approx(0.45) and res.mean_b == pytest.approx(0.275)
    assert res.diff == pytest.approx(0.175)
    assert res.t == pytest.approx(t) and res.t == pytest.approx(1.5784566588)
    assert res.p_value == pytest.approx(2 * stats.t.sf(t, df=3))
    ref = stats.ttest_rel(list(a.values()), list(b.values()))
    assert (res.t, res.p_value) == pytest.approx((ref.statistic, ref.pvalue))
    back = paired_ttest(metrics_table(b), metrics_table(a), "ndcg_cut_10")
    assert back.t == pytest.approx(-t) and back.p_value == pytest.approx(res.p_value)


def test_paired_ttest_degenerate_cases() -> None:
    a = {"q1": 0.3, "q2": 0.5, "q3": 0.9}
    same = paired_ttest(metrics_table(a), metrics_table(dict(a)))
    assert (same.n, same.diff, same.t, same.p_value) == (3, 0.0, 0.0, 1.0)
    shifted = paired_ttest(metrics_table({"q1": 1.0, "q2": 2.0}), metrics_table({"q1": 0.0, "q2": 1.0}))
    assert (shifted.t, shifted.p_value) == (math.inf, 0.0)


def test_paired_ttest_query_sets_and_measures() -> None:
    a = metrics_table({"q1": 0.3, "q2": 0.5, "q3": 0.9, "q4": 0.2})
    b = metrics_table({"q1": 0.2, "q2": 0.5, "q3": 0.4, "q5": 0.7, "q6": 0.1})
    with pytest.raises(ValueError, match=r"1 only in a.*2 only in b.*allow_subset=True.*3 common"):
        paired_ttest(a, b)
    res = paired_ttest(a, b, allow_subset=True)
    assert res.n == 3
    assert res.t == pytest.approx(stats.ttest_rel([0.3, 0.5, 0.9], [0.2, 0.5, 0.4]).statistic)
    two = pa.concat_tables([a, metrics_table({"q1": 1.0}, "mrr_10")])
    with pytest.raises(ValueError, match="name the one to test"):
        paired_ttest(two, a)
    with pytest.raises(ValueError, match="no rows for measure 'map'"):
        paired_ttest(a, a, "map")
    with pytest.raises(ValueError, match="at least 2 common queries"):
        paired_ttest(metrics_table({"q1": 0.1}), metrics_table({"q1": 0.2}))
