"""The BM25 flow: runs of the lexical baseline, written like every other system's."""

from __future__ import annotations

from prefect import flow

from stages.bm25 import BM25Config, stage

from .runner import run_in_flow, run_name

__all__ = ["BM25Config", "bm25_flow"]


@flow(name="bm25", flow_run_name=run_name, description=stage.description)
def bm25_flow(config: BM25Config) -> dict:
    return run_in_flow(stage, config)
