"""The late flow: late-parametric re-scoring of a first stage's top m by any system's mode (SIDR's beta(m))."""

from __future__ import annotations

from prefect import flow

from stages.late import LateConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["LateConfig", "late_flow"]


@flow(name="late", flow_run_name=run_name, description=stage.description)
def late_flow(config: LateConfig) -> dict:
    return run_in_flow(stage, config)
