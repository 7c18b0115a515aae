"""What the CLI shows: progress bars, result tables (table / CSV / JSON), the leaderboard, index checks."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import sys
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

from rich.console import Console
from rich.filesize import decimal
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from diffret.schemas import MEASURES

console = Console(stderr=True, emoji=False)  # logs, progress, result lines
out = Console(emoji=False)  # results


class OutputFormat(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


QUIET_LOGGERS = (
    "transformers",
    "huggingface_hub",
    "peft",
    "accelerate",
    "torch",
    "lancedb",
    "bm25s",
    "nltk",
    "matplotlib",
    "distributed",
    "faiss",
    "urllib3",
    "httpx",
)


def library_output(verbose: bool) -> None:
    """The libraries' own warnings, log lines and progress bars: shown with ``-v``, else hidden (the stages report
    their own progress and errors; a library's notice before the first result line reads as the result)."""
    import logging
    import os
    import warnings

    level = logging.INFO if verbose else logging.ERROR
    os.environ["TRANSFORMERS_VERBOSITY"] = "info" if verbose else "error"  # read when transformers is imported
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "0" if verbose else "1"
    os.environ["TQDM_DISABLE"] = "0" if verbose else "1"
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(level)
    if "transformers" in sys.modules:  # already imported (a second command in one process): its own switch
        from transformers.utils import logging as tf_logging

        tf_logging.set_verbosity(level)
        (tf_logging.enable_progress_bar if verbose else tf_logging.disable_progress_bar)()
    warnings.simplefilter("default" if verbose else "ignore")


def log(message: str) -> None:
    console.print(message, highlight=False, markup=False, soft_wrap=True)


class RateColumn(ProgressColumn):
    def render(self, task: Any) -> Text:
        unit = task.fields.get("unit", "units")
        if not task.speed:
            return Text(f"… {unit}/s")
        if unit == "bytes":
            return Text(f"{decimal(int(task.speed))}/s")
        return Text(f"{task.speed:,.0f} {unit}/s" if task.speed >= 10 else f"{task.speed:.2f} {unit}/s")


@contextlib.contextmanager
def progress(transient: bool = False) -> Iterator[Any]:
    """A rich bar per labelled task; yields the ``report(label, done, total, unit)`` the stages call."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
    )
    with Progress(*columns, console=console, transient=transient) as bar:
        tasks: dict[str, Any] = {}

        def report(label: str, done: int, total: int | None, unit: str, note: str = "") -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total, unit=unit, note=note)
            bar.update(tasks[label], completed=done, total=total, note=note)

        yield report


def help_text(command: Any, ctx: Any, width: int) -> str:
    """A command's ``--help`` in ``width`` columns: its usage and description, then each argument and option as one
    paragraph (names, value, help, default) with a hanging indent, so that a command of 65 options reads in about
    two lines each at 80 columns (rich's boxed table gives its help a third of the width: ~8 lines each)."""
    import functools
    import textwrap

    width = max(40, width - 1)
    wrap = functools.partial(textwrap.wrap, width=width, break_on_hyphens=False)
    lines = [f"Usage: {ctx.command_path} {' '.join(command.collect_usage_pieces(ctx))}", ""]
    for para in (command.help or "").split("\n\n"):
        lines += [*wrap(" ".join(para.split()), initial_indent=" ", subsequent_indent=" "), ""]
    params = [p for p in command.get_params(ctx) if p.get_help_record(ctx) is not None]
    for title, group in (
        ("Arguments", [p for p in params if p.param_type_name == "argument"]),
        ("Options", [p for p in params if p.param_type_name != "argument"]),
    ):
        if group:
            lines.append(f"{title}:")
        for p in group:
            names, text = p.get_help_record(ctx)
            para = f"{names}  {' '.join(text.split())}"
            lines += wrap(para, initial_indent="  ", subsequent_indent="      ")
        if group:
            lines.append("")
    return "\n".join(lines)


def wide() -> Console:
    """stdout; when piped, wide enough that no value is cut (a terminal keeps its own width)."""
    return out if out.is_terminal else Console(emoji=False, width=100_000)


def cell(value: Any) -> str:
    """A value in a printed table: floats to 6 significant digits (CSV and JSON keep every digit).

    >>> cell(0.45678912345678), cell(None), cell(3), cell(1234567.891)
    ('0.456789', 'NULL', '3', '1.23457e+06')
    """
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def print_rows(cols: list[str], rows: list[tuple], fmt: OutputFormat) -> None:
    if fmt is OutputFormat.csv:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        w.writerows(rows)
        sys.stdout.write(buf.getvalue())
    elif fmt is OutputFormat.json:
        sys.stdout.write(json.dumps([dict(zip(cols, r, strict=True)) for r in rows], default=str, indent=1) + "\n")
    else:
        table = Table(*cols, show_lines=False)
        for r in rows:
            table.add_row(*(cell(v) for v in r))
        wide().print(table, crop=False)  # piped output is not squeezed to 80 columns


def print_leaderboard(dataset: str, split: str, rows: list[dict]) -> None:
    """The best cell per mode and BM25, with the headline measures (``storage.schemas.MEASURES``)."""
    table = Table(title=f"{dataset} / {split}: best (K_q, K_p) per mode by {MEASURES[0].label}", title_justify="left")
    for c in ("system", "mode", "K_q", "K_p", *(m.label for m in MEASURES), "queries", "p vs BM25"):
        table.add_column(c, justify="left" if c in ("system", "mode") else "right", no_wrap=True)
    for r in rows:
        vals = ["–" if r[m.short] is None else f"{r[m.short]:.4f}" for m in MEASURES]
        kq, kp = ("–", "–") if r["mode"] == "bm25" else (str(r["kq"]), str(r["kp"]))
        p = "–" if r["p_vs_bm25"] is None else f"{r['p_vs_bm25']:.2g}"
        table.add_row(r["system"], r["mode"], kq, kp, *vals, str(r["queries"]), p)
    wide().print(table, crop=False)
