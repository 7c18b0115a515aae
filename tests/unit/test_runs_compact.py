"""Compact run files: the encoding round trip, the depth per split (fusions included), and old run files."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import write_beir
from stage_world import CORPUS, QRELS, QUERIES, configs
from tiny_models import save_tiny_mlm
from typer.testing import CliRunner

from diffret.retrieval.search.modes import fuse_minmax
from diffret.retrieval.search.runs import doc_order, run_file_bytes, run_table
from diffret.retrieval.search.scoring import TopK
from diffret.schemas import RUN_SCHEMA
from diffret.stages import execute, stages
from diffret.stages.runs import Cell, RetrievalConfig, read_run, search_depth
from diffret.storage import ArtifactStore, Manifest, StoreError
from diffret.storage.layout import RUN_FILE
from diffret.storage.sql import StoreSQL

DOC_IDS = ["7", "007", "d-1", "D-1", "é-ü", "MED-10", "a b", "x" * 60, "10", "9", "2", "1"]


def _top(rng: np.random.Generator, nq: int, nd: int, k: int) -> TopK:
    """A TopK with many tied scores (one decimal) and padding at the end of some rows."""
    index = np.stack([rng.choice(nd, k, replace=False) for _ in range(nq)]).astype(np.int64)
    scores = np.round(rng.random((nq, k)), 1).astype(np.float32)
    index[::3, -5:], scores[::3, -5:] = -1, -np.inf
    return TopK(scores, index)


def test_run_file_round_trip_gives_back_doc_ids_ranks_and_ties_exactly() -> None:
    rng = np.random.default_rng(0)
    doc_ids = DOC_IDS + [f"doc{i:05d}" for i in range(400)]
    query_ids = [f"q{i}" for i in range(40)]
    table = run_table(_top(rng, 40, len(doc_ids), 120), query_ids, doc_ids)
    data = run_file_bytes(table)
    back = pq.read_table(io.BytesIO(data))
    assert back.schema == RUN_SCHEMA and back.equals(table)  # strings, ranks, float32 scores: all the same
    assert set(back.column("doc_id").to_pylist()) <= set(doc_ids)
    for q in query_ids:  # ties stay broken by doc id ascending, ranks 1..n
        rows = back.filter(pc.equal(back.column("query_id"), q)).to_pylist()
        assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
        keys = [(-r["score"], r["doc_id"]) for r in rows]
        assert keys == sorted(keys)
    meta = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema: meta.column(i).encodings for i in range(meta.num_columns)}
    assert "RLE_DICTIONARY" in encodings["doc_id"] and "BYTE_STREAM_SPLIT" in encodings["score"]
    assert "DELTA_BINARY_PACKED" in encodings["rank"]
    # scores as real runs have them (nearly all distinct): smaller than the way runs were written before
    top = TopK(rng.random((40, 400)).astype(np.float32), np.tile(np.arange(400), (40, 1)))
    real = run_table(top, query_ids, doc_ids)
    plain = io.BytesIO()
    pq.write_table(real, plain, compression="zstd", row_group_size=100_000)
    assert len(run_file_bytes(real)) < 0.75 * len(plain.getvalue())
    with pytest.raises(ValueError, match="not a run table: columns"):
        run_file_bytes(pa.table({"query_id": ["q"]}))


def test_depth_keeps_a_prefix_of_the_deeper_run() -> None:
    rng = np.random.default_rng(1)
    top = _top(rng, 12, 80, 60)
    qids, dids = [f"q{i}" for i in range(12)], [f"d{i}" for i in range(80)]
    full = run_table(top, qids, dids, lex=doc_order(dids))
    cut = run_table(top, qids, dids, depth=7)
    assert cut.equals(full.filter(pc.less_equal(full.column("rank"), 7)))
    assert max(pc.value_counts(cut.column("query_id")).field("counts").to_pylist()) == 7
    assert run_table(top, qids, dids, depth=500).equals(full)
    with pytest.raises(ValueError, match="depth must be >= 1"):
        run_table(top, qids, dids, depth=0)


def test_depth_per_split_and_the_search_depth_of_a_pass() -> None:
    cfg = RetrievalConfig(dataset="scifact")
    assert (cfg.depth("train"), cfg.depth("test"), cfg.depth("dev")) == (100, 1000, 1000)
    assert RetrievalConfig(dataset="x", topk=50).depth("train") == 50  # never deeper than topk
    assert RetrievalConfig(dataset="x", train_topk=300).depth("train") == 300
    with pytest.raises(ValueError):
        RetrievalConfig(dataset="x", train_topk=0)
    base = Cell("train", 1, 1, "multi_dense", "s", {"topk": 100})
    fused = Cell("train", 1, 1, "fusion_multi_sparse_max", "s", {"topk": 100, "fusion": {"depth": 1000}})
    assert search_depth([base]) == 100 and search_depth([base, fused]) == 1000
    assert search_depth([base, Cell("test", 1, 1, "sparse_max", "s", {"topk": 1000})]) == 1000


def test_a_fusion_needs_its_inputs_at_fusion_depth() -> None:
    """Why a pass searches to the fusion depth: fusing inputs already cut to the run's depth ranks differently."""
    rng = np.random.default_rng(2)
    a, b = (
        TopK(
            -np.sort(-rng.random((30, 50)), 1).astype(np.float32),
            np.stack([rng.choice(60, 50, replace=False) for _ in range(30)]),
        )
        for _ in range(2)
    )
    deep = fuse_minmax(a, b, 50)
    qids, dids = [f"q{i}" for i in range(30)], [f"d{i}" for i in range(60)]
    cut_after = run_table(deep, qids, dids, depth=10)
    shallow = fuse_minmax(TopK(a.scores[:, :10], a.index[:, :10]), TopK(b.scores[:, :10], b.index[:, :10]), 10)
    assert not run_table(shallow, qids, dids).equals(cut_after)


# ---------------------------------------------------------------------------------- stages on a tiny store


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny store scored on train (depth 4) and test (depth 10), plus the same train runs at depth 10."""
    base = tmp_path_factory.mktemp("compact")
    model = save_tiny_mlm(base / "model")
    beir = write_beir(base / "tiny", CORPUS, QUERIES, QRELS)
    root = str(base / "store")
    cfgs = configs(root, model, beir)
    depth = {"topk": 10, "train_topk": 4}
    cfgs["score"] = cfgs["score"].model_copy(update=depth)
    cfgs["bm25"] = cfgs["bm25"].model_copy(update=depth)
    cfgs["training-data"] = cfgs["training-data"].model_copy(update={"depth": 3})
    for name in ("download", "tokenize", "encode", "score", "bm25", "evaluate", "training-data"):
        execute(stages()[name], cfgs[name], log=lambda _: None)
    deep_root = str(base / "deep")
    shutil.copytree(root, deep_root)
    deep = configs(deep_root, model, beir)
    for name in ("score", "bm25"):
        execute(
            stages()[name],
            deep[name].model_copy(update={"topk": 10, "train_topk": 10, "force": True}),
            log=lambda _: None,
        )
    alone_root = str(base / "train-alone")  # train cells scored in a pass of their own (no deeper test cell)
    shutil.copytree(root, alone_root, ignore=shutil.ignore_patterns("runs", "metrics", "training"))
    alone = configs(alone_root, model, beir)["score"].model_copy(update={**depth, "splits": ["train"]})
    execute(stages()["score"], alone, log=lambda _: None)
    return {"root": root, "deep": deep_root, "alone": alone_root, "configs": cfgs, "model": model}


def _runs(root: str) -> dict[str, pa.Table]:
    store = ArtifactStore(root)
    return {stage: read_run(store, stage) for stage in store.folders("runs/*/*/*/*/*/*")}


def test_train_runs_are_cut_to_their_depth_and_equal_the_deeper_runs_prefix(tiny: dict) -> None:
    shallow, deep = _runs(tiny["root"]), _runs(tiny["deep"])
    assert shallow.keys() == deep.keys() and len(shallow) == 2 * (2 * 2 * 5 - 2) + 2
    modes = set()
    for stage, table in shallow.items():
        counts = pc.value_counts(table.column("query_id")).field("counts").to_pylist()
        m = ArtifactStore(tiny["root"]).require_manifest(stage)
        if "/split=train/" in stage:
            assert m.config["topk"] == 4 and max(counts, default=0) <= 4
            cut = deep[stage].filter(pc.less_equal(deep[stage].column("rank"), 4))
            assert table.equals(cut), stage  # fusions too: they normalise their inputs' top fusion depth
            modes.add(m.config["mode"])
        else:
            assert m.config["topk"] == 10 and table.equals(deep[stage])
            assert max(counts, default=0) <= 10
    assert {"fusion_multi_sparse_max", "fusion_single_sparse_max", "bm25"} <= modes
    # a pass of train cells alone still searches to the fusion depth: the same documents in the same order; the
    # scores equal up to float32's last bits (CPU GEMM kernels may round a product of fewer query rows otherwise),
    # which a fusion's min-max normalisation magnifies where a query's scores lie within a few ulps of each other
    alone = _runs(tiny["alone"])
    assert alone and alone.keys() <= shallow.keys()
    for stage, table in alone.items():
        ids = ("query_id", "doc_id", "rank")
        assert table.select(ids).equals(shallow[stage].select(ids)), stage
        a, b = (t.column("score").to_numpy() for t in (table, shallow[stage]))
        fused = "/mode=fusion_" in stage
        assert np.allclose(a, b, rtol=0 if fused else 4 * np.finfo(np.float32).eps, atol=1e-3 if fused else 0), stage


def test_train_runs_feed_training_groups_and_a_deeper_request_is_refused(tiny: dict) -> None:
    store = ArtifactStore(tiny["root"])
    with StoreSQL(store) as db:
        _, rows = db.query("select query_id, negative_passages from training_groups order by 1")
        _, judged = db.query("select query_id, doc_id from qrels where split = 'train'")
    assert [r[0] for r in rows] == ["q3", "q4"]
    # each group: the BM25 train run's top 3 minus the positives, distinct (no duplicate fills a short group)
    bm25 = next(s for s in store.folders("runs/*/*/*/*/*/*") if "/split=train/" in s and s.endswith("mode=bm25"))
    run = read_run(store, bm25).to_pylist()
    for q, negatives in rows:
        positives = {d for qq, d in judged if qq == q}
        top = [r["doc_id"] for r in sorted((r for r in run if r["query_id"] == q), key=lambda r: r["rank"])][:3]
        ids = [n["docid"] for n in negatives]
        assert len(ids) == len(set(ids)) and sorted(ids) == sorted(d for d in top if d not in positives), q
    cfg = tiny["configs"]["training-data"].model_copy(update={"depth": 5, "name": "deeper"})
    with pytest.raises(StoreError, match="keeps 4 documents per query, fewer than the negatives' depth 5"):
        execute(stages()["training-data"], cfg, log=lambda _: None)


def test_views_and_export_show_doc_ids_as_strings(tiny: dict, tmp_path: Path, monkeypatch) -> None:
    from diffret.flows.cli import app

    store = ArtifactStore(tiny["root"])
    runs = _runs(tiny["root"])
    stage = next(s for s in runs if "/split=test/" in s and s.endswith("mode=bm25"))
    with StoreSQL(store) as db:
        cols, rows = db.query("select typeof(doc_id), count(*) from runs group by 1")
        _, bm25 = db.query(
            "select query_id, doc_id, rank, score from runs where mode = 'bm25' and split = 'test' "
            "order by query_id, rank"
        )
    assert [r[0] for r in rows] == ["VARCHAR"] and rows[0][1] == sum(t.num_rows for t in runs.values())
    assert [tuple(r.values()) for r in runs[stage].to_pylist()] == [(q, d, r, pytest.approx(s)) for q, d, r, s in bm25]
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    out = tmp_path / "bm25.trec"
    system = stage.split("/")[1].split("=", 1)[1]
    res = CliRunner().invoke(
        app, ["export-run", "--system", system, "-d", "tiny", "-o", str(out), "--root", tiny["root"]]
    )
    assert res.exit_code == 0, res.output
    lines = [line.split() for line in out.read_text().splitlines()]
    assert [(x[0], x[2], int(x[3])) for x in lines] == [
        (r["query_id"], r["doc_id"], r["rank"])
        for r in runs[stage].sort_by([("query_id", "ascending"), ("rank", "ascending")]).to_pylist()
    ]


def test_old_run_files_still_read_and_evaluate_the_same(tiny: dict, tmp_path: Path) -> None:
    """A run file written the old way (plain Parquet defaults) reads, evaluates and shows the same; a file of
    another schema is refused with one line."""
    root = tmp_path / "store"
    shutil.copytree(tiny["root"], root)
    store = ArtifactStore(str(root))
    stages_ = [s for s in store.folders("runs/*/*/*/*/*/*") if "/split=test/" in s]
    with StoreSQL(store) as db:
        _, before = db.query("select * from metrics order by all")
    for stage in stages_:  # rewrite every test run as the code before compact runs wrote it
        table, old = read_run(store, stage), store.require_manifest(stage)
        m = Manifest.new("runs", old.partition, old.config, stats=old.stats)
        with store.folder_writer(stage, m) as w:
            w.write_parquet(RUN_FILE, RUN_SCHEMA, [table])
        assert read_run(store, stage).equals(table)
        enc = pq.ParquetFile(str(root / stage / RUN_FILE)).metadata.row_group(0).column(3).encodings
        assert "BYTE_STREAM_SPLIT" not in enc  # really the old layout
    res = execute(
        stages()["evaluate"], tiny["configs"]["evaluate"].model_copy(update={"root": str(root)}), log=lambda _: None
    )
    assert res.done == len(stages_)  # the run files changed: metrics recomputed ...
    with StoreSQL(store) as db:
        _, after = db.query("select * from metrics order by all")
    assert after == before  # ... to the same values
    bad = stages_[0]
    m = Manifest.new("runs", store.require_manifest(bad).partition, store.require_manifest(bad).config)
    ints = pa.schema(
        [
            pa.field("query_id", pa.string()),
            pa.field("doc_id", pa.int32()),
            pa.field("rank", pa.int32()),
            pa.field("score", pa.float32()),
        ]
    )
    with store.folder_writer(bad, m) as w:
        w.write_parquet(
            RUN_FILE, ints, [pa.table({"query_id": ["q0"], "doc_id": [3], "rank": [1], "score": [1.0]}, schema=ints)]
        )
    with pytest.raises(StoreError, match=r"not a run file of this version \(query_id: string, doc_id: int32"):
        read_run(store, bad)
