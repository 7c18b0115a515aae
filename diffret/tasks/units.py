"""The one Prefect task of diffret: run one unit of a stage (a shard, a pass, ...) wherever the task runner puts
it (this process, a local Dask cluster, a cluster with one worker per GPU). The flow commits its result."""

from __future__ import annotations

from typing import Any

from prefect import task

from diffret.stages import run_unit


@task(name="stage-unit", tags=["diffret"], retries=1, retry_delay_seconds=10)
def run_unit_task(stage_name: str, root: str, unit: Any) -> Any:
    return run_unit(stage_name, root, unit)
