"""DuckDB over the artifact store: a connection with the views of ``queries/*.sql``.

A view reads exactly the files that complete stage manifests list (``@files`` in the view SQL is
replaced by that list), so an interrupted write or a stray file never reaches a query. When no file
exists yet, the view reads a zero-row placeholder with the right schema, so every view always
exists and ``SELECT count(*) FROM corpus`` on an empty store answers 0. ``@measure_columns`` becomes
one mean column per headline measure (``storage.layout.MEASURES``).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from importlib import resources
from typing import Any

import duckdb
import pyarrow.parquet as pq

from . import layout
from .manifest import Manifest, StoreError
from .store import ArtifactStore

_HEADER = re.compile(r"^--\s*(view|files):\s*(.+?)\s*$")


@dataclass
class ViewDef:
    name: str
    files: str | None  # glob relative to the store root
    sql: str
    origin: str


def load_view_defs() -> list[ViewDef]:
    """Every ``-- view:`` block of every ``queries/*.sql`` file, in file-name order."""
    out: list[ViewDef] = []
    folder = resources.files("queries")
    for entry in sorted((e for e in folder.iterdir() if e.name.endswith(".sql")), key=lambda e: e.name):
        text = entry.read_text()
        current: dict[str, Any] | None = None
        for line in text.splitlines(keepends=True):
            m = _HEADER.match(line)
            if m and m.group(1) == "view":
                if current:
                    out.append(ViewDef(current["name"], current["files"], "".join(current["sql"]), entry.name))
                current = {"name": m.group(2), "files": None, "sql": []}
            elif m and m.group(1) == "files" and current is not None and not current["sql"]:
                current["files"] = m.group(2)
            elif current is not None:
                current["sql"].append(line)
        if current:
            out.append(ViewDef(current["name"], current["files"], "".join(current["sql"]), entry.name))
    return out


def listed_files(store: ArtifactStore, pattern: str, verify: bool = False) -> list[str]:
    """Absolute paths matching ``pattern`` that a complete manifest in their folder lists.

    Manifests themselves (``_manifest.json``) are listed as they are; staging and lock folders never are.
    """
    matches = store.fs.glob(store.abspath(pattern))
    out: list[str] = []
    manifests: dict[str, Manifest | None] = {}
    base = store.abspath("")
    for path in sorted(matches):
        rel = path[len(base) :].lstrip("/") if path.startswith(base) else path
        if rel.startswith((layout.STAGING_DIR + "/", layout.LOCKS_DIR + "/")):
            continue
        folder, name = rel.rsplit("/", 1) if "/" in rel else ("", rel)
        if name == layout.MANIFEST_NAME:
            out.append(path)
            continue
        if folder not in manifests:
            manifests[folder] = store.read_manifest(folder)
        m = manifests[folder]
        if m is None or name not in m.files:
            continue
        if verify:
            store.verify_file(folder, name, m.files[name])
        out.append(path)
    return out


def measure_columns() -> str:
    """``avg(value) FILTER (WHERE measure = 'ndcg_cut_10') AS ndcg_10, ...`` for the headline measures."""
    return ",\n       ".join(
        f"avg(value) FILTER (WHERE measure = '{m.pytrec}') AS {m.short}" for m in layout.MEASURES
    )


def _sql_list(paths: list[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def _placeholder(pattern: str, tmp: str) -> str:
    """A zero-row file standing in for ``pattern`` when nothing matches (typed like the real files)."""
    rel = pattern.replace("**/", "").replace("*", "__none__")
    path = os.path.join(tmp, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    name = os.path.basename(rel)
    if name == layout.MANIFEST_NAME:
        with open(path, "w") as f:
            json.dump({"stage": None, "files": {}}, f)
        return path
    schema = layout.schema_for_pattern(pattern)
    if schema is None:
        raise StoreError(f"no schema known for {pattern!r}; add it to storage.layout.schema_for_pattern")
    pq.write_table(schema.empty_table(), path)
    return path


class StoreSQL:
    """An in-memory DuckDB connection with every view of ``queries/`` defined over one store."""

    def __init__(self, store: ArtifactStore, verify: bool = False):
        if not store.is_local:
            raise StoreError(
                f"{store.root}: SQL views need a local store (DuckDB's httpfs extension is not available here)"
            )
        self.store = store
        self._tmp = tempfile.TemporaryDirectory(prefix="diffret-sql-")
        self.con = duckdb.connect()
        self.views: list[str] = []
        for view in load_view_defs():
            sql = view.sql.replace("@measure_columns", measure_columns())
            if view.files:
                files = listed_files(store, view.files, verify=verify) or [_placeholder(view.files, self._tmp.name)]
                sql = sql.replace("@files", _sql_list(files))
            try:
                self.con.execute(sql)
            except duckdb.Error as exc:
                raise StoreError(f"queries/{view.origin}: view {view.name!r} failed: {exc}") from exc
            self.views.append(view.name)

    def query(self, sql: str) -> tuple[list[str], list[tuple]]:
        rel = self.con.execute(sql)
        cols = [d[0] for d in rel.description] if rel.description else []
        return cols, rel.fetchall()

    def close(self) -> None:
        self.con.close()
        self._tmp.cleanup()

    def __enter__(self) -> StoreSQL:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
