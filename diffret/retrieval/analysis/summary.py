"""The pipeline's result summary: leaderboard, (K_q, K_p) heatmaps per mode and a markdown page.

Every number comes from the SQL views of ``queries/`` (``cells``, ``best_cells``, ``metrics``), so
``diffret sql`` shows exactly what the summary prints. Columns follow the measure table
(``storage.schemas.MEASURES``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffret.schemas import MEASURES

from ..evaluation import paired_ttest_values
from ..search.modes import MODE_NAMES
from .figures import heatmap_png
from .views import Views, per_query

SHORT = tuple(m.short for m in MEASURES)
NEAR_CHANCE = 0.1  # a best cell under this share of BM25's headline measure is flagged as near chance


@dataclass
class Row:
    """One leaderboard line: a system's best cell in one mode (or BM25)."""

    system: str
    mode: str
    kq: int
    kp: int
    values: dict[str, float | None]  # measure short name -> mean
    queries: int
    p_vs_bm25: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "mode": self.mode,
            "kq": self.kq,
            "kp": self.kp,
            **self.values,
            "queries": self.queries,
            "p_vs_bm25": self.p_vs_bm25,
        }


@dataclass
class Summary:
    system: str
    dataset: str
    split: str
    rows: list[Row] = field(default_factory=list)
    grids: dict[str, tuple[list[int], list[int], np.ndarray]] = field(default_factory=dict)  # mode -> kq, kp, ndcg
    random_weights: str | None = None  # what the registry says of a system built with random weights (else None)

    def bm25_value(self) -> float | None:
        """BM25's mean headline measure on this split (None without a BM25 row)."""
        return next((r.values[SHORT[0]] for r in self.rows if r.mode == "bm25"), None)

    def warnings(self) -> list[str]:
        """A line when the system scores near chance: its best cell under a tenth of BM25's headline measure (a model
        whose representations carry little of the texts here), so that a grid of noise is not read as a landscape.

        >>> s = Summary("m", "d", "test", [Row("m", "multi_dense", 1, 1, {k: 0.004 for k in SHORT}, 300),
        ...                                Row("b", "bm25", 0, 0, {k: 0.676 for k in SHORT}, 300)])
        >>> s.warnings()[0][:80]
        'm scores near chance on d/test: its best NDCG@10 is 0.0040 (multi_dense), BM25 s'
        """
        first = [f"{self.system} has {self.random_weights}"] if self.random_weights else []
        bm25 = self.bm25_value()
        mine = [r for r in self.rows if r.system == self.system and r.values[SHORT[0]] is not None]
        if not bm25 or not mine:
            return first
        best = max(mine, key=lambda r: r.values[SHORT[0]] or 0.0)
        value = best.values[SHORT[0]] or 0.0
        if value >= NEAR_CHANCE * bm25:
            return first
        label = MEASURES[0].label
        return first + [
            f"{self.system} scores near chance on {self.dataset}/{self.split}: its best {label} is "
            f"{value:.4f} ({best.mode}), BM25 scores {bm25:.4f}; under a tenth of BM25, its heatmaps show "
            "noise, not a landscape (a model not trained for this readout, or too small?)"
        ]

    def markdown(self, figures: dict[str, str] | None = None) -> str:
        labels = " | ".join(m.label for m in MEASURES)
        # no system column (the heading names the system, the line below the baseline): the table fits a page
        head = f"| mode | K_q | K_p | {labels} | queries | p vs BM25 |"
        sep = "|---|---:|---:|" + "---:|" * len(MEASURES) + "---:|---:|"
        lines = [
            f"# {self.dataset} / {self.split}: `{self.system}`" + (" (RANDOM WEIGHTS)" if self.random_weights else ""),
            "",
        ]
        lines += [f"**Warning**: {w}" for w in self.warnings()] + ([""] if self.warnings() else [])
        lines += [head, sep]
        for r in self.rows:
            vals = " | ".join("–" if r.values[m] is None else f"{r.values[m]:.4f}" for m in SHORT)
            p = "–" if r.p_vs_bm25 is None else f"{r.p_vs_bm25:.3g}"
            kq, kp = ("–", "–") if r.mode == "bm25" else (r.kq, r.kp)
            lines.append(f"| {r.mode} | {kq} | {kp} | {vals} | {r.queries} | {p} |")
        baseline = next((r.system for r in self.rows if r.mode == "bm25"), None)
        lines += [
            "",
            *([f"BM25: `{baseline}`.", ""] if baseline else []),
            f"Best (K_q, K_p) per mode by mean {MEASURES[0].label} on this split (ties: the smaller budget); p: paired "
            f"t-test on per-query {MEASURES[0].label} against BM25.",
            "",
            "```sql",
            f"select mode, kq, kp, {', '.join(SHORT)} from best_cells "
            f"where system = '{self.system}' and dataset = '{self.dataset}' and split = '{self.split}'",
            f"order by {SHORT[0]} desc, mode",
            "```",
        ]
        for mode, name in (figures or {}).items():
            lines += ["", f"## {mode}", "", f"![{mode} {MEASURES[0].label} over (K_q, K_p)]({name})"]
        return "\n".join(lines) + "\n"

    def leaderboard_csv(self) -> bytes:
        lines = ["system,mode,kq,kp," + ",".join(SHORT) + ",queries,p_vs_bm25"]
        for r in self.rows:
            vals = [r.system, r.mode, r.kq, r.kp, *(r.values[m] for m in SHORT), r.queries, r.p_vs_bm25]
            lines.append(",".join("" if v is None else str(v) for v in vals))
        return ("\n".join(lines) + "\n").encode()

    def files(self) -> dict[str, bytes]:
        """Every file of the summary folder: one heatmap PNG per mode, leaderboard.csv and summary.md."""
        out: dict[str, bytes] = {}
        figures: dict[str, str] = {}
        for mode, (kqs, kps, grid) in self.grids.items():
            best = next((r for r in self.rows if r.mode == mode and r.system == self.system), None)
            marks = {"best": (best.kq, best.kp)} if best else None
            name = f"heatmap_{mode}.png"
            title = f"{self.dataset} {self.split}: {mode} {MEASURES[0].label}"
            out[name] = heatmap_png(kqs, kps, grid, title, marks, reference=self.bm25_value())
            figures[mode] = name
        out["leaderboard.csv"] = self.leaderboard_csv()
        out["summary.md"] = self.markdown(figures).encode()
        return out


def build_summary(
    db: Views, system: str, dataset: str, split: str, bm25: str | None = None, random_weights: str | None = None
) -> Summary:
    """The best cell per mode (view ``best_cells``), BM25, paired t-tests against it, and the grids per mode;
    ``random_weights``: the registry's note on a system built with random weights (said first in its warnings)."""
    s = Summary(system, dataset, split, random_weights=random_weights)
    cols = f"mode, kq, kp, {', '.join(SHORT)}, queries"
    where = "system = ? and dataset = ? and split = ?"

    def row(sys_: str, r: tuple) -> Row:
        return Row(sys_, r[0], r[1], r[2], dict(zip(SHORT, r[3 : 3 + len(SHORT)], strict=True)), r[-1])

    best = db.execute(
        f"select {cols} from best_cells where {where} order by {SHORT[0]} desc, mode", [system, dataset, split]
    )
    rows = [row(system, r) for r in best.fetchall()]
    if bm25:
        b = db.execute(f"select {cols} from cells where {where} and mode = 'bm25'", [bm25, dataset, split]).fetchall()
        rows += [row(bm25, r) for r in b]
    if bm25 and any(r.mode == "bm25" for r in rows):
        base = per_query(db, bm25, dataset, split, "bm25", 0, 0)
        for r in rows:
            if r.mode != "bm25":
                a = per_query(db, system, dataset, split, r.mode, r.kq, r.kp)
                r.p_vs_bm25 = paired_ttest_values(a, base).p_value
    s.rows = sorted(rows, key=lambda r: -(r.values[SHORT[0]] or 0.0))
    for mode in MODE_NAMES:
        cells = db.execute(
            f"select kq, kp, {SHORT[0]} from cells where {where} and mode = ?", [system, dataset, split, mode]
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
