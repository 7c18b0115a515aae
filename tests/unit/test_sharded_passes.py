"""Search passes cut into units (score's passage blocks): the top k of the blocks' top k is one pass's top k (the tie
rule included), runs are byte-identical whatever the cut, and a pass stopped half way resumes from its finished
units. In process, on a tiny store (a random tiny BERT, 24 passages in shards of 3)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_beir
from tiny_models import save_tiny_mlm

from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.search.runs import topk_from_table, topk_table
from diffret.retrieval.search.scoring import RunningTopK, TopK, merge_topk
from diffret.stages import execute, stages
from diffret.stages.base import run_units
from diffret.stages.beta import BetaConfig
from diffret.stages.bm25 import BM25Config
from diffret.stages.bot import BotConfig
from diffret.stages.download import DownloadConfig
from diffret.stages.encode import EncodeConfig
from diffret.stages.late import LateConfig
from diffret.stages.rerank import RerankConfig
from diffret.stages.score import ScoreConfig
from diffret.stages.systems import SystemRef

WORDS = "cats purr dogs bark tea coffee cocoa garden fox jumps lazy mailman retrieval words query".split()
CORPUS = [{"_id": f"d{i:02d}", "title": WORDS[i % 15], "text": " ".join(WORDS[i % 9 : i % 9 + 3])} for i in range(24)]
QUERIES = [{"_id": f"q{i}", "text": " ".join(WORDS[2 * i : 2 * i + 2])} for i in range(6)] + [
    {"_id": "d03", "text": "dogs bark"}
]  # a query whose id is a passage's: the self-hit rule
QRELS = {
    "test": [("q0", "d00", 1), ("q1", "d02", 1), ("q2", "d04", 2), ("d03", "d03", 1)],
    "train": [("q3", "d06", 1), ("q4", "d08", 1)],
}


def _stream_topk(scores: np.ndarray, k: int, cuts: list[int]) -> TopK:
    t = RunningTopK(scores.shape[0], k, torch.device("cpu"))
    for a, b in zip([0, *cuts], [*cuts, scores.shape[1]], strict=True):
        t.update(torch.from_numpy(scores[:, a:b].copy()), a)
    return t.result()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_of_block_top_ks_is_one_pass_top_k(seed: int) -> None:
    """Scores with many ties (a few distinct values) and -inf (no shared term): blocks merged = one pass."""
    rng = np.random.default_rng(seed)
    n_docs, k = 97, 20
    scores = rng.integers(0, 4, size=(5, n_docs)).astype(np.float32)
    scores[rng.random(scores.shape) < 0.3] = -np.inf
    whole = _stream_topk(scores, k, [33, 60])
    edges = sorted(rng.choice(np.arange(1, n_docs), size=4, replace=False).tolist())
    parts = []
    for a, b in zip([0, *edges], [*edges, n_docs], strict=True):
        part = _stream_topk(scores[:, a:b], k, [])
        part.index[part.index >= 0] += a
        parts.append(topk_from_table(topk_table({(1, "m"): part}))[(1, "m")])  # through the partials' file format
    merged = merge_topk(parts[::-1], k, columns=n_docs)
    assert merged.index.tolist() == whole.index.tolist()
    assert merged.scores.tobytes() == whole.scores.tobytes()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("passes")
    model = save_tiny_mlm(base / "model")
    beir = write_beir(base / "tiny", CORPUS, QUERIES, QRELS)
    root = str(base / "store")
    bb = BackboneConfig(model=str(model))
    execute(stages()["download"], DownloadConfig(name="tiny", source=str(beir), root=root), log=lambda _: None)
    encode = EncodeConfig(dataset="tiny", k=[1, 2], backbone=bb, max_length=64, shard_size=3, batch_size=4, root=root)
    execute(stages()["tokenize"], encode.tokenize_config(), log=lambda _: None)
    execute(stages()["encode"], encode, log=lambda _: None)
    execute(stages()["bot"], BotConfig(dataset="tiny", backbone=bb, max_length=64, root=root), log=lambda _: None)
    return {"root": root, "ref": SystemRef(model=str(model)), "model": str(model)}


def score_config(tiny: dict, root: str, **kw: object) -> ScoreConfig:
    return ScoreConfig(
        root=root,
        dataset="tiny",
        system=tiny["ref"],
        splits=["test", "train"],
        kq=[1, 2],
        kp=[1, 2],
        topk=10,
        train_topk=5,
        fusion_depth=8,
        self_hits="drop",
        **kw,
    )


def run_digests(root: str) -> dict[str, str]:
    out = {}
    for path in sorted(Path(root, "runs").rglob("run.parquet")):
        out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def f16(tiny: dict, root: str) -> str:
    """The tiny encoder system's slug."""
    from diffret.stages.systems import find_system
    from diffret.storage import ArtifactStore

    return find_system(ArtifactStore(root), tiny["ref"]).system


def no_partials(root: str) -> bool:
    """No unit file left: every pass merged (its partials folder removed)."""
    return not list(Path(root).glob("partials/**/*.parquet"))


def copy_store(tiny: dict, dest: Path) -> str:
    import shutil

    shutil.copytree(tiny["root"], dest)
    return str(dest)


@pytest.fixture(scope="module")
def one_pass(tiny: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The runs of one unit per K_p pass (today's single pass)."""
    root = copy_store(tiny, tmp_path_factory.mktemp("one") / "store")
    res = execute(stages()["score"], score_config(tiny, root), log=lambda _: None)
    assert res.done == 2 * 2 * 2 * 5 - 2 * 2  # multi_dense and its fusion skipped at (1, 1), as the reference does
    digests = run_digests(root)
    assert len(digests) == 36 and no_partials(root)
    return digests


def test_runs_do_not_depend_on_the_cut(tiny: dict, one_pass: dict[str, str], tmp_path: Path) -> None:
    root = copy_store(tiny, tmp_path / "store")
    logs: list[str] = []
    execute(stages()["score"], score_config(tiny, root, unit_passages=4, block_mb=0.05), log=logs.append)
    assert any("K_p=2: 20 cell(s) over 24 passages in 8 unit(s), 0 already done" in m for m in logs), logs
    assert run_digests(root) == one_pass
    assert no_partials(root)  # merged, then removed


def test_a_stopped_pass_resumes_from_its_finished_units(tiny: dict, one_pass: dict[str, str], tmp_path: Path) -> None:
    root = copy_store(tiny, tmp_path / "store")
    config = score_config(tiny, root, unit_passages=6)

    class Stop(Exception):
        pass

    def three_then_stop(stage, plan, ctx):  # noqa: ANN001, ANN202
        keep = plan.units[:3]
        plan.units[:] = keep
        run_units(stage, plan, ctx)
        raise Stop  # as a kill after three units (SIGKILL in tests/e2e/test_sharded_scoring.py)

    with pytest.raises(Stop):
        execute(stages()["score"], config, log=lambda _: None, units=three_then_stop)
    kept = {p: os.stat(p).st_mtime_ns for p in Path(root, "partials").rglob("block=*.parquet")}
    assert len(kept) == 3 and not list(Path(root).glob("runs/**/run.parquet"))

    seen: dict[str, object] = {}

    def check_then_run(stage, plan, ctx):  # noqa: ANN001, ANN202
        seen["units"] = len(plan.units)
        seen["same"] = {p: os.stat(p).st_mtime_ns for p in kept} == kept  # not rewritten before the merge
        return run_units(stage, plan, ctx)

    logs: list[str] = []
    res = execute(stages()["score"], config, log=logs.append, units=check_then_run)
    assert seen == {"units": 8 - 3, "same": True}  # 4 units per K_p pass, the first 3 kept
    assert any("K_p=1: 16 cell(s) over 24 passages in 4 unit(s), 3 already done" in m for m in logs), logs
    assert res.done == 36 and run_digests(root) == one_pass


def test_beta_runs_do_not_depend_on_the_cut(tiny: dict, tmp_path: Path) -> None:
    digests = []
    for unit in (1_000_000, 5):
        root = copy_store(tiny, tmp_path / f"u{unit}")
        cfg = BetaConfig(
            root=root,
            dataset="tiny",
            system=tiny["ref"],
            splits=["test", "train"],
            kq=[1, 2],
            topk=10,
            train_topk=5,
            self_hits="drop",
            unit_passages=unit,
        )
        logs: list[str] = []
        assert execute(stages()["beta"], cfg, log=logs.append).done == 4
        assert any(f"in {-(-24 // unit)} unit(s), 0 already done" in m for m in logs), logs
        digests.append(run_digests(root))
        assert no_partials(root)
    assert len(digests[0]) == 4 and digests[0] == digests[1]


def test_late_runs_do_not_depend_on_the_cut(tiny: dict, tmp_path: Path, monkeypatch) -> None:
    """Late re-scoring of beta's runs as one slice of queries or slices of the grain (2 here, 256 by default: the
    re-scoring's query chunks stay the same): the same runs."""
    monkeypatch.setattr("diffret.retrieval.search.late.QUERY_GRAIN", 2)
    monkeypatch.setattr("diffret.stages.late.QUERY_GRAIN", 2)
    digests = []
    for unit, units in ((65_536, 1), (1, 3)):
        root = copy_store(tiny, tmp_path / f"u{unit}")
        execute(
            stages()["beta"],
            BetaConfig(root=root, dataset="tiny", system=tiny["ref"], splits=["test", "train"], kq=[1], topk=10),
            log=lambda _: None,
        )
        cfg = LateConfig(
            root=root,
            dataset="tiny",
            system=tiny["ref"],
            splits=["test", "train"],
            kq=2,
            kp=1,
            mode="fusion_multi_sparse_max",
            depths=[3, 6],
            first_stage=f16(tiny, root),
            first_kq=1,
            first_mode="beta",
            unit_queries=unit,
        )
        logs: list[str] = []
        assert execute(stages()["late"], cfg, log=logs.append).done == 4
        assert any(f"6 queries in {units} unit(s), 0 already done" in m for m in logs), logs
        digests.append(run_digests(root))
        assert no_partials(root)
    assert digests[0] == digests[1]


@pytest.mark.parametrize("method", ["pointwise", "logits_listwise"])
def test_rerank_runs_do_not_depend_on_the_cut(tiny: dict, tmp_path: Path, method: str) -> None:
    """BM25's top 5 reranked whole, or in slices ending where the whole run's batches end (batch_cuts)."""
    digests, units = [], []

    def count(stage, plan, ctx):  # noqa: ANN001, ANN202
        units.append(len(plan.units))
        return run_units(stage, plan, ctx)

    prompt = Path(__file__).parent / "data" / "rerank_tiny.yaml"
    if method == "pointwise":  # the tiny listwise prompt's words, one pair per prompt
        prompt = tmp_path / "pointwise.yaml"
        prompt.write_text(
            'name: tiny_pointwise\nsystem: ""\nuser: "query : {query} {document}"\nassistant: "{slot}"\n'
            'answers: ["x", "a"]\n'
        )
    for unit in (4096, 1):
        root = copy_store(tiny, tmp_path / f"u{unit}")
        execute(stages()["bm25"], BM25Config(root=root, dataset="tiny", splits=["test"]), log=lambda _: None)
        cfg = RerankConfig(
            root=root,
            dataset="tiny",
            backbone=BackboneConfig(model=tiny["model"]),
            depth=5,
            window=3,
            step=1,
            doc_tokens=8,
            batch_size=2,
            method=method,
            unit_queries=unit,
            prompt=str(prompt),
        )
        assert execute(stages()["rerank"], cfg, log=lambda _: None, units=count).done == 1
        digests.append(run_digests(root))
        assert no_partials(root)
    assert units[0] == 1 and units[1] >= 2, units
    assert len(digests[0]) == 2 and digests[0] == digests[1]


def twice(results_seen: dict[str, list[str]]):  # noqa: ANN201
    """A units runner that runs each unit twice before committing it, then commits both results, as when Dask
    computes a unit again after the worker holding its result died; each unit's file digests go to
    ``results_seen[stage name]``."""

    def runner(stage, plan, ctx):  # noqa: ANN001, ANN202
        out = []
        for unit in plan.units:
            path = Path(ctx.store.abspath(f"{unit.folder}/{unit.name}"))
            first = stage.run(unit, ctx)
            data = path.read_bytes()
            again = stage.run(unit, ctx)
            assert path.read_bytes() == data, f"{stage.name} {stage.unit_name(unit)}: other bytes the second time"
            assert (again.sha256, again.bytes) == (first.sha256, first.bytes)
            results_seen.setdefault(stage.name, []).append(first.sha256)
            stage.commit(unit, first, ctx)
            stage.commit(unit, again, ctx)  # the same bytes again: accepted, recorded once
            out.append(first)
        return out

    return runner


def test_a_unit_run_twice_writes_the_same_bytes_and_is_recorded_once(
    tiny: dict, one_pass: dict[str, str], tmp_path: Path, monkeypatch
) -> None:
    """score, beta, late and rerank: a unit's partial file holds only what its inputs decide (its search seconds go
    beside it, into the runs' manifests), so a unit computed twice writes the same bytes, and its second result is
    accepted; the runs are one pass's."""
    import json

    monkeypatch.setattr("diffret.retrieval.search.late.QUERY_GRAIN", 2)  # late's slices: 2 queries, not 256
    monkeypatch.setattr("diffret.stages.late.QUERY_GRAIN", 2)

    root = copy_store(tiny, tmp_path / "store")
    seen: dict[str, list[str]] = {}
    execute(stages()["bm25"], BM25Config(root=root, dataset="tiny", splits=["test", "train"]), log=lambda _: None)
    prompt = str(Path(__file__).parent / "data" / "rerank_tiny.yaml")
    common = {"root": root, "dataset": "tiny", "splits": ["test", "train"]}
    # fmt: off
    configs = [
        ("score", score_config(tiny, root, unit_passages=9)),
        ("beta", BetaConfig(system=tiny["ref"], kq=[1], topk=10, unit_passages=12, **common)),
        ("late", LateConfig(system=tiny["ref"], kq=2, kp=1, depths=[3], first_stage="bm25", unit_queries=1, **common)),
        ("rerank", RerankConfig(backbone=BackboneConfig(model=tiny["model"]), depth=5, window=3, step=1, doc_tokens=8,
                                batch_size=2, prompt=prompt, unit_queries=1, **common)),
    ]
    # fmt: on
    for name, cfg in configs:
        assert execute(stages()[name], cfg, log=lambda _: None, units=twice(seen)).done > 0, name
    assert {name: len(v) > 1 for name, v in seen.items()} == {"score": True, "beta": True, "late": True, "rerank": True}
    assert no_partials(root)
    score_runs = {k: v for k, v in run_digests(root).items() if k in one_pass}
    assert score_runs == one_pass
    stats = [
        json.loads(p.read_text())["stats"]
        for p in Path(root, "runs").rglob("mode=*/_manifest.json")
        if "mode=single_dense" in str(p)
    ]
    assert stats and all(s["search_seconds"] > 0 for s in stats)  # the units' seconds, kept out of their files


def test_a_unit_computed_twice_with_other_bytes_is_refused_as_damage(
    tiny: dict, one_pass: dict[str, str], tmp_path: Path
) -> None:
    """A second result of a unit that differs from the first (a unit that is not deterministic) is not merged: the
    run stops naming the unit file, and the same command then redoes it and gives one pass's runs."""
    from diffret.storage import ChecksumError

    root = copy_store(tiny, tmp_path / "store")
    config = score_config(tiny, root, unit_passages=9)

    def other_bytes_the_second_time(stage, plan, ctx):  # noqa: ANN001, ANN202
        unit = plan.units[0]
        entry = stage.run(unit, ctx)
        stage.commit(unit, entry, ctx)
        stage.commit(unit, entry.model_copy(update={"sha256": "0" * 64}), ctx)

    with pytest.raises(ChecksumError, match=r"block=00000\.parquet: computed twice with different bytes") as err:
        execute(stages()["score"], config, log=lambda _: None, units=other_bytes_the_second_time)
    assert "\n" not in str(err.value) and "run the same command again" in str(err.value)
    assert execute(stages()["score"], config, log=lambda _: None).done == 36
    assert run_digests(root) == one_pass and no_partials(root)


@pytest.fixture(scope="module")
def dask_address():
    """Two local Dask workers (CPU), shared by the module's tests that join them with --dask-address."""
    import distributed

    from diffret.flows.cluster import local_cluster

    with local_cluster(n_workers=2) as cluster, distributed.Client(cluster, set_as_default=False) as client:
        client.wait_for_workers(2)
        yield cluster.scheduler_address


def metric_digests(root: str) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).glob("metrics/**/per_query.parquet"))
    }


def test_every_distributed_stage_runs_its_units_on_the_workers(tiny: dict, dask_address: str, tmp_path: Path) -> None:
    """score, beta, late, bm25 (a unit per split), rerank, evaluate (a unit per run) and index (a unit per K_p) on
    two Dask workers: the same runs and metrics as in this process, byte for byte."""
    from diffret.flows.runner import run_stage
    from diffret.stages.evaluate import EvaluateConfig
    from diffret.stages.index import IndexConfig

    def configs(root: str, **kw: object) -> list[tuple[str, object]]:
        common = {"root": root, "dataset": "tiny", "splits": ["test", "train"], **kw}
        return [
            ("score", score_config(tiny, root, unit_passages=9, **kw)),
            ("beta", BetaConfig(system=tiny["ref"], kq=[1], topk=10, unit_passages=12, **common)),
            ("bm25", BM25Config(**common)),
            ("late", LateConfig(system=tiny["ref"], kq=2, kp=1, depths=[3], first_stage="bm25", **common)),
            (
                "rerank",
                RerankConfig(
                    backbone=BackboneConfig(model=tiny["model"]),
                    depth=5,
                    window=3,
                    step=1,
                    doc_tokens=8,
                    batch_size=2,
                    prompt=str(Path(__file__).parent / "data" / "rerank_tiny.yaml"),
                    **common,
                ),
            ),
            ("evaluate", EvaluateConfig(root=root, **kw)),
            (
                "index",
                IndexConfig(root=root, dataset="tiny", system=tiny["ref"], kq=[1], kp=[1, 2], index_type="none", **kw),
            ),
        ]

    here, there = copy_store(tiny, tmp_path / "here"), copy_store(tiny, tmp_path / "there")
    for (name, cfg), (_, on_dask) in zip(configs(here), configs(there, dask_address=dask_address), strict=True):
        done = execute(stages()[name], cfg, log=lambda _: None).done
        logs: list[str] = []
        assert run_stage(stages()[name], on_dask, log=logs.append).done == done > 0, name
        assert any("on 2 Dask worker(s)" in m for m in logs), (name, logs)
    assert run_digests(here) == run_digests(there) and len(run_digests(here)) == 36 + 2 + 2 + 2 + 2
    assert metric_digests(here) == metric_digests(there) and len(metric_digests(here)) == 44


def test_a_worker_killed_while_it_starts_is_replaced_and_the_command_succeeds(
    tiny: dict, one_pass: dict[str, str], tmp_path: Path
) -> None:
    """`diffret score --workers 2` in a subprocess, its first Dask worker process killed (SIGKILL) as soon as it
    appears, while it is still starting: the cluster starts without it (a worker started again in its place), and
    the command exits 0 with the runs of one in-process pass, byte for byte."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    root = copy_store(tiny, tmp_path / "store")
    args = ["score", "-d", "tiny", "--system", f16(tiny, root), "--split", "test", "--split", "train"]
    args += ["--kq", "1,2", "--kp", "1,2", "--topk", "10", "--train-topk", "5", "--fusion-depth", "8"]
    args += ["--self-hits", "drop", "--unit-passages", "9", "--workers", "2", "--root", root]
    env = {**os.environ, "COLUMNS": "200", "PREFECT_API_URL": "", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffret.flows.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    killed = None
    try:
        deadline = time.monotonic() + 120
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if any("spawn_main" in part for part in child.cmdline()):  # a nanny's worker process
                        child.send_signal(signal.SIGKILL)
                        killed = child.pid
                        break
                except psutil.Error:  # gone meanwhile
                    pass
            time.sleep(0.005)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert killed is not None, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    assert "on 2 Dask worker(s)" in out, out[-3000:]
    assert run_digests(root) == one_pass and no_partials(root)


def test_a_cluster_whose_workers_never_start_is_refused_in_one_line(monkeypatch) -> None:
    """Every start of the local cluster fails (a worker dies while it starts): a bounded number of tries, then one
    line naming the last failure and what to do."""
    from diffret.flows import cluster

    tries: list[int] = []

    def dies(pins, n_workers):  # noqa: ANN001, ANN202
        tries.append(n_workers)
        raise RuntimeError("Nanny failed to start.")

    monkeypatch.setattr(cluster, "_start_local_cluster", dies)
    with pytest.raises(cluster.ClusterStartError) as err:
        cluster.local_cluster(n_workers=2)
    assert tries == [2] * cluster.START_TRIES and "\n" not in str(err.value)
    message = str(err.value)
    assert "did not start in 3 tries (last: Nanny failed to start.)" in message and "--workers 0" in message
