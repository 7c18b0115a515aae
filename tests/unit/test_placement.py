"""A GPU per worker, with a faked GPU count (no GPU here): the placement of a local cluster's workers, the refusal of
more workers than GPUs, the GPU resource that keeps GPU units off CPU workers, and a worker started outside the flow
keeping its own device. One Dask cluster for the module (its start costs seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from diffret.flows import cluster as cluster
from diffret.flows.runner import run_stage
from diffret.stages.base import ClusterConfig, Context, Plan, Stage, StageConfig

FAKE_GPUS = ["0", "1", "2", "3"]
REPO = Path(__file__).resolve().parents[2]


class ProbeConfig(StageConfig, ClusterConfig):
    """A stage whose units report where they ran."""

    device: str = Field(default="cuda", description="Where the units compute.")
    units: int = Field(default=8, description="Units to run.")


class Probe(Stage, name="probe", config=ProbeConfig, distributed=True):
    """Reports, per unit, the worker, its CUDA_VISIBLE_DEVICES and what the unit's device resolves to there."""

    def plan(self, config: ProbeConfig, ctx: Context) -> Plan:
        return Plan(units=[(i, config.device) for i in range(config.units)])

    def run(self, unit: tuple[int, str], ctx: Context) -> tuple[str, str | None, str]:
        from distributed import get_worker

        from diffret.retrieval.devices import gpu_name, resolve_device

        time.sleep(0.2)  # every idle worker gets a unit
        return str(get_worker().name), os.environ.get("CUDA_VISIBLE_DEVICES"), gpu_name(resolve_device(unit[1]))

    def commit(self, unit: Any, result: Any, ctx: Context) -> None:
        PROBED.append(result)


PROBED: list[tuple[str, str | None, str]] = []
probe = Probe()


def _fake_cuda() -> None:
    """In a worker: torch believes in one GPU, so that ``cuda`` resolves as it would on a GPU machine."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1


def _probe(root: str, **kw: Any) -> list[tuple[str, str | None, str]]:
    PROBED.clear()
    run_stage(probe, ProbeConfig(root=root, **kw), log=lambda _m: None)
    return list(PROBED)


def _outside_worker(address: str, name: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    """A worker started by hand as docs/operations.md says (``dask worker <scheduler> --nthreads 1 ...``)."""
    path = os.pathsep.join([str(REPO), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            address,
            "--nthreads",
            "1",
            "--name",
            name,
            "--no-dashboard",
            *args,
        ],
        env={**os.environ, "PYTHONPATH": path, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def gpu_cluster():
    """The local cluster a stage starts with --workers 4 on a machine with 4 (faked) GPUs, its client, and two
    workers started outside the flow: one pinned to GPU 7 (offering GPU=1), one without a GPU."""
    import distributed

    options = cluster.local_cluster_options(probe, ProbeConfig(workers=4), gpus=FAKE_GPUS)
    with cluster.local_cluster(**options) as local, distributed.Client(local, set_as_default=False) as client:
        address = local.scheduler_address
        outside = [
            _outside_worker(address, "outside-gpu7", {"CUDA_VISIBLE_DEVICES": "7"}, "--resources", "GPU=1"),
            _outside_worker(address, "outside-cpu", {"CUDA_VISIBLE_DEVICES": ""}),
        ]
        try:
            client.wait_for_workers(6, timeout=120)
            client.run(_fake_cuda)
            yield client, address, options
        finally:
            for proc in outside:
                proc.terminate()
            for proc in outside:
                proc.wait(timeout=60)


def test_four_workers_over_four_gpus_get_four_different_devices(gpu_cluster) -> None:
    client, _, options = gpu_cluster
    assert options == {"pins": FAKE_GPUS}
    pinned = {
        w["name"]: w
        for w in client.scheduler_info(n_workers=-1)["workers"].values()
        if not str(w["name"]).startswith("outside")
    }
    assert len(pinned) == 4 and all(w["resources"] == {"GPU": 1} for w in pinned.values())
    from diffret.retrieval.devices import gpu_name, resolve_device

    seen = client.run(lambda: (os.environ["CUDA_VISIBLE_DEVICES"], gpu_name(resolve_device("cuda"))))
    mine = sorted(v for v in seen.values() if v[0] in FAKE_GPUS)
    assert mine == [(g, f"cuda (GPU {g})") for g in FAKE_GPUS]


def test_more_workers_than_gpus_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as err:
        cluster.local_cluster_options(probe, ProbeConfig(workers=8), gpus=FAKE_GPUS)
    msg = str(err.value)
    assert "\n" not in msg and "--workers 8" in msg and "4 GPU(s)" in msg and "--workers-per-gpu 2" in msg
    shared = cluster.local_cluster_options(probe, ProbeConfig(workers=8, workers_per_gpu=2), gpus=FAKE_GPUS)
    assert shared == {"pins": FAKE_GPUS * 2}
    assert cluster.local_cluster_options(probe, ProbeConfig(workers=-1), gpus=FAKE_GPUS) == {"pins": FAKE_GPUS}
    # a CPU device: plain workers, no pinning
    assert cluster.local_cluster_options(probe, ProbeConfig(workers=3, device="cpu"), gpus=FAKE_GPUS, cores=4) == {
        "n_workers": 3
    }


def test_more_cpu_workers_than_cores_is_refused_in_one_line_unless_asked_for(tmp_path, monkeypatch) -> None:
    """CPU units: --workers 64 on 2 cores is refused before any work (no cluster started, nothing planned), naming
    both numbers and the way to ask for it; --workers-per-core 32 asks for it; -1 is Dask's own count."""
    cpu = {"device": "cpu"}
    with pytest.raises(ValueError) as err:
        cluster.local_cluster_options(probe, ProbeConfig(workers=64, **cpu), gpus=[], cores=2)
    msg = str(err.value)
    assert "\n" not in msg and "--workers 64" in msg and "2 CPU core(s)" in msg, msg
    assert "--workers 2 or fewer" in msg and "--workers-per-core 32" in msg, msg
    asked = ProbeConfig(workers=64, workers_per_core=32, **cpu)
    assert cluster.local_cluster_options(probe, asked, gpus=[], cores=2) == {"n_workers": 64}
    assert cluster.local_cluster_options(probe, ProbeConfig(workers=2, **cpu), gpus=[], cores=2) == {"n_workers": 2}
    assert cluster.local_cluster_options(probe, ProbeConfig(workers=-1, **cpu), gpus=[], cores=2) == {"n_workers": None}
    # `auto` on a machine without a GPU: CPU workers, the same rule
    with pytest.raises(ValueError, match="more than the 2 CPU core"):
        cluster.local_cluster_options(probe, ProbeConfig(workers=3, device="auto"), gpus=[], cores=2)

    # through run_stage (what every command calls): refused before the plan, and no cluster is started
    monkeypatch.setattr(cluster, "cpu_cores", lambda: 2)
    monkeypatch.setattr(cluster, "visible_gpus", lambda: [])
    monkeypatch.setattr(cluster, "local_cluster", lambda **_: pytest.fail("a cluster was started"))
    monkeypatch.setattr(Probe, "plan", lambda *_: pytest.fail("the stage was planned"))
    with pytest.raises(ValueError, match=r"--workers 64 is more than the 2 CPU core\(s\) here"):
        run_stage(probe, ProbeConfig(root=str(tmp_path), workers=64, **cpu), log=lambda _m: None)
    # `diffret run --workers 64`: refused before anything is downloaded
    from diffret.flows.runner import run_pipeline_stages
    from diffret.stages import download
    from diffret.stages.pipeline import PipelineConfig

    monkeypatch.setattr(download.stage, "plan", lambda *_: pytest.fail("a collection was downloaded"))
    pipeline = PipelineConfig(
        dataset="scifact",
        backbone={"model": str(tmp_path / "model"), "device": "cpu"},
        workers=64,
        root=str(tmp_path / "store"),
    )
    with pytest.raises(ValueError, match=r"--workers 64 is more than the 2 CPU core\(s\) here"):
        run_pipeline_stages(pipeline, log=lambda _m: None)
    assert not (tmp_path / "store").exists()


def test_a_gpu_unit_never_goes_to_a_worker_without_the_resource(gpu_cluster, tmp_path) -> None:
    _, address, _ = gpu_cluster
    ran = _probe(str(tmp_path), dask_address=address, units=12)
    assert len(ran) == 12
    assert "outside-cpu" not in {w for w, _, _ in ran}
    # CPU units ask for nothing: any worker may take them, the one without a GPU included
    cpu = _probe(str(tmp_path), dask_address=address, device="cpu", units=12)
    assert len({w for w, _, _ in cpu}) > 1 and {d for _, _, d in cpu} == {"cpu"}


def test_a_worker_started_outside_the_flow_keeps_its_own_device(gpu_cluster, tmp_path) -> None:
    client, address, _ = gpu_cluster
    pinned = [
        a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if not str(w["name"]).startswith("outside")
    ]
    client.retire_workers(pinned, close_workers=True)
    ran = _probe(str(tmp_path), dask_address=address, units=4)
    assert {(w, env, dev) for w, env, dev in ran} == {("outside-gpu7", "7", "cuda (GPU 7)")}
    client.retire_workers(
        [a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if w["name"] == "outside-gpu7"],
        close_workers=True,
    )
    with pytest.raises(ValueError, match="no worker of the Dask cluster at .* offers the resource GPU") as err:
        _probe(str(tmp_path), dask_address=address, units=1)
    assert "\n" not in str(err.value)


def test_every_distributed_stage_form_offers_the_placement_choices() -> None:
    """The Prefect deployment form of each stage whose units may run on Dask (and of the pipeline) has the CLI's
    choices: --workers, --workers-per-gpu, --workers-per-core and --dask-address."""
    import importlib

    from prefect.utilities.callables import parameter_schema

    from diffret.flows.runner import flows as flow_refs
    from diffret.stages import stages

    flows = {name: getattr(importlib.import_module(mod), fn) for name, (mod, fn) in flow_refs().items()}
    flows["pipeline"] = importlib.import_module("diffret.flows.pipeline").pipeline_flow
    wanted = [name for name, stage in stages().items() if stage.distributed and name in flows]
    assert {"encode", "score", "beta", "late", "rerank", "bm25", "evaluate", "index", "compress"} <= set(wanted)
    for name in [*wanted, "pipeline"]:
        schema = parameter_schema(flows[name].fn).model_dump_for_openapi()
        config = schema["properties"]["config"]["$ref"].rsplit("/", 1)[-1]
        fields = schema["definitions"][config]["properties"]
        assert {"workers", "workers_per_gpu", "workers_per_core", "dask_address"} <= set(fields), (name, sorted(fields))
