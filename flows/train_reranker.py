"""The train-reranker flow: DiffuRank's rerankers fine-tuned on ranked lists, resumable from checkpoints."""

from __future__ import annotations

from prefect import flow

from stages.train_reranker import TrainRerankerConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["TrainRerankerConfig", "train_reranker_flow"]


@flow(name="train-reranker", flow_run_name=run_name, description=stage.description)
def train_reranker_flow(config: TrainRerankerConfig) -> dict:
    return run_in_flow(stage, config)
