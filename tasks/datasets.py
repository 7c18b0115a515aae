"""Tasks of the download flow: fetch a collection's source files, materialise it into the store."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from retrieval.ingest import IngestResult, materialise
from retrieval.sources import DownloadError, SourceFiles, resolve_source
from storage import ArtifactStore
from tasks.keys import artifact_key


class _ArtifactProgress:
    """Download progress as a Prefect progress artifact (updated at most once a second)."""

    def __init__(self, key: str):
        self.key = key
        self.artifact_id = None
        self._last = 0.0

    def __call__(self, label: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        if total is None or (now - self._last < 1.0 and done < total):
            return
        self._last = now
        pct = 100.0 * done / total if total else 0.0
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(pct, key=self.key, description=f"download {label}")
        else:
            update_progress_artifact(self.artifact_id, pct)


def _network_errors_only(task, task_run, state) -> bool:
    """Retry downloads that failed on the network, never malformed input or a wrong name."""
    try:
        state.result()
    except DownloadError:
        return True
    except Exception:  # noqa: BLE001
        return False
    return False


@task(
    name="fetch-source",
    retries=2,
    retry_delay_seconds=30,
    retry_condition_fn=_network_errors_only,
    tags=["download"],
)
def fetch_source(name: str, source: str | None, cache_dir: str, beir_base_url: str) -> SourceFiles:
    progress = _ArtifactProgress(key=artifact_key("download", name))
    return resolve_source(name, source, Path(cache_dir).expanduser(), beir_base_url, progress=progress)


@task(name="materialise-dataset", tags=["store"])
def materialise_dataset(root: str, name: str, files: SourceFiles, force: bool) -> IngestResult:
    return materialise(ArtifactStore(root), name, files, force=force)
