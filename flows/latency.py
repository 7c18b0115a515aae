"""The latency flow: a system's encoding latency against input length and search latency against index size."""

from __future__ import annotations

from prefect import flow

from stages.latency import LatencyConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["LatencyConfig", "latency_flow"]


@flow(name="latency", flow_run_name=run_name, description=stage.description)
def latency_flow(config: LatencyConfig) -> dict:
    return run_in_flow(stage, config)
