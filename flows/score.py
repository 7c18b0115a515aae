"""The score flow: stored encodings -> runs for every (split, K_q, K_p, mode) cell."""

from __future__ import annotations

from prefect import flow

from stages.score import ScoreConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["ScoreConfig", "score_flow"]


@flow(name="score", flow_run_name=run_name, description=stage.description)
def score_flow(config: ScoreConfig) -> dict:
    return run_in_flow(stage, config)
