"""The paper tables (Tables 2-3): D / S / H NDCG@10 per test dataset at each system's selected budget, best per
column, significance markers against reference systems (paired tests corrected across the table: compare.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..evaluation.compare import CORRECTION_NAMES, TEST_NAMES, Correction, Test, correct, paired_test
from .views import Views, per_query, rows

D, S, H = "multi_dense", "sparse_max", "fusion_multi_sparse_max"
TABLE_MODES = {"D": D, "S": S, "H": H}


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
    settings: dict[str, str] = field(default_factory=dict)  # system -> "zero-shot" / "fine-tuned from <base>"
    test: Test = "t"
    correction: Correction = "holm"

    def columns(self) -> list[tuple[str, str]]:
        return [(d, c) for d in [*self.datasets, "avg"] for c in TABLE_MODES]

    def markdown(self) -> str:
        tag = bool(self.settings)
        head = (
            "| system | "
            + ("setting | " if tag else "")
            + "K_q*, K_p* | "
            + " | ".join(f"{d} {c}" for d, c in self.columns())
            + " |"
        )
        sep = "|---|---|" + ("---|" if tag else "") + "---:|" * len(self.columns())
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
            setting = f"{self.settings.get(system, '–')} | " if tag else ""
            lines.append(f"| {system} | {setting}{budget} | " + " | ".join(vals) + " |")
        marks = ", ".join(
            f"{m} p < 0.05 (two-sided) against `{r}`" for m, r in zip(("†", "‡"), self.refs, strict=False)
        )
        how = f"{TEST_NAMES[self.test]} on per-query NDCG@10, same dataset and column; p " + (
            "uncorrected"
            if self.correction == "none"
            else f"{CORRECTION_NAMES[self.correction]}-corrected across the table's comparisons with that system"
        )
        tail = f"; {marks} ({how})." if marks else "."
        lines += [
            "",
            "NDCG@10 on test at each system's train-selected budget; D = multi_dense, S = sparse_max "
            "(BM25 in S), H = fusion_multi_sparse_max; best per column in bold" + tail,
        ]
        if tag:
            lines[-1] += (
                " A fine-tuned system enters at its base model's selected budget (a selection on the"
                " train split it was trained on would favour it)."
            )
        return "\n".join(lines) + "\n"

    def csv_rows(self) -> list[list[Any]]:
        out: list[list[Any]] = [["system", "setting", "kq", "kp", *[f"{d}:{c}" for d, c in self.columns()]]]
        for system, cells in self.rows.items():
            kq, kp = self.budgets.get(system, (None, None))
            vals = []
            for col in self.columns():
                c = cells.get(col)
                vals.append("" if c is None or c.value is None else f"{c.value:.6f}{c.markers}")
            out.append([system, self.settings.get(system, ""), kq, kp, *vals])
        return out


def system_budgets(db: Views) -> dict[str, tuple[int, int]]:
    """The budget at which each system enters the tables: its train selection; a system with one cell
    per mode (BM25, single-vector readouts) uses that cell; systems with a grid but no train split are left out."""
    out = {r["system"]: (r["kq_star"], r["kp_star"]) for r in rows(db, "select * from budget_selection")}
    single = rows(
        db,
        "select system, min(kq) kq, min(kp) kp from cells where split = 'test' group by system "
        "having count(distinct (kq, kp)) = 1",
    )
    for r in single:
        out.setdefault(r["system"], (r["kq"], r["kp"]))
    return out


def paper_table(
    db: Views,
    refs: list[str] | None = None,
    alpha: float = 0.05,
    finetuned: dict[str, str] | None = None,
    test: Test = "t",
    correction: Correction = "holm",
) -> PaperTable:
    """Tables 2-3: D / S / H NDCG@10 per test dataset and their average, best per column, significance markers: a
    paired ``test`` against each reference, its p-values corrected across the table (``correction``: Holm by
    default, over every cell compared with that reference).

    ``finetuned`` (base slug -> fine-tuned slug) labels the zero-shot and fine-tuned halves and puts each
    fine-tuned system at its base's train-selected budget.

    Examples
    --------
    >>> import tempfile
    >>> from diffret.storage import ArtifactStore
    >>> from diffret.storage.sql import StoreSQL
    >>> with tempfile.TemporaryDirectory() as root, StoreSQL(ArtifactStore(root)) as db:
    ...     paper_table(db, finetuned={"base-0123456789": "ft-0123456789"}).rows  # an empty store: no rows
    {}
    """
    budgets = system_budgets(db)
    finetuned = dict(finetuned or {})
    for base, ft in finetuned.items():
        if base in budgets:
            budgets[ft] = budgets[base]
    cells = rows(db, "select system, dataset, mode, kq, kp, ndcg_10 from cells where split = 'test'")
    datasets = sorted({c["dataset"] for c in cells})
    table = PaperTable(datasets, list(refs or [])[:2])
    value: dict[tuple[str, str, str], float] = {}
    for c in cells:
        budget = budgets.get(c["system"])
        if budget is None or (c["kq"], c["kp"]) != budget:
            continue
        column = "S" if c["mode"] == "bm25" else next((k for k, m in TABLE_MODES.items() if m == c["mode"]), None)
        if column is not None:
            value[(c["system"], c["dataset"], column)] = c["ndcg_10"]
    tuned = set(finetuned.values())
    systems = sorted({m for m, _, _ in value}, key=lambda s: (not s.startswith("bm25"), s in tuned, s))
    for base, ft in finetuned.items():
        table.settings[base] = "zero-shot"
        table.settings[ft] = f"fine-tuned from {base}"
    for system in systems:
        table.budgets[system] = budgets[system]
        row: dict[tuple[str, str], TableCell] = {}
        for col in TABLE_MODES:
            per_ds = [value.get((system, d, col)) for d in datasets]
            for d, v in zip(datasets, per_ds, strict=True):
                if v is not None:
                    row[(d, col)] = TableCell(v)
            present = [v for v in per_ds if v is not None]
            if per_ds and len(present) == len(per_ds):
                row[("avg", col)] = TableCell(float(np.mean(present)))
        table.rows[system] = row
    # markers: paired tests against each named reference, same dataset and column, corrected across the table
    table.test, table.correction = test, correction
    for mark, ref in zip(("†", "‡"), table.refs, strict=False):
        if ref not in budgets:
            raise ValueError(f"reference system {ref!r} has no test metrics at a selected budget; systems: {systems}")
        rkq, rkp = budgets[ref]
        tested: list[tuple[TableCell, float]] = []
        for system, row in table.rows.items():
            if system == ref:
                continue
            kq, kp = budgets[system]
            for (d, col), cell in row.items():
                if d == "avg":
                    continue
                ref_mode = "bm25" if ref.startswith("bm25") else TABLE_MODES[col]
                mode = "bm25" if system.startswith("bm25") else TABLE_MODES[col]
                a = per_query(db, system, d, "test", mode, kq, kp)
                b = per_query(db, ref, d, "test", ref_mode, rkq, rkp)
                if not a or not b:
                    continue
                common = sorted(a.keys() & b.keys())
                tested.append((cell, paired_test([a[q] for q in common], [b[q] for q in common], test)))
        for (cell, _), p in zip(tested, correct([p for _, p in tested], correction, alpha), strict=True):
            if p < alpha:
                cell.markers += mark
    for key in table.columns():
        vals = [(s, v) for s, r in table.rows.items() if key in r and (v := r[key].value) is not None]
        if vals:
            top = max(v for _, v in vals)
            for s, v in vals:
                if v == top:
                    table.rows[s][key].best = True
    return table
