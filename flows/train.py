"""The train flow: contrastive fine-tuning on a stored training set, resumable from its checkpoints."""

from __future__ import annotations

from prefect import flow

from stages.train import TrainConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["TrainConfig", "train_flow"]


@flow(name="train", flow_run_name=run_name, description=stage.description)
def train_flow(config: TrainConfig) -> dict:
    return run_in_flow(stage, config)
