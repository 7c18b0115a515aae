"""The compress flow: a stored float16 system -> a compressed one (int8, residual:B, pq:M), without re-encoding."""

from __future__ import annotations

from prefect import flow

from stages.compress import CompressConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["CompressConfig", "compress_flow"]


@flow(name="compress", flow_run_name=run_name, description=stage.description)
def compress_flow(config: CompressConfig) -> dict:
    return run_in_flow(stage, config)
