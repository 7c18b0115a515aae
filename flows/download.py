"""The download flow: a test collection from its official location or a mirror into the store."""

from __future__ import annotations

from prefect import flow

from stages.ingest import DownloadConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["DownloadConfig", "download_flow"]


@flow(name="download", flow_run_name=run_name, description=stage.description)
def download_flow(config: DownloadConfig) -> dict:
    return run_in_flow(stage, config)
