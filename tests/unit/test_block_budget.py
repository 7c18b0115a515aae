"""Exact search under a byte budget: any budget gives the same runs (ties by document index), the vectorised
sparse scorer equals a dict reference, the running top-k is exact, and a budget too small is refused."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from diffret.retrieval.models.encoding import encoded_table
from diffret.retrieval.models.readouts import Encoded
from diffret.retrieval.search import Encodings, SearchSettings, all_modes, encodings_from_table, search_pass
from diffret.retrieval.search.encodings import SparseFlat
from diffret.retrieval.search.modes import BASE_MODES, MODE_NAMES
from diffret.retrieval.search.scoring import (
    RunningTopK,
    SparsePassages,
    SparseQueries,
    key_parts,
    plan_blocks,
    query_vocab,
    score_keys,
)

H = 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def _tied(rng: np.random.Generator, n: int, k: int, prefix: str, vocab: int = 40, vary: bool = True) -> Encodings:
    """Encodings whose every score is exact in float32 whatever the summation order, so that many tie:
    vector entries in {-1, 0, 1} / 2, real slots a power of two, sparse weights multiples of 1/2."""
    reps = rng.choice([1, 2, 4], size=n) if vary else np.full(n, k)
    reps = np.minimum(reps, k)
    multi = torch.from_numpy(rng.integers(-1, 2, size=(n, k, H)).astype(np.float32) / 2)
    mask = torch.arange(k)[None, :] < torch.from_numpy(reps)[:, None]
    multi[~mask] = 0
    single = torch.from_numpy(rng.integers(-1, 2, size=(n, H)).astype(np.float32) / 2)
    ids, weights = [], []
    for _ in range(n):
        nnz = int(rng.integers(0, 6))
        ids.append(np.sort(rng.choice(vocab, size=nnz, replace=False)).astype(np.int64))
        weights.append((rng.integers(1, 4, size=nnz) / 2).astype(np.float32))
    return Encodings([f"{prefix}{i:04d}" for i in range(n)], multi, mask, single, ids, weights)


def _random(rng: np.random.Generator, n: int, k: int, prefix: str) -> Encodings:
    encs = []
    for _ in range(n):
        nnz = int(rng.integers(0, 12))
        sid = rng.choice(300, size=nnz, replace=False).astype(np.int32)
        encs.append(
            Encoded(
                rng.standard_normal((int(rng.integers(1, k + 1)), H)).astype(np.float16),
                sid,
                (rng.random(nnz) * 3).astype(np.float32),
                n_tokens=5,
            )
        )
    return encodings_from_table(encoded_table([f"{prefix}{i:04d}" for i in range(n)], encs, H))


def _brute(q: Encodings, p: Encodings, mode: str) -> np.ndarray:
    """[Q, N] scores by the definitions under the default rules (the reference evaluator's; float64, exact for
    the tied data): MaxSim clamped at 0 and summed, a sparse score of 0 retrieved like any other."""
    out = np.zeros((len(q), len(p)))
    for i in range(len(q)):
        qv = q.multi[i][q.mask[i]].double().numpy()
        qd = dict(zip(q.sparse_ids[i].tolist(), q.sparse_weights[i].tolist(), strict=True))
        for j in range(len(p)):
            if mode == "multi_dense":
                out[i, j] = np.maximum((qv @ p.multi[j][p.mask[j]].double().numpy().T).max(1), 0.0).sum()
            elif mode == "single_dense":
                out[i, j] = q.single[i].double() @ p.single[j].double()
            else:
                s = sum(
                    qd.get(t, 0.0) * w
                    for t, w in zip(p.sparse_ids[j].tolist(), p.sparse_weights[j].tolist(), strict=True)
                )
                out[i, j] = s
    return out


def _brute_top(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top k per row by score descending, then index ascending; -inf entries are pads (-1)."""
    width = min(k, scores.shape[1])
    s_out = np.full((len(scores), width), -np.inf, np.float32)
    i_out = np.full((len(scores), width), -1, np.int64)
    for r, row in enumerate(scores):
        order = np.lexsort((np.arange(len(row)), -row))[:width]
        finite = np.isfinite(row[order])
        s_out[r, : finite.sum()] = row[order][finite]
        i_out[r, : finite.sum()] = order[finite]
    return s_out, i_out


def _blocks(p: Encodings, size: int) -> list[Encodings]:
    return [p.rows(s, min(s + size, len(p))) for s in range(0, len(p), size)]


def _search(queries, p, budget, topk, ignore=False, shard=1000, modes=BASE_MODES):  # noqa: ANN001, ANN202
    st = SearchSettings(topk=topk, ignore_identical_ids=ignore, block_bytes=budget)
    return search_pass(queries, _blocks(p, shard), modes, st)


@pytest.mark.parametrize("device", DEVICES)
def test_any_budget_gives_the_brute_force_runs_with_ties_by_index(device: str) -> None:
    rng = np.random.default_rng(11)
    queries = {kq: _tied(rng, 13, kq, "q") for kq in (1, 4)}
    p = _tied(rng, 300, 4, "d")
    on = {kq: _move(q, device) for kq, q in queries.items()}
    pd = _move(p, device)
    ref = {}
    for kq, q in queries.items():
        for mode in BASE_MODES:
            ref[(kq, mode)] = _brute_top(_brute(q, p, mode), 40)
    for budget, shard in ((14_000, 37), (60_000, 100), (1 << 30, 300)):  # 1-3 passages x 1-2 rows ... one block
        tops, ids = _search(on, pd, budget, 40, shard=shard)
        assert ids == p.ids
        for key, (s, ix) in ref.items():
            np.testing.assert_array_equal(tops[key].index, ix, err_msg=f"{key} budget {budget}")
            np.testing.assert_array_equal(tops[key].scores, s, err_msg=f"{key} budget {budget}")
    assert sum(len(set(r.tolist())) < len(r) for s, _ in ref.values() for r in s) > 20  # the data has many ties


def _move(e: Encodings, device: str) -> Encodings:
    return Encodings(e.ids, e.multi.to(device), e.mask.to(device), e.single.to(device), e.sparse_ids, e.sparse_weights)


@pytest.mark.parametrize("ignore", [False, True])
def test_tiny_budgets_equal_one_block_for_every_mode(ignore: bool) -> None:
    """Random data, fusions included, with self-hit removal: every budget gives the same rankings."""
    rng = np.random.default_rng(5)
    p = _random(rng, 250, 4, "d")
    queries = {kq: _random(rng, 17, kq, "q") for kq in (1, 3)}
    # queries named like documents: self-hits to drop
    queries = {
        kq: Encodings(
            [f"d{i * 13:04d}" for i in range(len(q))], q.multi, q.mask, q.single, q.sparse_ids, q.sparse_weights
        )
        for kq, q in queries.items()
    }
    one, ids = _search(queries, p, 1 << 30, 60, ignore, shard=250)
    one = all_modes(one, 60)
    assert {m for _, m in one} == set(MODE_NAMES)
    for budget, shard in ((16_000, 250), (40_000, 33), (200_000, 64)):
        got, ids2 = _search(queries, p, budget, 60, ignore, shard=shard)
        got = all_modes(got, 60)
        assert ids2 == ids
        for key in one:
            np.testing.assert_array_equal(got[key].index, one[key].index, err_msg=f"{key} budget {budget}")
            # BLAS may sum a product in another order for another block shape: the last bit can differ
            np.testing.assert_allclose(got[key].scores, one[key].scores, atol=1e-6, err_msg=f"{key} {budget}")
    hit = [ids[ix] in queries[1].ids[qi : qi + 1] for qi in range(17) for ix in one[(1, "single_dense")].index[qi]]
    assert any(hit) != ignore  # a query's own document is its best dense match unless it is dropped


def test_budget_too_small_is_refused_with_one_clear_line() -> None:
    rng = np.random.default_rng(0)
    q, p = _random(rng, 3, 2, "q"), _random(rng, 10, 2, "d")
    with pytest.raises(ValueError, match=r"score block budget of 1,000 bytes is too small: .* raise --block-mb"):
        search_pass({2: q}, [p], BASE_MODES, SearchSettings(topk=10, block_bytes=1000))
    with pytest.raises(ValueError, match="too small"):  # the sparse passage matrix alone is too big
        plan_blocks(1 << 20, 10, 10, 1, 10, {"sparse_max"}, 1 << 20, torch.device("cpu"))


def test_plan_fits_the_budget_and_grows_with_it() -> None:
    cpu = torch.device("cpu")
    last = 0
    for mb in (1, 4, 16, 64, 256):
        for modes in ({"single_dense"}, {"multi_dense"}, {"sparse_max"}, set(BASE_MODES)):
            for dev in (cpu, torch.device("cuda")):  # planning only: no GPU needed
                plan = plan_blocks(mb << 20, 10_000, 7_000, 16, 1000, modes, 30_000, dev)
                assert plan.bytes <= mb << 20, (mb, modes, dev)
        plan = plan_blocks(mb << 20, 10_000, 7_000, 16, 1000, set(BASE_MODES), 30_000, cpu)
        assert plan.passages * plan.queries > last
        last = plan.passages * plan.queries


def test_vectorised_sparse_scorer_equals_a_dict_reference() -> None:
    rng = np.random.default_rng(3)

    def rand_sparse(n: int, vocab: int, most: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        ids = [rng.choice(vocab, size=int(rng.integers(0, most)), replace=False).astype(np.int64) for _ in range(n)]
        return ids, [rng.random(len(x)).astype(np.float32) * 2 for x in ids]

    qi, qw = rand_sparse(31, 500, 20)
    pi, pw = rand_sparse(200, 900, 60)  # passage terms beyond the query vocabulary are dropped
    vocab = query_vocab(SparseFlat.from_lists(qi, qw))
    sq = SparseQueries(SparseFlat.from_lists(qi, qw), vocab, torch.device("cpu"))
    sp = SparsePassages(SparseFlat.from_lists(pi, pw), vocab, torch.device("cpu"))
    ref = np.zeros((31, 200))
    for i in range(31):
        qd = dict(zip(qi[i].tolist(), qw[i].tolist(), strict=True))
        for j in range(200):
            ref[i, j] = sum(qd.get(t, 0.0) * w for t, w in zip(pi[j].tolist(), pw[j].tolist(), strict=True))
    np.testing.assert_allclose(sq.scores(sp).numpy(), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sq.scores(sp, 5, 12).numpy(), ref[5:12], rtol=1e-5, atol=1e-6)  # a query block
    out = torch.full((4, 200), float("nan"))  # a reused buffer: overwritten, NaNs included
    np.testing.assert_allclose(sq.scores(sp, 27, 31, out=out).numpy(), ref[27:31], rtol=1e-5, atol=1e-6)
    assert (ref > 0).mean() > 0.2 and (ref == 0).any()
    empty = SparseQueries(
        SparseFlat.from_lists([np.zeros(0, np.int64)], [np.zeros(0, np.float32)]), vocab, torch.device("cpu")
    )
    assert not empty.scores(sp).any()


def test_running_topk_is_exact_whatever_the_blocks(monkeypatch) -> None:
    from diffret.retrieval.search import scoring

    monkeypatch.setattr(scoring, "RESULT_BYTES", 64 * 50 * 4)  # the result decoded 4 rows at a time
    rng = np.random.default_rng(9)
    scores = rng.integers(-3, 4, size=(6, 500)).astype(np.float32)  # heavy ties
    scores[rng.random(scores.shape) < 0.1] = -np.inf
    scores[0] = -0.0  # -0.0 ties 0.0
    scores[0, ::7] = 0.0
    ref_s, ref_i = _brute_top(scores.astype(np.float64), 50)
    for cuts in ([500], [1, 2, 3, 494], list(range(0, 500, 17))[1:] + [500], [60, 500]):
        for row_blocks in ([0, 6], [0, 1, 4, 6]):
            t = RunningTopK(6, 50, torch.device("cpu"))
            start = 0
            for end in sorted(set(cuts)):
                for a, b in zip(row_blocks, row_blocks[1:], strict=False):
                    t.update(torch.from_numpy(scores[a:b, start:end].copy()), start, row=a)
                start = end
            res = t.result()
            np.testing.assert_array_equal(res.index, ref_i)
            np.testing.assert_array_equal(res.scores, ref_s)
    t = RunningTopK(1, 3, torch.device("cpu"))
    t.update(torch.zeros(1, 2), 5)
    with pytest.raises(ValueError, match="increasing offset"):
        t.update(torch.zeros(1, 2), 0)
    assert RunningTopK(2, 5, torch.device("cpu")).result().index.shape == (2, 0)  # no documents: no columns


def test_score_keys_order_and_round_trip() -> None:
    s = torch.tensor([0.5, -0.0, 0.0, -np.inf, 3e38, -1e-30, 1e-30, -2.0])
    ix = torch.arange(8) * 1000
    keys = score_keys(s, ix)
    back_s, back_i = key_parts(keys)
    assert back_i.tolist() == ix.tolist()
    assert back_s.tolist() == (s + 0.0).tolist()
    order = torch.argsort(keys, descending=True).tolist()
    assert order == np.lexsort((ix.numpy(), -s.double().numpy())).tolist()


def test_encodings_sparse_flat_from_arrow_matches_lists() -> None:
    rng = np.random.default_rng(1)
    e = _random(rng, 20, 2, "d")
    flat = e.sparse()
    for i in range(20):
        a, b = flat.offsets[i], flat.offsets[i + 1]
        np.testing.assert_array_equal(flat.ids[a:b], e.sparse_ids[i])
        np.testing.assert_array_equal(flat.weights[a:b], e.sparse_weights[i])
    sub = e.rows(5, 9).sparse()
    np.testing.assert_array_equal(sub.ids, np.concatenate(e.sparse_ids[5:9]))
    dense_only = encoded_table(["a", "b"], [Encoded(np.ones((1, H), np.float16), None, None, 3)] * 2, H)
    d = encodings_from_table(pa.concat_tables([dense_only, dense_only]))  # null sparse lists, two chunks
    assert d.sparse().offsets.tolist() == [0, 0, 0, 0, 0] and len(d.sparse_ids) == 4


def test_score_config_takes_the_budget_in_mib() -> None:
    from pydantic import ValidationError

    from diffret.stages.score import ScoreConfig

    assert ScoreConfig(dataset="d").block_mb == 256
    with pytest.raises(ValidationError, match="block_mb"):
        ScoreConfig(dataset="d", block_mb=0)
