"""DuckDB over the artifact store: a connection with the views of ``queries/*.sql``.

A view reads exactly the files that complete stage manifests list (``@files`` in the view SQL is
replaced by that list), so an interrupted write or a stray file never reaches a query. When no file
exists yet, the view reads a zero-row placeholder with the right schema, so every view always
exists and ``SELECT count(*) FROM corpus`` on an empty store answers 0. ``@measure_columns`` becomes
one mean column per headline measure (``storage.schemas.MEASURES``).

The connection cannot write, twice over. DuckDB reads the store (local or not) through a read-only fsspec
filesystem registered under its own protocol (:class:`ReadOnlyFS`: every write, delete or rename raises), and it
may open nothing else (``allowed_directories`` holds that protocol's store root and the placeholders only,
``enable_external_access = false``, then ``lock_configuration``), so even a ``COPY ... TO`` reaching the engine
fails, into the store root as anywhere else, and no query reads ``/etc/passwd``, attaches a database, installs or
loads an extension, or re-opens access. And :meth:`StoreSQL.query` runs one plain statement at a time, a SELECT
(``WITH``, ``FROM``, ``VALUES``, ``DESCRIBE``, ``SUMMARIZE`` included) or an EXPLAIN of one: everything else (COPY,
CREATE, INSERT, UPDATE, DELETE, ATTACH, DETACH, SET, RESET, PRAGMA, CALL, EXPORT, IMPORT, INSTALL, LOAD, EXPLAIN
ANALYZE of anything, EXPLAIN of anything but a SELECT) is refused with one line naming the statement, and a
string of several statements is refused naming their count (run them one at a time), never run in part. Results
leave through :meth:`StoreSQL.export` (CSV or Parquet, written atomically by Python) or ``diffret export-run``.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from diffret import schemas

from . import layout
from .files import FILE_MODE
from .manifest import StoreError
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
    folder = resources.files("diffret.queries")
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


class DamagedView(StoreError):
    """A query that cannot be answered because a file it reads is damaged (DuckDB failed on bytes that passed the
    cheap checks): it names the file and the repair; every other query works."""


class DamagedFolderWarning(UserWarning):
    """A folder a view leaves out: damaged or incomplete (a file missing, changed or unreadable, a manifest edited by
    hand or deleted). The message names the folder and its repair."""


def listed_files(store: ArtifactStore, pattern: str, verify: bool = False) -> tuple[list[str], dict[str, str]]:
    """(the absolute paths matching ``pattern`` that a complete, sound manifest in their folder lists, the folders left
    out with why). Each folder counts as a whole: a manifest's files are checked first, their size and mtime against
    the manifest (:meth:`ArtifactStore.check_file`, what re-run planning trusts; a file touched since is hashed), or
    with ``verify`` their sha256, and a file it lists that is not on disk is damage, not rows silently gone.

    Manifests themselves (``_manifest.json``) are listed as they are; staging and lock folders never are. A local
    folder holding matching files but no manifest (a deleted one), an unreadable or hand-edited manifest or a file
    that fails its check leaves its folder out, with the line that names it and its repair; the other folders are
    read.

    >>> import tempfile, pyarrow as pa
    >>> from diffret.storage import Manifest
    >>> with tempfile.TemporaryDirectory() as root:
    ...     store = ArtifactStore(root)
    ...     for d in ("a", "b"):
    ...         m = Manifest.new("t", {}, {"d": d})
    ...         with store.folder_writer(f"t/d={d}", m) as w:
    ...             _ = w.write_parquet("x.parquet", pa.schema([("x", pa.int64())]), [pa.table({"x": [1]})])
    ...     os.remove(store.abspath("t/d=b/x.parquet"))
    ...     files, left_out = listed_files(store, "t/d=*/x.parquet")
    ...     [store.relpath(f) for f in files], {k: "but missing" in why for k, why in left_out.items()}
    (['t/d=a/x.parquet'], {'t/d=b': True})
    """
    folder_glob, name_glob = pattern.rsplit("/", 1) if "/" in pattern else ("", pattern)
    skip = (layout.STAGING_DIR + "/", layout.LOCKS_DIR + "/")
    if name_glob == layout.MANIFEST_NAME:
        return [p for p in sorted(store.fs.glob(store.abspath(pattern))) if not store.relpath(p).startswith(skip)], {}
    on_disk: dict[str, set[str]] = {}  # folder -> its files matching the pattern
    for path in store.fs.glob(store.abspath(pattern)):
        folder, _, name = store.relpath(path).rpartition("/")
        on_disk.setdefault(folder, set()).add(name)
    for path in store.fs.glob(
        store.abspath(f"{folder_glob}/{layout.MANIFEST_NAME}" if folder_glob else layout.MANIFEST_NAME)
    ):
        on_disk.setdefault(store.relpath(path).rpartition("/")[0], set())
    out: list[str] = []
    left_out: dict[str, str] = {}
    for folder in sorted(on_disk):
        if (folder + "/").startswith(skip):
            continue
        try:
            m = store.read_manifest(folder)
        except StoreError as exc:
            left_out[folder] = str(exc)
            continue
        if m is None:
            if on_disk[folder] and store.is_local:
                left_out[folder] = (
                    f"{store.abspath(folder)}: files without a manifest (deleted?), so they are not "
                    f"trusted; {store.repair(folder)}"
                )
            continue
        names = sorted(n for n in m.files if fnmatch.fnmatchcase(n, name_glob))
        try:
            if verify:
                for name in names:
                    store.verify_file(folder, name, m.files[name])
            elif names:
                stat = store.file_stat(layout.manifest_path(folder))  # files are written before their manifest
                for name in names:
                    store.check_file(folder, name, m.files[name], stat[1] if stat else None)
        except StoreError as exc:
            left_out[folder] = str(exc)
            continue
        out += [store.abspath(f"{folder}/{name}") for name in names]
    return out, left_out


def damaged_files(store: ArtifactStore, paths: list[str]) -> list[str]:
    """Of the listed files ``paths`` (absolute), the problems of those that fail their manifest's checksum."""
    problems = []
    for path in paths:
        rel = store.relpath(path)
        folder, name = rel.rsplit("/", 1) if "/" in rel else ("", rel)
        if name == layout.MANIFEST_NAME:
            continue
        m = store.read_manifest(folder)
        if m is None or name not in m.files:
            continue
        try:
            store.verify_file(folder, name, m.files[name], cached=False)
        except StoreError as exc:
            problems.append(str(exc))
    return problems


def _python_warning(line: str) -> None:
    warnings.warn(line, DamagedFolderWarning, stacklevel=4)


def measure_columns() -> str:
    """``avg(value) FILTER (WHERE measure = 'ndcg_cut_10') AS ndcg_10, ...`` for the headline measures."""
    return ",\n       ".join(f"avg(value) FILTER (WHERE measure = '{m.pytrec}') AS {m.short}" for m in schemas.MEASURES)


def _sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _sql_list(paths: list[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


class SQLRefused(StoreError):
    """A statement that ``diffret sql`` does not run (it writes, attaches, configures or installs, or it is
    several statements)."""


READ_ONLY_PROTOCOL = "diffret-readonly"
_WRITE_REFUSED = "SQL over the store cannot write"


class ReadOnlyFS(AbstractFileSystem):
    """The filesystem DuckDB reads the store through: ``diffret-readonly://PATH`` opens ``PATH`` of the store's own
    filesystem (paths under ``local_dirs`` on the local one) for reading; opening for writing, deleting, renaming,
    copying or making a folder raises :class:`PermissionError`.

    >>> import tempfile
    >>> fs = ReadOnlyFS(LocalFileSystem())
    >>> with tempfile.TemporaryDirectory() as d:
    ...     fs.open(f"{READ_ONLY_PROTOCOL}://{d}/x.csv", "wb")
    Traceback (most recent call last):
    ...
    PermissionError: SQL over the store cannot write .../x.csv: the store is read-only to SQL
    """

    protocol = READ_ONLY_PROTOCOL
    cachable = False

    def __init__(self, inner: AbstractFileSystem, local_dirs: tuple[str, ...] = (), **kwargs: Any):
        super().__init__(**kwargs)
        self.inner = inner
        self.local = LocalFileSystem()
        self.local_dirs = tuple(d.rstrip("/") + "/" for d in local_dirs)

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        prefix = f"{READ_ONLY_PROTOCOL}://"
        path = path[len(prefix) :] if path.startswith(prefix) else path
        return path.rstrip("/") or "/"

    def _fs(self, path: str) -> AbstractFileSystem:
        path = self._strip_protocol(path)
        return self.local if (path + "/").startswith(self.local_dirs) else self.inner

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        return self._fs(path).ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        return self._fs(path).info(path, **kwargs)

    def modified(self, path: str) -> Any:
        path = self._strip_protocol(path)
        return self._fs(path).modified(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if mode != "rb":
            self._refuse(path)
        kwargs.pop("autocommit", None)
        return self._fs(path).open(path, "rb", **kwargs)

    def _refuse(self, path: Any, *_: Any, **__: Any) -> Any:
        raise PermissionError(f"{_WRITE_REFUSED} {self._strip_protocol(path)}: the store is read-only to SQL")

    mkdir = makedirs = rm = rm_file = _rm = rmdir = mv = cp_file = copy = touch = pipe_file = put_file = _refuse


_ANALYZE = {"analyze", "analyse"}


def _tokens(sql: str) -> list[tuple[int, str]]:
    """(offset, text) of each token of ``sql`` (DuckDB's tokenizer), comments left out."""
    found = duckdb.tokenize(sql)
    out = []
    for i, (start, kind) in enumerate(found):
        if kind == duckdb.token_type.comment:
            continue
        end = found[i + 1][0] if i + 1 < len(found) else len(sql)
        out.append((start, sql[start:end].strip()))
    return out


def _parsed(sql: str) -> list[Any] | None:
    try:
        return duckdb.connect().extract_statements(sql)
    except duckdb.Error:
        return None


def _statement_name(st: Any) -> str:
    """The statement as its user wrote it: INSTALL (DuckDB's type says LOAD), RESET, IMPORT, CHECKPOINT, ..."""
    kind = st.type.name
    words = [t.upper() for _, t in _tokens(st.query)[:2]]
    if kind == "LOAD":
        return "INSTALL" if "INSTALL" in words else "LOAD"
    if not words or not words[0].isalpha() or words[0] == "WITH":
        return kind
    return words[0]


def _analyzed(sql: str) -> str:
    """The name EXPLAIN ANALYZE and the statement it would run (EXPLAIN ANALYZE COPY)."""
    inner = _parsed(sql)
    return "EXPLAIN ANALYZE" + (f" {_statement_name(inner[0])}" if inner and len(inner) == 1 else "")


def refused_statement(st: Any) -> str | None:
    """None if the parsed statement ``st`` (``extract_statements``) only reads: a SELECT, or a plain EXPLAIN of
    one; else the name of what it is ("COPY", "INSTALL", "EXPLAIN ANALYZE", "EXPLAIN CREATE", ...).

    >>> con = duckdb.connect()
    >>> [refused_statement(st) for st in con.extract_statements(
    ...     "select 1; explain select 1; /* x */ Explain -- y\\n Analyze select 1; explain (format json) select 1;"
    ...     "explain copy (select 1) to 'x.csv'; install httpfs; with a as (select 1) insert into t select * from a")]
    [None, None, 'EXPLAIN ANALYZE SELECT', None, 'EXPLAIN COPY', 'INSTALL', 'INSERT']
    """
    kind = st.type.name
    if kind == "SELECT":
        return None
    if kind != "EXPLAIN":
        return _statement_name(st)
    toks = _tokens(st.query)[1:]  # after EXPLAIN: [ANALYZE] [(options)] statement
    if not toks:
        return "EXPLAIN"
    if toks[0][1].lower() in _ANALYZE:
        return _analyzed(st.query[toks[1][0] :] if len(toks) > 1 else "")
    inner = _parsed(st.query[toks[0][0] :])
    if inner is None and toks[0][1] == "(":  # an option list: (FORMAT json), (ANALYZE), ...
        depth, end = 0, len(toks)
        for i, (_, text) in enumerate(toks):
            depth += text.count("(") - text.count(")")
            if depth <= 0:
                end = i
                break
        rest = st.query[toks[end + 1][0] :] if end + 1 < len(toks) else ""
        if _ANALYZE & {text.lower() for _, text in toks[1:end]}:
            return _analyzed(rest)
        inner = _parsed(rest)
    if not inner or len(inner) != 1:
        return "EXPLAIN"
    return None if inner[0].type.name == "SELECT" else f"EXPLAIN {_statement_name(inner[0])}"


def _placeholder(pattern: str, tmp: str) -> str:
    """A zero-row file standing in for ``pattern`` when nothing matches (typed like the real files)."""
    rel = pattern.replace("**/", "").replace("=*", "=0").replace("*", "__none__")  # partition values cast to int
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
    """An in-memory DuckDB connection with every view of ``queries/`` defined over one store.

    A damaged or incomplete folder is left out of its views (:func:`listed_files`), so that one bad folder never
    takes the store down; a query that reads such a view calls ``warn`` once per folder left out, with the line naming
    it and its repair (default: a :class:`DamagedFolderWarning`). ``left_out`` lists them by view."""

    def __init__(self, store: ArtifactStore, verify: bool = False, warn: Callable[[str], None] | None = None):
        store.require_root()
        self.store = store
        self.warn = warn or _python_warning
        self._tmp = tempfile.TemporaryDirectory(prefix="diffret-sql-")
        self.con = duckdb.connect()
        # every file is read through the read-only filesystem (the placeholders under the private folder too)
        self.con.register_filesystem(ReadOnlyFS(store.fs, local_dirs=(self._tmp.name,)))

        def url(path: str) -> str:
            return f"{READ_ONLY_PROTOCOL}://{path}"

        self.views: list[str] = []
        self.damaged: dict[str, str] = {}  # view -> why it fails (a view DuckDB cannot define, or one it reads)
        self.view_files: dict[str, list[str]] = {}  # view -> the files it reads, its own and its views'
        self.left_out: dict[str, dict[str, str]] = {}  # view -> the folders of its own files it leaves out, and why
        self._view_reads: dict[str, list[str]] = {}  # view -> the views it reads
        self._warned: set[str] = set()
        for view in load_view_defs():
            sql = view.sql.replace("@measure_columns", measure_columns())
            files: list[str] = []
            try:
                if view.files:
                    files, self.left_out[view.name] = listed_files(store, view.files, verify=verify)
                    sql = sql.replace(
                        "@files", _sql_list([url(p) for p in files] or [url(_placeholder(view.files, self._tmp.name))])
                    )
                self.con.execute(sql)
            except (duckdb.Error, StoreError) as exc:
                self._fail_alone(view, exc, files)
            self._view_reads[view.name] = self._reads(view.sql)
            self.view_files[view.name] = files + [f for v in self._view_reads[view.name] for f in self.view_files[v]]
            self.views.append(view.name)
        allowed = [url(store.abspath("")).rstrip("/") + "/", url(self._tmp.name) + "/"]
        self.con.execute(f"SET allowed_directories = {_sql_list(allowed)}")
        self.con.execute(f"SET temp_directory = {_sql_str(os.path.join(self._tmp.name, 'spill'))}")
        self.con.execute("SET enable_external_access = false")
        self.con.execute("SET lock_configuration = true")

    def _reads(self, sql: str) -> list[str]:
        """The views defined so far that ``sql`` names."""
        return [v for v in self.view_files if re.search(rf"\b{re.escape(v)}\b", sql)]

    def leaves_out(self, sql: str) -> list[str]:
        """One line per folder that a query over ``sql``'s views (and the views they read) leaves out: the view, the
        folder's damage and its repair.

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as root, StoreSQL(ArtifactStore(root)) as db:
        ...     db.leaves_out("select * from cells")
        []
        """
        seen, todo, lines = set(), self._reads(sql), []
        while todo:
            view = todo.pop(0)
            if view in seen:
                continue
            seen.add(view)
            lines += [f"view {view} leaves out a damaged folder: {why}" for why in self.left_out.get(view, {}).values()]
            todo += self._view_reads.get(view, [])
        return lines

    def _warn_left_out(self, sql: str) -> None:
        for line in self.leaves_out(sql):
            if line not in self._warned:
                self._warned.add(line)
                self.warn(line)

    def _fail_alone(self, view: ViewDef, exc: Exception, files: list[str]) -> None:
        """Define ``view`` as one that raises why it cannot be read, so that only queries that read it fail."""
        if isinstance(exc, StoreError):
            why = str(exc)
        else:
            found = damaged_files(self.store, files)
            upstream = [v for v in self.damaged if re.search(rf"\b{re.escape(v)}\b", view.sql)]
            if found:
                why = f"{found[0]}" + (f" (and {len(found) - 1} more damaged file(s))" if len(found) > 1 else "")
            elif upstream:
                why = f"it reads view {upstream[0]!r}, which is damaged: {self.damaged[upstream[0]]}"
            else:
                why = f"queries/{view.origin}: view {view.name!r} failed: {' '.join(str(exc).split())}"
        self.damaged[view.name] = why
        reason = _sql_str(f"view {view.name}: " + why)  # raised by any query that reads a row of it, count(*) too
        self.con.execute(
            f"CREATE OR REPLACE VIEW {view.name} AS SELECT 1 AS damaged FROM range(1) WHERE error({reason}) IS NULL"
        )

    def _checked(self, sql: str) -> str:
        """``sql`` if it is one read-only statement, else :class:`SQLRefused` naming the first statement that is not
        read-only, or the number of statements (several are refused: run them one at a time)."""
        try:
            statements = self.con.extract_statements(sql)
        except duckdb.Error as exc:
            raise StoreError(f"SQL error: {' '.join(str(exc).split())}") from None
        if not statements:  # comments, ';' (DuckDB would run nothing and return no result)
            raise StoreError(
                f"no SQL statement in {sql.strip()[:60]!r} (only comments or ';'): give a SELECT over "
                "the views (the `views` command lists them)"
            )
        for st in statements:
            refused = refused_statement(st)
            if refused:
                raise SQLRefused(
                    f"SQL over the store is read-only: {refused} is refused ({' '.join(st.query.split())[:60]!r}); "
                    "export a result with the sql command's --out FILE.csv|.parquet or the export-run command"
                )
        if len(statements) > 1:
            shown = ", ".join(repr(" ".join(st.query.split()).rstrip(";")[:40]) for st in statements[:3])
            raise SQLRefused(
                f"SQL over the store runs one statement at a time; this holds {len(statements)} ({shown}"
                f"{', ...' if len(statements) > 3 else ''}): run each on its own"
            )
        return sql

    def _run(self, sql: str, relation: bool = False) -> Any:
        if not sql.strip():
            raise StoreError(
                "empty SQL query (only whitespace): give a SELECT over the views (the `views` command lists them)"
            )
        try:
            rel = self.con.sql(self._checked(sql)) if relation else self.con.execute(self._checked(sql))
            self._warn_left_out(sql)
            return rel
        except duckdb.PermissionException as exc:
            what = str(exc).splitlines()[0].replace("Permission Error: ", "")
            raise SQLRefused(
                f"SQL reads the store {self.store.root} through its views only (the `views` command lists them): {what}"
            ) from None
        except duckdb.Error as exc:
            raise self._translated(exc, sql) from None

    @staticmethod
    def _write_refused(exc: duckdb.Error) -> SQLRefused | None:
        """The read-only filesystem's refusal (a write that reached the engine) as one line, if ``exc`` is one."""
        found = re.search(rf"{_WRITE_REFUSED} [^\n]*", str(exc))
        return SQLRefused(found.group(0)) if found else None

    def _translated(self, exc: duckdb.Error, sql: str = "") -> StoreError:
        """A DuckDB error as one line: a damaged view's reason (and its repair) when the query reads one (its
        error, or a column it no longer has), else the SQL error."""
        refused = self._write_refused(exc)
        if refused:
            return refused
        text = " ".join(str(exc).split())
        for name, why in self.damaged.items():
            if f"view {name}: " in text or re.search(rf"\b{re.escape(name)}\b", sql):
                return DamagedView(f"view {name} cannot be read: {why}")
        if not isinstance(exc, duckdb.ParserException | duckdb.BinderException | duckdb.CatalogException):
            base = re.escape(self.store.abspath("").rstrip("/"))
            named = re.search(rf"({base}/[^'\"\s]+)", text)  # the store file DuckDB could not read, if it says
            suspects = [named.group(1)] if named else [f for v in self._reads(sql) for f in self.view_files[v]]
            found = damaged_files(self.store, sorted(set(suspects)))
            if found:
                more = f" (and {len(found) - 1} more damaged file(s))" if len(found) > 1 else ""
                return DamagedView(found[0] + more)
        return StoreError(f"SQL error: {text}")

    def execute(self, sql: str, params: list | None = None) -> duckdb.DuckDBPyConnection:
        """A query of diffret's own (the analyses: with ``params``, unchecked) on the connection, warning of the
        folders its views leave out as :meth:`query` does; DuckDB's result (``fetchall``, ``description``)."""
        result = self.con.execute(sql, params or [])
        self._warn_left_out(sql)
        return result

    def query(self, sql: str) -> tuple[list[str], list[tuple]]:
        """Columns and rows of a read-only query (:class:`SQLRefused` for anything else).

        Examples
        --------
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as root, StoreSQL(ArtifactStore(root)) as db:
        ...     db.query("select count(*) as n from corpus")
        (['n'], [(0,)])
        """
        rel = self._run(sql)
        cols = [d[0] for d in rel.description] if rel.description else []
        return cols, rel.fetchall()

    def arrow(self, sql: str) -> pa.Table:
        """A read-only query's result as an Arrow table (:meth:`query`'s checks).

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as root, StoreSQL(ArtifactStore(root)) as db:
        ...     db.arrow("select 42 as answer").to_pylist()
        [{'answer': 42}]
        """
        rel = self._run(sql, relation=True)
        fetch = getattr(rel, "to_arrow_table", None) or rel.arrow  # DuckDB 1.x: arrow(); 2.x: to_arrow_table()
        return fetch()

    def export(self, sql: str, path: str) -> int:
        """Write a read-only query's result to ``path`` (``.csv`` or ``.parquet``) atomically; its row count.

        Examples
        --------
        >>> import os, tempfile
        >>> with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
        ...     with StoreSQL(ArtifactStore(root)) as db:
        ...         db.export("select 42 as answer", os.path.join(out, "answer.csv"))
        1
        """
        ext = os.path.splitext(path)[1].lower()
        if ext not in (".csv", ".parquet"):
            raise StoreError(f"{path}: --out writes .csv or .parquet files")
        self.store.refuse_inside(path)
        try:
            table = self._run(sql, relation=True).to_arrow_table()
        except duckdb.Error as exc:
            raise self._translated(exc, sql) from None
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".diffret-out-", dir=folder)
        os.fchmod(fd, FILE_MODE)  # a result file readable as any other (mkstemp's 0600 is for secrets)
        os.close(fd)
        try:
            if ext == ".csv":
                import pyarrow.csv as pcsv

                pcsv.write_csv(table, tmp)
            else:
                pq.write_table(table, tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        return table.num_rows

    def close(self) -> None:
        self.con.close()
        self._tmp.cleanup()

    def __enter__(self) -> StoreSQL:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
