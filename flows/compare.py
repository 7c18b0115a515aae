"""The compare flow: runs against a baseline with corrected significance (Markdown, CSV, LaTeX)."""

from __future__ import annotations

from prefect import flow

from stages.compare import CompareConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["CompareConfig", "compare_flow"]


@flow(name="compare", flow_run_name=run_name, description=stage.description)
def compare_flow(config: CompareConfig) -> dict:
    return run_in_flow(stage, config)
