"""``diffret import-run``, ``fuse`` and ``compare`` on a tiny collection (no model): a run made elsewhere becomes a
system; bad input is one line naming file:line and writes nothing; another file under the same name is drift;
fusion's ranks; the comparison's tables and the report's section."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_beir
from typer.testing import CliRunner

from diffret.flows.cli import app
from diffret.storage import ArtifactStore

DOCS = [f"d{i}" for i in range(1, 7)]


@pytest.fixture
def store(tmp_path: Path) -> dict[str, str]:
    corpus = [{"_id": d, "title": "", "text": f"text {d}"} for d in DOCS]
    queries = [{"_id": q, "text": f"query {q}"} for q in ("q1", "q2", "q3", "q4")]
    qrels = {"test": [("q1", "d1", 1), ("q2", "d2", 1), ("q3", "d3", 2)], "train": [("q4", "d4", 1)]}
    src = write_beir(tmp_path / "tiny", corpus, queries, qrels)
    root = str(tmp_path / "store")
    assert CliRunner().invoke(app, ["download", "tiny", "--source", str(src), "--root", root]).exit_code == 0
    return {"root": root, "dir": str(tmp_path)}


def trec(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GOOD = [
    "q1 Q0 d1 1 3.0 x",
    "q1 Q0 d3 2 2.0 x",
    "q1 Q0 d2 3 2.0 x",
    "q2 Q0 d1 1 1.5 x",
    "q2 Q0 d2 2 0.5 x",
    "q3 Q0 d3 1 9 x",
    "q4 Q0 d4 1 1 x",
]


def cli(root: str, *args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, [*args, "--root", root])
    return res.exit_code, res.output


def runs(root: str) -> list[str]:
    return ArtifactStore(root).folders("runs/*/*/*/*/*/*")


def test_an_imported_run_is_a_system_ranked_by_score_then_the_files_rank(store, tmp_path):
    from diffret.stages.runs import read_run
    from diffret.stages.systems import list_systems

    code, out = cli(store["root"], "import-run", trec(tmp_path / "splade.trec", GOOD), "-d", "tiny")
    assert code == 0 and "splade: 1 run(s) imported" in out, out
    ((stage,),) = [runs(store["root"])]
    assert stage.endswith("system=splade/dataset=tiny/split=test/kq=0/kp=0/mode=imported")
    t = read_run(ArtifactStore(store["root"]), stage)
    q1 = [
        (d, r)
        for q, d, r in zip(*(t.column(c).to_pylist() for c in ("query_id", "doc_id", "rank")), strict=True)
        if q == "q1"
    ]
    assert q1 == [("d1", 1), ("d3", 2), ("d2", 3)]  # the tie at 2.0 in the file's order
    assert [r.kind for r, _ in list_systems(ArtifactStore(store["root"]))] == ["run"]
    # Parquet, without ranks: the same run
    pq.write_table(
        pa.table({"query_id": ["q1", "q1"], "doc_id": ["d2", "d1"], "score": [0.1, 0.9]}), tmp_path / "dense.parquet"
    )
    code, out = cli(store["root"], "import-run", str(tmp_path / "dense.parquet"), "-d", "tiny", "--name", "dense")
    assert code == 0, out


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("q9 Q0 d1 1 1.0 x", "query 'q9' is not a query of 'tiny'"),
        ("q1 Q0 d9 1 1.0 x", "document 'd9' is not in the corpus of 'tiny'"),
        ("q1 Q0 d1 4 1.0 x", "document 'd1' appears twice for query 'q1' (first at"),
        ("q1 Q0 d4 4 high x", "score 'high' is not a number"),
        ("q1 Q0 d4 4 nan x", "score 'nan' is not a finite number"),
        ("q1 Q0 d4 4", "a run line needs at least 6 whitespace-separated fields"),
    ],
)
def test_bad_lines_are_refused_naming_file_and_line_and_nothing_is_written(store, tmp_path, line, says):
    path = trec(tmp_path / "bad.trec", [*GOOD[:2], line])
    code, out = cli(store["root"], "import-run", path, "-d", "tiny")
    assert code == 2 and f"{path}:3: {says}" in " ".join(out.split()), out
    assert runs(store["root"]) == [] and not list(Path(store["root"]).glob("systems/*"))


def test_other_mistakes_are_one_line(store, tmp_path):
    code, out = cli(store["root"], "import-run", trec(tmp_path / "r.trec", ["q4 Q0 d4 1 1 x"]), "-d", "tiny")
    assert code == 2 and "judged in ['train']): give --split" in " ".join(out.split()), out
    pq.write_table(pa.table({"qid": ["q1"], "doc_id": ["d1"], "score": [1.0]}), tmp_path / "r.parquet")
    code, out = cli(store["root"], "import-run", str(tmp_path / "r.parquet"), "-d", "tiny")
    assert code == 2 and "lacks ['query_id']" in out, out
    pq.write_table(
        pa.table({"query_id": ["q1", "q2"], "doc_id": ["d1", "d2"], "score": [1.0, None]}), tmp_path / "r.parquet"
    )
    code, out = cli(store["root"], "import-run", str(tmp_path / "r.parquet"), "-d", "tiny")
    assert code == 2 and "r.parquet:row 2: score None is not a number" in " ".join(out.split()), out
    assert runs(store["root"]) == []


def test_another_file_under_the_same_name_is_refused_unless_forced(store, tmp_path):
    assert cli(store["root"], "import-run", trec(tmp_path / "a.trec", GOOD), "-d", "tiny", "--name", "s")[0] == 0
    other = trec(tmp_path / "b.trec", GOOD[3:])
    code, out = cli(store["root"], "import-run", other, "-d", "tiny", "--name", "s")
    assert code == 2 and "from another file" in out and "--force" in out, out
    assert cli(store["root"], "import-run", other, "-d", "tiny", "--name", "s", "--force")[0] == 0


def test_fusion_of_imported_runs_then_compare_and_the_report(store, tmp_path):
    root = store["root"]
    cli(root, "import-run", trec(tmp_path / "a.trec", GOOD), "-d", "tiny")
    cli(
        root,
        "import-run",
        trec(
            tmp_path / "b.trec",
            ["q1 Q0 d2 1 5 x", "q1 Q0 d1 2 1 x", "q2 Q0 d2 1 2 x", "q3 Q0 d1 1 4 x", "q3 Q0 d3 2 3 x"],
        ),
        "-d",
        "tiny",
    )
    code, out = cli(root, "fuse", "-d", "tiny", "--run", "a", "--run", "b", "--weight", "0.5", "--weight", "0.5")
    assert code == 0, out
    got = {
        r["query_id"]: r
        for r in _sql(
            root,
            "select query_id, list(doc_id order by rank) docs, "
            "list(score order by rank) scores from runs where mode = 'fusion' "
            "group by 1",
        )
    }
    # q1: a gives d1 1, d3 0, d2 0; b gives d2 1, d1 0 -> d1 0.5, d2 0.5 (tie: doc_id), d3 0
    assert got["q1"]["docs"] == ["d1", "d2", "d3"] and got["q1"]["scores"] == pytest.approx([0.5, 0.5, 0.0])
    assert cli(root, "evaluate")[0] == 0
    code, out = cli(
        root,
        "compare",
        "-d",
        "tiny",
        "--baseline",
        "a",
        "--run",
        "b",
        "--run",
        "fusion",
        "--test",
        "wilcoxon",
        "--show",
        "latex",
        "--measure",
        "ndcg_cut_10",
    )
    assert code == 0 and "\\begin{tabular}{lrr}" in out and "Wilcoxon" in out, out
    code, out = cli(root, "compare", "-d", "tiny", "--baseline", "a", "--run", "nope")
    assert code == 2 and "no system named 'nope'" in out, out
    code, out = cli(root, "report", "--ref", "a")
    assert code == 0, out
    report = next(Path(root).glob("reports/report=default/report.md")).read_text()
    assert "## Runs against a" in report and "b (baseline)" not in report and "a (baseline)" in report
    assert list(Path(root).glob("reports/report=default/comparison_tiny.tex"))


def _sql(root: str, query: str) -> list[dict]:
    from diffret.storage.sql import StoreSQL

    with StoreSQL(ArtifactStore(root)) as db:
        cols, data = db.query(query)
    return [dict(zip(cols, r, strict=True)) for r in data]


def test_a_malformed_run_reference_is_one_line(store):
    code, out = cli(store["root"], "compare", "-d", "tiny", "--baseline", "bm25:x:1")
    assert code == 2 and "expected SYSTEM, SYSTEM:MODE or SYSTEM:MODE:KQ:KP" in " ".join(out.split()), json.dumps(out)
