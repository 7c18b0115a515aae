"""One way to run any stage: :func:`run_stage`, in this process or as a Prefect flow run.

In this process it is ``stages.execute``, and Prefect is not imported (that takes about a second). Under
Prefect, each stage has a flow (generated in ``flows/stage_flows.py``) whose body is :func:`run_in_flow`: the same plan,
units run in the flow (or, for a distributed stage, as Prefect tasks on a thread, a local Dask cluster or an
existing one), commits in the flow process, a progress artifact and a markdown summary.
Both return one :class:`stages.StageResult`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from diffret.stages import Context, Stage, StageConfig, StageResult, execute, presentation_of
from diffret.stages.base import ProgressFn, inline_figures, run_units
from diffret.storage import ArtifactStore
from diffret.tasks.keys import artifact_key


def flow_name(command: str) -> str:
    """The flow function's name of a stage's command: ``import-run`` -> ``import_run_flow``."""
    return command.replace("-", "_") + "_flow"


def flow_ref(stage: str) -> tuple[str, str]:
    """(module, function) of a stage's Prefect flow (generated, named after the stage's command)."""
    from diffret.stages import stages

    return ("diffret.flows.stage_flows", flow_name(stages()[stage].command))


def flows() -> dict[str, tuple[str, str]]:
    """Every stage's flow as (module, function), by stage name."""
    from diffret.stages import stages

    return {name: flow_ref(name) for name in stages()}


def use_prefect(flag: bool | None = None) -> bool:
    """Run through Prefect when asked, or by default when a Prefect API is configured (``PREFECT_API_URL``)."""
    return flag if flag is not None else bool(os.environ.get("PREFECT_API_URL"))


class PrefectUnreachable(RuntimeError):
    """The configured Prefect API does not answer: one line with the way out (start it, or run without Prefect)."""


def check_prefect_api(url: str, timeout: float = 5.0) -> None:
    """Refuse, in one line, a Prefect API at ``url`` that does not answer (a server not started, a wrong host or
    port): before any flow run, which would otherwise fail after retries with three tracebacks. Any HTTP answer
    counts as an answer (an API that wants a key says so itself).

    >>> import socket
    >>> with socket.socket() as s:
    ...     s.bind(("127.0.0.1", 0))
    ...     port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    >>> try:
    ...     check_prefect_api(f"http://127.0.0.1:{port}/api")
    ... except PrefectUnreachable as exc:
    ...     print(str(exc).split(" (")[0].replace(str(port), "PORT"))
    the Prefect API at http://127.0.0.1:PORT/api does not answer
    """
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=timeout)
    except httpx.TransportError as exc:  # refused, unknown host, timed out: not an HTTP status
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise PrefectUnreachable(
            f"the Prefect API at {url} does not answer ({why}): start the server (`prefect "
            'server start`, README "In the Prefect UI"), or run without Prefect: --no-prefect '
            "(or unset PREFECT_API_URL)"
        ) from None


SERVER_STARTUP_S = 120  # Prefect's 20 s default is too short for a fresh database on a busy two-core machine
HEARTBEAT_S = 30  # flow-run heartbeats (Prefect's minimum); automations/zombie-flows.yaml waits 90 s for one


@contextlib.contextmanager
def prefect_api() -> Iterator[None]:
    """A Prefect API for the flow runs started inside (the configured one, else one temporary server), with
    the runs tagged ``diffret`` and sending a heartbeat every 30 s unless configured otherwise: the zombie-flow
    automation (automations/zombie-flows.yaml) marks a tagged run Crashed when its heartbeats stop.

    A configured API that does not answer is refused in one line (:func:`check_prefect_api`).

    Prefect would start its temporary server lazily, and a Dask worker that runs a task would then start one
    of its own (the worker inherits the flow's settings, which name no API); a worker killed before its
    server stops leaves that server holding the parent's output pipes. Naming the server in the settings
    up front gives every process of the run the same one.
    """
    from prefect import tags
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_settings(set_defaults={"flows.heartbeat_frequency": HEARTBEAT_S}))
        stack.enter_context(tags("diffret"))
        if PREFECT_API_URL.value():
            check_prefect_api(PREFECT_API_URL.value())
        else:
            from prefect.server.api.server import SubprocessASGIServer

            server = SubprocessASGIServer()
            # stopped at exit; a longer configured startup timeout wins
            server.start(timeout=max(SERVER_STARTUP_S, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
            stack.enter_context(temporary_settings(updates={PREFECT_API_URL: server.api_url}))
        yield


def run_stage(
    stage: Stage,
    config: StageConfig,
    *,
    prefect: bool = False,
    log: Callable[[str], None] = print,
    report: ProgressFn | None = None,
) -> StageResult:
    """Run ``stage`` with ``config``: in this process (``log``, ``report`` show progress; its units on Dask when the
    config asks for workers or a scheduler, :func:`flows.cluster.run_units`) or as its Prefect flow. The stages it
    needs first (``Stage.prerequisites``) run before it, the same way (in its flow, under Prefect)."""
    if prefect:
        module, name = flow_ref(stage.name)
        flow_fn = getattr(importlib.import_module(module), name)
        with prefect_api():
            return StageResult.model_validate(flow_fn(config))
    from diffret.stages import stages

    for name, first in stage.prerequisites(config):
        res = run_stage(stages()[name], first, log=log, report=report)
        if res.done:
            log(f"{name}: {res.line()}")
    from .cluster import distributed

    if distributed(stage, config):
        from .cluster import check_placement, run_units

        check_placement(stage, config)  # more workers than GPUs or cores: refused before any work

        def on_dask(stage: Stage, plan: Any, ctx: Context) -> list[Any]:
            return run_units(stage, config, plan, ctx) if plan.units else []

        res = execute(stage, config, log=log, report=report, units=on_dask)
    else:
        res = execute(stage, config, log=log, report=report)
    res.next = presentation_of(stage).next_for(config, res.system)
    return res


def run_pipeline_stages(
    config: Any, *, prefect: bool = False, log: Callable[[str], None] = print, report: Callable[..., None] | None = None
) -> dict[str, Any]:
    """`diffret run`: :func:`stages.pipeline.run_pipeline` with each stage through :func:`run_stage` (as sub-flow
    runs with ``prefect``), the local workers it asks for checked before anything is downloaded."""
    from diffret.stages.pipeline import run_pipeline

    from .cluster import check_placement

    def run(stage: Stage, cfg: StageConfig) -> StageResult:
        return run_stage(stage, cfg, prefect=prefect, log=log, report=report)

    return run_pipeline(config, run, log=log, check=check_placement)


# ------------------------------------------------------------------------------------------- Prefect
def run_name() -> str:
    """A flow run's name in the Prefect UI, from its flow and config: stage, dataset and system
    (``encode scifact splade-tiny-mlm diffretriever``); Prefect calls it when the run starts."""
    from prefect.runtime import flow_run

    return describe_run(flow_run.flow_name, flow_run.parameters.get("config"))


def describe_run(stage: str, config: Any) -> str:
    """``stage``, then the dataset(s) and the system(s) a config names (a model's folder name for a backbone).

    >>> describe_run("encode", {"dataset": "scifact", "backbone": {"model": "/m/splade-tiny"},
    ...                         "readout": {"readout": "sidr"}})
    'encode scifact splade-tiny sidr'
    >>> describe_run("score", {"dataset": "nq", "system": {"system": "dream-diffretriever-1a2b"}})
    'score nq dream-diffretriever-1a2b'
    """
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    config = config if isinstance(config, dict) else {}

    def tail(model: Any) -> str:
        return str(model).rstrip("/").rsplit("/", 1)[-1] if model else ""

    dataset = config.get("dataset") or config.get("name") or ",".join(config.get("datasets") or [])
    system = config.get("system")
    if isinstance(system, dict):
        system = system.get("system") or tail(system.get("model"))
    if not system and config.get("systems"):
        system = ",".join(config["systems"])
    if not system and isinstance(config.get("backbone"), dict):
        readout = config.get("readout") if isinstance(config.get("readout"), dict) else {}
        system = " ".join(x for x in (tail(config["backbone"].get("model")), readout.get("readout")) if x)
    return " ".join(str(x) for x in (stage, dataset, system) if x)


class ArtifactProgress:
    """Progress as Prefect progress artifacts, one per label, updated at most once a second."""

    def __init__(self) -> None:
        self._ids: dict[str, Any] = {}
        self._last: dict[str, float] = {}

    def __call__(self, label: str, done: int, total: int | None, unit: str, note: str = "") -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        now = time.monotonic()
        finished = total is not None and done >= total
        if total is None or (label in self._ids and now - self._last.get(label, 0.0) < 1.0 and not finished):
            return
        self._last[label] = now
        pct = 100.0 * done / total if total else 100.0
        text = f"{label}: {note}" if note else label
        if label not in self._ids:
            self._ids[label] = create_progress_artifact(pct, key=artifact_key(label, "progress"), description=text)
        else:
            update_progress_artifact(self._ids[label], pct, description=text)


def run_in_flow(stage: Stage, config: StageConfig) -> dict[str, Any]:
    """The body of every stage flow: the stages it needs first (``Stage.prerequisites``), then ``stages.execute``
    with its units as tasks of this run when the stage is distributed, progress as an artifact, and the summary
    (what it did, where, the rows, the time, what is next) published as a markdown artifact, with the stage's own
    pages (its presentation's ``published``)."""
    from prefect import get_run_logger
    from prefect.artifacts import create_markdown_artifact

    def units(stage: Stage, plan: Any, ctx: Context) -> list[Any]:
        ctx.log(f"{stage.label(plan)}: {len(plan.units)} unit(s) to run, {plan.skipped} already done")
        if plan.units and stage.distributed:
            return _run_unit_tasks(stage, config, plan, ctx)
        return run_units(stage, plan, ctx)

    from diffret.stages import stages

    for name, first in stage.prerequisites(config):
        run_in_flow(stages()[name], first)
    result = execute(stage, config, log=get_run_logger().info, report=ArtifactProgress(), units=units)
    shows = presentation_of(stage)
    result.next = shows.next_for(config, result.system)
    store = ArtifactStore(config.root)
    create_markdown_artifact(
        inline_figures(result.markdown(), store),
        description=stage.name,
        key=artifact_key(stage.name, result.system or "summary"),
    )
    for page in shows.published(result, store):
        create_markdown_artifact(page.markdown, key=artifact_key(*page.key), description=page.description)
    return result.model_dump(mode="json")


def unit_parameters(stage: Stage, root: str, unit: Any) -> dict[str, Any]:
    """What one unit task is sent (and Prefect records): the stage, the store and the unit, which names the run's
    shared settings by key (``storage.ArtifactStore.put_plan``): the same few hundred bytes whatever the config."""
    return {"stage_name": stage.name, "root": root, "unit": unit}


def _run_unit_tasks(stage: Stage, config: StageConfig, plan: Any, ctx: Context) -> list[Any]:
    """One Prefect task per unit, named after it, on the config's task runner (Dask workers, or this process),
    under this stage's flow run; each committed here (one writer) as it completes, progress on this run. On Dask a
    unit that computes on a GPU asks for the worker resource ``GPU`` (flows/cluster.py)."""
    import dask
    from prefect.futures import as_completed

    from diffret.tasks.units import run_unit_task

    tags = ["diffret", stage.name, *stage.task_tags]
    with _task_runner(stage, config) as runner:
        resources = _resources(stage, config, runner)

        def as_tasks() -> Iterator[tuple[Any, Any]]:
            futures = {}
            for unit in plan.units:
                task = run_unit_task.with_options(
                    name=f"{stage.name} unit", task_run_name=f"{stage.name} {stage.unit_name(unit)}", tags=tags
                )
                with dask.annotate(**({"resources": resources} if resources else {})):
                    futures[runner.submit(task, parameters=unit_parameters(stage, config.root, unit))] = unit
            for fut in as_completed(list(futures)):
                unit = futures.pop(fut)
                result = fut.result()
                # on Dask: forgotten there once here (a lost worker loses nothing); a thread's future has no release
                release = getattr(getattr(fut, "wrapped_future", None), "release", None)
                if release is not None:
                    release()
                yield unit, result

        return run_units(stage, plan, ctx, elsewhere=as_tasks)


def _task_runner(stage: Stage, config: StageConfig) -> Any:
    """Dask when the config asks for workers or names a scheduler (a local cluster placed one worker per GPU:
    ``flows.cluster.local_cluster``); else one unit at a time in this process (threads would only contend for the
    same model and device)."""
    from .cluster import distributed, expose_packages_to_workers, local_cluster, local_cluster_options

    if distributed(stage, config):
        from prefect_dask import DaskTaskRunner

        expose_packages_to_workers()
        address = getattr(config, "dask_address", None)
        if address:
            return DaskTaskRunner(address=address)
        return DaskTaskRunner(cluster_class=local_cluster, cluster_kwargs=local_cluster_options(stage, config))
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner(max_workers=1)


def _resources(stage: Stage, config: StageConfig, runner: Any) -> dict[str, int] | None:
    """The Dask resources of each unit task (None off Dask): a local cluster's GPU workers, or a joined cluster's
    (refused in one line when a GPU stage finds none there)."""
    from .cluster import check_workers, cluster_gpus, distributed, local_cluster_options, unit_resources

    if not distributed(stage, config):
        return None
    address = getattr(config, "dask_address", None)
    if not address:
        return {"GPU": 1} if local_cluster_options(stage, config).get("pins") else None
    resources = unit_resources(stage, config, gpus=cluster_gpus(runner.client))
    check_workers(runner.client, resources, address)
    return resources
