"""``diffret sql`` reads the store and nothing else: the escapes a user tried (COPY ... TO a file,
read_csv('/etc/passwd'), CREATE TABLE, ATTACH, INSTALL / LOAD, SET to re-open access) are refused with one line,
nothing is written, and the views still answer on a local and on a memory:// store; results leave through
``--out`` (CSV or Parquet, atomically)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from diffret.schemas import METRICS_SCHEMA
from diffret.storage import ArtifactStore, Manifest, StoreError
from diffret.storage.layout import METRICS_FILE, metrics_dir
from diffret.storage.sql import SQLRefused, StoreSQL


def put_metrics(store: ArtifactStore, system: str = "sys-0123456789", value: float = 0.5) -> None:
    folder = metrics_dir(system, "toy", "test", 1, 1, "multi_dense")
    table = pa.table(
        {"query_id": ["q1", "q2"], "measure": ["ndcg_cut_10"] * 2, "value": [value, value]}, schema=METRICS_SCHEMA
    )
    part = {"system": system, "dataset": "toy", "split": "test", "kq": "1", "kp": "1", "mode": "multi_dense"}
    with store.folder_writer(folder, Manifest.new("metrics", part, {"synthetic": True})) as w:
        w.write_parquet(METRICS_FILE, METRICS_SCHEMA, [table])


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    s = ArtifactStore(tmp_path / "store")
    put_metrics(s)
    return s


def test_views_answer_on_a_local_and_a_memory_store(store: ArtifactStore) -> None:
    mem = ArtifactStore(f"memory://diffret-sql-{uuid.uuid4().hex}")
    put_metrics(mem, value=0.25)
    for s, expected in ((store, 0.5), (mem, 0.25)):
        with StoreSQL(s) as db:
            cols, rows = db.query("select system, mode, ndcg_10 from cells")
        assert cols == ["system", "mode", "ndcg_10"] and rows == [("sys-0123456789", "multi_dense", expected)]


@pytest.mark.parametrize(
    ("sql", "match"),
    [
        ("copy (select 42) to '{outside}/x.csv'", "read-only: COPY is refused"),
        ("copy (select 42) to '{root}/x.csv'", "read-only: COPY is refused"),  # not into the store either
        ("select * from read_csv('/etc/passwd')", "reads the store .* through its views only .*: .*/etc/passwd"),
        ("select * from read_text('{outside}/secret.txt')", "reads the store .* through its views only"),
        ("select * from glob('/etc/*')", "reads the store .* through its views only"),
        ("create table t as select 1", "read-only: CREATE is refused"),
        ("select 1; create table t as select 1", "read-only: CREATE is refused"),
        ("insert into cells select * from cells", "read-only: INSERT is refused"),
        ("attach '{outside}/other.db'", "read-only: ATTACH is refused"),
        ("install httpfs", "read-only: INSTALL is refused"),
        ("load httpfs", "read-only: LOAD is refused"),
        ("set enable_external_access = true", "read-only: SET is refused"),
        ("export database '{outside}/dump'", "read-only: EXPORT is refused"),
    ],
)
def test_escapes_are_refused_and_write_nothing(store: ArtifactStore, tmp_path: Path, sql: str, match: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    before = sorted(p.name for p in Path(store.root).rglob("*"))
    with StoreSQL(store) as db, pytest.raises(SQLRefused, match=match):
        db.query(sql.format(outside=outside, root=store.root))
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert sorted(p.name for p in Path(store.root).rglob("*")) == before


def test_the_lock_holds_on_the_raw_connection(store: ArtifactStore) -> None:
    import duckdb

    with StoreSQL(store) as db:
        with pytest.raises(duckdb.Error, match="locked"):
            db.con.execute("set enable_external_access = true")
        with pytest.raises(duckdb.PermissionException):
            db.con.execute("select * from read_csv('/etc/passwd')")
        assert db.query("select count(*) from metrics")[1] == [(2,)]  # reading the store still works


def test_export_writes_csv_and_parquet_atomically(store: ArtifactStore, tmp_path: Path) -> None:
    with StoreSQL(store) as db:
        assert db.export("select query_id, value from metrics order by 1", str(tmp_path / "r.csv")) == 2
        assert db.export("select query_id, value from metrics order by 1", str(tmp_path / "r.parquet")) == 2
        with pytest.raises(SQLRefused):
            db.export("copy (select 1) to 'x.csv'", str(tmp_path / "bad.csv"))
        with pytest.raises(Exception, match=r"\.csv or \.parquet"):
            db.export("select 1", str(tmp_path / "r.json"))
    assert (tmp_path / "r.csv").read_text().splitlines() == ['"query_id","value"', '"q1",0.5', '"q2",0.5']
    assert pq.read_table(tmp_path / "r.parquet").column("query_id").to_pylist() == ["q1", "q2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv", "r.parquet", "store"]  # no temporary left


def test_a_missing_root_is_refused_not_read_as_an_empty_store(tmp_path: Path) -> None:
    missing = ArtifactStore(tmp_path / "typo")
    with pytest.raises(StoreError, match="no store at .*typo"):
        StoreSQL(missing)
    with pytest.raises(StoreError, match="no store at"):
        missing.verify_all()
    assert not (tmp_path / "typo").exists()


def test_a_folder_that_is_not_a_store_is_refused_by_sql_views_and_verify(tmp_path: Path) -> None:
    """A folder of TREC files given as --root is refused naming it (not read as an empty store); an empty folder is an
    empty store; a store root holding other files beside its folders is a store, local or on memory://."""
    trec = tmp_path / "trec-files"
    trec.mkdir()
    for name in ("bm25.trec", "dense.trec", "fused.trec", "x.trec"):
        (trec / name).write_text("q1 Q0 d1 1 1.0 x\n")
    with pytest.raises(
        StoreError, match=f"{trec} is not a diffret store: it holds bm25.trec, dense.trec, fused.trec and 1 more"
    ):
        StoreSQL(ArtifactStore(trec))
    with pytest.raises(StoreError, match="is not a diffret store"):
        ArtifactStore(trec).verify_all()
    p = subprocess.run(
        [sys.executable, "-m", "diffret.flows.cli", "sql", "--root", str(trec), "select count(*) from runs"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "300", "PREFECT_API_URL": ""},
        timeout=120,
    )
    assert p.returncode == 2 and "is not a diffret store" in p.stderr and not p.stdout, (p.stdout, p.stderr)
    with pytest.raises(StoreError, match="it holds trec-files but"):  # the folder above: not a store either
        StoreSQL(ArtifactStore(tmp_path))
    mem = ArtifactStore(f"memory://diffret-top-{uuid.uuid4().hex}")
    put_metrics(mem)
    mem.fs.pipe(mem.abspath("notes.txt"), b"beside the store's folders")
    with StoreSQL(mem) as db:
        assert db.query("select count(*) from metrics")[1] == [(2,)]


def test_every_folder_the_layout_names_marks_a_store() -> None:
    """Every path function of storage/layout.py starts with a folder ``STORE_TOP_FOLDERS`` lists: a store holding
    only that folder is never refused as "not a store"."""
    import inspect

    from diffret.storage import layout

    checked = 0
    for name, fn in vars(layout).items():
        if not inspect.isfunction(fn) or not name.endswith(("_dir", "_path")) or fn.__module__ != layout.__name__:
            continue
        params = inspect.signature(fn).parameters
        if "folder" in params:
            continue
        path = fn(*[1 if p.annotation in ("int", int) else "x" for p in params.values()])
        assert path.split("/")[0] in layout.STORE_TOP_FOLDERS, (name, path)
        checked += 1
    assert checked >= 15
    assert set(layout.STAGE_FOLDERS) <= layout.STORE_TOP_FOLDERS


def test_cli_refusal_is_one_line_and_fails(store: ArtifactStore, tmp_path: Path) -> None:
    target = tmp_path / "x.csv"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffret.flows.cli",
            "sql",
            "--root",
            str(store.root),
            f"copy (select 42) to '{target}'",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", "PREFECT_API_URL": ""},
        timeout=120,
    )
    assert p.returncode != 0 and not target.exists()
    assert p.stderr.strip().count("\n") == 0 and "read-only: COPY is refused" in p.stderr
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffret.flows.cli",
            "sql",
            "--root",
            str(store.root),
            "--out",
            str(target),
            "select query_id from metrics",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", "PREFECT_API_URL": ""},
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert target.read_text().splitlines() == ['"query_id"', '"q1"', '"q2"']


@pytest.mark.parametrize("sql", [" ", "-- x", "/* a comment */", ";", " ; -- x"])
@pytest.mark.parametrize("out", [False, True])
def test_a_query_of_nothing_is_one_line_not_a_traceback(
    store: ArtifactStore, tmp_path: Path, sql: str, out: bool
) -> None:
    """Whitespace, a comment or ';' alone (DuckDB runs nothing and returns no result) is one error line,
    exit 2, however the query starts ('-- x' is the query, not an option)."""
    from typer.testing import CliRunner

    from diffret.flows.cli import app

    args = ["sql", "--root", str(store.root), *(["--out", str(tmp_path / "x.csv")] if out else []), sql]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and res.exception is None or isinstance(res.exception, SystemExit), res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "give a SELECT" in lines[0], res.output
    assert not (tmp_path / "x.csv").exists()
