"""Paired t-tests on per-query scores (the significance markers of the paper tables)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pyarrow as pa

from .trec import table_rows

# --------------------------------------------------------------------------------------- t-test

Q = TypeVar("Q", str, int)  # a query's key: its id, or its position


@dataclass(frozen=True)
class TTest:
    """A paired t-test of system a against system b on one measure; ``diff = mean_a - mean_b`` and ``t > 0``
    when a is better; ``p_value`` is two-sided."""

    measure: str
    n: int
    mean_a: float
    mean_b: float
    diff: float
    t: float
    p_value: float


def _per_query(table: pa.Table, measure: str | None, side: str) -> tuple[str, dict[str, float]]:
    rows = list(table_rows(table, ("query_id", "measure", "value"), f"metrics ({side})"))
    if measure is None:
        present = sorted({m for _, m, _ in rows})
        if len(present) != 1:
            raise ValueError(f"table {side} holds measures {present}: name the one to test")
        measure = present[0]
    out: dict[str, float] = {}
    for q, m, v in rows:
        if m == measure:
            if q in out:
                raise ValueError(f"table {side} has two {measure!r} values for query {q!r}")
            out[q] = float(v)
    if not out:
        raise ValueError(f"table {side} has no rows for measure {measure!r}")
    return measure, out


def paired_ttest(a: pa.Table, b: pa.Table, measure: str | None = None, *, allow_subset: bool = False) -> TTest:
    """Paired t-test (scipy.stats.ttest_rel) of a's per-query scores against b's on ``measure`` (default: the one
    measure the tables hold).

    Both tables must score the same queries unless ``allow_subset``, which tests the common ones. When every
    difference is the same the test is degenerate: t = 0 and p = 1 if a and b are identical, otherwise t = +-inf
    and p = 0.
    """
    measure, sa = _per_query(a, measure, "a")
    _, sb = _per_query(b, measure, "b")
    return paired_ttest_values(sa, sb, measure, allow_subset=allow_subset)


def paired_ttest_values(
    sa: Mapping[Q, float], sb: Mapping[Q, float], measure: str = "value", *, allow_subset: bool = False
) -> TTest:
    """``paired_ttest`` on two {query_id: score} maps (or {position: score}).

    >>> t = paired_ttest_values({"a": 0.5, "b": 0.7, "c": 0.9}, {"a": 0.4, "b": 0.5, "c": 0.6})
    >>> t.n, round(t.diff, 4), round(t.p_value, 3)
    (3, 0.2, 0.074)
    """
    only_a, only_b = sa.keys() - sb.keys(), sb.keys() - sa.keys()
    common = sorted(sa.keys() & sb.keys())
    if (only_a or only_b) and not allow_subset:
        raise ValueError(
            f"paired t-test on {measure!r}: query sets differ ({len(only_a)} only in a, e.g. {sorted(only_a)[:3]}; "
            f"{len(only_b)} only in b, e.g. {sorted(only_b)[:3]}); pass allow_subset=True to test the "
            f"{len(common)} common queries"
        )
    if len(common) < 2:
        raise ValueError(f"paired t-test on {measure!r} needs at least 2 common queries, got {len(common)}")
    xa = np.array([sa[q] for q in common], dtype=np.float64)
    xb = np.array([sb[q] for q in common], dtype=np.float64)
    d = xa - xb
    mean_diff = float(d.mean())
    if np.all(d == d[0]):  # zero variance: scipy would return nan
        t, p = (0.0, 1.0) if d[0] == 0 else (math.copysign(math.inf, float(d[0])), 0.0)
    else:
        from scipy import stats  # here: scipy.stats takes ~1 s to import, and most commands never test

        res = stats.ttest_rel(xa, xb)
        t, p = float(res.statistic), float(res.pvalue)
    return TTest(measure, len(common), float(xa.mean()), float(xb.mean()), mean_diff, t, p)
