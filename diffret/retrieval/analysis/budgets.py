"""Adaptive budgets: choose (K_q, K_p) per query from features known before search, learned on one split's
per-query grid metrics and applied to another (the paper's named future work, section 6.3).

Pure functions over arrays: a :class:`Grid` holds every query's score at every cell of a budget grid; a selector
learns, from query features and a train grid, which cell each query should use. Selectors (:data:`SELECTORS`):

- ``fixed``: the cell with the best mean score on the train split (the paper's train-selected budget);
- ``rule``: one feature and one threshold, a cell below it and a cell above it, the best on the train split;
- ``classifier``: gradient boosting over the cells, each query labelled with its best cell;
- ``regressor``: gradient boosting of a query's score at a cell from its features and the cell, argmax over cells.

The learners are scikit-learn's; hyper-parameters are chosen by k-fold cross-validation on the train split, on
the mean score of the cells chosen for the held-out queries (what the selector is for, not its accuracy).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

Cell = tuple[int, int]


@dataclass
class Grid:
    """Per-query scores over a budget grid: ``scores[i, j]`` is query ``queries[i]`` at cell ``cells[j]``."""

    queries: list[str]
    cells: list[Cell]
    scores: np.ndarray

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[str, int, int, float]], cells: Sequence[Cell] | None = None) -> Grid:
        """A grid from (query_id, kq, kp, value) rows; every query must have every cell (else ValueError naming
        the missing ones).

        >>> g = Grid.from_rows([("a", 1, 1, 0.5), ("a", 4, 1, 0.7), ("b", 1, 1, 0.2), ("b", 4, 1, 0.1)])
        >>> g.queries, g.cells, g.scores.tolist()
        (['a', 'b'], [(1, 1), (4, 1)], [[0.5, 0.7], [0.2, 0.1]])
        """
        cells = sorted({(int(kq), int(kp)) for _, kq, kp, _ in rows}) if cells is None else list(cells)
        queries = sorted({q for q, _, _, _ in rows})
        qi = {q: i for i, q in enumerate(queries)}
        ci = {c: j for j, c in enumerate(cells)}
        scores = np.full((len(queries), len(cells)), np.nan)
        for q, kq, kp, v in rows:
            j = ci.get((int(kq), int(kp)))
            if j is not None:
                scores[qi[q], j] = float(v)
        missing = [cells[j] for j in range(len(cells)) if np.isnan(scores[:, j]).all()]
        if missing:
            raise ValueError(f"no per-query metrics for the cells (K_q, K_p) {missing}: score and evaluate them first")
        holes = np.argwhere(np.isnan(scores))
        if len(holes):
            q, j = holes[0]
            raise ValueError(
                f"{len(holes)} (query, cell) pairs lack a metric, e.g. query {queries[q]!r} at "
                f"(K_q, K_p) = {cells[j]}: the cells were evaluated on different queries"
            )
        return cls(queries, cells, scores)

    def restrict(self, over: str, fixed: Cell) -> Grid:
        """The cells a choice ``over`` K_q (K_p fixed at ``fixed[1]``), K_p (K_q fixed) or ``joint`` may take.

        >>> g = Grid(["a"], [(1, 1), (1, 4), (4, 1), (4, 4)], np.array([[1.0, 2.0, 3.0, 4.0]]))
        >>> g.restrict("kq", (4, 4)).cells, g.restrict("kp", (1, 4)).cells
        ([(1, 4), (4, 4)], [(1, 1), (1, 4)])
        """
        if over == "joint":
            return self
        keep = [j for j, (kq, kp) in enumerate(self.cells) if (kp == fixed[1] if over == "kq" else kq == fixed[0])]
        if over not in ("kq", "kp") or not keep:
            raise ValueError(f"over must be kq, kp or joint (with the fixed cell {fixed} in the grid), got {over!r}")
        return Grid(self.queries, [self.cells[j] for j in keep], self.scores[:, keep])

    def subset(self, queries: Sequence[str]) -> Grid:
        """The rows of ``queries`` (in that order)."""
        index = {q: i for i, q in enumerate(self.queries)}
        rows = [index[q] for q in queries]
        return Grid(list(queries), self.cells, self.scores[rows])

    def best_mean(self) -> int:
        """The cell index with the best mean score (ties: the smaller budget, then the smaller K_q)."""
        means = self.scores.mean(0)
        return min(
            range(len(self.cells)), key=lambda j: (-round(float(means[j]), 12), sum(self.cells[j]), self.cells[j])
        )

    def oracle(self) -> np.ndarray:
        """Per query, its best score over the cells."""
        return self.scores.max(1)

    def achieved(self, chosen: np.ndarray) -> np.ndarray:
        """Per query, the score of the cell chosen for it (cell indices)."""
        return self.scores[np.arange(len(self.queries)), chosen]


def best_cells(grid: Grid) -> np.ndarray:
    """Per query, the index of its best cell; ties go to the cell with the best mean score, then the smaller budget.

    >>> best_cells(Grid(["a", "b", "c"], [(1, 1), (4, 1)], np.array([[0.5, 0.5], [0.1, 0.9], [0.8, 0.2]]))).tolist()
    [1, 1, 0]
    """
    means = grid.scores.mean(0)
    prefer = sorted(range(len(grid.cells)), key=lambda j: (-means[j], sum(grid.cells[j]), grid.cells[j]))
    out = np.empty(len(grid.queries), dtype=int)
    for i, row in enumerate(grid.scores):
        top = row >= row.max() - 1e-12
        out[i] = next(j for j in prefer if top[j])
    return out


@dataclass
class Fitted:
    """A learned selector: its name, the hyper-parameters it chose (cross-validated), what it learned (the rule,
    the cell), and the features' importances where the learner has them."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    learned: dict[str, Any] = field(default_factory=dict)
    importances: dict[str, float] = field(default_factory=dict)
    cv_score: float | None = None
    model: Any = None
    names: list[str] = field(default_factory=list)  # the feature columns it was fitted on


class Selector:
    """Learns which cell of a grid each query should use, from its features (rows of ``X``, columns ``names``)."""

    name: ClassVar[str]
    grid_params: ClassVar[list[dict[str, Any]]] = [{}]
    uses_features: ClassVar[bool] = True

    def fit_params(self, X: np.ndarray, names: list[str], grid: Grid, params: dict[str, Any], seed: int) -> Fitted:
        raise NotImplementedError

    def choose(self, fitted: Fitted, X: np.ndarray, grid: Grid) -> np.ndarray:
        raise NotImplementedError

    def fit(self, X: np.ndarray, names: list[str], grid: Grid, seed: int = 0, folds: int = 5) -> Fitted:
        """Fit on ``grid`` (the train split), the hyper-parameters chosen by ``folds``-fold cross-validation on the
        mean score of the cells chosen for the held-out queries."""
        scores = {}
        if len(self.grid_params) > 1:
            for i, params in enumerate(self.grid_params):
                scores[i] = cross_validate(self, X, names, grid, params, seed, folds)
        best = max(scores, key=lambda i: (scores[i], -i)) if scores else 0
        fitted = self.fit_params(X, names, grid, self.grid_params[best], seed)
        fitted.cv_score = scores.get(best)
        return fitted


def cross_validate(
    selector: Selector, X: np.ndarray, names: list[str], grid: Grid, params: dict[str, Any], seed: int, folds: int
) -> float:
    """Mean score of the cells ``selector`` (with ``params``) chooses for held-out queries, over ``folds`` seeded
    folds of the train queries."""
    from sklearn.model_selection import KFold

    n = len(grid.queries)
    folds = max(2, min(folds, n))
    got = np.zeros(n)
    for train, held in KFold(folds, shuffle=True, random_state=seed).split(np.arange(n)):
        part = Grid([grid.queries[i] for i in train], grid.cells, grid.scores[train])
        fitted = selector.fit_params(X[train], names, part, params, seed)
        held_grid = Grid([grid.queries[i] for i in held], grid.cells, grid.scores[held])
        got[held] = held_grid.achieved(selector.choose(fitted, X[held], held_grid))
    return float(got.mean())


class Fixed(Selector):
    """The cell with the best mean score on the train split, for every query (the paper's fixed budget)."""

    name = "fixed"
    uses_features = False

    def fit_params(self, X, names, grid, params, seed):  # noqa: ANN001, ANN201
        j = grid.best_mean()
        return Fitted(self.name, learned={"cell": list(grid.cells[j])})

    def choose(self, fitted, X, grid):  # noqa: ANN001, ANN201
        return np.full(len(X), grid.cells.index(tuple(fitted.learned["cell"])))


class Rule(Selector):
    """One feature, one threshold: queries with the feature <= the threshold take one cell, the others another;
    the (feature, threshold, cells) with the best mean score on the train split (exhaustive)."""

    name = "rule"

    def fit_params(self, X, names, grid, params, seed):  # noqa: ANN001, ANN201
        j0 = grid.best_mean()
        best = (float(grid.scores[:, j0].mean()), None, math.inf, j0, j0)
        n = len(grid.queries)
        for f in range(X.shape[1]):
            order = np.argsort(X[:, f], kind="stable")
            values = X[order, f]
            below = np.cumsum(grid.scores[order], 0)  # below[i]: the first i + 1 queries
            above = below[-1] - below
            for i in range(n - 1):
                if values[i] == values[i + 1]:
                    continue  # a threshold between equal values splits nothing
                a, b = int(below[i].argmax()), int(above[i].argmax())
                total = (below[i, a] + above[i, b]) / n
                if total > best[0] + 1e-12:
                    best = (float(total), f, float((values[i] + values[i + 1]) / 2), a, b)
        _, f, t, a, b = best
        learned = {
            "feature": names[f] if f is not None else None,
            "threshold": t if f is not None else None,
            "below": list(grid.cells[a]),
            "above": list(grid.cells[b]),
        }
        imp = {name: float(name == learned["feature"]) for name in names}
        return Fitted(self.name, learned=learned, importances=imp, names=list(names))

    def choose(self, fitted, X, grid):  # noqa: ANN001, ANN201
        rule = fitted.learned
        below, above = grid.cells.index(tuple(rule["below"])), grid.cells.index(tuple(rule["above"]))
        if rule["feature"] is None:
            return np.full(len(X), below)
        f = fitted.names.index(rule["feature"])
        return np.where(X[:, f] <= rule["threshold"], below, above)


_GB_GRID = [
    {"max_depth": d, "n_estimators": n, "learning_rate": 0.1} for d, n in itertools.product((1, 2, 3), (50, 150))
]


class Classifier(Selector):
    """Gradient boosting over the cells (scikit-learn's), each train query labelled with its best cell."""

    name = "classifier"
    grid_params = _GB_GRID

    def fit_params(self, X, names, grid, params, seed):  # noqa: ANN001, ANN201
        from sklearn.ensemble import GradientBoostingClassifier

        labels = best_cells(grid)
        if len(set(labels.tolist())) < 2:  # one class: that cell for everyone
            return Fitted(self.name, params=dict(params), learned={"cell": list(grid.cells[int(labels[0])])})
        model = GradientBoostingClassifier(random_state=seed, **params).fit(X, labels)
        imp = dict(zip(names, map(float, model.feature_importances_), strict=True))
        return Fitted(self.name, params=dict(params), importances=imp, model=model)

    def choose(self, fitted, X, grid):  # noqa: ANN001, ANN201
        if fitted.model is None:
            return np.full(len(X), grid.cells.index(tuple(fitted.learned["cell"])))
        return fitted.model.predict(X).astype(int)


class Regressor(Selector):
    """Gradient boosting (scikit-learn's) of a query's score at a cell from its features and the cell's
    (log2 K_q, log2 K_p); each query takes the cell with the highest prediction."""

    name = "regressor"
    grid_params = _GB_GRID

    @staticmethod
    def _pairs(X: np.ndarray, cells: list[Cell]) -> np.ndarray:
        c = np.log2(np.array(cells, dtype=float))
        return np.concatenate([np.repeat(X, len(cells), 0), np.tile(c, (len(X), 1))], 1)

    def fit_params(self, X, names, grid, params, seed):  # noqa: ANN001, ANN201
        from sklearn.ensemble import GradientBoostingRegressor

        model = GradientBoostingRegressor(random_state=seed, **params)
        model.fit(self._pairs(X, grid.cells), grid.scores.reshape(-1))
        imp = dict(zip([*names, "log2_kq", "log2_kp"], map(float, model.feature_importances_), strict=True))
        return Fitted(self.name, params=dict(params), importances=imp, model=model)

    def choose(self, fitted, X, grid):  # noqa: ANN001, ANN201
        pred = fitted.model.predict(self._pairs(X, grid.cells)).reshape(len(X), len(grid.cells))
        return pred.argmax(1)


SELECTORS: dict[str, Selector] = {s.name: s for s in (Fixed(), Rule(), Classifier(), Regressor())}


def gap_closed(fixed: np.ndarray, selected: np.ndarray, oracle: np.ndarray) -> dict[str, float]:
    """Means of per-query scores at the fixed budget, the selector's and the oracle's; the share of the
    fixed-to-oracle gap the selector closes; a paired t-test of selector against fixed (p = nan when they never
    differ).

    >>> r = gap_closed(np.array([0.2, 0.4]), np.array([0.3, 0.4]), np.array([0.4, 0.6]))
    >>> round(r["fixed"], 2), round(r["selected"], 2), round(r["oracle"], 2), round(r["gap_closed"], 2)
    (0.3, 0.35, 0.5, 0.25)
    """
    from scipy import stats

    f, s, o = float(fixed.mean()), float(selected.mean()), float(oracle.mean())
    diff = selected - fixed
    p = float(stats.ttest_rel(selected, fixed).pvalue) if np.any(diff) else math.nan
    return {
        "fixed": f,
        "selected": s,
        "oracle": o,
        "gap_closed": (s - f) / (o - f) if o > f else math.nan,
        "p_value": p,
        "queries": len(fixed),
    }


# Features read from a query's stored encoding at one K, and what each costs at query time: nothing beyond the
# query's encoding at that K (one forward pass per K whose features a selector reads; K = the served budget's is
# paid anyway).
ENCODING_FEATURES = {
    "slots": "slots read (the stop cut), of K",
    "distinct": "distinct tokens decoded at the slots read",
    "sparse_mass": "sum of the sparse vector's weights",
    "support": "non-zero entries of the sparse vector",
    "agreement": "mean pairwise cosine of the slots' dense vectors (1 for one slot)",
}
# With the LM head's stats stored (`diffret encode --head-stats`): per slot read, the softmax's entropy (nats) and
# its largest probability, as mean / min / max over the slots; they cost nothing beyond that same pass.
HEAD_FEATURES = {
    f"{stat}_{agg}": f"{agg} over the slots read of the LM head's {what}"
    for stat, what in (("entropy", "softmax entropy (nats)"), ("maxprob", "largest probability"))
    for agg in ("mean", "min", "max")
}


def encoding_features(
    dense: np.ndarray,
    n_reps: int,
    tokens: Sequence[int] | None,
    sparse_weights: Sequence[float] | None,
    entropy: Sequence[float] | None = None,
    maxprob: Sequence[float] | None = None,
) -> dict[str, float]:
    """The :data:`ENCODING_FEATURES` of one text's encoding at one K, and the :data:`HEAD_FEATURES` when its
    slots' ``entropy`` and ``maxprob`` (all K slots; the first ``n_reps`` were read) are given.

    >>> f = encoding_features(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), 3, [7, 7, 9, 0], [0.5, 1.5])
    >>> f["slots"], f["distinct"], f["sparse_mass"], f["support"], round(f["agreement"], 4)
    (3.0, 2.0, 2.0, 2.0, 0.4714)
    >>> f = encoding_features(np.ones((1, 2)), 1, [7, 3], None, entropy=[2.0, 9.0], maxprob=[0.5, 0.1])
    >>> f["entropy_mean"], f["entropy_max"], f["maxprob_min"], f["support"]
    (2.0, 2.0, 0.5, 0.0)
    """
    vecs = np.asarray(dense, dtype=np.float64)[:n_reps]
    if len(vecs) > 1:
        unit = vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
        sim = unit @ unit.T
        agreement = float(sim[np.triu_indices(len(vecs), 1)].mean())
    else:
        agreement = 1.0
    read = list(tokens or [])[:n_reps]
    weights = np.asarray(sparse_weights if sparse_weights is not None else [], dtype=np.float64)
    out = {
        "slots": float(n_reps),
        "distinct": float(len(set(read))),
        "sparse_mass": float(weights.sum()),
        "support": float(np.count_nonzero(weights)),
        "agreement": agreement,
    }
    for stat, values in (("entropy", entropy), ("maxprob", maxprob)):
        if values is not None:
            v = np.asarray(values, dtype=np.float64)[: max(1, n_reps)]
            out.update({f"{stat}_mean": float(v.mean()), f"{stat}_min": float(v.min()), f"{stat}_max": float(v.max())})
    return out


def text_features(text: str, n_tokens: int) -> dict[str, float]:
    """A query's length in the model's tokens and in whitespace words (free at query time).

    >>> text_features("what is  covid?", 5)
    {'length_tokens': 5.0, 'length_words': 3.0}
    """
    return {"length_tokens": float(n_tokens), "length_words": float(len(text.split()))}


def first_pass_features(scores: Sequence[float]) -> dict[str, float]:
    """Features of a query's ranked scores from a cheap first pass (the smallest cell's run): the top score, the
    gap to the second, and the entropy (nats) of the softmax over the top 10 (one extra search at query time).

    >>> f = first_pass_features([3.0, 1.0, 1.0])
    >>> f["fp_top"], f["fp_gap"], round(f["fp_entropy"], 4)
    (3.0, 2.0, 0.6656)
    >>> first_pass_features([])["fp_top"]
    0.0
    """
    s = np.sort(np.asarray(scores, dtype=np.float64))[::-1][:10]
    if not len(s):
        return {"fp_top": 0.0, "fp_gap": 0.0, "fp_entropy": 0.0}
    p = np.exp(s - s.max())
    p /= p.sum()
    return {
        "fp_top": float(s[0]),
        "fp_gap": float(s[0] - s[1]) if len(s) > 1 else 0.0,
        "fp_entropy": float(-(p * np.log(p)).sum()),
    }
