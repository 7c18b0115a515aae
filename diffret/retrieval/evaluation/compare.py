"""Runs against a baseline, per measure: mean, paired test, multiple-comparison correction, per-query win / tie / loss.

The tests are scipy's (``ttest_rel``, ``wilcoxon``, both two-sided and paired on the queries), the correction is
statsmodels' ``multipletests`` (Holm's step-down by default, or Bonferroni) over every comparison of the table, so a
grid of many runs does not find differences by chance. ranx's ``compare`` is not used: its Tukey HSD test treats the
runs as independent groups, ignoring that every run answers the same queries (the pairing these tests use).

Output: a Markdown table (``†``: corrected p < alpha), one CSV row per (run, measure) with every number, and a LaTeX
``table`` (plain ``tabular`` and ``\\hline``: no package needed) for a paper.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from diffret.schemas import MEASURES

from .significance import paired_ttest_values

Test = Literal["t", "wilcoxon"]
Correction = Literal["holm", "bonferroni", "none"]
TEST_NAMES = {"t": "paired t-test", "wilcoxon": "Wilcoxon signed-rank test"}
CORRECTION_NAMES = {"holm": "Holm", "bonferroni": "Bonferroni", "none": "no"}


@dataclass
class Cell:
    """One run against the baseline on one measure."""

    mean: float
    delta: float = 0.0  # mean - the baseline's mean
    p_value: float | None = None  # the test's two-sided p (None: the baseline's own row)
    p_corrected: float | None = None
    wins: int = 0
    ties: int = 0
    losses: int = 0

    def significant(self, alpha: float) -> bool:
        return self.p_corrected is not None and self.p_corrected < alpha


@dataclass
class Comparison:
    """The table: ``rows`` (the baseline first) x ``measures``, with how it was tested."""

    baseline: str
    rows: list[str]
    measures: list[str]
    cells: dict[tuple[str, str], Cell]
    queries: int
    test: Test = "t"
    correction: Correction = "holm"
    alpha: float = 0.05
    where: str = ""  # e.g. "scifact/test"
    details: dict[str, dict[str, str]] = field(default_factory=dict)  # row -> extra CSV columns (system, kq, ...)

    @property
    def comparisons(self) -> int:
        return sum(1 for c in self.cells.values() if c.p_value is not None)

    def caption(self) -> str:
        corr = (
            "uncorrected"
            if self.correction == "none"
            else f"{CORRECTION_NAMES[self.correction]}-corrected across the table's {self.comparisons} comparisons"
        )
        of = f" of {self.where}" if self.where else ""
        return (
            f"Mean per-query scores over the {self.queries:,} judged queries{of}"
            f"; {TEST_NAMES[self.test]} (two-sided) of each run against {self.baseline}, p {corr}; † p < "
            f"{self.alpha:g}. W/T/L: queries on which the run scores higher / the same / lower than the baseline."
        )

    def markdown(self) -> str:
        """The table as Markdown (one column group per measure: mean, delta, corrected p, W/T/L).

        >>> c = compare_runs({"bm25": {"ndcg_cut_10": {"a": 0.2, "b": 0.4}},
        ...                   "x": {"ndcg_cut_10": {"a": 0.5, "b": 0.4}}}, "bm25")
        >>> print(c.markdown().splitlines()[3])
        | x | 0.4500 | +0.1500 | 0.5000 | 1/1/0 |
        """
        head = ["run"]
        for m in self.measures:
            label = _label(m)
            head += [label, f"Δ {label}", "p", "W/T/L"]
        lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for row in self.rows:
            vals = [row + (" (baseline)" if row == self.baseline else "")]
            for m in self.measures:
                c = self.cells[(row, m)]
                mark = "†" if c.significant(self.alpha) else ""
                if c.p_value is None:
                    vals += [f"{c.mean:.4f}", "–", "–", "–"]
                else:
                    vals += [
                        f"{c.mean:.4f}{mark}",
                        f"{c.delta:+.4f}",
                        _p(c.p_corrected),
                        f"{c.wins}/{c.ties}/{c.losses}",
                    ]
            lines.append("| " + " | ".join(vals) + " |")
        return "\n".join(lines) + "\n\n" + self.caption() + "\n"

    def csv(self) -> str:
        """One row per (run, measure) with every number (the baseline's rows have no test)."""
        buf = io.StringIO()
        extra = sorted({k for d in self.details.values() for k in d})
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(
            [
                "run",
                *extra,
                "measure",
                "mean",
                "baseline_mean",
                "delta",
                "test",
                "p_value",
                "correction",
                "p_corrected",
                "significant",
                "wins",
                "ties",
                "losses",
                "queries",
            ]
        )
        for row in self.rows:
            for m in self.measures:
                c, base = self.cells[(row, m)], self.cells[(self.baseline, m)]
                tested = c.p_value is not None
                w.writerow(
                    [
                        row,
                        *(self.details.get(row, {}).get(k, "") for k in extra),
                        m,
                        _num(c.mean),
                        _num(base.mean),
                        _num(c.delta) if tested else "",
                        self.test if tested else "",
                        _num(c.p_value),
                        self.correction if tested else "",
                        _num(c.p_corrected),
                        str(c.significant(self.alpha)).lower() if tested else "",
                        *((c.wins, c.ties, c.losses) if tested else ("", "", "")),
                        self.queries,
                    ]
                )
        return buf.getvalue()

    def latex(self, label: str = "tab:comparison") -> str:
        """A LaTeX ``table`` with a plain ``tabular`` (``\\hline``; no package needed): mean and W/T/L per measure,
        ``$^\\dagger$`` where the corrected p is below alpha, the caption saying how it was tested."""
        spec = "l" + "rr" * len(self.measures)
        head = ["Run"] + [x for m in self.measures for x in (latex_escape(_label(m)), "W/T/L")]
        out = [
            "\\begin{table}[t]",
            "\\centering",
            f"\\begin{{tabular}}{{{spec}}}",
            "\\hline",
            " & ".join(head) + " \\\\",
            "\\hline",
        ]
        for row in self.rows:
            vals = [latex_escape(row) + (" (baseline)" if row == self.baseline else "")]
            for m in self.measures:
                c = self.cells[(row, m)]
                mark = "$^\\dagger$" if c.significant(self.alpha) else ""
                vals += [f"{c.mean:.4f}{mark}", "--" if c.p_value is None else f"{c.wins}/{c.ties}/{c.losses}"]
            out.append(" & ".join(vals) + " \\\\")
        caption = latex_escape(self.caption()).replace("†", "$^\\dagger$")
        out += ["\\hline", "\\end{tabular}", f"\\caption{{{caption}}}", f"\\label{{{label}}}", "\\end{table}"]
        return "\n".join(out) + "\n"


def _label(measure: str) -> str:
    return next((m.label for m in MEASURES if m.pytrec == measure), measure)


def _p(p: float | None) -> str:
    return "–" if p is None else ("<0.0001" if p < 1e-4 else f"{p:.4f}")


def _num(v: float | None) -> str:
    return "" if v is None else repr(float(v))


_LATEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def latex_escape(text: str) -> str:
    """``text`` with LaTeX's special characters escaped.

    >>> latex_escape("bm25-0a_b & 50%")
    'bm25-0a\\\\_b \\\\& 50\\\\%'
    """
    return "".join(_LATEX.get(ch, ch) for ch in text)


def paired_test(a: Sequence[float], b: Sequence[float], test: Test = "t") -> float:
    """The two-sided p of a paired test of ``a`` against ``b`` (the same queries, in the same order): scipy's
    ``ttest_rel`` (``t``) or ``wilcoxon`` (zero differences dropped, its default); 1.0 when every difference is 0.

    >>> round(paired_test([0.5, 0.7, 0.9], [0.4, 0.5, 0.6]), 3), paired_test([1, 2], [1, 2], "wilcoxon")
    (0.074, 1.0)
    """
    if test == "t":
        return paired_ttest_values(dict(enumerate(a)), dict(enumerate(b))).p_value
    if test != "wilcoxon":
        raise ValueError(f"test must be t or wilcoxon, not {test!r}")
    if all(x == y for x, y in zip(a, b, strict=True)):
        return 1.0
    from scipy import stats

    return float(stats.wilcoxon(a, b).pvalue)


def correct(p_values: Sequence[float], method: Correction = "holm", alpha: float = 0.05) -> list[float]:
    """p-values corrected for the family of ``p_values`` by statsmodels' ``multipletests`` (``holm`` or
    ``bonferroni``; ``none``: unchanged).

    >>> [round(p, 3) for p in correct([0.01, 0.04, 0.03])]
    [0.03, 0.06, 0.06]
    """
    if method == "none" or not p_values:
        return list(p_values)
    if method not in ("holm", "bonferroni"):
        raise ValueError(f"correction must be holm, bonferroni or none, not {method!r}")
    from statsmodels.stats.multitest import multipletests

    return [float(p) for p in multipletests(list(p_values), alpha=alpha, method=method)[1]]


def compare_runs(
    scores: Mapping[str, Mapping[str, Mapping[str, float]]],
    baseline: str,
    measures: Sequence[str] | None = None,
    test: Test = "t",
    correction: Correction = "holm",
    alpha: float = 0.05,
    where: str = "",
) -> Comparison:
    """Every run of ``scores`` (run -> measure -> {query_id: value}) against ``baseline`` on each measure.

    Every run must score the same queries as the baseline (evaluate scores every judged query, 0 when a run
    has no result for it); the corrected p-values cover all (run, measure) comparisons of the table at once.

    >>> c = compare_runs({"b": {"m": {"q1": 0.1, "q2": 0.2, "q3": 0.3}},
    ...                   "x": {"m": {"q1": 0.2, "q2": 0.2, "q3": 0.5}}}, "b")
    >>> cell = c.cells[("x", "m")]
    >>> round(cell.delta, 4), (cell.wins, cell.ties, cell.losses), cell.p_corrected == cell.p_value
    (0.1, (2, 1, 0), True)
    """
    if baseline not in scores:
        raise ValueError(f"the baseline {baseline!r} is not among the runs ({', '.join(scores)})")
    measures = list(measures or next(iter(scores.values())).keys())
    rows = [baseline] + [r for r in scores if r != baseline]
    cells: dict[tuple[str, str], Cell] = {}
    queries = 0
    for m in measures:
        base = scores[baseline].get(m)
        if not base:
            raise ValueError(
                f"the baseline {baseline!r} has no per-query {m!r} scores (evaluate it with --measure {m})"
            )
        qids = sorted(base)
        queries = max(queries, len(qids))
        b = [base[q] for q in qids]
        cells[(baseline, m)] = Cell(mean=math.fsum(b) / len(b))
        for row in rows[1:]:
            got = scores[row].get(m)
            if not got:
                raise ValueError(f"run {row!r} has no per-query {m!r} scores (evaluate it with --measure {m})")
            if set(got) != set(base):
                only = sorted(set(got) ^ set(base))
                raise ValueError(
                    f"run {row!r} and the baseline score different queries on {m!r} ({len(only)} differ, "
                    f"e.g. {only[:3]}): are they evaluated against the same qrels?"
                )
            a = [got[q] for q in qids]
            mean = math.fsum(a) / len(a)
            cells[(row, m)] = Cell(
                mean=mean,
                delta=mean - cells[(baseline, m)].mean,
                p_value=paired_test(a, b, test),
                wins=sum(x > y for x, y in zip(a, b, strict=True)),
                ties=sum(x == y for x, y in zip(a, b, strict=True)),
                losses=sum(x < y for x, y in zip(a, b, strict=True)),
            )
    tested = {k: c.p_value for k, c in cells.items() if c.p_value is not None}
    for k, p in zip(tested, correct(list(tested.values()), correction, alpha), strict=True):
        cells[k].p_corrected = p
    return Comparison(baseline, rows, measures, cells, queries, test, correction, alpha, where)
