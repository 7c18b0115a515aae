"""One copy of each vector (docs/scale.md, "Footprint at H = 3,584"): `index` holds no more than the store's
precision (a float16 system's LanceDB table in float16, a residual:B system's codes index with no vector at all),
builds the operating point's K_p by default, and `score --search codes` searches a compressed system over its codes;
on synthetic stores (tests/synthetic_store.py), the kill-and-resume case at Dream-7B's width H = 3,584."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import synthetic_store

from diffret.stages import execute, stages
from diffret.stages.compress import CompressConfig
from diffret.stages.evaluate import EvaluateConfig
from diffret.stages.index import IndexConfig
from diffret.stages.score import ScoreConfig
from diffret.stages.summary import SummaryConfig
from diffret.stages.systems import SystemRef
from diffret.storage import ArtifactStore, ConfigDriftError, IncompleteArtifactError, StoreError
from diffret.storage.layout import CODES_INDEX_FILE, encodings_dir, index_dir, run_dir

KP = [1, 4]


def _run(name: str, config, log=None):  # noqa: ANN001, ANN202
    return execute(stages()[name], config, log=log or (lambda _: None))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("one-copy")
    syn = synthetic_store.build(base, 300, 64, KP, [4], n_queries=24, shard_size=100, train=True)
    comp = _run(
        "compress",
        CompressConfig(root=syn.root, dataset="synth", system=SystemRef(system=syn.system), store="residual:2"),
    ).system
    return {"base": base, "syn": syn, "f16": syn.system, "r2": comp}


def _copy(world: dict, tmp_path: Path) -> str:
    root = tmp_path / "store"
    shutil.copytree(world["syn"].root, root)
    return str(root)


def _bytes(folder: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.rglob(pattern) if p.is_file())


def test_a_float16_system_is_indexed_in_float16_and_no_float32_copy_is_made(world: dict, tmp_path: Path) -> None:
    root = _copy(world, tmp_path)
    logs: list[str] = []
    res = _run(
        "index",
        IndexConfig(root=root, dataset="synth", system=SystemRef(system=world["f16"]), index_type="none"),
        logs.append,
    )
    assert res.done == 2 and any("no operating point selected" in x and "every stored K_p = 1, 4" in x for x in logs)
    folder = Path(root) / index_dir(world["f16"], "synth", 4)
    schema = lancedb.connect(str(folder)).open_table("docs").schema
    assert schema.field("vector").type.value_type.value_type == pa.float16()
    table = _bytes(folder, "*.lance")
    dense = _bytes(Path(root) / encodings_dir(world["f16"], "synth", "passage", 4), "shard=*.parquet")
    vectors = 300 * 4 * 64 * 2  # float16 bytes of the passages' vectors
    assert vectors <= table < 1.2 * vectors and table < 1.2 * dense, (table, dense)
    # the earlier float32 table is an option: twice the bytes (what the default no longer makes)
    with pytest.raises(ConfigDriftError, match="vectors"):
        _run(
            "index",
            IndexConfig(
                root=root,
                dataset="synth",
                system=SystemRef(system=world["f16"]),
                kp=[4],
                index_type="none",
                vectors="float32",
            ),
        )
    _run(
        "index",
        IndexConfig(
            root=root,
            dataset="synth",
            system=SystemRef(system=world["f16"]),
            kp=[4],
            index_type="none",
            vectors="float32",
            force=True,
        ),
    )
    assert (
        lancedb.connect(str(folder)).open_table("docs").schema.field("vector").type.value_type.value_type
        == pa.float32()
    )
    assert _bytes(folder, "*.lance") > 1.8 * vectors


def test_recall_on_a_corpus_smaller_than_k_is_1_when_every_passage_is_found(tmp_path: Path) -> None:
    """50 passages, a flat index (exact search): recall@100 counts the 50 there are, not 100."""
    syn = synthetic_store.build(tmp_path, 50, 32, [1], [1], n_queries=4, shard_size=50)
    logs: list[str] = []
    res = _run(
        "index",
        IndexConfig(root=syn.root, dataset="synth", system=SystemRef(system=syn.system), kp=[1], index_type="none"),
        logs.append,
    )
    check = res.details["checks"][1]
    assert {kq: (c["recall_10"], c["recall_100"]) for kq, c in check.items()} == {"1": (1.0, 1.0)}, check
    stats = json.loads((Path(syn.root) / index_dir(syn.system, "synth", 1) / "_manifest.json").read_text())["stats"]
    assert stats["check"]["1"]["recall_100"] == 1.0


def test_the_index_builds_the_operating_point_s_kp_and_says_why(world: dict, tmp_path: Path) -> None:
    root = _copy(world, tmp_path)
    ref = SystemRef(system=world["f16"])
    # a summary of the test split: its best hybrid cell's K_p
    _run("score", ScoreConfig(root=root, dataset="synth", system=ref, kq=[4], kp=KP, splits=["test", "train"]))
    _run("evaluate", EvaluateConfig(root=root))
    _run("summary", SummaryConfig(root=root, dataset="synth", system=world["f16"], bm25="none"))
    logs: list[str] = []
    res = _run("index", IndexConfig(root=root, dataset="synth", system=ref, index_type="none"), logs.append)
    line = next(x for x in logs if x.startswith("index: K_p = "))
    assert res.done == 1 and "budget_selection" in line  # the train split's selection comes first
    store = ArtifactStore(root)
    from diffret.retrieval.analysis.views import rows
    from diffret.storage.sql import StoreSQL

    with StoreSQL(store) as db:
        kp = rows(db, "select kp_star from budget_selection where system = ?", [world["f16"]])[0]["kp_star"]
    assert store.exists(index_dir(world["f16"], "synth", kp)) and not store.exists(
        index_dir(world["f16"], "synth", 5 - kp)
    )
    # without the train split's metrics, the summary's best cell; a compressed system reads its float16 system's
    shutil.rmtree(Path(root) / "metrics" / f"system={world['f16']}" / "dataset=synth" / "split=train")
    logs.clear()
    _run("index", IndexConfig(root=root, dataset="synth", system=SystemRef(system=world["r2"])), logs.append)
    line = next(x for x in logs if x.startswith("index: K_p = "))
    assert "summary of synth/test" in line and world["f16"] in line
    assert len(store.folders(f"index/system={world['r2']}/*/*")) == 1
    # a selected K_p that is not encoded is refused, naming what to do
    shutil.rmtree(Path(root) / encodings_dir(world["r2"], "synth", "passage", int(line.split()[3].rstrip(","))))
    with pytest.raises(IncompleteArtifactError, match="give --kp"):
        _run("index", IndexConfig(root=root, dataset="synth", system=SystemRef(system=world["r2"])))


def test_a_residual_system_is_indexed_by_its_codes_and_searched_over_them(world: dict, tmp_path: Path) -> None:
    root = _copy(world, tmp_path)
    r2 = SystemRef(system=world["r2"])
    res = _run("index", IndexConfig(root=root, dataset="synth", system=r2, kp=[4]))
    folder = Path(root) / index_dir(world["r2"], "synth", 4)
    assert sorted(p.name for p in folder.iterdir()) == ["_manifest.json", CODES_INDEX_FILE]  # no vector copy
    codes = _bytes(Path(root) / encodings_dir(world["r2"], "synth", "passage", 4), "shard=*.parquet")
    ivf = (folder / CODES_INDEX_FILE).stat().st_size
    assert ivf < 4 * 300 * 4 + 4096 and ivf < codes / 4, (ivf, codes)
    check = res.details["checks"][4]["4"]
    assert check["recall_10"] > 0 and check["exact_ms_per_query"] > 0 and check["search"]["probes"] == 2
    # score --search codes: every cell probed and every passage a candidate gives the exact runs of the codes
    _run("score", ScoreConfig(root=root, dataset="synth", system=r2, kq=[4], kp=[4], modes=["multi_dense"]))
    stage = run_dir(world["r2"], "synth", "test", 4, 4, "multi_dense")
    store = ArtifactStore(root)
    exact = store.read_table(stage, "run.parquet")
    n_cells = res.details["checks"][4]["4"]["search"]
    logs: list[str] = []
    cfg = ScoreConfig(
        root=root, dataset="synth", system=r2, kq=[4], kp=[4], search="codes", probes=10_000, candidates=300, force=True
    )
    _run("score", cfg, logs.append)
    assert any("scores multi_dense only" in x for x in logs), n_cells
    codes_run = store.read_table(stage, "run.parquet")
    assert codes_run.column("doc_id").equals(exact.column("doc_id"))
    np.testing.assert_allclose(codes_run.column("score").to_numpy(), exact.column("score").to_numpy(), atol=1e-5)
    m = store.read_manifest(stage)
    assert (
        m.config["search"] == {"engine": "codes", "probes": 10_000, "candidates": 300} and "index" in m.config["inputs"]
    )
    assert not store.exists(run_dir(world["r2"], "synth", "test", 4, 4, "single_dense"))
    # fewer candidates: at most that many documents a query
    _run("score", cfg.model_copy(update={"candidates": 20, "probes": 4}))
    per_query = pq.read_table(Path(root) / stage / "run.parquet").group_by("query_id").aggregate([("rank", "max")])
    assert max(per_query.column("rank_max").to_pylist()) <= 20
    # verify covers the codes index: a flipped byte is named with the command that rebuilds it
    assert store.verify_all()[1] == []
    data = bytearray((folder / CODES_INDEX_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / CODES_INDEX_FILE).write_bytes(bytes(data))
    problems = store.verify_all()[1]
    assert any(CODES_INDEX_FILE in p and "diffret index" in p for p in problems), problems
    assert _run("index", IndexConfig(root=root, dataset="synth", system=r2, kp=[4])).done == 1  # rebuilt
    assert store.verify_all()[1] == []


def test_what_cannot_be_searched_over_codes_is_refused(world: dict, tmp_path: Path) -> None:
    root = _copy(world, tmp_path)
    with pytest.raises(StoreError, match="residual:B system's codes"):
        _run("score", ScoreConfig(root=root, dataset="synth", system=SystemRef(system=world["f16"]), search="codes"))
    with pytest.raises(IncompleteArtifactError, match="no codes index"):
        _run(
            "score",
            ScoreConfig(root=root, dataset="synth", system=SystemRef(system=world["r2"]), kp=[4], search="codes"),
        )
    int8 = _run(
        "compress",
        CompressConfig(root=root, dataset="synth", system=SystemRef(system=world["f16"]), store="int8", k=[4]),
    ).system
    with pytest.raises(StoreError, match="--vectors float16"):
        _run("index", IndexConfig(root=root, dataset="synth", system=SystemRef(system=int8), kp=[4]))


# ------------------------------------------------------------------------------- a kill at H = 3,584
KILLER = """
import sys, time
from pathlib import Path
from diffret.stages import execute, stages
from diffret.stages.compress import Compress, CompressConfig
from diffret.stages import index as index_stage
from diffret.stages.index import IndexConfig
from diffret.stages.systems import SystemRef

what, root, system, marker = sys.argv[1:5]

def stop(*args, **kwargs):  # the process is killed here (SIGKILL from the test), mid-stage
    Path(marker).write_text("here")
    time.sleep(600)

if what == "compress":
    real = Compress.commit
    def commit(self, unit, result, ctx):
        real(self, unit, result, ctx)
        if unit.side == "passage":
            stop()
    Compress.commit = commit
    config = CompressConfig(root=root, dataset="synth", system=SystemRef(system=system), store="residual:2")
else:
    index_stage.check_codes = stop  # after the codes index is written in the staging folder
    config = IndexConfig(root=root, dataset="synth", system=SystemRef(system=system), kp=[4])
execute(stages()[what], config, log=lambda _: None)
"""


def _killed(what: str, root: str, system: str, tmp_path: Path) -> None:
    marker = tmp_path / f"{what}.here"
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    proc = subprocess.Popen([sys.executable, str(script), what, root, system, str(marker)], env=os.environ.copy())
    try:
        deadline = time.time() + 600
        while not marker.exists():
            assert proc.poll() is None, f"{what} ended before the kill point (exit {proc.returncode})"
            assert time.time() < deadline, f"{what} never reached the kill point"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "_manifest.json" and "_locks" not in p.parts
    }


def test_a_kill_during_compress_or_index_at_h_3584_resumes_to_the_same_bytes(tmp_path_factory) -> None:
    base = tmp_path_factory.mktemp("h3584")
    syn = synthetic_store.build(base, 48, 3584, [4], [4], n_queries=6, shard_size=16)
    a, b = str(base / "a"), str(base / "b")
    shutil.copytree(syn.root, a)
    shutil.copytree(syn.root, b)
    ref = SystemRef(system=syn.system)
    comp = _run("compress", CompressConfig(root=a, dataset="synth", system=ref, store="residual:2")).system
    _run("index", IndexConfig(root=a, dataset="synth", system=SystemRef(system=comp), kp=[4]))
    # b: compress killed after its first passage shard, then run again
    _killed("compress", b, syn.system, tmp_path_factory.mktemp("kill-compress"))
    folder = Path(b) / encodings_dir(comp, "synth", "passage", 4)
    assert len((folder / "_shards.jsonl").read_text().splitlines()) == 1  # one shard recorded, not compacted
    res = _run("compress", CompressConfig(root=b, dataset="synth", system=ref, store="residual:2"))
    assert res.done == 2 and res.skipped == 1 + 1  # the query shard and the recorded passage shard are kept
    for part in ("encodings", "codebooks"):
        assert _files(Path(a) / part / f"system={comp}") == _files(Path(b) / part / f"system={comp}"), part
    # b: index killed with its codes index written in the staging folder, then run again
    _killed("index", b, comp, tmp_path_factory.mktemp("kill-index"))
    assert not (Path(b) / index_dir(comp, "synth", 4)).exists()  # nothing half-written in place
    assert _run("index", IndexConfig(root=b, dataset="synth", system=SystemRef(system=comp), kp=[4])).done == 1
    ia, ib = (Path(r) / index_dir(comp, "synth", 4) for r in (a, b))
    assert _files(ia) == _files(ib) and CODES_INDEX_FILE in _files(ia)
    ma, mb = (json.loads((f / "_manifest.json").read_text()) for f in (ia, ib))
    assert ma["files"] == mb["files"] and ma["config_hash"] == mb["config_hash"]
    assert not list((Path(b) / "_staging").glob("*")) if (Path(b) / "_staging").exists() else True
    assert ArtifactStore(b).verify_all()[1] == []
