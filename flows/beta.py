"""The beta flow: SIDR_beta runs, a stored system's sparse query vectors against a bag-of-tokens index."""

from __future__ import annotations

from prefect import flow

from stages.beta import BetaConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["BetaConfig", "beta_flow"]


@flow(name="beta", flow_run_name=run_name, description=stage.description)
def beta_flow(config: BetaConfig) -> dict:
    return run_in_flow(stage, config)
