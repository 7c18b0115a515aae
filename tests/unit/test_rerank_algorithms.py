"""DiffuRank's model-free algorithms against hand computations, RankGPT's own loop and brute force."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

from diffret.retrieval.rerank import (
    assignment_permutation,
    constrained_permutation,
    decode_permutation,
    order_by_scores,
    sliding_window_rerank,
    window_starts,
    yes_no_score,
)


def test_pointwise_score_is_p1_over_p0_plus_p1_of_the_full_softmax() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)) * 4  # five masks over a 50-token vocabulary; "0" is id 7, "1" is id 11
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    want = p[:, 11] / (p[:, 7] + p[:, 11])
    assert np.allclose(yes_no_score(logits[:, 7], logits[:, 11]), want, rtol=1e-12, atol=0)
    assert float(yes_no_score(2.0, 2.0)) == 0.5 and float(yes_no_score(-800.0, 800.0)) == 1.0


# RankGPT's sliding window (rank_gpt.py: sliding_windows / permutation_pipeline / receive_permutation), transcribed
# with the LLM call replaced by a window ranking from synthetic scores
def _rankgpt(item: dict, rank_start: int, rank_end: int, window_size: int, step: int, score: dict) -> dict:
    def permutation_pipeline(item, rank_start, rank_end):
        cut_range = copy.deepcopy(item["hits"][rank_start:rank_end])
        response = sorted(range(len(cut_range)), key=lambda i: (-score[cut_range[i]["docid"]], i))
        for j, x in enumerate(response):
            item["hits"][j + rank_start] = copy.deepcopy(cut_range[x])
        return item

    item = copy.deepcopy(item)
    end_pos = rank_end
    start_pos = rank_end - window_size
    while start_pos >= rank_start:
        start_pos = max(start_pos, rank_start)
        item = permutation_pipeline(item, start_pos, end_pos)
        end_pos = end_pos - step
        start_pos = start_pos - step
    return item


@pytest.mark.parametrize(
    ("n", "window", "step"),
    [(100, 20, 10), (20, 20, 10), (25, 20, 10), (37, 20, 10), (100, 10, 5), (64, 8, 8), (30, 20, 20)],
)
def test_window_merge_equals_rankgpt(n: int, window: int, step: int) -> None:
    rng = np.random.default_rng(n * 100 + window)
    docs = [f"d{i}" for i in range(n)]
    score = {d: float(rng.integers(0, 6)) for d in docs}  # few distinct values: many ties
    want = [h["docid"] for h in _rankgpt({"hits": [{"docid": d} for d in docs]}, 0, n, window, step, score)["hits"]]
    got = sliding_window_rerank(docs, lambda w: order_by_scores([score[d] for d in w]), window, step)
    assert got == want


def test_windows_of_a_short_list_and_bad_rankings() -> None:
    assert window_starts(0, 20, 10) == [] and window_starts(5, 20, 10) == [(0, 5)]
    assert sliding_window_rerank(["a", "b", "c"], lambda w: [2, 0, 1]) == ["c", "a", "b"]
    with pytest.raises(ValueError, match="permutation"):
        sliding_window_rerank(["a", "b"], lambda w: [0, 0])
    with pytest.raises(ValueError, match="positive"):
        window_starts(10, 0, 1)


@pytest.mark.parametrize("seed", range(40))
def test_constrained_sampling_always_returns_a_permutation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 11))
    steps = int(rng.integers(1, n + 2))
    tied = seed % 2 == 0  # half the trials with integer logits from a tiny range: ties everywhere

    def slot_logits(state: list[int | None]) -> np.ndarray:  # depends on the state, as a model's would
        r = np.random.default_rng([seed, sum(1 for s in state if s is not None)])
        x = r.integers(0, 2, size=(n, n)).astype(float) if tied else r.normal(size=(n, n)) * 3
        x[:, 0] += 5.0  # every slot prefers candidate 0: unconstrained decoding repeats it
        return x

    out = constrained_permutation(slot_logits, n, steps)
    assert sorted(out) == list(range(n))  # type: ignore[type-var]
    d = decode_permutation(slot_logits, n, steps)
    assert sorted(d.perm) == list(range(n))
    if n > 1:
        assert not d.unconstrained_valid


def test_constrained_sampling_commits_by_confidence_within_a_step() -> None:
    # one step, two slots both wanting candidate 1; slot 1 is more confident, so it gets 1 and slot 0 gets 0
    logits = np.array([[0.0, 1.0], [0.0, 4.0]])
    assert constrained_permutation(lambda s: logits, 2, 1) == [0, 1]
    with pytest.raises(ValueError, match=r"\[2, 2\]"):
        constrained_permutation(lambda s: np.zeros((2, 3)), 2, 1)


@pytest.mark.parametrize("n", range(1, 8))
def test_assignment_equals_brute_force(n: int) -> None:
    rng = np.random.default_rng(n)
    for _ in range(5):
        logp = np.log(rng.dirichlet(np.ones(n), size=n))
        best = max(itertools.permutations(range(n)), key=lambda p: sum(logp[r, p[r]] for r in range(n)))
        got = assignment_permutation(logp)
        assert got == list(best)
    with pytest.raises(ValueError, match="square"):
        assignment_permutation(np.zeros((2, 3)))
