"""Runs in and out on SciFact (its first 30 test queries; the corpus cut to the documents they judge and 600 more):
BM25, two splade-tiny encoders and a fusion; a run exported from one store and imported into another evaluates to
the same metrics; reranking and late re-scoring take an imported first stage; ``diffret compare``'s corrected
p-values are statsmodels' on the same per-query scores, its LaTeX well-formed text. In process (CliRunner)."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest
from conftest import SHARED, write_beir
from typer.testing import CliRunner

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]
N_QUERIES, EXTRA_DOCS = 30, 600
SPLADE = SHARED / "models" / "splade-tiny-mlm"


def cli(*args: str) -> str:
    from diffret.flows.cli import app

    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def rows(root: Path, query: str) -> list[dict]:
    from diffret.storage import ArtifactStore
    from diffret.storage.sql import StoreSQL

    with StoreSQL(ArtifactStore(str(root))) as db:
        cols, data = db.query(query)
    return [dict(zip(cols, r, strict=True)) for r in data]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    scifact = SHARED / "data" / "scifact"
    if not (scifact / "corpus.jsonl").exists() or not (SPLADE / "config.json").exists():
        pytest.skip("../shared/data/scifact or ../shared/models/splade-tiny-mlm is absent")
    tmp = tmp_path_factory.mktemp("runs")
    corpus = [json.loads(line) for line in (scifact / "corpus.jsonl").read_text().splitlines() if line.strip()]
    queries = [json.loads(line) for line in (scifact / "queries.jsonl").read_text().splitlines() if line.strip()]
    judged = [line.split("\t") for line in (scifact / "qrels" / "test.tsv").read_text().splitlines()[1:]]
    keep = list(dict.fromkeys(r[0] for r in judged))[:N_QUERIES]
    qrels = [(q, d, int(g)) for q, d, g in judged if q in keep]
    docs = {d for _, d, _ in qrels}
    src = write_beir(
        tmp / "sub",
        [d for i, d in enumerate(corpus) if i < EXTRA_DOCS or d["_id"] in docs],
        [q for q in queries if q["_id"] in keep],
        {"test": qrels},
    )
    a = tmp / "a"
    cli("download", "sub", "--source", str(src), "--root", str(a))
    cli("bm25", "-d", "sub", "--root", str(a))
    for readout in ("diffretriever", "diffembed"):
        cli("encode", "-d", "sub", "--model", str(SPLADE), "--readout", readout, "--k", "1", "--root", str(a))
        cli("score", "-d", "sub", "--system", f"splade-tiny-mlm-{readout}", "--kq", "1", "--kp", "1", "--root", str(a))
    cli("fuse", "-d", "sub", "--run", "bm25", "--run", "splade-tiny-mlm-diffretriever:sparse_max", "--root", str(a))
    cli("evaluate", "--root", str(a))
    cli("export-run", "--system", "bm25", "-d", "sub", "-o", str(tmp / "bm25.trec"), "--root", str(a))
    return {"a": a, "b": tmp / "b", "src": src, "trec": tmp / "bm25.trec"}


def test_an_exported_run_imported_into_another_store_evaluates_the_same(stores):
    b = stores["b"]
    cli("download", "sub", "--source", str(stores["src"]), "--root", str(b))
    out = cli("import-run", str(stores["trec"]), "-d", "sub", "--name", "pyserini-bm25", "--root", str(b))
    assert "1 run(s) imported" in out
    cli("evaluate", "--root", str(b))
    want = rows(stores["a"], "select query_id, measure, value from metrics where mode = 'bm25' order by 1, 2")
    got = rows(b, "select query_id, measure, value from metrics where system = 'pyserini-bm25' order by 1, 2")
    assert got == want and len(got) == 4 * N_QUERIES
    assert rows(b, "select kind from systems where system = 'pyserini-bm25'") == [{"kind": "run"}]
    assert "0 run(s) imported, 1 already done" in cli(
        "import-run", str(stores["trec"]), "-d", "sub", "--name", "pyserini-bm25", "--root", str(b)
    )


def test_rerank_and_late_take_an_imported_first_stage(stores):
    a = str(stores["a"])
    cli("import-run", str(stores["trec"]), "-d", "sub", "--name", "bm25-file", "--root", a)
    cli(
        "rerank",
        "-d",
        "sub",
        "--first-stage",
        "bm25-file",
        "--model",
        str(SPLADE),
        "--method",
        "pointwise",
        "--depth",
        "10",
        "--doc-tokens",
        "32",
        "--root",
        a,
    )
    cli(
        "late",
        "-d",
        "sub",
        "--system",
        "splade-tiny-mlm-diffretriever",
        "--first-stage",
        "bm25-file",
        "--depth",
        "10",
        "--mode",
        "sparse_max",
        "--root",
        a,
    )
    cli("evaluate", "--root", a)
    got = rows(
        stores["a"],
        "select s.kind, c.mode, c.queries from cells c join systems s using (system) where "
        "c.mode in ('rerank', 'late_sparse_max_m10') order by 1",
    )
    assert got == [
        {"kind": "encoder", "mode": "late_sparse_max_m10", "queries": N_QUERIES},
        {"kind": "reranker", "mode": "rerank", "queries": N_QUERIES},
    ]
    firsts = rows(stores["a"], "select first_system, first_mode from late_runs")
    assert firsts == [{"first_system": "bm25-file", "first_mode": "imported"}]
    # each query's reranked and re-scored documents are the imported run's top 10
    same = rows(
        stores["a"],
        "select count(*) n from runs r join runs f on r.query_id = f.query_id and r.doc_id = "
        "f.doc_id where f.system = 'bm25-file' and f.rank <= 10 and r.mode in ('rerank', "
        "'late_sparse_max_m10')",
    )
    assert same == [{"n": 2 * 10 * N_QUERIES}]


def test_compare_corrects_as_statsmodels_does_and_writes_latex(stores, tmp_path):
    from scipy import stats
    from statsmodels.stats.multitest import multipletests

    a = str(stores["a"])
    runs = ["splade-tiny-mlm-diffretriever:sparse_max:1:1", "splade-tiny-mlm-diffembed:single_dense", "fusion"]
    for test, correction, scipy_test in (("t", "holm", stats.ttest_rel), ("wilcoxon", "bonferroni", stats.wilcoxon)):
        out_dir = tmp_path / test
        cli(
            "compare",
            "-d",
            "sub",
            "--baseline",
            "bm25",
            *[x for r in runs for x in ("--run", r)],
            "--measure",
            "ndcg_cut_10",
            "--measure",
            "recall_100",
            "--test",
            test,
            "--correction",
            correction,
            "--out",
            str(out_dir),
            "--root",
            a,
        )
        table = list(csv.DictReader(io.StringIO((out_dir / "comparison.csv").read_text())))
        tested = [r for r in table if r["p_value"]]
        assert [r["run"] for r in table if not r["p_value"]] == ["bm25", "bm25"] and len(tested) == 2 * len(runs)
        raw = []
        for r in tested:
            where = (
                f"system = '{r['system']}' and mode = '{r['mode']}' and kq = {r['kq']} and kp = {r['kp']} and "
                f"measure = '{r['measure']}'"
            )
            x = rows(stores["a"], f"select query_id, value from metrics where {where} order by 1")
            y = rows(
                stores["a"],
                f"select query_id, value from metrics where mode = 'bm25' and measure = '{r['measure']}' order by 1",
            )
            assert [q["query_id"] for q in x] == [q["query_id"] for q in y]
            va, vb = [q["value"] for q in x], [q["value"] for q in y]
            raw.append(1.0 if va == vb else float(scipy_test(va, vb).pvalue))
            assert (int(r["wins"]), int(r["ties"]), int(r["losses"])) == (
                sum(p > q for p, q in zip(va, vb, strict=True)),
                sum(p == q for p, q in zip(va, vb, strict=True)),
                sum(p < q for p, q in zip(va, vb, strict=True)),
            )
        assert [float(r["p_value"]) for r in tested] == pytest.approx(raw, rel=1e-12, abs=1e-300)
        want = multipletests(raw, alpha=0.05, method=correction)[1]
        assert [float(r["p_corrected"]) for r in tested] == pytest.approx(list(want), rel=1e-12, abs=1e-300)
        _check_latex((out_dir / "comparison.tex").read_text(), n_rows=1 + len(runs), n_measures=2)


def _check_latex(tex: str, n_rows: int, n_measures: int) -> None:
    """Well-formed as text: environments closed in order, braces balanced, every row the tabular's width, the
    specials escaped, the significance marker in math mode."""
    envs = re.findall(r"\\(begin|end)\{(\w+)\}", tex)
    stack = []
    for kind, name in envs:
        if kind == "begin":
            stack.append(name)
        else:
            assert stack and stack.pop() == name, envs
    assert not stack and [n for k, n in envs if k == "begin"] == ["table", "tabular"]
    unescaped = re.sub(r"\\[{}]", "", tex)
    assert unescaped.count("{") == unescaped.count("}")
    spec = re.search(r"\\begin\{tabular\}\{([lrc]+)\}", tex).group(1)
    assert spec == "l" + "rr" * n_measures
    body = [line for line in tex.splitlines() if line.endswith("\\\\")]
    assert len(body) == 1 + n_rows and all(line.count(" & ") == len(spec) - 1 for line in body)
    assert re.search(r"(?<!\\)_", tex) is None and "sparse\\_max" in tex and "†" not in tex
    assert re.search(r"\\caption\{.*Holm|Bonferroni", tex) and "\\label{tab:comparison}" in tex
