"""The index flow: a LanceDB multivector table (+ optional ANN index) per K_p, checked against exact search."""

from __future__ import annotations

from prefect import flow

from stages.index import IndexConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["IndexConfig", "index_flow"]


@flow(name="index", flow_run_name=run_name, description=stage.description)
def index_flow(config: IndexConfig) -> dict:
    return run_in_flow(stage, config)
