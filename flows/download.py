"""The download flow: a test collection from its official location or a mirror into the store."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from retrieval.ingest import IngestResult, materialise
from retrieval.sources import BEIR_BASE_URL, Progress, resolve_source
from storage import ArtifactStore
from tasks.keys import artifact_key


class DownloadConfig(BaseModel):
    """Parameters of the download flow (the Prefect UI renders them as a form)."""

    name: str = Field(
        description="Collection: a BEIR name (scifact, nfcorpus, arguana, fiqa, trec-covid, nq, hotpotqa, quora, "
        "scidocs, ...), msmarco-passage, trec-dl-2019, trec-dl-2020, or any name with a --source."
    )
    source: str | None = Field(
        default=None,
        description="Mirror in BEIR layout: a folder, a .zip/.tar.gz, or a URL of either. "
        "Default: the official location.",
    )
    root: str = Field(default="./diffret-store", description="Artifact store root: a local folder or an fsspec URL.")
    cache_dir: str = Field(default="~/.cache/diffret/downloads", description="Where downloaded archives are kept.")
    force: bool = Field(default=False, description="Replace a stored copy that came from a different source.")
    beir_base_url: str = Field(
        default=BEIR_BASE_URL, description="Base URL of the BEIR zips (for institutional mirrors)."
    )


def run_download(config: DownloadConfig, progress: Progress | None = None) -> IngestResult:
    """The flow's work without Prefect (what the CLI runs when no Prefect API is configured)."""
    files = resolve_source(
        config.name, config.source, Path(config.cache_dir).expanduser(), config.beir_base_url, progress=progress
    )
    return materialise(ArtifactStore(config.root), config.name, files, force=config.force)


def report_markdown(result: IngestResult) -> str:
    rows = "\n".join(
        f"| {name} | {e.rows:,} | {e.bytes:,} | `{e.sha256[:12]}` |" for name, e in result.manifest.files.items()
    )
    notes = "\n".join(f"- {line}" for line in result.report_lines)
    head = "| file | rows | bytes | sha256 |\n|---|---:|---:|---|"
    return f"# {result.dataset}: {result.status}\n\n{head}\n{rows}\n\n{notes}\n"


@flow(name="download", description="Materialise a retrieval test collection into the artifact store.")
def download_flow(config: DownloadConfig) -> dict:
    from tasks.datasets import fetch_source, materialise_dataset

    files = fetch_source(config.name, config.source, config.cache_dir, config.beir_base_url)
    result = materialise_dataset(config.root, config.name, files, config.force)
    create_markdown_artifact(
        report_markdown(result), key=artifact_key("dataset", config.name), description="download report"
    )
    return result.summary()
