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
    require_same_config,
)
from .store import ArtifactStore, StageWriter

__all__ = [
    "ArtifactStore",
    "ChecksumError",
    "ConfigDriftError",
    "FileEntry",
    "IncompleteArtifactError",
    "Manifest",
    "StageWriter",
    "StoreError",
    "config_hash",
    "diff_configs",
    "require_same_config",
]
