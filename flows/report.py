"""The report flow: the paper's analyses from the metrics in the store, published as markdown artifacts."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from diffret.stages.base import inline_figures
from diffret.stages.report import ReportConfig, stage
from diffret.storage import ArtifactStore
from diffret.tasks.keys import artifact_key

from .runner import run_in_flow, run_name

__all__ = ["ReportConfig", "report_flow"]


@flow(name="report", flow_run_name=run_name, description=stage.description)
def report_flow(config: ReportConfig) -> dict:
    res = run_in_flow(stage, config)
    store, folder = ArtifactStore(config.root), res["details"]["folder"]
    for title, body in res["details"]["sections"].items():
        # figure links point into the store folder; embedded, so that the browser shows them
        body = inline_figures(body.replace("](", f"]({folder}/").replace(f"]({folder}/#", "](#"), store)
        create_markdown_artifact(
            f"## {title}\n\n{body}", key=artifact_key("report", config.name, title), description=title
        )
    return res
