"""SQL over the store cannot write: every statement that can execute or write (EXPLAIN ANALYZE of anything, COPY,
CREATE, INSERT / UPDATE / DELETE, ATTACH / DETACH, SET / RESET, PRAGMA, CALL, EXPORT / IMPORT, INSTALL / LOAD), in
any case, behind comments, whitespace, CTEs or nested in EXPLAIN, and several statements in one string, is refused
with one line naming the statement, through the library (``StoreSQL``, ``Store.sql``) and ``diffret sql``; every
byte of the store stays as it was and no file appears. The engine refuses a write that slips past the statement
check, into the store root as anywhere else, on a local and on a memory:// store."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import duckdb
import pytest
from conftest import write_beir
from typer.testing import CliRunner

from diffret.api import Store
from diffret.flows.cli import app
from diffret.storage import ArtifactStore
from diffret.storage.sql import READ_ONLY_PROTOCOL, SQLRefused, StoreSQL

pytestmark = pytest.mark.usefixtures("one_thread")

CORPUS = [{"_id": f"d{i}", "title": "", "text": f"passage {i} about word{i}"} for i in range(6)]
QUERIES = [{"_id": f"q{i}", "text": f"word{i}"} for i in range(3)]
QRELS = {"test": [(f"q{i}", f"d{i}", 1) for i in range(3)]}


def invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A store with a collection, its BM25 run and the run's metrics."""
    base = tmp_path_factory.mktemp("sqlro")
    beir = write_beir(base / "c", CORPUS, QUERIES, QRELS)
    root = base / "store"
    for args in (("download", "c", "--source", str(beir)), ("bm25", "-d", "c"), ("evaluate",)):
        code, out = invoke(*args, "--root", str(root))
        assert code == 0, (args, out)
    (run,) = root.glob("runs/**/run.parquet")
    outside = base / "outside"
    outside.mkdir()
    return {"root": root, "run": run, "outside": outside}


def sha256s(root: Path) -> dict[str, str]:
    """Every file under ``root`` (lock files aside) and its sha256."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "_locks" not in p.parts
    }


COPY = "copy (select 'q' as query_id, 'x' as doc_id, 1 as rank, 0.0 as score) to '{run}' (format parquet)"
REFUSED = [
    # EXPLAIN ANALYZE runs its statement: refused whatever it explains, however it is written
    ("EXPLAIN ANALYZE " + COPY, "EXPLAIN ANALYZE COPY"),
    ("explain analyze create table t as select 1", "EXPLAIN ANALYZE CREATE"),
    ("explain analyze select 1", "EXPLAIN ANALYZE SELECT"),
    ("eXpLaIn   AnAlYsE\n\t" + COPY, "EXPLAIN ANALYZE COPY"),
    ("/* a */ explain /* b */ analyze -- c\n " + COPY, "EXPLAIN ANALYZE COPY"),
    ("explain (analyze) " + COPY, "EXPLAIN ANALYZE COPY"),
    ("explain (format json, analyze) select 1", "EXPLAIN ANALYZE SELECT"),
    ("explain analyze with a as (select 1) insert into t select * from a", "EXPLAIN ANALYZE INSERT"),
    ("explain " + COPY, "EXPLAIN COPY"),
    ("explain create table t as select 1", "EXPLAIN CREATE"),
    ("explain (format json) insert into t values (1)", "EXPLAIN INSERT"),
    # statements that write, attach, configure or install
    (COPY, "COPY"),
    ("  -- x\n  CoPy (select 1) tO '{root}/x.csv'", "COPY"),
    ("copy (select 1) to '{outside}/x.csv'", "COPY"),
    ("copy runs from '{run}'", "COPY"),
    ("create table t as select 1", "CREATE"),
    ("create or replace view runs as select 1", "CREATE"),
    ("insert into runs select * from runs", "INSERT"),
    ("with a as (select 1) insert into t select * from a", "INSERT"),
    ("update runs set score = 0", "UPDATE"),
    ("delete from runs", "DELETE"),
    ("attach '{outside}/other.db' as o", "ATTACH"),
    ("attach '{root}/other.db' as o", "ATTACH"),
    ("detach memory", "DETACH"),
    ("set enable_external_access = true", "SET"),
    ("reset lock_configuration", "RESET"),
    ("pragma enable_profiling", "PRAGMA"),
    ("call pragma_version()", "CALL"),
    ("checkpoint", "CHECKPOINT"),
    ("export database '{outside}/dump'", "EXPORT"),
    ("import database '{outside}/dump'", "IMPORT"),
    ("install httpfs", "INSTALL"),
    ("force install httpfs", "INSTALL"),
    ("load httpfs", "LOAD"),
    ("drop view runs", "DROP"),
    # several statements: a write among them is named, else the count
    ("select 1; " + COPY, "COPY"),
    ("select 1 as a; select 2 as b", "runs one statement at a time; this holds 2"),
    ("select 1;\n-- c\nselect 2; select 3", "runs one statement at a time; this holds 3"),
]


@pytest.fixture(scope="module")
def db(world: dict):
    with StoreSQL(ArtifactStore(world["root"])) as con:
        yield con


@pytest.mark.parametrize(("sql", "name"), REFUSED, ids=[f"{i:02d}" for i in range(len(REFUSED))])
def test_every_statement_that_can_write_is_refused_and_no_byte_changes(
    world: dict, db: StoreSQL, sql: str, name: str
) -> None:
    root, outside = world["root"], world["outside"]
    before = sha256s(root)
    text = sql.format(run=world["run"], root=root, outside=outside)
    expected = name if "statement at a time" in name else f"read-only: {name} is refused"
    for call in (db.query, db.arrow, lambda q: db.export(q, str(outside / "r.csv"))):
        with pytest.raises(SQLRefused, match=expected):
            call(text)
    assert db.query("select count(*) from runs")[1] == [(3,)]
    with pytest.raises(SQLRefused, match=expected):
        Store(root).sql(text)
    code, out = invoke("sql", "--root", str(root), text)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and expected in " ".join(out.split()), out
    assert sha256s(root) == before  # no byte changed, no file appeared
    assert list(outside.iterdir()) == []


def test_reads_and_plain_explain_still_answer(world: dict) -> None:
    before = sha256s(world["root"])
    with StoreSQL(ArtifactStore(world["root"])) as db:
        assert db.query("select count(*) from runs")[1] == [(3,)]
        assert db.query("/* c */ WITH r AS (select * from runs) SELECT count(*) FROM r;")[1] == [(3,)]
        assert db.query("from metrics select count(distinct query_id)")[1] == [(3,)]
        for sql in ("explain select * from runs", "EXPLAIN (select 1)", "explain (format json) select 1"):
            assert db.query(sql)[1]
        assert db.query("describe runs")[1] and db.query("summarize select 1 as a")[1]
    assert sha256s(world["root"]) == before


@pytest.mark.parametrize(
    "sql",
    [
        COPY,
        "copy (select 1 as a) to '{root}/x.csv'",
        "copy (select 1 as a) to '{protocol}://{run}' (format parquet)",
        "copy (select 1 as a) to '{protocol}://{root}/x.csv'",
        "explain analyze " + COPY,
        "copy (select 1 as a) to '{outside}/x.csv'",
        "export database '{root}/dump'",
        "attach '{root}/new.db' as n",
    ],
)
def test_the_engine_refuses_a_write_that_slips_past_the_statement_check(world: dict, sql: str) -> None:
    """Straight on the connection (no statement check): DuckDB cannot open any file for writing, the store's own
    included, by its path or through the read-only filesystem the views read by."""
    root, outside = world["root"], world["outside"]
    before = sha256s(root)
    text = sql.format(run=world["run"], root=root, outside=outside, protocol=READ_ONLY_PROTOCOL)
    with StoreSQL(ArtifactStore(root)) as db:
        with pytest.raises(duckdb.Error):
            db.con.execute(text)
        with pytest.raises((duckdb.Error, SQLRefused)):
            db.execute(text)  # diffret's own queries: unchecked, same engine
        assert db.query("select count(*) from runs")[1] == [(3,)]
    assert sha256s(root) == before
    assert list(outside.iterdir()) == []


def test_a_memory_store_is_read_and_never_written() -> None:
    from test_sql_confinement import put_metrics

    mem = ArtifactStore(f"memory://diffret-ro-{uuid.uuid4().hex}")
    put_metrics(mem)
    target = next(p for p in mem.fs.find(mem.abspath("")) if p.endswith(".parquet"))  # a stored file
    before = {p: mem.fs.cat_file(p) for p in mem.fs.find(mem.abspath(""))}
    with StoreSQL(mem) as db:
        assert db.query("select count(*) from metrics")[1] == [(2,)]
        for sql in (
            f"copy (select 1 as a) to 'memory://{target}' (format parquet)",
            f"copy (select 1 as a) to '{READ_ONLY_PROTOCOL}://{target}' (format parquet)",
            f"copy (select 1 as a) to '{READ_ONLY_PROTOCOL}://{mem.abspath('x.csv')}'",
        ):
            with pytest.raises(duckdb.Error):
                db.con.execute(sql)
            with pytest.raises(SQLRefused, match="read-only: COPY is refused"):
                db.query(sql)
        assert db.query("select count(*) from metrics")[1] == [(2,)]
    assert {p: mem.fs.cat_file(p) for p in mem.fs.find(mem.abspath(""))} == before
