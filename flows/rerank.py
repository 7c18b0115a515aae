"""The rerank flow: a diffusion-LM reranker (DiffuRank) over a stored first-stage run, written as a run."""

from __future__ import annotations

from prefect import flow

from stages.rerank import RerankConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["RerankConfig", "rerank_flow"]


@flow(name="rerank", flow_run_name=run_name, description=stage.description)
def rerank_flow(config: RerankConfig) -> dict:
    return run_in_flow(stage, config)
