"""The artifact store of diffret: paths, Arrow schemas, atomic Parquet writes, manifests."""

from .manifest import (
    ChecksumError,
    ConfigDriftError,
    FileEntry,
    IncompleteArtifactError,
    Manifest,
    StoreError,
    config_hash,
    diff_configs,
)
from .store import ArtifactStore, FolderState, FolderWriter, remove_empty_sharded

__all__ = [
    "ArtifactStore",
    "ChecksumError",
    "ConfigDriftError",
    "FileEntry",
    "IncompleteArtifactError",
    "Manifest",
    "FolderState",
    "FolderWriter",
    "StoreError",
    "config_hash",
    "diff_configs",
    "remove_empty_sharded",
]
