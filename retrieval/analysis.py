"""The analyses of the paper (sections 4.4 and 6) on top of the SQL views of ``queries/40_analysis.sql``.

The numbers come from the views (``budget_selection``, ``selected_cells``, ``oracle``, ``query_peaks``,
``footprint``); this module adds what SQL cannot do well: rank correlations with bootstrap confidence
intervals, paired t-test markers for the paper tables, and the footprint projection to MS MARCO scale.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from storage.sql import StoreSQL

D, S, H = "multi_dense", "sparse_max", "fusion_multi_sparse_max"
TABLE_MODES = {"D": D, "S": S, "H": H}
MSMARCO_PASSAGES = 8_841_823


def rows(db: StoreSQL, sql: str, params: list | None = None) -> list[dict[str, Any]]:
    rel = db.con.execute(sql, params or [])
    cols = [d[0] for d in rel.description]
    return [dict(zip(cols, r, strict=True)) for r in rel.fetchall()]


# ---------------------------------------------------------------------------------- correlation
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
    """
    xa, ya = np.asarray(x, float), np.asarray(y, float)
    if xa.shape != ya.shape:
        raise ValueError(f"x and y differ in length ({len(xa)} vs {len(ya)})")
    n = len(xa)
    nan = float("nan")
    if n < 3 or np.ptp(xa) == 0 or np.ptp(ya) == 0:
        return Correlation(n, nan, (nan, nan), nan, (nan, nan))

    def spearman(a: np.ndarray, b: np.ndarray) -> float:
        return float(stats.spearmanr(a, b).statistic) if np.ptp(a) and np.ptp(b) else nan

    def kendall(a: np.ndarray, b: np.ndarray) -> float:
        return float(stats.kendalltau(a, b).statistic) if np.ptp(a) and np.ptp(b) else nan

    def ci(fn) -> tuple[float, float]:  # noqa: ANN001
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = stats.bootstrap(
                (xa, ya), fn, paired=True, vectorized=False, n_resamples=n_boot, confidence_level=0.95,
                method="BCa", rng=np.random.default_rng(seed),
            )  # fmt: skip
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


def feature_correlations(db: StoreSQL, n_boot: int = 1000) -> list[dict[str, Any]]:
    """Per (model, dataset, split, mode): peak K_q against query length and entropy (view ``query_peaks``)."""
    data = rows(db, "select * from query_peaks order by model, dataset, split, mode, query_id")
    groups: dict[tuple, list[dict]] = {}
    for r in data:
        groups.setdefault((r["model"], r["dataset"], r["split"], r["mode"]), []).append(r)
    out = []
    for (model, dataset, split, mode), rs in sorted(groups.items()):
        peak = [r["peak_kq"] for r in rs]
        off_mode = len(peak) - max(peak.count(v) for v in set(peak))
        for feature in ("length", "entropy"):
            c = rank_correlation([r[feature] for r in rs], peak, n_boot)
            out.append(
                {
                    "model": model, "dataset": dataset, "split": split, "mode": mode, "feature": feature,
                    "n": c.n, "off_mode": off_mode, "spearman": c.spearman, "spearman_lo": c.spearman_ci[0],
                    "spearman_hi": c.spearman_ci[1], "kendall": c.kendall, "kendall_lo": c.kendall_ci[0],
                    "kendall_hi": c.kendall_ci[1],
                }
            )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------- paper tables
@dataclass
class TableCell:
    value: float | None
    markers: str = ""
    best: bool = False


@dataclass
class PaperTable:
    datasets: list[str]
    refs: list[str]
    rows: dict[str, dict[tuple[str, str], TableCell]] = field(default_factory=dict)  # system -> (dataset, col)
    budgets: dict[str, tuple[int, int]] = field(default_factory=dict)

    def columns(self) -> list[tuple[str, str]]:
        return [(d, c) for d in [*self.datasets, "avg"] for c in TABLE_MODES]

    def markdown(self) -> str:
        head = "| system | K_q*, K_p* | " + " | ".join(f"{d} {c}" for d, c in self.columns()) + " |"
        sep = "|---|---|" + "---:|" * len(self.columns())
        lines = [head, sep]
        for system, cells in self.rows.items():
            kq, kp = self.budgets.get(system, (None, None))
            budget = "–" if kq is None or (kq, kp) == (0, 0) else f"{kq}, {kp}"  # BM25 runs are kq = kp = 0
            vals = []
            for col in self.columns():
                c = cells.get(col)
                if c is None or c.value is None:
                    vals.append("–")
                    continue
                text = f"{c.value:.4f}{c.markers}"
                vals.append(f"**{text}**" if c.best else text)
            lines.append(f"| {system} | {budget} | " + " | ".join(vals) + " |")
        marks = ", ".join(
            f"{m} p < 0.05 (two-sided) against `{r}`" for m, r in zip(("†", "‡"), self.refs, strict=False)
        )
        lines += ["", "NDCG@10 on test at each model's train-selected budget; D = multi_dense, S = sparse_max "
                  "(BM25 in S), H = fusion_multi_sparse_max; best per column in bold" + (f"; {marks} (paired "
                  "t-test on per-query NDCG@10, same dataset and column)." if marks else ".")]  # fmt: skip
        return "\n".join(lines) + "\n"

    def csv_rows(self) -> list[list[Any]]:
        out: list[list[Any]] = [["system", "kq", "kp", *[f"{d}:{c}" for d, c in self.columns()]]]
        for system, cells in self.rows.items():
            kq, kp = self.budgets.get(system, (None, None))
            vals = []
            for col in self.columns():
                c = cells.get(col)
                vals.append("" if c is None or c.value is None else f"{c.value:.6f}{c.markers}")
            out.append([system, kq, kp, *vals])
        return out


def per_query_ndcg(db: StoreSQL, model: str, dataset: str, split: str, mode: str, kq: int, kp: int) -> dict[str, float]:
    """{query_id: NDCG@10} of one cell (view ``metrics``): the input of the paired t-tests."""
    r = db.con.execute(
        "select query_id, value from metrics where model = ? and dataset = ? and split = ? and mode = ? "
        "and kq = ? and kp = ? and measure = 'ndcg_cut_10'",
        [model, dataset, split, mode, kq, kp],
    ).fetchall()
    return dict(r)


def system_budgets(db: StoreSQL) -> dict[str, tuple[int, int]]:
    """The budget at which each system enters the tables: its train selection; a system with one cell
    per mode (BM25, single-vector readouts) uses that cell; systems with a grid but no train split are left out."""
    out = {r["model"]: (r["kq_star"], r["kp_star"]) for r in rows(db, "select * from budget_selection")}
    single = rows(
        db,
        "select model, min(kq) kq, min(kp) kp from cells where split = 'test' group by model "
        "having count(distinct (kq, kp)) = 1",
    )
    for r in single:
        out.setdefault(r["model"], (r["kq"], r["kp"]))
    return out


def paper_table(db: StoreSQL, refs: list[str] | None = None, alpha: float = 0.05) -> PaperTable:
    """Tables 2-3: D / S / H NDCG@10 per test dataset and their average, best per column, t-test markers."""
    from .evaluation import paired_ttest_values

    budgets = system_budgets(db)
    cells = rows(db, "select model, dataset, mode, kq, kp, ndcg_10 from cells where split = 'test'")
    datasets = sorted({c["dataset"] for c in cells})
    table = PaperTable(datasets, list(refs or [])[:2])
    value: dict[tuple[str, str, str], float] = {}
    for c in cells:
        b = budgets.get(c["model"])
        if b is None or (c["kq"], c["kp"]) != b:
            continue
        col = "S" if c["mode"] == "bm25" else next((k for k, m in TABLE_MODES.items() if m == c["mode"]), None)
        if col is not None:
            value[(c["model"], c["dataset"], col)] = c["ndcg_10"]
    systems = sorted({m for m, _, _ in value}, key=lambda s: (not s.startswith("bm25"), s))
    for system in systems:
        table.budgets[system] = budgets[system]
        row: dict[tuple[str, str], TableCell] = {}
        for col in TABLE_MODES:
            per_ds = [value.get((system, d, col)) for d in datasets]
            for d, v in zip(datasets, per_ds, strict=True):
                if v is not None:
                    row[(d, col)] = TableCell(v)
            if per_ds and all(v is not None for v in per_ds):
                row[("avg", col)] = TableCell(float(np.mean(per_ds)))
        table.rows[system] = row
    # markers: paired t-tests against each named reference, same dataset and column
    for mark, ref in zip(("†", "‡"), table.refs, strict=False):
        if ref not in budgets:
            raise ValueError(f"reference system {ref!r} has no test metrics at a selected budget; systems: {systems}")
        rkq, rkp = budgets[ref]
        for system, row in table.rows.items():
            if system == ref:
                continue
            kq, kp = budgets[system]
            for (d, col), cell in row.items():
                if d == "avg":
                    continue
                ref_mode = "bm25" if ref.startswith("bm25") else TABLE_MODES[col]
                mode = "bm25" if system.startswith("bm25") else TABLE_MODES[col]
                a = per_query_ndcg(db, system, d, "test", mode, kq, kp)
                b = per_query_ndcg(db, ref, d, "test", ref_mode, rkq, rkp)
                if not a or not b:
                    continue
                t = paired_ttest_values(a, b)
                if t.p_value < alpha:
                    cell.markers += mark
    for col in table.columns():
        vals = [(s, r[col].value) for s, r in table.rows.items() if col in r and r[col].value is not None]
        if vals:
            top = max(v for _, v in vals)
            for s, v in vals:
                if v == top:
                    table.rows[s][col].best = True
    return table


# ------------------------------------------------------------------------------------- footprint
def footprint_projection(
    hidden: int = 3584,
    passages: int = MSMARCO_PASSAGES,
    grid: tuple[int, ...] = (1, 2, 4, 8, 16),
    backbones: int = 4,
    settings: int = 2,
    bytes_per_value: float = 2.0,
    sparse_topk: int = 256,
    queries: int = 6980 + 43 + 54,
) -> dict[str, Any]:
    """Bytes of the encodings of the full grid at MS MARCO scale, with its assumptions.

    One encoding pass per K and side stores K dense vectors of ``hidden`` values per text (float16 by
    default: 2 bytes) plus ``sparse_topk`` (int32 id, float32 weight) pairs; every backbone and setting
    (e.g. zero-shot and fine-tuned) repeats it. Parquet (zstd) barely compresses float16 activations,
    so raw bytes are a fair estimate; ``bytes_per_value`` can be taken from the store's own ratio.
    """
    vectors_per_text = sum(grid)
    dense = (passages + queries) * vectors_per_text * hidden * bytes_per_value
    sparse = (passages + queries) * len(grid) * sparse_topk * 8
    per_setting = dense + sparse
    total = per_setting * backbones * settings
    return {
        "assumptions": {
            "passages": passages,
            "queries": queries,
            "hidden": hidden,
            "grid": list(grid),
            "vectors_per_text": vectors_per_text,
            "bytes_per_value": bytes_per_value,
            "sparse_topk": sparse_topk,
            "backbones": backbones,
            "settings": settings,
        },
        "dense_bytes_per_setting": dense,
        "sparse_bytes_per_setting": sparse,
        "bytes_per_backbone_setting": per_setting,
        "total_bytes": total,
        "total_tb": total / 1e12,
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} PB"
