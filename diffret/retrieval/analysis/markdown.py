"""The report as a document: its sections (markdown) and files (PNG, CSV), and the helpers every section writes
its tables with (markdown tables, CSV bytes, safe file names)."""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Report:
    name: str
    sections: list[tuple[str, str]] = field(default_factory=list)  # (title, markdown body)
    files: dict[str, bytes] = field(default_factory=dict)  # name -> bytes (PNG, CSV)
    warnings: list[str] = field(default_factory=list)  # said under the title (systems with random weights)

    def markdown(self) -> str:
        out = [f"# diffret report `{self.name}`", ""]
        out += [f"**Warning**: {w}" for w in self.warnings] + ([""] if self.warnings else [])
        out += [f"- [{t}](#{_anchor(t)})" for t, _ in self.sections]
        for title, body in self.sections:
            out += ["", f"## {title}", "", body.rstrip()]
        return "\n".join(out) + "\n"


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def csv_bytes(data: list[list[Any]]) -> bytes:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(data)
    return buf.getvalue().encode()


def dicts_csv(data: list[dict[str, Any]], columns: list[str] | None = None) -> bytes:
    """Rows as CSV with a header line, also without rows (``columns``, or a :class:`views.Rows`' own)."""
    cols = list(data[0]) if data else list(columns or getattr(data, "columns", []))
    return csv_bytes([cols] + [[r.get(c) for c in cols] for r in data])


def fmt(v: Any, nd: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return "nan" if np.isnan(v) else f"{v:.{nd}f}"
    return str(v)


def md_table(data: list[dict[str, Any]], cols: list[str] | None = None) -> str:
    if not data:
        return "_(no rows)_\n"
    cols = cols or list(data[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in data]
    return "\n".join(lines) + "\n"


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", name)
