"""The pipeline's result summary: leaderboard, (K_q, K_p) heatmaps per mode and a markdown page.

Every number comes from the SQL views of ``queries/`` (``cells``, ``best_cells``, ``metrics``), so
``diffret sql`` shows exactly what the summary prints.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from storage import ArtifactStore, Manifest
from storage.layout import MODES, summary_dir
from storage.sql import StoreSQL

HEADLINE = ("ndcg_10", "mrr_10", "recall_100", "recall_1000")


@dataclass
class Row:
    system: str
    mode: str
    kq: int
    kp: int
    ndcg_10: float | None
    mrr_10: float | None
    recall_100: float | None
    recall_1000: float | None
    queries: int
    p_vs_bm25: float | None = None


@dataclass
class Summary:
    system: str
    dataset: str
    split: str
    rows: list[Row] = field(default_factory=list)
    grids: dict[str, tuple[list[int], list[int], np.ndarray]] = field(default_factory=dict)  # mode -> kq, kp, ndcg

    def markdown(self, figures: dict[str, str] | None = None) -> str:
        head = "| system | mode | K_q | K_p | NDCG@10 | MRR@10 | R@100 | R@1000 | queries | p vs BM25 |"
        sep = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
        lines = [f"# {self.dataset} / {self.split}: `{self.system}`", "", head, sep]
        for r in self.rows:
            vals = " | ".join("–" if getattr(r, m) is None else f"{getattr(r, m):.4f}" for m in HEADLINE)
            p = "–" if r.p_vs_bm25 is None else f"{r.p_vs_bm25:.3g}"
            kq, kp = ("–", "–") if r.mode == "bm25" else (r.kq, r.kp)
            lines.append(f"| {r.system} | {r.mode} | {kq} | {kp} | {vals} | {r.queries} | {p} |")
        lines += [
            "",
            "Best (K_q, K_p) per mode by mean NDCG@10 on this split (ties: the smaller budget); p: paired t-test "
            "on per-query NDCG@10 against BM25.",
            "",
            "```sql",
            f"select mode, kq, kp, ndcg_10, mrr_10, recall_100, recall_1000 from best_cells "
            f"where model = '{self.system}' and dataset = '{self.dataset}' and split = '{self.split}'",
            "order by ndcg_10 desc",
            "```",
        ]
        for mode, name in (figures or {}).items():
            lines += ["", f"## {mode}", "", f"![{mode} NDCG@10 over (K_q, K_p)]({name})"]
        return "\n".join(lines) + "\n"


def build_summary(db: StoreSQL, system: str, dataset: str, split: str, bm25: str | None = None) -> Summary:
    from .analysis import per_query_ndcg
    from .evaluation import paired_ttest_values

    s = Summary(system, dataset, split)
    cols = "mode, kq, kp, ndcg_10, mrr_10, recall_100, recall_1000, queries"
    where = "model = ? and dataset = ? and split = ?"
    best = db.con.execute(
        f"select {cols} from best_cells where {where} order by ndcg_10 desc", [system, dataset, split]
    )
    rows = [Row(system, *r) for r in best.fetchall()]
    if bm25:
        b = db.con.execute(
            f"select {cols} from cells where {where} and mode = 'bm25'", [bm25, dataset, split]
        ).fetchall()
        rows += [Row(bm25, *r) for r in b]
    if bm25 and any(r.mode == "bm25" for r in rows):
        base = per_query_ndcg(db, bm25, dataset, split, "bm25", 0, 0)
        for r in rows:
            if r.mode != "bm25":
                a = per_query_ndcg(db, system, dataset, split, r.mode, r.kq, r.kp)
                r.p_vs_bm25 = paired_ttest_values(a, base).p_value
    s.rows = sorted(rows, key=lambda r: -(r.ndcg_10 or 0.0))
    for mode in MODES:
        cells = db.con.execute(
            f"select kq, kp, ndcg_10 from cells where {where} and mode = ?", [system, dataset, split, mode]
        ).fetchall()
        if not cells:
            continue
        kqs = sorted({c[0] for c in cells})
        kps = sorted({c[1] for c in cells})
        grid = np.full((len(kqs), len(kps)), np.nan)
        for kq, kp, v in cells:
            grid[kqs.index(kq), kps.index(kp)] = np.nan if v is None else v
        s.grids[mode] = (kqs, kps, grid)
    return s


def heatmap_png(
    kqs: list[int], kps: list[int], grid: np.ndarray, title: str, marks: dict[str, tuple] | None = None
) -> bytes:
    """A (K_q rows, K_p columns) heatmap with the values written in; ``marks``: label -> (kq, kp) boxed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(1.1 * len(kps) + 2.2, 0.9 * len(kqs) + 1.6), dpi=110)
    im = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
    ax.set_xticks(range(len(kps)), [str(k) for k in kps])
    ax.set_yticks(range(len(kqs)), [str(k) for k in kqs])
    ax.set_xlabel("K_p (passage budget)")
    ax.set_ylabel("K_q (query budget)")
    ax.set_title(title, fontsize=10)
    finite = grid[np.isfinite(grid)]
    mid = float(finite.mean()) if finite.size else 0.0
    fmt = "{:.3f}" if finite.size and float(np.abs(finite).max()) >= 0.05 else "{:.4f}"
    for i in range(len(kqs)):
        for j in range(len(kps)):
            v = grid[i, j]
            if np.isfinite(v):
                ax.text(
                    j, i, fmt.format(v), ha="center", va="center", fontsize=8, color="black" if v > mid else "white"
                )
    styles = [("red", "-"), ("cyan", "--")]
    for (label, (kq, kp)), (color, ls) in zip((marks or {}).items(), styles, strict=False):
        if kq in kqs and kp in kps:
            ax.add_patch(
                Rectangle(
                    (kps.index(kp) - 0.5, kqs.index(kq) - 0.5), 1, 1, fill=False, ec=color, lw=2.2, ls=ls, label=label
                )
            )
    if marks:
        ax.legend(loc="upper left", bbox_to_anchor=(1.25, 1.0), fontsize=7, frameon=False)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def write_summary(store: ArtifactStore, summary: Summary, config: dict[str, Any]) -> str:
    """Write summary.md, leaderboard.csv and one heatmap PNG per mode into the store; returns the folder."""
    stage = summary_dir(summary.system, summary.dataset, summary.split)
    part = {"model": summary.system, "dataset": summary.dataset, "split": summary.split}
    m = Manifest.new("summaries", part, config, stats={"rows": len(summary.rows)})
    figures: dict[str, str] = {}
    with store.stage_writer(stage, m) as w:
        for mode, (kqs, kps, grid) in summary.grids.items():
            best = next((r for r in summary.rows if r.mode == mode and r.system == summary.system), None)
            marks = {"best": (best.kq, best.kp)} if best else None
            name = f"heatmap_{mode}.png"
            w.write_file(name, heatmap_png(kqs, kps, grid, f"{summary.dataset} {summary.split}: {mode} NDCG@10", marks))
            figures[mode] = name
        csv_lines = ["system,mode,kq,kp," + ",".join(HEADLINE) + ",queries,p_vs_bm25"]
        for r in summary.rows:
            vals = [r.system, r.mode, r.kq, r.kp, *(getattr(r, h) for h in HEADLINE), r.queries, r.p_vs_bm25]
            csv_lines.append(",".join("" if v is None else str(v) for v in vals))
        w.write_file("leaderboard.csv", ("\n".join(csv_lines) + "\n").encode())
        w.write_file("summary.md", summary.markdown(figures).encode())
    return store.abspath(stage)
