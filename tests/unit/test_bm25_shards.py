"""BM25 a shard at a time: the whole-corpus index's scores bit for bit, its runs up to the documents tied
at the cut-off, for every bm25s variant; memory held is one shard's index."""

from __future__ import annotations

import numpy as np
import pytest

from diffret.retrieval.search.bm25 import BM25Settings, bm25_search, bm25_search_shards

WORDS = (
    "cat dog bird fish tree river stone cloud rain wind sun moon star light dark fast slow big small red "
    "green blue old new running runs ran the a of and"
).split()


def _corpus(n: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 12)))) for _ in range(n)]
    docs[5] = "the a of and"  # stopwords only: no terms
    queries = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 5)))) for _ in range(40)]
    queries[0] = "the of"  # nothing to match
    queries[1] = "cat cat running runs"  # a repeated term and two words of one stem
    return [f"d{i}" for i in range(n)], docs, queries


def _shards(ids: list[str], docs: list[str], size: int):  # noqa: ANN202
    return lambda: ((ids[s : s + size], docs[s : s + size]) for s in range(0, len(docs), size))


@pytest.mark.parametrize("method", ["lucene", "robertson", "atire", "bm25l", "bm25+"])
def test_shards_score_as_the_whole_index_bit_for_bit(method: str) -> None:
    ids, docs, queries = _corpus(400)
    s = BM25Settings(method=method)
    k = 25
    whole = bm25_search(docs, queries, k, s)
    every = bm25_search(docs, queries, len(docs), s)  # every document's score, to check each kept one
    score_of = [
        dict(zip(row_i.tolist(), row_s.tolist(), strict=True))
        for row_i, row_s in zip(every.index, every.scores, strict=True)
    ]
    for size in (1, 37, 100, 399, 400, 1000):
        top, hit_ids = bm25_search_shards(_shards(ids, docs, size), queries, k, s)
        assert top.scores.shape == whole.scores.shape
        assert top.scores.tobytes() == whole.scores.tobytes(), (method, size)  # the same scores at every rank
        for q in range(len(queries)):
            kept = top.index[q][top.index[q] >= 0]
            got = [int(hit_ids[i][1:]) for i in kept]
            assert [score_of[q][d] for d in got] == top.scores[q][: len(got)].tolist()  # each its own score
            want = whole.index[q][whole.index[q] >= 0].tolist()
            if got:  # the same documents above the cut-off score; at it, the first in corpus order
                cut = top.scores[q][len(got) - 1]
                above = [d for d in want if score_of[q][d] > cut]
                assert sorted(d for d in got if score_of[q][d] > cut) == sorted(above)
                tied = sorted(d for d, v in score_of[q].items() if v == cut)
                assert sorted(d for d in got if score_of[q][d] == cut) == tied[: len(got) - len(above)]
    assert (top.index[0] == -1).all()  # stopwords only: nothing retrieved


def test_shards_drop_self_hits_and_return_only_the_retrieved_ids() -> None:
    ids, docs, queries = _corpus(120, seed=1)
    qids = [f"d{i}" for i in range(len(queries))]  # query i shares document i's id
    queries = [docs[i] for i in range(len(queries))]
    whole = bm25_search(docs, queries, 10, None, qids, ids, ignore_identical_ids=True)
    top, hit_ids = bm25_search_shards(_shards(ids, docs, 50), queries, 10, None, qids, ignore_identical_ids=True)
    assert top.scores.tobytes() == whole.scores.tobytes()
    for q, qid in enumerate(qids):
        assert qid not in [hit_ids[i] for i in top.index[q] if i >= 0]
    assert len(hit_ids) == len(set(hit_ids)) <= top.index.size
    assert sorted(set(top.index[top.index >= 0].tolist())) == list(range(len(hit_ids)))
    with pytest.raises(ValueError, match="needs query_ids"):
        bm25_search_shards(_shards(ids, docs, 50), queries, 10, ignore_identical_ids=True)
    with pytest.raises(ValueError, match="empty corpus"):
        bm25_search_shards(lambda: iter([]), queries, 10)
