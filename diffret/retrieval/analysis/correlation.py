"""Feature correlation (paper section 6.4): peak K_q per query against query length and entropy, as Spearman
and Kendall rank correlations with bootstrap confidence intervals."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .views import Views, rows


@dataclass
class Correlation:
    n: int
    spearman: float
    spearman_ci: tuple[float, float]
    kendall: float
    kendall_ci: tuple[float, float]


def rank_correlation(x: list[float], y: list[float], n_boot: int = 1000, seed: int = 0) -> Correlation:
    """Spearman rho and Kendall tau-b with 95% bootstrap intervals (queries resampled in pairs; BCa, which
    corrects the bias that resampling introduces through extra ties; when BCa is undefined, the percentile
    interval over the resamples where the statistic is defined, if at least half are).

    NaN when a variable is constant (no ranking to correlate).

    >>> c = rank_correlation([1, 2, 3, 4, 5], [1, 1, 2, 4, 4], n_boot=50)
    >>> c.n, round(c.spearman, 3), round(c.kendall, 3)
    (5, 0.949, 0.894)
    """
    xa, ya = np.asarray(x, float), np.asarray(y, float)
    if xa.shape != ya.shape:
        raise ValueError(f"x and y differ in length ({len(xa)} vs {len(ya)})")
    n = len(xa)
    nan = float("nan")
    if n < 3 or np.ptp(xa) == 0 or np.ptp(ya) == 0:
        return Correlation(n, nan, (nan, nan), nan, (nan, nan))
    from scipy import stats  # here, not at import: scipy.stats takes about a second to import

    def spearman(a: np.ndarray, b: np.ndarray) -> float:
        return float(stats.spearmanr(a, b).statistic) if np.ptp(a) and np.ptp(b) else nan

    def kendall(a: np.ndarray, b: np.ndarray) -> float:
        return float(stats.kendalltau(a, b).statistic) if np.ptp(a) and np.ptp(b) else nan

    def ci(fn) -> tuple[float, float]:  # noqa: ANN001
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = stats.bootstrap(
                (xa, ya),
                fn,
                paired=True,
                vectorized=False,
                n_resamples=n_boot,
                confidence_level=0.95,
                method="BCa",
                rng=np.random.default_rng(seed),
            )
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if np.isfinite(lo) and np.isfinite(hi):
            return (lo, hi)
        # BCa is undefined when resamples are degenerate (a constant variable in some of them, e.g. few
        # queries off the modal peak): percentile interval over the resamples where it is defined
        dist = np.asarray(res.bootstrap_distribution, float)
        dist = dist[np.isfinite(dist)]
        if len(dist) < n_boot / 2:
            return (nan, nan)
        if np.ptp(dist) == 0:
            return (float(dist[0]), float(dist[0]))
        return (float(np.percentile(dist, 2.5)), float(np.percentile(dist, 97.5)))

    return Correlation(n, spearman(xa, ya), ci(spearman), kendall(xa, ya), ci(kendall))


def feature_correlations(db: Views, n_boot: int = 1000) -> list[dict[str, Any]]:
    """Per (system, dataset, split, mode): peak K_q against query length and entropy (view ``query_peaks``)."""
    data = rows(db, "select * from query_peaks order by system, dataset, split, mode, query_id")
    groups: dict[tuple, list[dict]] = {}
    for r in data:
        groups.setdefault((r["system"], r["dataset"], r["split"], r["mode"]), []).append(r)
    out = []
    for (system, dataset, split, mode), rs in sorted(groups.items()):
        peak = [r["peak_kq"] for r in rs]
        off_mode = len(peak) - max(peak.count(v) for v in set(peak))
        for feature in ("length", "entropy"):
            c = rank_correlation([r[feature] for r in rs], peak, n_boot)
            out.append(
                {
                    "system": system,
                    "dataset": dataset,
                    "split": split,
                    "mode": mode,
                    "feature": feature,
                    "n": c.n,
                    "off_mode": off_mode,
                    "spearman": c.spearman,
                    "spearman_lo": c.spearman_ci[0],
                    "spearman_hi": c.spearman_ci[1],
                    "kendall": c.kendall,
                    "kendall_lo": c.kendall_ci[0],
                    "kendall_hi": c.kendall_ci[1],
                }
            )
    return out
