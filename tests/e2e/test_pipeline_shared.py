"""`diffret run` end to end on ../shared (SciFact mirror, splade-tiny), and the stages it composes.

One pipeline run (a 2 x 2 grid, short texts) is shared by the tests of this module; they check the
leaderboard, the summary files, SQL over runs and metrics, that a re-run does no model work, and the
clear errors and resume behaviour of score and evaluate.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_harness import run, sql
from conftest import SHARED

SPLADE = SHARED / "models" / "splade-tiny-mlm"
DATA = SHARED / "data"
MODES = ["single_dense", "multi_dense", "sparse_max", "fusion_single_sparse_max", "fusion_multi_sparse_max"]

pytestmark = pytest.mark.e2e


GRID = [
    "--kq",
    "1,4",
    "--kp",
    "1,4",
    "--max-length",
    "128",
    "--shard-size",
    "2000",
    "--split",
    "train",
    "--split",
    "test",
]


def pipeline_args(root: Path) -> list[str]:
    return ["run", "--source", str(DATA / "scifact"), "--root", str(root), "--model", str(root.parent / "model"), *GRID]


@pytest.fixture(scope="module")
def pipeline_root(tmp_path_factory) -> Path:
    if not (DATA / "scifact" / "corpus.jsonl").exists() or not (SPLADE / "model.safetensors").exists():
        pytest.skip("../shared/data/scifact or ../shared/models/splade-tiny-mlm is absent")
    root = tmp_path_factory.mktemp("pipeline") / "store"
    shutil.copytree(SPLADE, root.parent / "model")  # a private copy: the re-run test removes its weights
    p = run(*pipeline_args(root))
    (root.parent / "first.out").write_text(p.stdout + "\n---\n" + p.stderr)
    return root


def test_pipeline_writes_every_cell_metrics_and_summary(pipeline_root: Path) -> None:
    out = (pipeline_root.parent / "first.out").read_text()
    assert "best (K_q, K_p) per mode" in out and "bm25" in out
    cells = sql(
        pipeline_root, "select system, kq, kp, mode, queries, ndcg_10 from cells where split = 'test' order by all"
    )
    train = sql(pipeline_root, "select distinct queries from cells where split = 'train' and mode <> 'bm25'")
    assert train == [{"queries": 809}]
    dense = [c for c in cells if c["mode"] != "bm25"]
    assert len(dense) == 2 * 2 * 5 - 2  # multi_dense and its fusion skipped at (1, 1), as the reference does
    assert {(c["kq"], c["kp"]) for c in dense} == {(1, 1), (1, 4), (4, 1), (4, 4)}
    assert {c["mode"] for c in dense} == set(MODES)
    assert all(c["queries"] == 300 for c in cells)  # every judged test query, with or without results
    bm25 = [c for c in cells if c["mode"] == "bm25"]
    assert len(bm25) == 1 and 0.670 <= bm25[0]["ndcg_10"] <= 0.685  # pyserini BM25-flat: 0.679
    folder = next((pipeline_root / "summaries").rglob("summary.md")).parent
    for mode in MODES:
        png = (folder / f"heatmap_{mode}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"heatmap_{mode}.png" in (folder / "summary.md").read_text()
    board = (folder / "leaderboard.csv").read_text().splitlines()
    assert len(board) == 1 + 5 + 1  # header, best cell per mode, BM25


def test_sql_best_cell_per_mode_matches_the_leaderboard(pipeline_root: Path) -> None:
    best = sql(
        pipeline_root,
        "select mode, kq, kp, ndcg_10 from best_cells where split = 'test' and mode <> 'bm25' order by mode",
    )
    assert [b["mode"] for b in best] == sorted(MODES)
    folder = next((pipeline_root / "summaries").rglob("leaderboard.csv")).parent
    rows = [line.split(",") for line in (folder / "leaderboard.csv").read_text().splitlines()[1:]]
    board = {r[1]: (int(r[2]), int(r[3]), float(r[4])) for r in rows}
    for b in best:
        assert board[b["mode"]] == (b["kq"], b["kp"], pytest.approx(b["ndcg_10"]))
    # the same number from the raw per-query metrics
    raw = sql(
        pipeline_root,
        f"select avg(value) v from metrics where mode = '{best[0]['mode']}' and kq = {best[0]['kq']} "
        f"and kp = {best[0]['kp']} and measure = 'ndcg_cut_10' and split = 'test' and system not like 'bm25%'",
    )
    assert raw[0]["v"] == pytest.approx(best[0]["ndcg_10"])


def test_rerun_does_no_model_work(pipeline_root: Path) -> None:
    runs = sorted((pipeline_root / "runs").rglob("run.parquet"))
    before = {p: p.stat().st_mtime_ns for p in runs}
    # without the weights, any attempt to load the model fails the command (the tokenizer stays)
    weights = pipeline_root.parent / "model" / "model.safetensors"
    weights.rename(weights.with_suffix(".away"))
    try:
        p = run(*pipeline_args(pipeline_root))
    finally:
        weights.with_suffix(".away").rename(weights)
    text = p.stdout + p.stderr
    assert "0 shard(s) encoded" in text and "0 cell(s) scored" in text and "0 run(s) evaluated" in text
    assert {q: q.stat().st_mtime_ns for q in runs} == before


def test_export_run_writes_a_trec_file(pipeline_root: Path, tmp_path: Path) -> None:
    from diffret.retrieval.evaluation import read_trec_run

    system = sql(pipeline_root, "select distinct system from runs where mode = 'multi_dense'")[0]["system"]
    out = tmp_path / "run.trec"
    run(
        "export-run",
        "--root",
        str(pipeline_root),
        "--system",
        system,
        "-d",
        "scifact",
        "--kq",
        "4",
        "--kp",
        "1",
        "--mode",
        "multi_dense",
        "-o",
        str(out),
    )
    lines = out.read_text().splitlines()
    assert lines[0].split()[1] == "Q0" and lines[0].split()[3] == "1"
    stored = sql(
        pipeline_root,
        f"select count(*) n from runs where system = '{system}' and kq = 4 and kp = 1 and mode = 'multi_dense' "
        "and split = 'test'",
    )[0]["n"]
    assert len(lines) == stored and sum(len(v) for v in read_trec_run(out).values()) == stored


def test_score_errors_and_resume(pipeline_root: Path) -> None:
    system = sql(pipeline_root, "select distinct system from runs where mode = 'multi_dense'")[0]["system"]
    base = ["score", "--root", str(pipeline_root), "-d", "scifact", "--system", system, "--kq", "1", "--kp", "1"]
    # K_p that was never encoded
    p = run(*base[:-2], "--kp", "2", check=False)
    assert p.returncode == 2 and "run `diffret encode`" in p.stderr and "k=2" in p.stderr
    # an unknown split
    p = run(*base, "--split", "dev", check=False)
    assert p.returncode == 2 and "no split 'dev'" in p.stderr and "test" in p.stderr
    # config drift: another topk for cells already scored names the field
    p = run(*base, "--topk", "10", check=False)
    assert p.returncode == 2 and "topk" in p.stderr and "1000" in p.stderr
    # a damaged run file is detected and that cell alone is redone
    runfile = next(
        pipeline_root.glob(f"runs/system={system}/dataset=scifact/split=test/kq=1/kp=1/mode=sparse_max/run.parquet")
    )
    original = runfile.read_bytes()
    runfile.write_bytes(original[:-10] + b"0123456789")
    p = run(*base)
    assert "1 cell(s) scored, 2 already done" in p.stderr
    assert runfile.read_bytes() == original  # scoring is deterministic: the redone run is byte-identical
    # so its metrics stay valid; a damaged metrics file is recomputed, alone
    metrics = Path(str(runfile.parent).replace("/runs/", "/metrics/")) / "per_query.parquet"
    good = metrics.read_bytes()
    metrics.write_bytes(good[:-10] + b"0123456789")
    p = run("evaluate", "--root", str(pipeline_root))
    assert "1 run(s) evaluated, 37 already done" in p.stderr
    assert metrics.read_bytes() != good[:-10] + b"0123456789"


@pytest.mark.skipif(not (DATA / "nfcorpus" / "corpus.jsonl").exists(), reason="../shared/data/nfcorpus is absent")
def test_bm25_nfcorpus(tmp_path: Path) -> None:
    root = tmp_path / "store"
    run("download", "nfcorpus", "--source", str(DATA / "nfcorpus"), "--root", str(root))
    run("bm25", "-d", "nfcorpus", "--root", str(root))
    run("evaluate", "--root", str(root))
    cells = sql(root, "select ndcg_10, queries from cells where mode = 'bm25'")
    assert cells[0]["queries"] == 323
    assert 0.315 <= cells[0]["ndcg_10"] <= 0.330  # pyserini BM25-flat: 0.322
    # a shard at a time (memory of one shard's index): every rank's score bit for bit; the same documents
    # above each query's cut-off score (bm25s picks among those tied at it arbitrarily; the shards, in corpus order)
    import pyarrow.parquet as pq

    (runfile,) = (root / "runs").rglob("run.parquet")
    whole = pq.read_table(runfile).to_pylist()
    p = run("bm25", "-d", "nfcorpus", "--shard-size", "1000", "--force", "--root", str(root))
    assert "in 4 shards of 1,000" in p.stderr + p.stdout
    shards = pq.read_table(runfile).to_pylist()
    key = [(r["query_id"], r["rank"], r["score"]) for r in whole]
    assert [(r["query_id"], r["rank"], r["score"]) for r in shards] == key
    for qid in {r["query_id"] for r in whole}:
        a, b = ([r for r in rows if r["query_id"] == qid] for rows in (whole, shards))
        cut = a[-1]["score"]
        assert {r["doc_id"] for r in a if r["score"] > cut} == {r["doc_id"] for r in b if r["score"] > cut}
    run("evaluate", "--root", str(root))
    again = sql(root, "select ndcg_10 from cells where mode = 'bm25'")
    assert abs(again[0]["ndcg_10"] - cells[0]["ndcg_10"]) < 1e-3  # only ties at the 1,000th rank differ


def test_report_on_the_scifact_run(pipeline_root: Path, tmp_path: Path) -> None:
    """Every item of the report, PNGs that open, and numbers equal to `diffret sql` over the same views."""
    out = tmp_path / "report"
    run("report", "--root", str(pipeline_root), "--out", str(out), "--n-boot", "200")
    text = (out / "report.md").read_text()
    for title in (
        "Budget selection",
        "Landscapes",
        "Per-query oracle",
        "Feature correlation",
        "Paper tables",
        "Footprint",
    ):
        assert f"## {title}" in text, title
    sel = sql(pipeline_root, "select * from budget_selection")
    assert len(sel) == 1 and sel[0]["train_on"] == "scifact"
    assert f"| {sel[0]['kq_star']} | {sel[0]['kp_star']} | {sel[0]['train_ndcg_10']:.4f} |" in text
    orc = sql(pipeline_root, "select * from oracle where mode = 'fusion_multi_sparse_max'")[0]
    assert orc["joint"] >= orc["kq_oracle"] >= orc["fixed"] and orc["joint"] >= orc["kp_oracle"] >= orc["fixed"]
    assert f"{orc['fixed']:.4f} | {orc['kq_oracle']:.4f} | {orc['kp_oracle']:.4f} | {orc['joint']:.4f}" in text
    peaks = sql(pipeline_root, "select count(*) n from query_peaks where mode = 'multi_dense'")[0]["n"]
    assert peaks == 300
    import matplotlib.image as mpimg

    pngs = sorted(out.glob("*.png"))
    assert len([p for p in pngs if p.name.startswith("landscape_")]) == 5  # one dataset: one landscape per mode
    for p in pngs:
        assert mpimg.imread(p).ndim == 3  # opens as an image
    table = (out / "paper_table.csv").read_text().splitlines()
    assert table[0].startswith("system,setting,kq,kp,scifact:D") and any(line.startswith("bm25-") for line in table)
    stored = next((pipeline_root / "reports").rglob("report.md"))
    assert stored.read_text() == text


def test_index_recall_against_exact_and_resume(pipeline_root: Path) -> None:
    system = sql(pipeline_root, "select distinct system from runs where mode = 'multi_dense'")[0]["system"]
    args = ["index", "--root", str(pipeline_root), "-d", "scifact", "--system", system, "--kq", "1,4", "--kp", "4"]
    p = run(*args, "--type", "IVF_PQ")
    assert "1 index(es) built" in p.stderr
    manifest = json.loads(next((pipeline_root / "index").rglob("_manifest.json")).read_text())
    checks = manifest["stats"]["check"]
    assert set(checks) == {"1", "4"}
    for c in checks.values():
        assert c["recall_10"] >= 0.99 and c["queries"] == 300 and c["latency_ms_mean"] > 0
    assert "| 4 | 1 |" in p.stdout  # the recall table is printed
    assert "0 index(es) built, 1 already done" in run(*args, "--type", "IVF_PQ").stderr


def test_adaptive_budgets_on_the_scifact_grid(pipeline_root: Path, tmp_path: Path) -> None:
    """`diffret budget` from the stored 2 x 2 grid (train + test): runs per selector that evaluate and SQL treat like
    any run, the fixed selector equal to the train-selected cell on test, the report's table."""
    system = sql(pipeline_root, "select distinct system from runs where mode = 'multi_dense'")[0]["system"]
    args = [
        "budget",
        "--root",
        str(pipeline_root),
        "-d",
        "scifact",
        "--system",
        system,
        "--selector",
        "fixed",
        "--selector",
        "rule",
    ]
    p = run(*args)
    assert "adaptive runs: 2" in p.stdout + p.stderr
    run("evaluate", "--root", str(pipeline_root))
    got = {
        r["selector"]: r
        for r in sql(
            pipeline_root,
            "select a.selector, a.fixed_kq, a.fixed_kp, c.ndcg_10 from "
            "adaptive_runs a join cells c using (system, dataset, split, mode) where "
            "a.split = 'test'",
        )
    }
    assert set(got) == {"fixed", "rule"}
    fixed = got["fixed"]
    cell = sql(
        pipeline_root,
        f"select ndcg_10 from cells where system = '{system}' and split = 'test' and mode = "
        f"'multi_dense' and kq = {fixed['fixed_kq']} and kp = {fixed['fixed_kp']}",
    )
    assert fixed["ndcg_10"] == pytest.approx(cell[0]["ndcg_10"])
    again = run(*args)
    assert "0 run(s) chosen, " in again.stdout + again.stderr  # a re-run does nothing
    out = tmp_path / "report"
    run("report", "--root", str(pipeline_root), "--name", "adaptive", "--out", str(out), "--n-boot", "50")
    assert "## Adaptive budgets" in (out / "report.md").read_text()
    assert len((out / "adaptive_budgets.csv").read_text().splitlines()) == 3
