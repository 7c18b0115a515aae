"""The evaluate flow: per-query metrics (pytrec_eval) for the runs in the store without current ones."""

from __future__ import annotations

from prefect import flow

from stages.evaluate import EvaluateConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["EvaluateConfig", "evaluate_flow"]


@flow(name="evaluate", flow_run_name=run_name, description=stage.description)
def evaluate_flow(config: EvaluateConfig) -> dict:
    return run_in_flow(stage, config)
