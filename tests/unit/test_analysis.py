"""The analyses on small synthetic per-query metric tables with known answers (SQL views + Python).

A store is filled with metrics folders (as the evaluate stage writes them), a query tokens folder and an
encodings manifest naming it; the views of queries/40_analysis.sql and retrieval/analysis/ must give
the answers built into the data.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from scipy import stats

from diffret.retrieval.analysis.correlation import rank_correlation
from diffret.retrieval.analysis.footprint import footprint_projection
from diffret.retrieval.analysis.report import build_report
from diffret.retrieval.analysis.tables import paper_table
from diffret.retrieval.analysis.views import rows
from diffret.schemas import METRICS_SCHEMA
from diffret.stages import execute
from diffret.stages.report import ReportConfig
from diffret.stages.report import stage as report_stage
from diffret.storage import ArtifactStore, Manifest
from diffret.storage.layout import METRICS_FILE, TOKENS_SCHEMA, encodings_dir, metrics_dir, tokens_dir
from diffret.storage.sql import StoreSQL

GRID = (1, 2, 4)
MODEL = "toy-diffretriever-0123456789"
BM25 = "bm25-abcdef0123"
H, D, S = "fusion_multi_sparse_max", "multi_dense", "sparse_max"


def put_metrics(store: ArtifactStore, system, dataset, split, kq, kp, mode, values: dict[str, float]) -> None:
    folder = metrics_dir(system, dataset, split, kq, kp, mode)
    qids = sorted(values)
    table = pa.table(
        {"query_id": qids, "measure": ["ndcg_cut_10"] * len(qids), "value": [float(values[q]) for q in qids]},
        schema=METRICS_SCHEMA,
    )
    part = {"system": system, "dataset": dataset, "split": split, "kq": str(kq), "kp": str(kp), "mode": mode}
    with store.folder_writer(folder, Manifest.new("metrics", part, {"synthetic": True})) as w:
        w.write_parquet(METRICS_FILE, METRICS_SCHEMA, [table])


def put_query_tokens(store: ArtifactStore, dataset: str, tokens: dict[str, list[int]]) -> None:
    folder = tokens_dir("toktok", dataset, "query")
    ids = sorted(tokens)
    table = pa.table(
        {
            "id": ids,
            "token_ids": [tokens[i] for i in ids],
            "n_tokens": [len(tokens[i]) for i in ids],
            "truncated": [False] * len(ids),
            "text": [" ".join(["w"] * len(tokens[i])) for i in ids],
        },
        schema=TOKENS_SCHEMA,
    )
    with store.folder_writer(folder, Manifest.new("tokens", {"dataset": dataset}, {"synthetic": True})) as w:
        w.write_parquet("shard=00000.parquet", TOKENS_SCHEMA, [table])
    enc = encodings_dir(MODEL, dataset, "query", 1)
    store.write_manifest(enc, Manifest.new("encodings", {"system": MODEL, "dataset": dataset}, {"tokens": "toktok"}))


# Test queries t0..t5: query i has i + 1 distinct tokens, and its best K_q (at K_p* = 4) is GRID[i // 2]:
# the peak K_q rises with length.
TEST_Q = [f"t{i}" for i in range(6)]


def grid_value(q: str, kq: int, kp: int, mode: str) -> float:
    i = int(q[1:])
    peak = GRID[i // 2]
    base = {D: 0.5, S: 0.45, H: 0.6}[mode]
    return base - 0.1 * abs(np.log2(kq) - np.log2(peak)) - 0.05 * (kp != 4) + 0.01 * i


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    st = ArtifactStore(tmp_path / "store")
    for kq, kp in itertools.product(GRID, GRID):
        # train: H is best at (2, 4)
        train = {f"r{i}": 0.5 - 0.1 * abs(kq - 2) - 0.1 * abs(kp - 4) + 0.01 * i for i in range(4)}
        put_metrics(st, MODEL, "toy", "train", kq, kp, H, train)
        for mode in (D, S, H):
            put_metrics(st, MODEL, "toy", "test", kq, kp, mode, {q: grid_value(q, kq, kp, mode) for q in TEST_Q})
    put_metrics(st, BM25, "toy", "test", 0, 0, "bm25", {q: 0.2 + 0.001 * int(q[1:]) for q in TEST_Q})
    put_query_tokens(st, "toy", {q: list(range(int(q[1:]) + 1)) for q in TEST_Q})
    return st


def test_budget_selection_on_train_applied_to_test(store: ArtifactStore) -> None:
    with StoreSQL(store) as db:
        sel = rows(db, "select * from budget_selection")
        assert len(sel) == 1 and (sel[0]["kq_star"], sel[0]["kp_star"]) == (2, 4)
        assert sel[0]["train_ndcg_10"] == pytest.approx(0.5 + 0.01 * 1.5)
        assert sel[0]["train_on"] == "toy"
        test = rows(db, "select * from selected_cells where mode = ?", [H])
        assert [(r["split"], r["kq"], r["kp"]) for r in test] == [("test", 2, 4)]
        assert test[0]["ndcg_10"] == pytest.approx(np.mean([grid_value(q, 2, 4, H) for q in TEST_Q]))


def test_oracle_known_values_and_ordering(store: ArtifactStore) -> None:
    with StoreSQL(store) as db:
        orc = {r["mode"]: r for r in rows(db, "select * from oracle where split = 'test'")}
    for mode in (D, S, H):
        r = orc[mode]
        assert r["queries"] == 6
        fixed = np.mean([grid_value(q, 2, 4, mode) for q in TEST_Q])
        kq_best = np.mean([max(grid_value(q, k, 4, mode) for k in GRID) for q in TEST_Q])
        kp_best = np.mean([max(grid_value(q, 2, p, mode) for p in GRID) for q in TEST_Q])
        joint = np.mean([max(grid_value(q, k, p, mode) for k in GRID for p in GRID) for q in TEST_Q])
        assert (r["fixed"], r["kq_oracle"], r["kp_oracle"], r["joint"]) == pytest.approx(
            (fixed, kq_best, kp_best, joint)
        )
        assert r["joint"] >= r["kq_oracle"] >= r["fixed"] and r["joint"] >= r["kp_oracle"] >= r["fixed"]
        assert r["kq_oracle"] > r["fixed"]  # the peaks differ per query, so the K_q oracle gains


def test_query_peaks_features_and_correlation(store: ArtifactStore) -> None:
    with StoreSQL(store) as db:
        peaks = rows(db, "select * from query_peaks where mode = ? order by query_id", [D])
    assert [p["peak_kq"] for p in peaks] == [1, 1, 2, 2, 4, 4]
    assert [p["length"] for p in peaks] == [1, 2, 3, 4, 5, 6]
    # i + 1 distinct tokens, each once: entropy log2(i + 1) bits
    assert [p["entropy"] for p in peaks] == pytest.approx([np.log2(i + 1) for i in range(6)])
    c = rank_correlation([p["length"] for p in peaks], [p["peak_kq"] for p in peaks], n_boot=200)
    assert c.n == 6
    assert c.spearman == pytest.approx(stats.spearmanr([1, 2, 3, 4, 5, 6], [1, 1, 2, 2, 4, 4]).statistic)
    assert c.kendall == pytest.approx(stats.kendalltau([1, 2, 3, 4, 5, 6], [1, 1, 2, 2, 4, 4]).statistic)
    assert c.spearman_ci[0] <= c.spearman <= c.spearman_ci[1] <= 1.0


def test_rank_correlation_known_values_and_constant_input() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=200)
    c = rank_correlation(x.tolist(), (-x).tolist(), n_boot=100)
    assert c.spearman == pytest.approx(-1.0) and c.kendall == pytest.approx(-1.0)
    assert c.spearman_ci == pytest.approx((-1.0, -1.0))
    noise = rank_correlation(x.tolist(), rng.normal(size=200).tolist(), n_boot=300)
    assert noise.spearman_ci[0] < 0 < noise.spearman_ci[1]  # independent: the CI covers 0
    assert np.isnan(rank_correlation([1, 2, 3], [4, 4, 4]).spearman)


def test_paper_table_markers_and_best(store: ArtifactStore) -> None:
    # a second system, equal to BM25 on every query but one: not significant
    for kq, kp in itertools.product(GRID, GRID):
        put_metrics(store, "same-as-bm25-0000000000", "toy", "train", kq, kp, H, {"r0": 0.1 * kq})
    for mode in (D, S, H):
        vals = {q: 0.2 + 0.001 * int(q[1:]) for q in TEST_Q}
        vals["t0"] += 0.01
        put_metrics(store, "same-as-bm25-0000000000", "toy", "test", 4, 1, mode, vals)
    with StoreSQL(store) as db:
        t = paper_table(db, [BM25])
    assert list(t.rows)[0] == BM25  # BM25 first
    assert t.budgets[MODEL] == (2, 4) and t.budgets["same-as-bm25-0000000000"] == (4, 1)
    assert t.rows[BM25][("toy", "S")].value == pytest.approx(0.2025)
    assert ("toy", "D") not in t.rows[BM25]
    for col in ("D", "S", "H"):
        good = t.rows[MODEL][("toy", col)]
        assert good.markers == "†" and good.best  # far above BM25 on every query
        assert t.rows["same-as-bm25-0000000000"][("toy", col)].markers == ""
        assert t.rows[MODEL][("avg", col)].value == pytest.approx(good.value)  # one dataset: avg = it
    md = t.markdown()
    assert "**0." in md and "†" in md and "p < 0.05 (two-sided) against `bm25-abcdef0123`" in md
    assert f"| {BM25} | – |" in md and f"| {MODEL} | 2, 4 |" in md  # BM25 has no (K_q, K_p) budget
    with StoreSQL(store) as db, pytest.raises(ValueError, match="reference system"):
        paper_table(db, ["nope"])


def test_paper_table_puts_a_finetuned_system_at_its_bases_budget(store: ArtifactStore) -> None:
    ft = "model-ft-0000000000"
    for kq, kp in itertools.product(GRID, GRID):  # its own train split would select (4, 1)
        put_metrics(store, ft, "toy", "train", kq, kp, H, {"r0": 1.0 if (kq, kp) == (4, 1) else 0.1})
    for (kq, kp), v in (((2, 4), 0.6), ((4, 1), 0.9)):
        for mode in (D, S, H):
            put_metrics(store, ft, "toy", "test", kq, kp, mode, dict.fromkeys(TEST_Q, v))
    with StoreSQL(store) as db:
        plain = paper_table(db, [BM25])
        t = paper_table(db, [BM25], finetuned={MODEL: ft})
    assert plain.budgets[ft] == (4, 1) and not plain.settings
    assert t.budgets[ft] == t.budgets[MODEL] == (2, 4)
    assert t.rows[ft][("toy", "D")].value == pytest.approx(0.6)
    assert list(t.rows) == [BM25, MODEL, ft]  # zero-shot half, then the fine-tuned one
    md = t.markdown()
    assert f"| {MODEL} | zero-shot | 2, 4 |" in md and f"| {ft} | fine-tuned from {MODEL} | 2, 4 |" in md
    assert t.csv_rows()[0][:4] == ["system", "setting", "kq", "kp"]


def test_footprint_projection_reproduces_the_papers_order_of_magnitude() -> None:
    p = footprint_projection(hidden=3584, backbones=4, settings=2)
    expected_dense = (8_841_823 + 6980 + 43 + 54) * 31 * 3584 * 2
    assert p["dense_bytes_per_setting"] == expected_dense
    assert 10 <= p["total_tb"] <= 30  # the paper: ~20 TB
    assert footprint_projection(hidden=3584, bytes_per_value=4)["total_tb"] == pytest.approx(
        2 * p["dense_bytes_per_setting"] * 8 / 1e12 + p["sparse_bytes_per_setting"] * 8 / 1e12
    )


def test_report_writes_every_section(store: ArtifactStore, tmp_path: Path) -> None:
    res = execute(report_stage, ReportConfig(root=store.root, name="toy", n_boot=50, out_dir=str(tmp_path / "copy")))
    folder = Path(res.details["folder"])
    text = (folder / "report.md").read_text()
    for title in (
        "Budget selection",
        "Landscapes",
        "Per-query oracle",
        "Feature correlation",
        "Paper tables",
        "Footprint",
    ):
        assert f"## {title}" in text
    pngs = sorted(folder.glob("*.png"))
    assert any(p.name.startswith("landscape_") for p in pngs) and (folder / "oracle.png").exists()
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    assert (tmp_path / "copy" / "report.md").read_text() == text
    for name in ("budget_selection.csv", "oracle.csv", "feature_correlation.csv", "paper_table.csv", "footprint.csv"):
        assert (folder / name).stat().st_size > 0
    # the numbers in the report are the views' numbers
    with StoreSQL(store) as db:
        fixed = rows(db, "select fixed from oracle where mode = ?", [H])[0]["fixed"]
    assert f"{fixed:.4f}" in text


@pytest.mark.prefect
def test_report_flow_publishes_markdown_artifacts(store: ArtifactStore) -> None:
    """Run as a Prefect flow (a temporary server), the report publishes one markdown artifact per section."""
    from prefect.client.orchestration import get_client
    from prefect.testing.utilities import prefect_test_harness

    from diffret.flows.stage_flows import report_flow
    from diffret.stages.report import ReportConfig

    with prefect_test_harness(server_startup_timeout=120):
        res = report_flow(ReportConfig(root=store.root, name="toy", n_boot=50))
        with get_client(sync_client=True) as client:
            arts = client.read_artifacts()
    keys = {a.key for a in arts}
    assert {"report-toy-budget-selection", "report-toy-per-query-oracle", "report-toy-footprint"} <= keys
    oracle = next(a for a in arts if a.key == "report-toy-per-query-oracle")
    # figures embedded (a browser cannot read the server's files), not linked into the store
    assert "![oracle](data:image/png;base64,iVBORw0KGgo" in oracle.data and res["details"]["folder"] not in oracle.data
    assert oracle.type == "markdown"


def test_average_landscape_and_finetuned_column(store: ArtifactStore) -> None:
    # a second test dataset (every cell 0.1 higher) and a fine-tuned model at the selected budget
    for kq, kp in itertools.product(GRID, GRID):
        for mode in (D, S, H):
            put_metrics(
                store, MODEL, "toy2", "test", kq, kp, mode, {q: grid_value(q, kq, kp, mode) + 0.1 for q in TEST_Q}
            )
    put_metrics(store, "toy-finetuned-0000000000", "toy", "test", 2, 4, H, {q: 0.9 for q in TEST_Q})
    with StoreSQL(store) as db:
        rep = build_report(db, name="toy", finetuned={MODEL: "toy-finetuned-0000000000"}, n_boot=50)
    avg = [n for n in rep.files if n.startswith(f"landscape_{MODEL}_avg_")]
    assert len(avg) == 3  # one per mode present (D, S, H)
    landscapes = next(body for title, body in rep.sections if title == "Landscapes")
    mean_best = np.mean([grid_value(q, 2, 4, H) for q in TEST_Q]) + 0.05  # the average of toy and toy2
    assert f"{MODEL} / avg / {H}: best (2, 4) = {mean_best:.4f}" in landscapes
    orc = next(body for title, body in rep.sections if title == "Per-query oracle")
    row = next(line for line in orc.splitlines() if f"| {MODEL} | toy | test | {H} |" in line)
    assert row.split("|")[9].strip() == "0.9000"  # the finetuned column
    tables = next(body for title, body in rep.sections if title.startswith("Paper tables"))
    assert "toy2 H" in tables and "avg H" in tables
