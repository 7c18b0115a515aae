"""The pipeline flow (`diffret run` under Prefect): the stages of ``stages.pipeline.run_pipeline`` as sub-flow runs, and
the leaderboard of each split as an artifact of this run.

Every stage is idempotent over the store (a stage finds its finished artifacts by config hash and
skips them), so re-running the pipeline, or `prefect deployment run` after a failure, resumes where
the last run stopped and a finished run does no model work.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from diffret.stages.base import inline_figures
from diffret.stages.pipeline import PipelineConfig
from diffret.stages.summary import summary_page
from diffret.storage import ArtifactStore
from diffret.storage.layout import summary_dir

from .runner import run_name, run_pipeline_stages

__all__ = ["pipeline_flow"]


@flow(
    name="pipeline",
    flow_run_name=run_name,
    description="Zero-shot DiffRetriever grid on one dataset, end to end, with BM25.",
)
def pipeline_flow(config: PipelineConfig) -> dict:
    """The same stages as sub-flow runs (each visible in the UI; each skips what the store already has); the
    leaderboard of each split, its heatmaps embedded, as an artifact of this run."""
    res = run_pipeline_stages(config, prefect=True, log=get_run_logger().info)
    store = ArtifactStore(config.root)
    for split in res["folders"]:
        page = inline_figures(summary_page(store, summary_dir(res["system"], config.name(), split)), store)
        create_markdown_artifact(page, key=f"leaderboard-{split}", description=f"{config.name()} {split} leaderboard")
    return {k: v for k, v in res.items() if k != "markdown"}
