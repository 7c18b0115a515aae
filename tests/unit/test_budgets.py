"""Adaptive budget selectors on hand-built grids with a planted answer: the rule finds the feature and threshold,
the learners close most of the gap on held-out queries, the fixed budget is the best mean cell, and a grid with
a missing cell is refused naming it."""

from __future__ import annotations

import numpy as np
import pytest

from diffret.retrieval.analysis.budgets import SELECTORS, Grid, best_cells, gap_closed

CELLS = [(1, 1), (1, 4), (4, 1), (4, 4)]


def planted(n: int, seed: int) -> tuple[np.ndarray, Grid]:
    """Short queries (length <= 5) do best at (1, 4), long ones at (4, 4); a noise feature beside the length."""
    rng = np.random.default_rng(seed)
    length = rng.integers(1, 11, n).astype(float)
    noise = rng.normal(size=n)
    scores = rng.uniform(0.0, 0.3, (n, len(CELLS)))
    scores[length <= 5, 1] += 0.6
    scores[length > 5, 3] += 0.5
    return np.stack([noise, length], 1), Grid([f"q{i}" for i in range(n)], CELLS, scores)


def test_the_rule_finds_the_planted_feature_threshold_and_cells() -> None:
    X, grid = planted(200, 0)
    fitted = SELECTORS["rule"].fit(X, ["noise", "length"], grid)
    rule = fitted.learned
    assert rule["feature"] == "length" and 5 <= rule["threshold"] < 6
    assert (tuple(rule["below"]), tuple(rule["above"])) == ((1, 4), (4, 4))
    assert fitted.importances == {"noise": 0.0, "length": 1.0}


@pytest.mark.parametrize("name", ["rule", "classifier", "regressor"])
def test_learners_close_most_of_the_gap_on_held_out_queries(name: str) -> None:
    X, train = planted(200, 0)
    Xt, test = planted(100, 1)
    sel = SELECTORS[name]
    fitted = sel.fit(X, ["noise", "length"], train, seed=0, folds=3)
    fixed = SELECTORS["fixed"].fit(X, ["noise", "length"], train)
    got = gap_closed(
        test.achieved(SELECTORS["fixed"].choose(fixed, Xt, test)),
        test.achieved(sel.choose(fitted, Xt, test)),
        test.oracle(),
    )
    assert got["gap_closed"] > 0.5 and got["p_value"] < 1e-6, got
    if name != "rule":  # cross-validated hyper-parameters, recorded; the length matters more than the noise
        assert fitted.params["max_depth"] in (1, 2, 3) and fitted.cv_score is not None
        assert fitted.importances["length"] > fitted.importances["noise"]


def test_fixed_is_the_best_mean_cell_and_ties_go_to_the_smaller_budget() -> None:
    grid = Grid(["a", "b"], CELLS, np.array([[0.5, 0.2, 0.5, 0.1], [0.1, 0.2, 0.1, 0.3]]))
    fitted = SELECTORS["fixed"].fit(np.zeros((2, 0)), [], grid)
    assert fitted.learned["cell"] == [1, 1]  # (1, 1) and (4, 1) tie at 0.3
    assert best_cells(grid).tolist() == [0, 3]


def test_a_grid_missing_a_cell_or_a_query_is_refused_naming_it() -> None:
    rows = [("a", 1, 1, 0.5), ("b", 1, 1, 0.4), ("a", 4, 4, 0.3)]
    with pytest.raises(ValueError, match=r"query 'b' at \(K_q, K_p\) = \(4, 4\)"):
        Grid.from_rows(rows)
    with pytest.raises(ValueError, match=r"\(1, 4\)"):
        Grid.from_rows(rows[:2], cells=[(1, 1), (1, 4)])


def test_choices_over_one_axis_keep_the_other_fixed() -> None:
    X, grid = planted(50, 2)
    sub = grid.restrict("kq", (4, 4))
    assert sub.cells == [(1, 4), (4, 4)]
    chosen = SELECTORS["classifier"].choose(SELECTORS["classifier"].fit(X, ["noise", "length"], sub, folds=2), X, sub)
    assert set(chosen.tolist()) <= {0, 1}


def test_cross_validation_scores_held_out_queries_only_and_is_seeded() -> None:
    from diffret.retrieval.analysis.budgets import cross_validate

    X, grid = planted(120, 3)
    names = ["noise", "length"]
    rule = cross_validate(SELECTORS["rule"], X, names, grid, {}, seed=0, folds=4)
    fixed = cross_validate(SELECTORS["fixed"], X, names, grid, {}, seed=0, folds=4)
    assert fixed < rule <= float(grid.oracle().mean())
    params = {"max_depth": 1, "n_estimators": 50, "learning_rate": 0.1}
    assert cross_validate(SELECTORS["classifier"], X, names, grid, params, seed=5, folds=4) == cross_validate(
        SELECTORS["classifier"], X, names, grid, params, seed=5, folds=4
    )
