"""Exact search equals brute force for every mode; fusion, ties, run tables and encodings loading."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from diffret.retrieval.models.encoding import encoded_table
from diffret.retrieval.models.readouts import Encoded
from diffret.retrieval.search import (
    Encodings,
    ScoreRules,
    SearchSettings,
    TopK,
    all_modes,
    doc_order,
    encodings_from_table,
    fuse_minmax,
    fuse_runs,
    maxsim,
    run_table,
    scoring,
    search_pass,
    select,
)
from diffret.retrieval.search.modes import MODE_NAMES as MODES

H = 16
VOCAB = 300


def _random_encoded(rng: np.random.Generator, n: int, k: int, vary: bool = False) -> list[Encoded]:
    out = []
    for _ in range(n):
        reps = int(rng.integers(1, k + 1)) if vary else k
        nnz = int(rng.integers(0, 12))
        ids = rng.choice(VOCAB, size=nnz, replace=False).astype(np.int32)
        w = rng.random(nnz).astype(np.float32) * 3
        out.append(Encoded(rng.standard_normal((reps, H)).astype(np.float16), ids, w, n_tokens=10))
    return out


def _table(rng, n, k, prefix, vary=False) -> pa.Table:
    return encoded_table([f"{prefix}{i}" for i in range(n)], _random_encoded(rng, n, k, vary), H)


def _encodings(rng, n, k, prefix, vary=False) -> Encodings:
    return encodings_from_table(_table(rng, n, k, prefix, vary))


# exact search runs where the encodings live: the CPU always, a GPU where there is one
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


# every score rule at its non-reference option
LEGACY = ScoreRules(
    maxsim_clamp=False,
    maxsim_reduce="mean",
    single_renorm=True,
    sparse_scale="unit",
    sparse_floor="positive",
    fusion_flat="one",
)
RULES = [pytest.param(ScoreRules(), id="reference"), pytest.param(LEGACY, id="options")]


def _brute_scores(q: Encodings, p: Encodings, mode: str, rules: ScoreRules = ScoreRules()) -> np.ndarray:
    """Straight loops over the definitions (float64)."""
    out = np.zeros((len(q), len(p)))
    for i in range(len(q)):
        qv = q.multi[i][q.mask[i]].double().numpy()
        for j in range(len(p)):
            pv = p.multi[j][p.mask[j]].double().numpy()
            if mode == "multi_dense":
                best = (qv @ pv.T).max(1)
                best = np.maximum(best, 0.0) if rules.maxsim_clamp else best
                out[i, j] = best.sum() if rules.maxsim_reduce == "sum" else best.mean()
            elif mode == "single_dense":
                a, b = qv.mean(0), pv.mean(0)
                out[i, j] = a @ b / (np.linalg.norm(a) * np.linalg.norm(b) if rules.single_renorm else 1.0)
            else:
                qd = dict(zip(q.sparse_ids[i].tolist(), q.sparse_weights[i].tolist(), strict=True))
                out[i, j] = sum(qd.get(t, 0.0) * w for t, w in zip(p.sparse_ids[j], p.sparse_weights[j], strict=True))
    return out


def _brute_top(scores: np.ndarray, k: int, positive_only: bool = False) -> list[list[tuple[int, float]]]:
    out = []
    for row in scores:
        order = np.lexsort((np.arange(len(row)), -row))
        pairs = [(int(j), float(row[j])) for j in order if not positive_only or row[j] > 0]
        out.append(pairs[:k])
    return out


def _brute_fusion(a: np.ndarray, b: np.ndarray, depth: int, b_positive: bool, flat: float = 1.0) -> np.ndarray:
    fused = np.full(a.shape, -np.inf)
    for i in range(a.shape[0]):
        acc: dict[int, float] = {}
        for row, pos in ((a[i], False), (b[i], b_positive)):
            top = _brute_top(row[None], depth, pos)[0]
            if not top:
                continue
            vals = np.array([s for _, s in top])
            lo, hi = vals.min(), vals.max()
            for j, s in top:
                acc[j] = acc.get(j, 0.0) + 0.5 * ((s - lo) / (hi - lo) if hi > lo else flat)
        for j, v in acc.items():
            fused[i, j] = v
    return fused


def _assert_same_top(top: TopK, ref: list[list[tuple[int, float]]], k: int) -> None:
    """Identical top-k up to ties: same scores rank by rank; same documents except at a tied boundary."""
    for qi, pairs in enumerate(ref):
        got_ix = [int(x) for x in top.index[qi, :k] if x >= 0]
        got_s = top.scores[qi, : len(got_ix)]
        assert len(got_ix) == len(pairs), qi
        np.testing.assert_allclose(got_s, [s for _, s in pairs], rtol=1e-4, atol=1e-4)
        if pairs:
            boundary = pairs[-1][1]
            strict_ref = {j for j, s in pairs if s > boundary + 1e-4}
            strict_got = {j for j, s in zip(got_ix, got_s, strict=True) if s > boundary + 1e-4}
            assert strict_ref == strict_got, qi


@pytest.mark.parametrize("rules", RULES)
@pytest.mark.parametrize("tile_elems", [None, 40], ids=["untiled", "tiled"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vary", [False, True])
def test_exact_search_equals_brute_force_all_modes(
    vary: bool, device: str, tile_elems, rules: ScoreRules, monkeypatch
) -> None:
    if tile_elems is not None:  # CPU MaxSim in tiles of 40 // (Q*K_q) documents: 1 to 5 per tile here
        monkeypatch.setattr(scoring, "CPU_TILE_ELEMS", tile_elems)
    rng = np.random.default_rng(7)
    q_tables = {kq: _table(rng, 23, kq, "q", vary) for kq in (1, 3)}
    p_table = _table(rng, 400, 4, "d", vary)
    on_device = encodings_from_table(p_table, device, rules)
    # tiny block budget: sub-blocks of a few passages and query blocks of a few rows, to exercise the running top-k
    st = SearchSettings(topk=150, block_bytes=40_000, rules=rules)
    blocks = [select(on_device, on_device.ids[s : s + 90]) for s in range(0, 400, 90)]
    queries = {kq: encodings_from_table(t, device, rules) for kq, t in q_tables.items()}
    base, doc_ids = search_pass(queries, blocks, settings=st)
    passages = encodings_from_table(p_table)  # the brute force reads CPU copies
    assert doc_ids == passages.ids
    runs = all_modes(base, depth=150, rules=rules)
    assert {m for _, m in runs} == set(MODES)
    positive = rules.sparse_floor == "positive"
    flat = 1.0 if rules.fusion_flat == "one" else 0.0
    for kq, t in q_tables.items():
        q = encodings_from_table(t)
        full = {m: _brute_scores(q, passages, m, rules) for m in ("single_dense", "multi_dense", "sparse_max")}
        for mode in MODES:
            if mode.startswith("fusion_"):
                dense = "single_dense" if "single" in mode else "multi_dense"
                ref = _brute_top(_brute_fusion(full[dense], full["sparse_max"], 150, positive, flat), 100, True)
                ref = [[(j, s) for j, s in r if s > -np.inf] for r in ref]
            else:
                ref = _brute_top(full[mode], 100, positive_only=positive and mode == "sparse_max")
            _assert_same_top(runs[(kq, mode)], ref, 100)


def test_maxsim_masks_padding_over_real_query_vectors() -> None:
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])
    qm = torch.tensor([[True, True, False]])
    p = torch.tensor([[[1.0, 0.0], [-5.0, -5.0]]])  # second vector is padding: must not count
    pm = torch.tensor([[True, False]])
    assert maxsim(q, qm, p, pm).item() == pytest.approx(1.0)  # the reference's: 1 + max(0, 0), a sum
    assert maxsim(q, qm, p, pm, clamp=False, reduce="mean").item() == pytest.approx(0.5)  # the unclamped mean


def test_padding_rows_do_not_change_scores() -> None:
    """A passage scored alone or in a block padded to a larger K gets the same score."""
    rng = np.random.default_rng(1)
    encs = _random_encoded(rng, 6, 4, vary=True)
    short = Encoded(encs[0].dense[:1], encs[0].sparse_ids, encs[0].sparse_weights, 3)
    q = encodings_from_table(encoded_table(["q"], [encs[1]], H))
    alone = encodings_from_table(encoded_table(["a"], [short], H))
    mixed = encodings_from_table(encoded_table(["a", "b"], [short, encs[2]], H))
    s_alone = maxsim(q.multi, q.mask, alone.multi, alone.mask)[0, 0]
    s_mixed = maxsim(q.multi, q.mask, mixed.multi, mixed.mask)[0, 0]
    assert s_alone.item() == pytest.approx(s_mixed.item(), abs=1e-6)


def test_ignore_identical_ids_drops_self_hits() -> None:
    rng = np.random.default_rng(3)
    docs = _random_encoded(rng, 20, 2)
    p = encodings_from_table(encoded_table([f"x{i}" for i in range(20)], docs, H))
    q = encodings_from_table(encoded_table(["x0", "x5"], [docs[0], docs[5]], H))
    top_self, ids = search_pass({2: q}, [p], ["multi_dense"], SearchSettings(topk=5))
    assert ids[top_self[(2, "multi_dense")].index[0, 0]] == "x0"  # itself is the best match
    top, ids = search_pass({2: q}, [p], ["multi_dense"], SearchSettings(topk=5, ignore_identical_ids=True))
    assert "x0" not in [ids[i] for i in top[(2, "multi_dense")].index[0]]
    assert "x5" not in [ids[i] for i in top[(2, "multi_dense")].index[1]]


def test_fusion_minmax_union_missing_is_zero_and_constant_runs() -> None:
    a = TopK(np.array([[3.0, 2.0, 1.0]], np.float32), np.array([[0, 1, 2]]))
    b = TopK(np.array([[10.0, 0.0, -np.inf]], np.float32), np.array([[2, 3, -1]]))
    f = fuse_minmax(a, b)
    got = dict(zip(f.index[0].tolist(), f.scores[0].tolist(), strict=True))
    # a: 0->1, 1->0.5, 2->0 ; b: 2->1, 3->0
    assert got == pytest.approx({0: 0.5, 1: 0.25, 2: 0.5, 3: 0.0})
    assert f.index[0].tolist()[:2] == [0, 2]  # tie broken by document index
    const = fuse_minmax(
        TopK(np.array([[1.0]], np.float32), np.array([[4]])), TopK(np.full((1, 1), -np.inf), -np.ones((1, 1), np.int64))
    )
    assert const.index[0, 0] == 4 and const.scores[0, 0] == 0.0  # all equal: (s - min) / max(0, 1e-9) = 0
    one = fuse_minmax(
        TopK(np.array([[1.0]], np.float32), np.array([[4]])),
        TopK(np.full((1, 1), -np.inf), -np.ones((1, 1), np.int64)),
        flat="one",
    )
    assert one.scores[0, 0] == pytest.approx(0.5)  # flat one: all equal normalises to 1


def test_run_table_orders_by_score_then_doc_id_and_drops_pads() -> None:
    top = TopK(np.array([[1.0, 2.0, 2.0, -np.inf]], np.float32), np.array([[0, 1, 2, -1]]))
    t = run_table(top, ["q1"], ["c", "b", "a"])
    assert t.column("doc_id").to_pylist() == ["a", "b", "c"]
    assert t.column("rank").to_pylist() == [1, 2, 3]
    assert t.schema.field("rank").type == pa.int32()
    assert run_table(top, ["q1"], ["c", "b", "a"], lex=doc_order(["c", "b", "a"])).equals(t)  # once per pass
    with pytest.raises(ValueError, match="doc order of 2 docs"):
        run_table(top, ["q1"], ["c", "b", "a"], lex=doc_order(["c", "b"]))


def test_encodings_errors() -> None:
    rng = np.random.default_rng(0)
    enc = _encodings(rng, 3, 2, "d")
    with pytest.raises(KeyError, match="nope"):
        select(enc, ["d0", "nope"])
    with pytest.raises(ValueError, match="unknown base mode"):
        search_pass({1: enc}, [enc], ["fusion_multi_sparse_max"])


def _fuse_loop(runs: list[TopK], depth: int, flat: str) -> TopK:
    """Fusion a query at a time, in a plain loop (the vectorised fuse_runs must equal it exactly)."""
    out_s, out_i = [], []
    for qi in range(runs[0].scores.shape[0]):
        acc: dict[int, float] = {}
        for run in runs:
            w = 1.0 / len(runs)
            s, ix = run.scores[qi, :depth], run.index[qi, :depth]
            keep = ix >= 0
            s, ix = s[keep].astype(np.float64), ix[keep]
            if not len(s):
                continue
            lo, hi = s.min(), s.max()
            norm = np.ones_like(s) if flat == "one" and hi <= lo else (s - lo) / max(hi - lo, 1e-9)
            for d, v in zip(ix.tolist(), norm.tolist(), strict=True):
                acc[d] = acc.get(d, 0.0) + w * v
        docs = np.fromiter(acc.keys(), np.int64, len(acc))
        vals = np.fromiter(acc.values(), np.float64, len(acc))
        order = np.lexsort((docs, -vals))[:depth]
        out_s.append(vals[order])
        out_i.append(docs[order])
    width = max([len(x) for x in out_s] + [1])
    scores = np.full((len(out_s), width), float("-inf"), np.float32)
    index = np.full((len(out_s), width), -1, np.int64)
    for qi, (s, ix) in enumerate(zip(out_s, out_i, strict=True)):
        scores[qi, : len(s)], index[qi, : len(ix)] = s, ix
    return TopK(scores, index)


@pytest.mark.parametrize("flat", ["zero", "one"])
def test_vectorised_fusion_equals_the_per_query_loop(flat: str) -> None:
    rng = np.random.default_rng(7)
    for _ in range(40):
        n_q, k, n_docs = int(rng.integers(1, 12)), int(rng.integers(1, 30)), int(rng.integers(1, 60))

        def run(n_q: int = n_q, k: int = k, n_docs: int = n_docs) -> TopK:
            index = np.stack([rng.permutation(max(n_docs, k))[:k] for _ in range(n_q)])
            scores = -np.sort(-np.round(rng.normal(size=(n_q, k)), int(rng.integers(0, 2))), axis=1)  # ties
            short = rng.random(n_q) < 0.3  # padded rows: fewer documents, or none
            cut = rng.integers(0, k + 1, size=n_q)
            pad = short[:, None] & (np.arange(k)[None, :] >= cut[:, None])
            return TopK(np.where(pad, -np.inf, scores).astype(np.float32), np.where(pad, -1, index))

        runs = [run() for _ in range(int(rng.integers(2, 5)))]  # two (the modes' fusions) to four runs
        depth = int(rng.integers(1, 2 * k + 1))
        got = fuse_minmax(*runs, depth, flat=flat) if len(runs) == 2 else fuse_runs(runs, depth, flat=flat)
        want = _fuse_loop(runs, depth, flat)
        assert got.index.tolist() == want.index.tolist()
        assert got.scores.tobytes() == want.scores.tobytes()
