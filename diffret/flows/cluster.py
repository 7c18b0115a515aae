"""Where a stage's units run on Dask: a local cluster placed one worker per GPU, or a cluster joined by address.

A local cluster for a GPU device has one worker per visible GPU (``--workers -1``) or ``--workers N`` of them,
each pinned to its own GPU through its environment (``CUDA_VISIBLE_DEVICES``, set by its nanny before the worker
process starts, so ``cuda`` / ``auto`` there mean that GPU) and offering the Dask resource ``GPU=1``; more
workers than GPUs is refused unless ``--workers-per-gpu`` allows it. Where ``dask-cuda`` is installed its
``LocalCUDACluster`` starts those workers. For CPU units it has ``--workers N`` workers, at most one per core
unless ``--workers-per-core`` allows more. A unit that computes on a GPU asks for the resource, so only a worker
with a GPU takes it; the other units (tokenize, bm25, evaluate, CPU scoring) run on any worker. A cluster joined
by ``--dask-address`` is used as it is: its GPU workers are started one per GPU with ``--resources GPU=1``
(docs/operations.md), and a GPU stage refuses, in one line, a cluster that has none.

Both ways of running a stage use it: :func:`run_units` (in this process, no Prefect) and the Prefect flow's
``DaskTaskRunner`` (``flows.runner``). A worker that dies (SIGKILL, the OOM killer) is restarted by its nanny and
Dask computes again what it held: a unit's result is committed once, and a unit's files are the same bytes each
time it runs (``stages.passes``), so the run goes on. A worker that dies while a local cluster starts fails that
start in Dask; nothing has run yet, so :func:`local_cluster` starts the cluster again (a bounded number of tries).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from diffret.retrieval.devices import count_cpu_workers, cpu_cores, place_workers, visible_gpus, wants_gpu
from diffret.stages import Context, Plan, Stage, StageConfig, run_unit
from diffret.stages.base import run_units as base_run_units

GPU = "GPU"  # the Dask resource a GPU unit asks for and a GPU worker offers (one per worker)
# glibc gives a large block back to the system when it is freed (its own threshold rises to 32 MB after the first
# free and keeps such blocks): a worker scoring shard after shard then holds one shard, not the largest it has seen.
# glibc reads it when a process starts, so a nanny sets it before it spawns its worker (Dask's pre-spawn-environ)
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def distributed(stage: Stage, config: StageConfig) -> bool:
    """Whether ``config`` asks for ``stage``'s units to run on Dask (local workers or a scheduler's address)."""
    return stage.distributed and bool(getattr(config, "workers", 0) or getattr(config, "dask_address", None))


def unit_device(stage: Stage, config: StageConfig) -> str:
    """The device ``stage``'s units compute on, as the config asks for it (``cpu`` for a stage without one)."""
    return stage.device_of(config)


def unit_resources(stage: Stage, config: StageConfig, gpus: list[str] | None = None) -> dict[str, int] | None:
    """The Dask resources each of ``stage``'s units asks for: ``{"GPU": 1}`` when it computes on a GPU (``cuda``,
    or ``auto`` where this machine or the joined cluster has one), else none (it may run on any worker)."""
    device = unit_device(stage, config)
    seen = visible_gpus() if gpus is None else gpus
    return {GPU: 1} if wants_gpu(device, seen) else None


def local_cluster_options(
    stage: Stage, config: StageConfig, gpus: list[str] | None = None, cores: int | None = None
) -> dict[str, Any]:
    """What :func:`local_cluster` is started with for ``config``: the GPU each worker is pinned to (``pins``), or
    the number of CPU workers (``n_workers``, None: Dask's default). ValueError (one line) for more workers than
    GPUs (unless ``workers_per_gpu``) or than cores (unless ``workers_per_core``), or a GPU device where none is
    visible. ``gpus``, ``cores``: this machine's unless given."""
    workers = int(getattr(config, "workers", 0))
    gpus = visible_gpus() if gpus is None else gpus
    if wants_gpu(unit_device(stage, config), gpus):
        return {"pins": place_workers(workers, gpus, int(getattr(config, "workers_per_gpu", 1)))}
    cores = cpu_cores() if cores is None else cores
    return {"n_workers": count_cpu_workers(workers, cores, int(getattr(config, "workers_per_core", 1)))}


def check_placement(stage: Stage, config: StageConfig) -> None:
    """Refuse, in one line and before any work, a local cluster ``config`` asks for that this machine cannot hold
    (more workers than GPUs or cores, unless allowed; a GPU device without a GPU): :func:`local_cluster_options`'s
    checks. Nothing to check for a stage run in this process or on a cluster joined by address."""
    if distributed(stage, config) and not getattr(config, "dask_address", None):
        local_cluster_options(stage, config)


START_TRIES = 3  # a local cluster whose worker dies while it starts is started again, at most this many times in all


class ClusterStartError(RuntimeError):
    """No local Dask cluster could be started (a worker died while it started, each of :data:`START_TRIES` times)."""


def local_cluster(pins: list[str] | None = None, n_workers: int | None = None, **_: Any) -> Any:
    """A local Dask cluster: one worker per entry of ``pins`` pinned to that GPU (``CUDA_VISIBLE_DEVICES``, resource
    ``GPU=1``; ``dask-cuda``'s ``LocalCUDACluster`` where installed and each GPU has one worker), else
    ``n_workers`` CPU workers (None: as many as Dask starts by default). One thread per worker: a worker runs one
    unit at a time, on its own device. A worker that dies while it starts (SIGKILL, the OOM killer) fails the
    whole start in Dask, which closes what it started; nothing has run yet, so the cluster is started again, up to
    :data:`START_TRIES` times, then :class:`ClusterStartError` (one line)."""
    last: BaseException | None = None
    for _attempt in range(START_TRIES):
        try:
            return _start_local_cluster(pins, n_workers)
        except (RuntimeError, OSError, TimeoutError) as exc:  # "Nanny failed to start", a closed comm, a time-out
            last = exc
    reason = " ".join(str(last).split()) or type(last).__name__
    raise ClusterStartError(
        f"the local Dask cluster did not start in {START_TRIES} tries (last: {reason}); check the workers' memory "
        "and logs, or run with --workers 0"
    ) from last


def _start_local_cluster(pins: list[str] | None, n_workers: int | None) -> Any:
    import dask
    import distributed

    expose_packages_to_workers()
    common = {"threads_per_worker": 1, "dashboard_address": ":0", "silence_logs": logging.ERROR}
    spawn_env = {**dask.config.get("distributed.nanny.pre-spawn-environ", {}), **WORKER_ENV}
    with dask.config.set({"distributed.nanny.pre-spawn-environ": spawn_env}):  # read by each nanny as it is made
        if not pins:
            return distributed.LocalCluster(n_workers=n_workers, **common)
        if len(set(pins)) == len(pins):
            with contextlib.suppress(ImportError):
                from dask_cuda import LocalCUDACluster

                return LocalCUDACluster(CUDA_VISIBLE_DEVICES=pins, n_workers=len(pins), resources={GPU: 1}, **common)
        return distributed.SpecCluster(
            workers={f"gpu{i}-{pin}": worker_spec(pin) for i, pin in enumerate(pins)},
            scheduler={"cls": distributed.Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": ":0"}},
            silence_logs=logging.ERROR,
            name="diffret-gpus",
        )


def worker_spec(gpu: str) -> dict[str, Any]:
    """A nanny-started worker pinned to ``gpu``: its process sees that GPU alone (as ``cuda:0``), offers one ``GPU``.

    >>> worker_spec("3")["options"]["env"]  # doctest: +NORMALIZE_WHITESPACE
    {'CUDA_VISIBLE_DEVICES': '3', 'CUDA_DEVICE_ORDER': 'PCI_BUS_ID'}
    """
    import distributed

    env = {"CUDA_VISIBLE_DEVICES": gpu, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    return {
        "cls": distributed.Nanny,
        "options": {
            "nthreads": 1,
            "host": "127.0.0.1",
            "env": env,
            "resources": {GPU: 1},
            "silence_logs": logging.ERROR,
        },
    }


def check_workers(client: Any, resources: dict[str, int] | None, where: str) -> None:
    """Refuse, in one line, a cluster none of whose workers can take units that ask for ``resources`` (they would
    wait forever)."""
    if not resources:
        return
    workers = client.scheduler_info(n_workers=-1).get("workers", {}).values()
    if not any(all(w.get("resources", {}).get(k, 0) >= v for k, v in resources.items()) for w in workers):
        raise ValueError(
            f"no worker of the Dask cluster at {where} offers the resource {GPU} that GPU units ask for "
            f"({len(workers)} worker(s)); start one worker per GPU with `CUDA_VISIBLE_DEVICES=<i> dask "
            f"worker <scheduler> --nthreads 1 --resources {GPU}=1` (docs/operations.md), or use "
            "--device cpu"
        )


@contextlib.contextmanager
def open_client(stage: Stage, config: StageConfig) -> Iterator[tuple[Any, dict[str, int] | None]]:
    """A Dask client for ``config`` (a local cluster started for it, or the one at its address) and the resources each
    of ``stage``'s units asks for there; the local cluster is closed when the block ends."""
    import distributed

    address = getattr(config, "dask_address", None)
    with contextlib.ExitStack() as stack:
        if address:
            expose_packages_to_workers()
            client = stack.enter_context(distributed.Client(address, set_as_default=False))
            resources = unit_resources(stage, config, gpus=cluster_gpus(client))
            check_workers(client, resources, address)
        else:
            options = local_cluster_options(stage, config)
            cluster = stack.enter_context(local_cluster(**options))
            client = stack.enter_context(distributed.Client(cluster, set_as_default=False))
            resources = {GPU: 1} if options.get("pins") else None
        yield client, resources


def cluster_gpus(client: Any) -> list[str]:
    """The GPU workers of a joined cluster (their names): ``auto`` units ask for a GPU when there is one."""
    workers = client.scheduler_info(n_workers=-1).get("workers", {}).values()
    return [str(w.get("name")) for w in workers if w.get("resources", {}).get(GPU, 0) >= 1]


def run_units(stage: Stage, config: StageConfig, plan: Plan, ctx: Context) -> list[Any]:
    """Run a plan's units on Dask without Prefect (``--workers`` / ``--dask-address``), each committed in this
    process as it completes (:func:`stages.base.run_units`, the one unit loop); their results, in completion order."""
    with open_client(stage, config) as (client, resources):
        ctx.log(f"{stage.label(plan)}: {len(plan.units)} unit(s) on {_describe(client)}")
        outcomes = _on_dask(client, resources, stage, config, plan)
        try:
            return base_run_units(stage, plan, ctx, elsewhere=lambda: outcomes)
        finally:
            outcomes.close()  # a failure here (a commit) cancels the units still on the cluster, while it is open


def _on_dask(
    client: Any, resources: dict[str, int] | None, stage: Stage, config: StageConfig, plan: Plan
) -> Generator[tuple[Any, Any], None, None]:
    """Each unit submitted to the cluster, yielded with its result as it completes; a unit's result is released from
    the cluster once here (a worker that dies later takes nothing Dask would compute again); on failure, the units
    not yet done are cancelled."""
    import distributed

    futures: dict[Any, Any] = {}  # a Dask future -> its unit
    for unit in plan.units:
        fut = client.submit(
            run_unit,
            stage,  # whole: a stage registered in this process only is known to the worker too
            config.root,
            unit,
            resources=resources,
            pure=False,
            key=f"{stage.name} {stage.unit_name(unit)}-{len(futures)}",
        )
        futures[fut] = unit
    try:
        for fut in distributed.as_completed(list(futures), loop=client.loop):
            unit = futures.pop(fut)
            result = fut.result()
            fut.release()
            yield unit, result
    except BaseException:
        client.cancel(list(futures))
        raise


def _describe(client: Any) -> str:
    workers = client.scheduler_info(n_workers=-1).get("workers", {}).values()
    gpus = sum(1 for w in workers if w.get("resources", {}).get(GPU, 0) >= 1)
    return f"{len(workers)} Dask worker(s) ({gpus} with a GPU)"


def expose_packages_to_workers() -> None:
    """Put this checkout on PYTHONPATH for the Dask worker processes we start.

    A Dask worker puts its scratch folder, which holds a ``storage/`` spill folder, first on
    ``sys.path``; with an editable install (a meta-path finder, consulted after the path) that
    folder would shadow our ``storage`` package as an empty namespace. A path entry for the checkout
    wins over that (a regular package found anywhere on the path beats a namespace portion).
    """
    from diffret import storage

    top = str(Path(storage.__file__).resolve().parents[1])
    if top not in sys.path:
        sys.path.append(top)  # spawned worker processes start from a copy of this sys.path
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if top not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([top, *parts])
