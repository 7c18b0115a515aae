"""The late stage's passage ids as Arrow arrays (no Python object per corpus passage): the first-stage top
per query, the lookups of ids to corpus positions, and runs written over the retrieved documents only."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from diffret.retrieval.search.runs import retrieved_ids, run_table
from diffret.retrieval.search.scoring import TopK
from diffret.stages.late import _positions, _top
from diffret.storage import StoreError


def test_first_stage_top_per_query_in_rank_order() -> None:
    rng = np.random.default_rng(0)
    corpus = [f"p{i:03d}" for i in rng.permutation(300)]
    rows = []
    for q in ("q2", "q10", "q1"):
        docs = rng.choice(300, size=40, replace=False)
        ranks = rng.permutation(np.arange(1, 41))  # stored in any order
        rows += [
            {"query_id": q, "doc_id": corpus[d], "rank": int(r), "score": 1.0} for d, r in zip(docs, ranks, strict=True)
        ]
    run = pa.Table.from_pylist(rows)
    got = _top(run, 25, pa.array(corpus))
    position = {d: i for i, d in enumerate(corpus)}
    for q in ("q2", "q10", "q1"):
        want = [position[r["doc_id"]] for r in sorted((r for r in rows if r["query_id"] == q), key=lambda r: r["rank"])]
        assert got[q].tolist() == want[:25]
    assert _top(run.slice(0, 0), 25, pa.array(corpus)) == {}


def test_an_id_the_corpus_lacks_is_refused_naming_it() -> None:
    corpus = pa.array(["a", "b", "c"])
    assert _positions(corpus, pa.array(["c", "a"]), "x").tolist() == [2, 0]
    run = pa.Table.from_pylist([{"query_id": "q", "doc_id": "zz", "rank": 1, "score": 1.0}])
    with pytest.raises(StoreError, match="first-stage run names passage 'zz'"):
        _top(run, 10, corpus)


def test_runs_over_the_retrieved_ids_equal_runs_over_the_corpus() -> None:
    rng = np.random.default_rng(1)
    corpus = [f"d{rng.integers(10**6)}" for _ in range(500)]
    scores = np.round(rng.random((6, 20)), 1).astype(np.float32)  # ties, broken by doc id
    index = np.stack([rng.choice(500, 20, replace=False) for _ in range(6)])
    index[0, 15:] = -1
    scores[0, 15:] = -np.inf
    tops = {(1, "m"): TopK(scores, index)}
    small, ids = retrieved_ids(tops, pa.array(corpus))
    assert len(ids) == len(set(index[index >= 0].tolist()))
    queries = [f"q{i}" for i in range(6)]
    assert run_table(small[(1, "m")], queries, ids).equals(run_table(tops[(1, "m")], queries, corpus))
