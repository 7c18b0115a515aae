"""Scoring cut into units on Dask workers: the runs of every mode, the fusions included, are byte-identical
(sha256) to one in-process pass, on SciFact with splade-tiny and on scifact-mini with the tiny Dream checkpoint; a
score killed with SIGKILL half way resumes with its finished units kept (mtime unchanged) and the same runs; a score
on two Dask workers, one of them killed with SIGKILL half way, goes on and ends (exit 0) with the same runs.

SciFact is cut to its first 100 test queries, the passages they judge and the first 1,000 others (encoding all of
it takes minutes here)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_harness import DIFFRET, ENV, run
from conftest import SHARED, write_beir
from prefect_harness import descendants

from diffret.flows.runner import run_stage
from diffret.stages import execute, stages
from diffret.stages.base import run_units
from diffret.stages.readers import corpus_size
from diffret.stages.score import ScoreConfig
from diffret.stages.systems import SystemRef
from diffret.storage import ArtifactStore

pytestmark = pytest.mark.e2e

SPLADE = SHARED / "models" / "splade-tiny-mlm"
DREAM = SHARED / "models" / "tiny-dream-random"
SCIFACT = SHARED / "data" / "scifact"
MINI = SHARED / "fixtures" / "reference-parity" / "scifact-mini"


def scifact_cut(dest: Path) -> Path:
    """SciFact's first 100 test queries, the passages they judge and the first 1,000 others (BEIR layout)."""
    qrels = [line.split("\t") for line in (SCIFACT / "qrels" / "test.tsv").read_text().splitlines()[1:]]
    qids = list(dict.fromkeys(q for q, _, _ in qrels))[:100]
    judged = [(q, d, int(r)) for q, d, r in qrels if q in qids]
    docs = {d for _, d, _ in judged}
    corpus = [json.loads(line) for line in (SCIFACT / "corpus.jsonl").read_text().splitlines()]
    keep = [c for i, c in enumerate(corpus) if i < 1000 or c["_id"] in docs]
    queries = [json.loads(line) for line in (SCIFACT / "queries.jsonl").read_text().splitlines()]
    return write_beir(dest, keep, [q for q in queries if q["_id"] in qids], {"test": judged})


def encoded(root: Path, name: str, source: Path, model: Path, shard_size: int) -> str:
    """A store at ``root`` holding ``name`` encoded by ``model`` at K 1, 2; the system's slug."""
    run("download", name, "--source", str(source), "--root", str(root))
    run(
        "encode",
        "-d",
        name,
        "--model",
        str(model),
        "--k",
        "1,2",
        "--max-length",
        "64",
        "--shard-size",
        str(shard_size),
        "--root",
        str(root),
    )
    return json.loads(run("systems", "--root", str(root), "--format", "json").stdout)[0]["system"]


def run_digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.glob("runs/**/run.parquet"))
    }


def config(root: Path, dataset: str, system: str, **kw: object) -> ScoreConfig:
    return ScoreConfig(root=str(root), dataset=dataset, system=SystemRef(system=system), kq=[1, 2], kp=[1, 2], **kw)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str, str]]:
    for need in (SPLADE / "model.safetensors", DREAM / "model.safetensors", SCIFACT / "corpus.jsonl", MINI):
        if not need.exists():
            pytest.skip(f"{need} is absent")
    base = tmp_path_factory.mktemp("sharded")
    splade = encoded(base / "splade", "scifact", scifact_cut(base / "scifact"), SPLADE, 100)
    dream = encoded(base / "dream", "mini", MINI, DREAM, 10)
    return {"splade": (base / "splade", "scifact", splade), "dream": (base / "dream", "mini", dream)}


@pytest.mark.parametrize("which, unit", [("splade", 250), ("dream", 10)])
def test_two_workers_give_one_pass_runs_byte_for_byte(stores, which: str, unit: int, tmp_path: Path) -> None:
    root, dataset, system = stores[which]
    one = tmp_path / "one"
    shutil.copytree(root, one)
    assert execute(stages()["score"], config(one, dataset, system), log=lambda _: None).done == 18  # q1-p1: 2 fewer
    sharded = tmp_path / "sharded"
    shutil.copytree(root, sharded)
    logs: list[str] = []
    res = run_stage(stages()["score"], config(sharded, dataset, system, workers=2, unit_passages=unit), log=logs.append)
    assert res.done == 18 and any("on 2 Dask worker(s) (0 with a GPU)" in m for m in logs), logs
    digests = run_digests(one)
    assert len(digests) == 18 and {p.split("mode=")[1].split("/")[0] for p in digests} == {
        "single_dense",
        "multi_dense",
        "sparse_max",
        "fusion_single_sparse_max",
        "fusion_multi_sparse_max",
    }
    assert run_digests(sharded) == digests
    assert not list(sharded.glob("partials/**/*.parquet"))


def recorded_units(root: Path) -> list[Path]:
    """The unit files a run recorded (its partials folders' ``_shards.jsonl`` lines)."""
    out = []
    for log in root.glob("partials/*/*/*/*/_shards.jsonl"):
        for line in log.read_text().splitlines():
            if line.strip():
                out.append(log.parent / json.loads(line)["name"])
    return out


@pytest.fixture(scope="module")
def splade_one_pass(stores, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The digests of the SciFact store's runs scored in one in-process pass (`--workers 0`)."""
    root, dataset, system = stores["splade"]
    one = tmp_path_factory.mktemp("one") / "store"
    shutil.copytree(root, one)
    assert execute(stages()["score"], config(one, dataset, system), log=lambda _: None).done == 18
    return run_digests(one)


def test_score_killed_half_way_resumes_with_its_finished_units(stores, splade_one_pass, tmp_path: Path) -> None:
    root, dataset, system = stores["splade"]
    killed = tmp_path / "killed"
    shutil.copytree(root, killed)
    args = [
        "score",
        "-d",
        dataset,
        "--system",
        system,
        "--kq",
        "1,2",
        "--kp",
        "1,2",
        "--unit-passages",
        "100",
        "--root",
        str(killed),
    ]
    proc = subprocess.Popen(
        [*DIFFRET, *args], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while len(recorded_units(killed)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = {p: p.stat().st_mtime_ns for p in recorded_units(killed)}
    total = 2 * -(-corpus_size(ArtifactStore(str(killed)), dataset) // 100)  # two K_p passes, units of one shard
    assert 3 <= len(kept) < total, (len(kept), proc.stderr.read().decode()[-2000:] if proc.stderr else "")
    assert not list(killed.glob("runs/**/run.parquet"))

    seen: dict[str, object] = {}

    def check_then_run(stage, plan, ctx):  # noqa: ANN001, ANN202
        seen["units"] = len(plan.units)
        seen["kept"] = {p: p.stat().st_mtime_ns for p in kept} == kept  # untouched by the resume's plan
        return run_units(stage, plan, ctx)

    res = execute(
        stages()["score"], config(killed, dataset, system, unit_passages=100), log=lambda _: None, units=check_then_run
    )
    assert seen == {"units": total - len(kept), "kept": True}
    assert res.done == 18 and run_digests(killed) == splade_one_pass


def dask_workers(pid: int) -> list[int]:
    """The Dask worker processes below ``pid`` (each started by its nanny through multiprocessing's spawn)."""
    out = []
    for child in descendants(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
        except OSError:  # gone meanwhile
            pass
    return out


def test_a_dask_worker_killed_mid_score_is_redone_and_the_command_succeeds(
    stores, splade_one_pass, tmp_path: Path
) -> None:
    """`score --workers 2`, one worker killed with SIGKILL once six units are recorded: Dask computes what the worker
    held again (a unit's file is the same bytes each time), and the command goes on to exit 0 with the runs of one
    in-process pass, byte for byte, and no partials left."""
    root, dataset, system = stores["splade"]
    killed = tmp_path / "killed"
    shutil.copytree(root, killed)
    args = [
        "score",
        "-d",
        dataset,
        "--system",
        system,
        "--kq",
        "1,2",
        "--kp",
        "1,2",
        "--workers",
        "2",
        "--unit-passages",
        "100",
        "--root",
        str(killed),
    ]
    proc = subprocess.Popen(
        [*DIFFRET, *args], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while len(recorded_units(killed)) < 6 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        workers = dask_workers(proc.pid)
        assert proc.poll() is None and len(workers) == 2, (workers, proc.poll())
        os.kill(workers[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "18 cell(s) scored" in out, out[-3000:]
    assert run_digests(killed) == splade_one_pass
    assert not list(killed.glob("partials/**/*.parquet"))
