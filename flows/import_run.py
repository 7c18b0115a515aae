"""The import-run flow: a TREC or Parquet run made elsewhere stored as a system of its own."""

from __future__ import annotations

from prefect import flow

from stages.import_run import ImportRunConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["ImportRunConfig", "import_run_flow"]


@flow(name="import-run", flow_run_name=run_name, description=stage.description)
def import_run_flow(config: ImportRunConfig) -> dict:
    return run_in_flow(stage, config)
