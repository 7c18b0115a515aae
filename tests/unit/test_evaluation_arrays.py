"""The vectorised evaluator (retrieval/evaluation/arrays.py) against pytrec_eval (``evaluate`` on dicts), query by
query and bit for bit, on random runs with score ties, unjudged and unretrieved documents, judged queries without
results, runs of unjudged queries, graded qrels at relevance levels 1 and 2, in each tie order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from diffret.retrieval.evaluation import arrays, evaluate, qrels_from_table, run_from_table
from diffret.retrieval.evaluation.arrays import evaluate_tables, supported

MEASURES = [
    "ndcg_cut_10",
    "mrr_10",
    "recall_100",
    "recall_1000",
    "ndcg_cut_3",
    "P_5",
    "map",
    "recip_rank",
    "ndcg",
    "success_1",
    "mrr_2",
    "num_ret",
    "num_rel",
    "num_rel_ret",
    "bpref",
]


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
    run = pa.table(
        {"query_id": rq, "doc_id": rd, "rank": pa.array(rr, pa.int32()), "score": pa.array(rs, pa.float32())}
    )
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


def reordered(run: pa.Table, seed: int, repeats: bool) -> pa.Table:
    """The run with ranks that disagree with its scores (a random order; ``repeats``: some ranks given twice)."""
    rng = np.random.default_rng(seed)
    q = np.array(run.column("query_id").to_pylist())
    rank = np.zeros(len(q), np.int32)
    for qid in np.unique(q):
        at = np.flatnonzero(q == qid)
        rank[at] = rng.permutation(len(at)) + 1
    if repeats:
        rank = np.where(rng.random(len(rank)) < 0.2, np.maximum(rank - 1, 1), rank)
    return run.set_column(run.schema.get_field_index("rank"), "rank", pa.array(rank))


@pytest.mark.parametrize("ties", ["rank", "trec", "score"])
def test_ranks_that_disagree_with_scores(ties: str) -> None:
    for seed in range(15):
        qrels, run = random_case(100 + seed)
        run = reordered(run, seed, repeats=ties != "rank")
        want = reference(qrels, run, 1, ties)
        assert evaluate_tables(qrels, run, MEASURES, 1, ties=ties).equals(want), (seed, ties)
        shuffled = run.take(pa.array(np.random.default_rng(seed).permutation(len(run))))
        if ties == "trec":  # repeated ranks keep the table's order: the reference reads the shuffled table
            want = reference(qrels, shuffled, 1, ties)
        assert evaluate_tables(qrels, shuffled, MEASURES, 1, ties=ties).equals(want), (seed, ties)


@pytest.mark.parametrize("ties", ["rank", "trec", "score"])
def test_stored_order_chunks_and_uneven_queries(ties: str) -> None:
    """The table as stored (grouped by query, in rank order: no sort), in several chunks, and queries of very
    unequal lengths (one long query among many short ones)."""
    for seed in range(10):
        qrels, run = random_case(200 + seed)
        chunked = pa.Table.from_batches(run.to_batches(max_chunksize=37))
        assert evaluate_tables(qrels, chunked, MEASURES, 2, ties=ties).equals(reference(qrels, run, 2, ties))
        distinct = run.set_column(3, "score", pc.cast(pc.subtract(1000, run.column("rank")), pa.float32()))
        assert evaluate_tables(qrels, distinct, MEASURES, 1, ties=ties).equals(reference(qrels, distinct, 1, ties))
    rng = np.random.default_rng(7)
    n = 3000
    docs = [f"doc-{i:05d}-with-a-longer-id" for i in range(n)]
    scores = np.round(rng.normal(size=n), 1)  # ties
    ranks = np.empty(n, np.int32)
    ranks[np.lexsort((np.arange(n), -scores))] = np.arange(1, n + 1)
    run = pa.table(
        {
            "query_id": ["long"] * n + [f"s{i}" for i in range(300)],
            "doc_id": docs + [docs[1]] * 300,
            "rank": pa.array(np.r_[ranks, np.ones(300, np.int32)]),
            "score": pa.array(np.r_[scores, np.zeros(300)], pa.float32()),
        }
    )
    run = run.take(pa.array(rng.permutation(len(run))))
    qrels = pa.table(
        {
            "query_id": ["long"] * 40 + ["s1", "s2"],
            "relevance": pa.array([1, 2] * 21, pa.int32()),
            "doc_id": [docs[i] for i in rng.choice(n, 40, replace=False)] + [docs[0], "absent"],
        }
    )
    assert evaluate_tables(qrels, run, MEASURES, 1, ties=ties).equals(reference(qrels, run, 1, ties))


def test_string_hashes() -> None:
    """Equal ids hash equal whatever their chunk, slice or string type; these distinct ids hash apart."""
    ids = [
        "",
        "a",
        "a\x00",
        "\x00",
        "abcdefgh",
        "abcdefgh\x00",
        "abcdefghi",
        "é",
        "e",
        "ABCDEFGHIJKLMNOPQ",
        "ABCDEFGHIJKLMNOPR",
        "msmarco_passage_00_123456789",
        "msmarco_passage_00_123456788",
        "12345678" * 5,
    ]
    h = arrays._hash_strings(pa.chunked_array([ids]))
    assert len(set(h.tolist())) == len(ids)
    for column in (
        pa.chunked_array([ids[:5], ids[5:]]),
        pa.chunked_array([pa.array(ids * 2).slice(len(ids))]),
        pa.chunked_array([pa.array(ids, pa.large_string())]),
        pa.chunked_array([ids], pa.large_binary()),
        pa.chunked_array([pa.array(ids, pa.string_view())]),
    ):
        assert arrays._hash_strings(column).tolist() == h.tolist()
    assert np.array_equal(arrays._hash_strings(pa.chunked_array([ids * 3]), block=5), np.tile(h, 3))


def test_hash_collisions_only_cost_a_string_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every id hashing alike: the repeat check compares the strings, which raise only on a real repeat."""
    monkeypatch.setattr(arrays, "_hash_strings", lambda column: np.zeros(len(column), np.uint64))
    qrels, run = random_case(5)
    assert evaluate_tables(qrels, run, MEASURES, 1, ties="trec").equals(reference(qrels, run, 1, "trec"))
    twice = pa.table({"query_id": ["q", "q", "r"], "doc_id": ["b", "a", "b"], "rank": [1, 2, 1], "score": [1.0] * 3})
    evaluate_tables(qrels, twice, ["ndcg_cut_10"])
    with pytest.raises(ValueError, match="document 'b' appears twice for query 'q'"):
        evaluate_tables(qrels, twice.set_column(1, "doc_id", pa.array(["b", "b", "b"])), ["ndcg_cut_10"])
