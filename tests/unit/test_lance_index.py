"""LanceDB multivector index: flat search equals brute-force MaxSim, IVF_PQ + over-fetch keeps recall, clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import lancedb
import numpy as np
import pytest

from diffret.retrieval.search import lance as li

H = 32
N_DOCS = 2000


def make_docs(n: int = N_DOCS, hidden: int = H, max_vectors: int = 8, seed: int = 0) -> tuple[list[str], list]:
    """Clustered float16 documents with 1..max_vectors vectors each (unnormalised)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((40, hidden)).astype(np.float32)
    ids, docs = [], []
    for i in range(n):
        c = centres[rng.integers(0, len(centres))]
        n_vec = int(rng.integers(1, max_vectors + 1))
        scale = rng.uniform(0.5, 3.0)  # unnormalised on purpose
        docs.append((scale * (c + rng.standard_normal((n_vec, hidden)))).astype(np.float16))
        ids.append(f"doc{i:05d}")
    return ids, docs


def make_queries(docs: list, n: int = 30, kq: int = 6, seed: int = 1) -> list[np.ndarray]:
    """Perturbed copies of some documents' vectors, so each query has a true neighbour."""
    rng = np.random.default_rng(seed)
    out = []
    for d in rng.choice(len(docs), size=n, replace=False):
        base = docs[d].astype(np.float32)
        pick = base[rng.integers(0, len(base), kq)]
        out.append(pick + 0.3 * np.linalg.norm(pick, axis=1, keepdims=True) * rng.standard_normal(pick.shape) / H**0.5)
    return out


def brute_force(ids: list[str], docs: list, queries: list[np.ndarray], k: int) -> list[list[tuple[str, float]]]:
    """Reference MaxSim: normalise, (1/K_q) * sum_i max_j <q_i, p_j>, top-k by score then id."""

    def unit(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    nd = [unit(d) for d in docs]
    out = []
    for q in queries:
        qn = unit(q)
        scores = [float((qn @ d.T).max(axis=1).sum() / len(qn)) for d in nd]
        out.append(sorted(zip(ids, scores, strict=True), key=lambda t: (-t[1], t[0]))[:k])
    return out


def in_batches(ids: list[str], docs: list, size: int = 500):
    for s in range(0, len(ids), size):
        yield ids[s : s + size], docs[s : s + size]


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list, list[np.ndarray]]:
    ids, docs = make_docs()
    return ids, docs, make_queries(docs)


@pytest.fixture(scope="module")
def db(corpus, tmp_path_factory) -> str:
    ids, docs, _ = corpus
    path = str(tmp_path_factory.mktemp("lance") / "db")
    assert li.build_table(path, in_batches(ids, docs), H) == N_DOCS
    return path


def assert_same_ranking(got: list[tuple[str, float]], want: list[tuple[str, float]], tol: float = 1e-4) -> None:
    assert len(got) == len(want)
    np.testing.assert_allclose([s for _, s in got], [s for _, s in want], atol=tol)
    for (gid, gs), (wid, ws) in zip(got, want, strict=True):
        assert gid == wid or abs(gs - ws) <= tol  # ids may only differ on (near) ties
    cut = want[-1][1] + tol  # every document clearly above the k-th score is found
    assert {d for d, s in want if s > cut} <= {d for d, _ in got}


def test_flat_search_equals_brute_force(db, corpus, capfd):
    ids, docs, queries = corpus
    li.create_index(db, "none")
    capfd.readouterr()
    got = li.search(db, queries, 10)
    # lance logs a deprecation warning on stderr per query unless the search names `_distance`
    assert "Deprecation warning" not in capfd.readouterr().err
    want = brute_force(ids, docs, queries, 10)
    for g, w in zip(got, want, strict=True):
        assert_same_ranking(g, w)
    assert len(got.stats.latencies_ms) == len(queries) and got.stats.p95_ms >= 0 and got.stats.mean_ms > 0
    assert got.stats.nprobes is None  # no index, nothing to probe


def test_lancedb_flat_distance_is_kq_minus_sum_of_max_cosines(db, corpus):
    """What LanceDB itself computes for a multivector cosine search: K_q - sum_i max_j cos(q_i, p_j)."""
    ids, docs, queries = corpus
    li.create_index(db, "none")
    tbl = lancedb.connect(db).open_table(li.TABLE)
    q = queries[0]
    res = tbl.search(li.l2_normalise(q), vector_column_name="vector").distance_type("cosine").limit(5).to_arrow()
    ref = dict(brute_force(ids, docs, [q], N_DOCS)[0])
    for doc_id, dist in zip(res["doc_id"].to_pylist(), res["_distance"].to_pylist(), strict=True):
        assert dist == pytest.approx(len(q) * (1 - ref[doc_id]), abs=1e-3)


def test_ivf_pq_default_overfetch_recall(db, corpus):
    ids, docs, queries = corpus
    info = li.create_index(db, "IVF_PQ")
    assert info.index_type == "IVF_PQ" and info.rows == N_DOCS and H % info.params["num_sub_vectors"] == 0
    assert li.index_info(db) == info
    want = brute_force(ids, docs, queries, 10)
    got = li.search(db, queries, 10)
    assert got.stats.limit == max(10 * li.DEFAULT_OVERFETCH, li.MIN_CANDIDATES)
    assert li.recall_at([[d for d, _ in w] for w in want], [[d for d, _ in g] for g in got], 10) >= 0.99
    # whatever is returned is scored exactly, whichever candidates the index found
    exact = {d: s for d, s in brute_force(ids, docs, queries[:1], N_DOCS)[0]}
    assert all(s == pytest.approx(exact[d], abs=1e-4) for d, s in got[0])
    li.create_index(db, "none")  # back to flat
    assert li.index_info(db) is None


def test_ivf_hnsw_sq_search(db, corpus):
    ids, docs, queries = corpus
    li.create_index(db, "IVF_HNSW_SQ")
    want = brute_force(ids, docs, queries, 10)
    got = li.search(db, queries, 10)
    assert li.recall_at([[d for d, _ in w] for w in want], [[d for d, _ in g] for g in got], 10) >= 0.95
    # under an index LanceDB's own distance is on another scale: ~ 2 * (K_q - sum_i max_j cos), quantised
    # (8-bit SQ: a few percent of the 2 * K_q range, varying from build to build, so 5% of that range)
    q = queries[0]
    tbl = lancedb.connect(db).open_table(li.TABLE)
    res = tbl.search(li.l2_normalise(q), vector_column_name="vector").distance_type("cosine").limit(3).to_arrow()
    ref = dict(brute_force(ids, docs, [q], N_DOCS)[0])
    for doc_id, dist in zip(res["doc_id"].to_pylist(), res["_distance"].to_pylist(), strict=True):
        assert dist == pytest.approx(2 * len(q) * (1 - ref[doc_id]), abs=0.05 * 2 * len(q))
    li.create_index(db, "none")


def test_dense_batches_and_float16_and_1d_query(tmp_path: Path):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 4, 16)).astype(np.float16)  # [docs, K_p, H] array per batch
    ids = [f"p{i}" for i in range(50)]
    db = str(tmp_path / "db")
    assert li.build_table(db, [(ids[:20], x[:20]), (ids[20:], x[20:])], 16) == 50
    hits = li.search(db, [x[7].astype(np.float32), x[9, 0]], 3)  # a [K_q, H] query and a single [H] vector
    assert hits[0][0][0] == "p7" and hits[0][0][1] == pytest.approx(1.0, abs=1e-5)
    assert hits[1][0][0] == "p9" and hits[1][0][1] == pytest.approx(1.0, abs=1e-5)
    assert [s for _, s in hits[0]] == sorted((s for _, s in hits[0]), reverse=True)
    # float16 storage halves the table; re-rank is then on rounded vectors
    db16 = str(tmp_path / "db16")
    li.build_table(db16, [(ids, x)], 16, dtype="float16")
    assert li.search(db16, [x[7]], 1)[0][0] == ("p7", pytest.approx(1.0, abs=1e-2))


def test_ties_break_by_doc_id(tmp_path: Path):
    v = np.eye(8, dtype=np.float32)
    db = str(tmp_path / "db")
    li.build_table(db, [(["b", "a", "c"], [v[:1], v[:1], v[1:2]])], 8)
    assert [d for d, _ in li.search(db, [v[:1]], 3)[0]] == ["a", "b", "c"]


def test_candidate_limit(tmp_path: Path):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((300, 2, 8)).astype(np.float32)
    db = str(tmp_path / "db")
    li.build_table(db, [([f"p{i}" for i in range(300)], x)], 8)
    q = [x[0]]
    assert li.search(db, q, 2).stats.limit == li.MIN_CANDIDATES
    assert li.search(db, q, 5, overfetch=30).stats.limit == 150
    assert li.search(db, q, 200).stats.limit == 200 * li.DEFAULT_OVERFETCH  # follows k: no cap below the bound
    got = li.search(db, q, 250, overfetch=1)
    assert got.stats.limit == 250 and len(got[0]) == 250 and got.stats.candidates == [250]
    # beyond the memory bound: one clear line, not a silently clamped (recall-losing) budget
    with pytest.raises(ValueError, match=r"k=600 x overfetch=20 = 12000 candidates per query exceeds max_candidates"):
        li.search(db, q, 600, overfetch=20)
    assert li.search(db, q, 600, overfetch=20, max_candidates=12_000).stats.limit == 12_000
    with pytest.raises(ValueError, match="overfetch must be >= 1"):
        li.candidate_budget(10, 0)


def test_candidate_budget_follows_k_recall_at_100(db, corpus):
    """At k=100 the budget is k x overfetch (no cap below the memory bound) and recall@100 against exact is high."""
    ids, docs, queries = corpus
    li.create_index(db, "IVF_PQ")
    want = [[d for d, _ in w] for w in brute_force(ids, docs, queries, 100)]
    got = li.search(db, queries, 100)
    assert got.stats.limit == 100 * li.DEFAULT_OVERFETCH and got.stats.refine_factor == li.DEFAULT_REFINE_FACTOR
    assert li.recall_at(want, [[d for d, _ in g] for g in got], 100) >= 0.99
    # a quarter of the collection as candidates (not all of it): still high, so the index, not the budget, finds them
    thin = li.search(db, queries, 100, overfetch=5)
    assert thin.stats.limit == 500 and max(thin.stats.candidates) == 500
    assert li.recall_at(want, [[d for d, _ in g] for g in thin], 100) >= 0.97
    li.create_index(db, "none")


def _counting_connect(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = lancedb.connect

    def connect(uri, *args, **kwargs):
        calls.append(str(uri))
        return real(uri, *args, **kwargs)

    monkeypatch.setattr(lancedb, "connect", connect)
    return calls


def test_search_opens_the_table_once_per_process(tmp_path: Path, monkeypatch):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((50, 3, 16)).astype(np.float32)
    db = str(tmp_path / "db")
    li.build_table(db, [([f"p{i}" for i in range(50)], x)], 16)
    calls = _counting_connect(monkeypatch)
    for i in range(5):
        assert li.search(db, [x[i]], 1)[0][0][0] == f"p{i}"
    assert li.index_info(db) is None
    assert calls == [db]  # one open for five searches and the index info


def test_cache_sees_a_rebuilt_index_under_the_same_path(tmp_path: Path, monkeypatch):
    rng = np.random.default_rng(6)
    a = rng.standard_normal((60, 2, 16)).astype(np.float32)
    b = rng.standard_normal((150, 2, 16)).astype(np.float32)
    db = str(tmp_path / "db")
    li.build_table(db, [([f"a{i}" for i in range(60)], a)], 16)
    assert li.search(db, [a[3]], 1)[0][0][0] == "a3"
    li.build_table(db, [([f"b{i}" for i in range(40)], b[:40])], 16)  # rebuilt in this process
    got = li.search(db, [b[3]], 1)
    assert got[0][0] == ("b3", pytest.approx(1.0, abs=1e-5))
    # rebuilt elsewhere and swapped in whole, as the store's stage writer does (here: as another process would)
    other = str(tmp_path / "other")
    li.build_table(other, [([f"c{i}" for i in range(150)], b)], 16)
    info = li.create_index(other, "IVF_PQ", num_partitions=1, num_sub_vectors=4)
    calls = _counting_connect(monkeypatch)
    os.replace(db, str(tmp_path / "old"))
    os.replace(other, db)
    got = li.search(db, [b[120]], 1)
    assert got[0][0][0] == "c120" and got.stats.refine_factor == li.DEFAULT_REFINE_FACTOR
    assert li.index_info(db) == info and calls == [db]
    assert li.search(db, [b[121]], 1)[0][0][0] == "c121"
    assert calls == [db]  # and it stays open again


def test_errors(tmp_path: Path, db):
    with pytest.raises(ValueError, match="unknown index type 'HNSW'"):
        li.create_index(db, "HNSW")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expected \[K_q, 32\]"):
        li.search(db, [np.ones((3, 31), np.float32)], 10)
    with pytest.raises(ValueError, match="zero or non-finite norm"):
        li.search(db, [np.zeros((2, H), np.float32)], 10)
    with pytest.raises(ValueError, match="k must be positive"):
        li.search(db, [np.ones((2, H), np.float32)], 0)

    empty = str(tmp_path / "empty")
    assert li.build_table(empty, [], H) == 0
    with pytest.raises(ValueError, match="is empty"):
        li.search(empty, [np.ones((2, H), np.float32)], 10)
    with pytest.raises(ValueError, match="is empty"):
        li.create_index(empty, "IVF_PQ")
    with pytest.raises(ValueError, match="no table"):
        li.search(str(tmp_path / "missing"), [np.ones((2, H), np.float32)], 10)

    small = str(tmp_path / "small")
    ids, docs = make_docs(n=20)
    li.build_table(small, [(ids, docs)], H)
    with pytest.raises(ValueError, match=r"too few vectors .* at least 256 are needed"):
        li.create_index(small, "IVF_PQ")

    with pytest.raises(ValueError, match="no vectors"):
        li.build_table(str(tmp_path / "bad"), [(["x"], [np.zeros((0, H), np.float32)])], H)
    with pytest.raises(ValueError, match=r"must be \[n, 32\]"):
        li.build_table(str(tmp_path / "bad"), [(["x"], [np.ones((2, 8), np.float32)])], H)
    with pytest.raises(ValueError, match="zero or non-finite norm"):
        li.build_table(str(tmp_path / "bad"), [(["x"], [np.zeros((1, H), np.float32)])], H)
    with pytest.raises(ValueError, match="2 doc ids but 1"):
        li.build_table(str(tmp_path / "bad"), [(["x", "y"], [np.ones((1, H), np.float32)])], H)


def test_recall_at():
    exact = [["a", "b", "c"], ["d", "e", "f"]]
    assert li.recall_at(exact, [["b", "x", "a"], ["d", "e", "f"]], 2) == pytest.approx(0.75)
    assert li.recall_at(exact, exact, 3) == 1.0
    assert li.recall_at([], [], 10) == 0.0
    # fewer passages than k: divided by the passages exact search finds (min(k, passages)), not by k
    fifty = [[f"d{i}" for i in range(50)]]
    assert li.recall_at(fifty, [fifty[0][::-1]], 100) == 1.0
    assert li.recall_at(fifty, [fifty[0][:25]], 100) == 0.5
    assert li.recall_at([[]], [[]], 100) == 1.0  # nothing to find
    with pytest.raises(ValueError):
        li.recall_at(exact, exact[:1], 2)


def test_default_index_params():
    p = li.default_index_params("IVF_PQ", 1_000_000, 128)
    assert p["num_partitions"] == 500 and 128 % p["num_sub_vectors"] == 0
    assert li.default_index_params("IVF_HNSW_SQ", 10_000, 96)["num_partitions"] == 39  # capped: >= 256 per partition
    assert li.default_index_params("none", 10, 8) == {}
    info = li.IndexInfo("IVF_PQ", 1000, 400_000, {"num_partitions": 632})
    assert li.default_nprobes(info, 100) == li.MIN_NPROBES
    assert li.default_nprobes(info, 2000) == 64
    assert li.default_nprobes(None, 100) is None
