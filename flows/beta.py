"""The beta flow: SIDR_beta runs, a stored system's sparse query vectors against a bag-of-tokens index."""

from __future__ import annotations

from prefect import flow

from stages.beta import BetaConfig, stage

from .runner import run_in_flow

__all__ = ["BetaConfig", "beta_flow"]


@flow(name="beta", description=stage.description)
def beta_flow(config: BetaConfig) -> dict:
    return run_in_flow(stage, config)
