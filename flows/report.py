"""The report flow: budget selection, landscapes, per-query oracle, feature correlation, paper tables and
footprint from the metrics in the store; published as Prefect artifacts when run as a flow."""

from __future__ import annotations

from collections.abc import Callable

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from storage import ArtifactStore
from tasks.keys import artifact_key


class ReportConfig(BaseModel):
    """Parameters of the report flow."""

    root: str = Field(default="./diffret-store", description="Artifact store root.")
    name: str = Field(default="default", description="Report name: reports/report=<name>/ in the store.")
    out_dir: str | None = Field(default=None, description="Also copy the report into this folder.")
    refs: list[str] | None = Field(
        default=None, description="Systems the tables' t-test markers compare with († first, ‡ second; default: bm25)."
    )
    finetuned: dict[str, str] = Field(default_factory=dict, description="BASE system slug -> fine-tuned slug.")
    n_boot: int = Field(default=1000, ge=10, description="Bootstrap resamples of the correlation CIs.")
    hidden: int = Field(default=3584, ge=1, description="Footprint projection: hidden size (Dream-7B: 3584).")
    backbones: int = Field(default=4, ge=1, description="Footprint projection: backbones.")
    settings: int = Field(default=2, ge=1, description="Footprint projection: settings per backbone.")


def run_report(config: ReportConfig, log: Callable[[str], None] = print):  # noqa: ANN201 - (Report, folder)
    from retrieval.report import build_report, write_report

    store = ArtifactStore(config.root)
    rep = build_report(
        store, config.name, config.refs, config.finetuned, config.n_boot, config.hidden, config.backbones,
        config.settings,
    )  # fmt: skip
    folder = write_report(store, rep, config.model_dump(mode="json", exclude={"root", "out_dir"}), config.out_dir)
    log(f"report: {folder}/report.md ({len(rep.files)} files)")
    return rep, folder


@flow(name="report", description="The paper's analyses and tables from the metrics in the store.")
def report_flow(config: ReportConfig) -> dict:
    rep, folder = run_report(config, get_run_logger().info)
    for title, body in rep.sections:
        # figure links point into the store folder
        body = body.replace("](", f"]({folder}/").replace(f"]({folder}/#", "](#")
        create_markdown_artifact(
            f"## {title}\n\n{body}", key=artifact_key("report", config.name, title), description=title
        )
    return {"folder": folder, "files": sorted(rep.files)}
