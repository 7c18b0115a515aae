"""The fuse flow: stored runs of any systems fused (min-max, weighted) into a system of its own."""

from __future__ import annotations

from prefect import flow

from stages.fuse import FuseConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["FuseConfig", "fuse_flow"]


@flow(name="fuse", flow_run_name=run_name, description=stage.description)
def fuse_flow(config: FuseConfig) -> dict:
    return run_in_flow(stage, config)
