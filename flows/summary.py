"""The summary flow: a system's leaderboard, heatmaps and summary page from the metrics in the store."""

from __future__ import annotations

from prefect import flow

from stages.summary import SummaryConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["SummaryConfig", "summary_flow"]


@flow(name="summary", flow_run_name=run_name, description=stage.description)
def summary_flow(config: SummaryConfig) -> dict:
    return run_in_flow(stage, config)
