"""The vectorised evaluator (retrieval/evaluation/arrays.py) against pytrec_eval (``evaluate`` on dicts), query by
query and bit for bit, on random runs with score ties, unjudged and unretrieved documents, judged queries without
results, runs of unjudged queries, graded qrels at relevance levels 1 and 2, in each tie order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from retrieval.evaluation import evaluate, qrels_from_table, run_from_table
from retrieval.evaluation.arrays import evaluate_tables, supported

MEASURES = ["ndcg_cut_10", "mrr_10", "recall_100", "recall_1000", "ndcg_cut_3", "P_5", "map", "recip_rank", "ndcg",
            "success_1", "mrr_2", "num_ret", "num_rel", "num_rel_ret", "bpref"]  # fmt: skip


def random_case(seed: int, negative: bool = False) -> tuple[pa.Table, pa.Table]:
    rng = np.random.default_rng(seed)
    n_q, n_d = int(rng.integers(1, 30)), int(rng.integers(5, 300))
    docs = [f"d{i}" for i in range(n_d)]
    q_rows, d_rows, g_rows = [], [], []
    for q in range(n_q):
        if rng.random() < 0.1:
            continue  # a run query without judgments
        for d in rng.choice(n_d, size=int(rng.integers(1, min(n_d, 40))), replace=False):
            q_rows.append(f"q{q}")
            d_rows.append(docs[d])
            g_rows.append(int(rng.integers(-1 if negative else 0, 4)))
    qrels = pa.table({"query_id": q_rows, "doc_id": d_rows, "relevance": pa.array(g_rows, pa.int32())})
    rq, rd, rr, rs = [], [], [], []
    for q in range(n_q + 3):  # three judged-or-not queries beyond: some judged queries have no results at all
        if rng.random() < 0.15:
            continue
        picked = rng.choice(n_d, size=int(rng.integers(1, n_d)), replace=False)
        scores = np.round(rng.normal(size=len(picked)), int(rng.integers(0, 3)))  # rounding makes ties
        order = np.lexsort((picked, -scores))  # rank by score, ties by doc index
        for rank, i in enumerate(order, 1):
            rq.append(f"q{q}")
            rd.append(docs[picked[i]])
            rr.append(rank)
            rs.append(float(scores[i]))
    run = pa.table({"query_id": rq, "doc_id": rd, "rank": pa.array(rr, pa.int32()),
                    "score": pa.array(rs, pa.float32())})  # fmt: skip
    return qrels, run


def reference(qrels: pa.Table, run: pa.Table, level: int, ties: str) -> pa.Table:
    if ties == "trec":
        ordered = run.sort_by([("query_id", "ascending"), ("rank", "ascending")])
        return evaluate(qrels_from_table(qrels), run_from_table(ordered, order="score"), MEASURES, level, ranked=True)
    return evaluate(qrels_from_table(qrels), run_from_table(run, order=ties), MEASURES, level)


@pytest.mark.parametrize("ties", ["rank", "trec", "score"])
@pytest.mark.parametrize("level", [1, 2])
def test_equal_to_pytrec_eval_bit_for_bit(ties: str, level: int) -> None:
    for seed in range(25):
        qrels, run = random_case(seed)
        shuffled = run.take(pa.array(np.random.default_rng(seed).permutation(len(run))))  # stored order is no help
        got = evaluate_tables(qrels, shuffled, MEASURES, level, ties=ties)
        want = reference(qrels, run, level, ties)
        assert got.equals(want), (seed, ties, level)


def test_negative_grades_and_other_measures_go_to_pytrec_eval() -> None:
    qrels, run = random_case(3, negative=True)
    assert evaluate_tables(qrels, run, MEASURES, 1).equals(reference(qrels, run, 1, "rank"))
    assert supported("ndcg_cut_10") and not supported("bpref")


def test_bad_runs_are_refused_as_run_from_table_refuses() -> None:
    qrels = pa.table({"query_id": ["q"], "doc_id": ["a"], "relevance": [1]})

    def run(docs: list[str], ranks: list[int]) -> pa.Table:
        return pa.table({"query_id": ["q"] * len(docs), "doc_id": docs, "rank": ranks, "score": [1.0] * len(docs)})

    with pytest.raises(ValueError, match="appears twice for query 'q'"):
        evaluate_tables(qrels, run(["a", "a"], [1, 2]), ["ndcg_cut_10"])
    with pytest.raises(ValueError, match="repeated ranks"):
        evaluate_tables(qrels, run(["a", "b"], [1, 1]), ["ndcg_cut_10"])
    with pytest.raises(ValueError, match="unknown measure"):
        evaluate_tables(qrels, run(["a"], [1]), ["ndcg_at_ten"])
    # by score, repeated ranks are no matter: tied scores by doc_id descending, "b" before "a"
    value = evaluate_tables(qrels, run(["a", "b"], [1, 1]), ["ndcg_cut_10"], ties="score").column("value")[0].as_py()
    assert value == pytest.approx(1 / np.log2(3))
