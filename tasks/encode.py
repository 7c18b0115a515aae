"""Tasks of the encode flow: encode one (side, K, shard) with a backbone cached per worker process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prefect import task

from retrieval.backbones import load_backbone
from retrieval.encoding import EncodeSettings, encode_shard
from retrieval.readouts import Reader
from storage import ArtifactStore, FileEntry

_READERS: dict[str, Reader] = {}
_LOAD_LOCK = threading.Lock()


def reader_for(settings: EncodeSettings) -> Reader:
    """One loaded model per worker process and settings (a Dask worker keeps it across shards).

    Loading is serialised: transformers builds a model under process-global state (the meta device
    context), so two threads loading at once can hand each other meta tensors.
    """
    key = settings.model_dump_json()
    with _LOAD_LOCK:
        if key not in _READERS:
            _READERS.clear()  # one model at a time: free the previous one's memory
            _READERS[key] = Reader(load_backbone(settings.backbone), settings.readout)
        return _READERS[key]


def encode_job(
    root: str,
    settings: dict[str, Any],
    tokens_stage: str,
    shard: str,
    out_stage: str,
    side: str,
    k: int,
    batch_size: int,
    on_rows: Callable[[int], None] | None = None,
) -> FileEntry:
    reader = reader_for(EncodeSettings.model_validate(settings))
    return encode_shard(ArtifactStore(root), reader, tokens_stage, shard, out_stage, side, k, batch_size, on_rows)


@task(name="encode-shard", tags=["encode", "gpu"], retries=1, retry_delay_seconds=10)
def encode_shard_task(
    root: str,
    settings: dict[str, Any],
    tokens_stage: str,
    shard: str,
    out_stage: str,
    side: str,
    k: int,
    batch_size: int,
) -> FileEntry:
    return encode_job(root, settings, tokens_stage, shard, out_stage, side, k, batch_size)
