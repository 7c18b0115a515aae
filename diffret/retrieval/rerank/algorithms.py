"""The model-free parts of DiffuRank's four rerankers: the pointwise / logits-listwise score, RankGPT's sliding
window, permutation decoding by constrained low-confidence remasking, and permutation by assignment.

Everything here works on logits handed in by a caller (a model, or a test), so each piece is checked against a
hand computation or a brute force without any model.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import numpy as np


# ------------------------------------------------------------------------------------- relevance scores
def yes_no_score(logit_0: np.ndarray | float, logit_1: np.ndarray | float) -> np.ndarray:
    """p("1") / (p("0") + p("1")) at a mask from its two logits: the softmax's other terms cancel, so this is
    the logistic of their difference (computed stably).

    >>> round(float(yes_no_score(0.0, np.log(3.0))), 6)  # p1 = 3 p0
    0.75
    >>> yes_no_score(np.array([1000.0, -1000.0]), np.array([-1000.0, 1000.0])).tolist()
    [0.0, 1.0]
    """
    d = np.asarray(logit_1, np.float64) - np.asarray(logit_0, np.float64)
    return np.where(d >= 0, 1.0 / (1.0 + np.exp(-np.abs(d))), np.exp(-np.abs(d)) / (1.0 + np.exp(-np.abs(d))))


# ------------------------------------------------------------------------------------- sliding windows
def window_starts(n: int, window: int, step: int) -> list[tuple[int, int]]:
    """The (start, end) windows RankGPT visits over ``n`` candidates, last window first: ``end`` from ``n``
    down by ``step`` while ``start = end - window`` is not negative. A list shorter than the window is one
    window (RankGPT would skip it and leave the first stage's order).

    >>> window_starts(100, 20, 10)[:3], window_starts(100, 20, 10)[-1], len(window_starts(100, 20, 10))
    ([(80, 100), (70, 90), (60, 80)], (0, 20), 9)
    >>> window_starts(7, 20, 10)
    [(0, 7)]
    """
    if window < 1 or step < 1:
        raise ValueError(f"window and step must be positive, got {window} and {step}")
    if n <= window:
        return [(0, n)] if n else []
    out, end, start = [], n, n - window
    while start >= 0:
        out.append((start, end))
        end, start = end - step, start - step
    return out


def sliding_window_rerank(
    order: Sequence[int], rank_window: Callable[[list[int]], Sequence[int]], window: int = 20, step: int = 10
) -> list[int]:
    """RankGPT's sliding-window reranking: each window's candidates (in their current order) are reordered by
    ``rank_window``, which returns the window's positions best first (a permutation of ``range(len(w))``);
    windows move from the bottom of the list to the top, so a strong candidate can climb ``step`` places per
    window up to the top.

    >>> score = {c: -c for c in range(30)}  # candidate c's score: lower ids are better
    >>> by_score = lambda w: sorted(range(len(w)), key=lambda i: -score[w[i]])
    >>> sliding_window_rerank(list(range(29, -1, -1)), by_score, window=20, step=10)[:5]
    [0, 1, 2, 3, 4]
    """
    out = list(order)
    for start, end in window_starts(len(out), window, step):
        w = out[start:end]
        perm = list(rank_window(w))
        if sorted(perm) != list(range(len(w))):
            raise ValueError(f"a window's ranking must be a permutation of 0..{len(w) - 1}, got {perm}")
        out[start:end] = [w[i] for i in perm]
    return out


def order_by_scores(scores: Sequence[float]) -> list[int]:
    """Positions best first by score; ties keep the incoming (first-stage) order.

    >>> order_by_scores([0.2, 0.9, 0.2, 0.5])
    [1, 3, 0, 2]
    """
    return sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))


# ------------------------------------------------------------------------------ constrained permutation
@dataclass
class Decoded:
    """A permutation decoded rank slot by rank slot: ``perm[r]`` is the candidate at rank ``r``."""

    perm: list[int]
    unconstrained_valid: bool  # whether the same decoding without the constraint gave a permutation too


def permutation_decoder(
    n: int,
    steps: int,
    constrained: bool = True,
) -> Generator[list[int | None], np.ndarray, list[int | None]]:
    """:func:`constrained_permutation` as a generator: it yields the state before each denoising step and
    receives that step's ``[n, n]`` logits, returning the final state; so that many windows decode in lockstep,
    one batched forward pass per step (the permutation reranker's batching across queries).

    >>> d = permutation_decoder(2, 2)
    >>> next(d)
    [None, None]
    >>> d.send(np.array([[5.0, 0], [4.0, 1]]))
    [0, None]
    """
    if n < 1 or steps < 1:
        raise ValueError(f"need n >= 1 and steps >= 1, got {n} and {steps}")
    steps = min(steps, n)
    per_step = [n // steps + (1 if i < n % steps else 0) for i in range(steps)]
    state: list[int | None] = [None] * n
    used = np.zeros(n, dtype=bool)
    for k in per_step:
        logits = np.asarray((yield list(state)), np.float64)
        if logits.shape != (n, n):
            raise ValueError(f"slot logits must be [{n}, {n}], got {list(logits.shape)}")
        for _ in range(k):
            open_slots = [r for r in range(n) if state[r] is None]
            best_slot, best_id, best_conf = -1, -1, -np.inf
            for r in open_slots:
                row = logits[r].copy()
                if constrained:
                    row[used] = -np.inf
                p = np.exp(row - row.max())
                p /= p.sum()
                cand = int(np.argmax(p))  # ties: the lowest identifier
                if p[cand] > best_conf:  # ties: the earliest slot
                    best_slot, best_id, best_conf = r, cand, float(p[cand])
            state[best_slot] = best_id
            used[best_id] = True
    return state


def constrained_permutation(
    slot_logits: Callable[[list[int | None]], np.ndarray], n: int, steps: int, constrained: bool = True
) -> list[int | None]:
    """Fill ``n`` masked rank slots over ``steps`` denoising steps with low-confidence remasking (LLaDA's
    Algorithm 5, greedy): at each step every open slot proposes its most probable identifier, and the most
    confident proposals are committed, ``n / steps`` per step (the remainder in the first steps).

    ``slot_logits(state)`` gives ``[n, n]`` logits (rank slot x identifier) for the current state (``None`` at
    open slots). With ``constrained``, an identifier once used is out of every other slot's choices, also
    within a step: commits go in confidence order and each open slot re-proposes among the identifiers left,
    so the result is always a permutation. Confidence is the probability under the softmax over the
    identifiers still feasible.

    >>> logits = np.array([[5.0, 0, 0], [4.0, 1, 0], [3.0, 2, 1]])  # every slot prefers candidate 0
    >>> constrained_permutation(lambda s: logits, 3, 1), constrained_permutation(lambda s: logits, 3, 1, False)
    ([0, 1, 2], [0, 0, 0])
    """
    decoder = permutation_decoder(n, steps, constrained)
    state = next(decoder)
    while True:
        try:
            state = decoder.send(np.asarray(slot_logits(state), np.float64))
        except StopIteration as done:
            return done.value


def decode_permutation(slot_logits: Callable[[list[int | None]], np.ndarray], n: int, steps: int) -> Decoded:
    """:func:`constrained_permutation`, plus whether the unconstrained decoding would have been valid (the
    share of invalid outputs is what the constraint saves).

    >>> logits = np.array([[5.0, 0], [4.0, 1]])
    >>> decode_permutation(lambda s: logits, 2, 2)
    Decoded(perm=[0, 1], unconstrained_valid=False)
    """
    perm = constrained_permutation(slot_logits, n, steps, constrained=True)
    free = constrained_permutation(slot_logits, n, steps, constrained=False)
    return Decoded([int(x) for x in perm if x is not None], sorted(free) == list(range(n)))  # type: ignore[type-var]


# -------------------------------------------------------------------------------------------- assignment
def assignment_permutation(log_probs: np.ndarray) -> list[int]:
    """The permutation maximising the summed log-probability of an ``[n, n]`` (rank slot x identifier) matrix
    from one forward pass: the Hungarian algorithm (scipy's ``linear_sum_assignment``). ``perm[r]`` is the
    candidate placed at rank ``r``.

    >>> assignment_permutation(np.log(np.array([[0.6, 0.4], [0.9, 0.1]])))  # 0.4 * 0.9 > 0.6 * 0.1
    [1, 0]
    """
    m = np.asarray(log_probs, np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"expected a square [slots, identifiers] matrix, got {list(m.shape)}")
    m = np.where(np.isfinite(m), m, -1e30)  # an impossible pair is merely very expensive
    from scipy.optimize import linear_sum_assignment  # here: scipy's import is slow, most runs never assign

    rows, cols = linear_sum_assignment(m, maximize=True)
    perm = [0] * len(rows)
    for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
        perm[r] = c
    return perm
