"""Search over residual codes (retrieval/search/codes.py): the codes index lists every vector's cell, the search
with every cell probed and every passage a candidate is exact search over the decoded codes, fewer candidates keep
most of its top 10 on clustered vectors, and what it cannot search is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffret.retrieval.search.codecs import Codec, decode, encode, train_codebook
from diffret.retrieval.search.codes import CodedPassages, CodesIndex, CodesSearchStats, search_codes
from diffret.retrieval.search.encodings import Encodings, normalised
from diffret.retrieval.search.exact import SearchSettings, search_pass
from diffret.retrieval.search.rules import ScoreRules

N, KP, H = 1200, 4, 32


@pytest.fixture(scope="module")
def world() -> dict:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(60, H))
    topic = rng.integers(0, 60, N)
    x = (centres[np.repeat(topic, KP)] + 0.6 * rng.normal(size=(N * KP, H))).astype(np.float32)
    reps = rng.integers(1, KP + 1, N)  # passages of 1..K_p vectors
    keep = np.concatenate([np.arange(KP * i, KP * i + r) for i, r in enumerate(reps)])
    x = x[keep]
    cb = train_codebook(x, "residual:2", seed=0, n_corpus=len(x))
    codes = encode(x, "residual:2", cb)
    cut = int(np.cumsum(reps)[N // 2 - 1])  # two shards
    coded = CodedPassages.from_blocks(
        [(codes[:cut], reps[: N // 2]), (codes[cut:], reps[N // 2 :])], Codec("residual:2", H, cb)
    )
    index = CodesIndex.build(
        [(coded.cells[:cut], reps[: N // 2]), (coded.cells[cut:], reps[N // 2 :])], len(cb.arrays["centroids"])
    )
    # the exact side: the decoded codes, as score reads a compressed folder
    rules = ScoreRules()
    dec = normalised(torch.from_numpy(decode(codes, "residual:2", cb)), rules)
    multi = torch.zeros(N, KP, H)
    mask = torch.arange(KP)[None, :] < torch.from_numpy(reps)[:, None]
    multi[mask] = dec
    passages = Encodings([f"p{i}" for i in range(N)], multi, mask, multi.sum(1), [], [])
    qsrc = rng.choice(N, 40, replace=False)
    q = centres[topic[qsrc]][:, None, :] + 0.6 * rng.normal(size=(40, 3, H))
    q = normalised(torch.from_numpy(q.astype(np.float32)).reshape(-1, H).clone(), rules).view(40, 3, H)
    qmask = torch.ones(40, 3, dtype=torch.bool)
    qmask[::5, 2] = False  # some queries with fewer vectors
    q[~qmask] = 0
    queries = Encodings([f"q{i}" for i in range(40)], q, qmask, q.sum(1), [], [])
    tops, _ = search_pass({3: queries}, [passages], ["multi_dense"], SearchSettings(topk=20, rules=rules))
    return {
        "coded": coded,
        "index": index,
        "queries": queries,
        "exact": tops[(3, "multi_dense")],
        "reps": reps,
        "cells": coded.cells,
        "n_cells": len(cb.arrays["centroids"]),
    }


def test_the_codes_index_lists_every_vector_in_its_cell(world: dict) -> None:
    index, reps, cells = world["index"], world["reps"], world["cells"]
    owner = np.repeat(np.arange(N), reps)
    want = {(int(c), int(p)) for c, p in zip(cells, owner, strict=True)}
    got = {(c, int(p)) for c in range(index.n_centroids) for p in index.cell(c)}
    assert got == want and index.n_passages == N
    assert all((np.diff(index.cell(c)) > 0).all() for c in range(index.n_centroids))  # ascending, each once
    back = CodesIndex.from_table(index.to_table(), N)
    assert np.array_equal(back.offsets, index.offsets) and np.array_equal(back.passages, index.passages)
    assert index.passages.dtype == np.int32 and index.passages.nbytes <= 4 * len(cells)  # at most 4 bytes a vector


def test_every_cell_and_every_candidate_is_exact_search_over_the_decoded_codes(world: dict) -> None:
    got = search_codes(world["queries"], world["coded"], world["index"], 20, probes=world["n_cells"], candidates=N)
    exact = world["exact"]
    assert np.array_equal(got.index, exact.index)
    np.testing.assert_allclose(got.scores, exact.scores, rtol=0, atol=1e-5)


def test_fewer_candidates_keep_most_of_the_top_10_and_score_them_exactly(world: dict) -> None:
    exact = world["exact"]
    exact_score = {
        (i, int(d)): float(s)
        for i in range(len(exact.index))
        for d, s in zip(exact.index[i], exact.scores[i], strict=True)
    }
    recalls = []
    for probes in (1, 4, 16):
        st = CodesSearchStats()
        got = search_codes(world["queries"], world["coded"], world["index"], 10, probes=probes, candidates=64, stats=st)
        assert max(st.decoded) <= 64 and len(st.latencies_ms) == 40
        recalls.append(np.mean([len(set(a) & set(b[:10])) / 10 for a, b in zip(got.index, exact.index, strict=True)]))
        for i in range(len(got.index)):  # a passage both find scores as in exact search
            for d, s in zip(got.index[i], got.scores[i], strict=True):
                if (i, int(d)) in exact_score:
                    assert s == pytest.approx(exact_score[(i, int(d))], abs=1e-5)
    assert recalls[-1] >= 0.9 and recalls[-1] >= recalls[0], recalls


def test_the_decode_block_and_the_slot_by_slot_max_change_no_bit(world: dict, monkeypatch) -> None:
    from diffret.retrieval.search import codes as codes_module

    args = (world["queries"], world["coded"], world["index"], 20)
    whole = search_codes(*args, probes=16, candidates=200)
    monkeypatch.setattr(codes_module, "DECODE_BLOCK", 7)  # blocks of 7 candidates, a short last one joined
    blocks = search_codes(*args, probes=16, candidates=200)
    assert np.array_equal(whole.index, blocks.index) and np.array_equal(whole.scores, blocks.scores)
    # centroid interaction: passages of K_p vectors each (the slot-by-slot max) against numpy's max over slots
    rng = np.random.default_rng(3)
    s_t = rng.normal(size=(50, 3)).astype(np.float32)
    cells = rng.integers(0, 50, 30 * KP)
    starts = np.array([0, 8, 20, 100]) * 1  # passages 0, 2, 5, 25 of 30 x K_p vectors
    starts = starts - starts % KP
    got = codes_module._interaction(s_t, cells, starts, starts + KP)
    best = s_t[cells[(starts[:, None] + np.arange(KP)).ravel()]].reshape(len(starts), KP, 3).max(axis=1)
    assert np.array_equal(got, best[:, 0] + best[:, 1] + best[:, 2])
    mixed = codes_module._interaction(s_t, cells, starts, starts + np.array([KP, 1, KP, 2]))  # the other path
    assert mixed[0] == got[0] and mixed[2] == got[2]


def test_what_it_cannot_search_is_refused(world: dict) -> None:
    coded, index, queries = world["coded"], world["index"], world["queries"]
    int8 = CodedPassages(coded.codes, coded.offsets, Codec("int8", H))
    with pytest.raises(ValueError, match="residual:B codes"):
        search_codes(queries, int8, index, 10)
    with pytest.raises(ValueError, match="covers 1,199 passages"):
        search_codes(queries, coded, CodesIndex(index.offsets, index.passages, N - 1), 10)
    with pytest.raises(ValueError, match="must be positive"):
        search_codes(queries, coded, index, 10, candidates=0)
    with pytest.raises(ValueError, match="not of this codebook"):
        CodesIndex.build([(np.array([5]), np.array([1]))], n_centroids=3)
