"""The training-data flow: contrastive training groups (Tevatron format) from a file or a stored run."""

from __future__ import annotations

from prefect import flow

from stages.training_data import TrainingDataConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["TrainingDataConfig", "training_data_flow"]


@flow(name="training-data", flow_run_name=run_name, description=stage.description)
def training_data_flow(config: TrainingDataConfig) -> dict:
    return run_in_flow(stage, config)
