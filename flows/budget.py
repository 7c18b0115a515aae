"""The budget flow: an adaptive (K_q, K_p) per query, learned on a train split, applied to others."""

from __future__ import annotations

from prefect import flow

from stages.budget import BudgetConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["BudgetConfig", "budget_flow"]


@flow(name="budget", flow_run_name=run_name, description=stage.description)
def budget_flow(config: BudgetConfig) -> dict:
    return run_in_flow(stage, config)
