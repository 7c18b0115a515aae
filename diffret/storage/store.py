"""The artifact store: one root (a local folder or any fsspec URL), atomic writes, verified reads.

Rules (docs/ARCHITECTURE.md, "The store"):
- every write is atomic: a file is written under a temporary name and renamed into place (on object
  stores, where a single PUT is already atomic, the object is uploaded whole);
- a folder is trusted only through its ``_manifest.json``: the producing config and its hash,
  row counts, sha256 and size of every file, library versions. The manifest is written last;
- a reader verifies checksums and refuses artifacts whose config differs from the one it expects,
  naming the differing fields.

Whole folders (a dataset's three tables) are built in ``_staging/`` and renamed into place in
one step on local filesystems, so a killed run leaves nothing under the stage's glob that DuckDB or a
reader would pick up.

:class:`ArtifactStore` is this module's URLs, plans, manifest and table reads and listings, over
:class:`storage.base.StoreBase` (``storage/base.py``: the root, paths, file stats, whole-file reads and atomic writes
every part uses), with its other parts mixed in from beside it: ``storage/files.py`` (checksums, file modes, Parquet
settings), ``storage/integrity.py`` (verification, stage states, repair hints), ``storage/shards.py`` (sharded
folders and their shard records) and ``storage/staging.py`` (locks, whole folders built in ``_staging/``). Every
name of those parts that was importable from here still is.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from diffret.caching import KeyedCache

from . import layout
from .files import FILE_MODE, PARQUET_COMPRESSION, ROW_GROUP_ROWS, sha256_file
from .integrity import DRIFT_HINT, FolderState, IntegrityMixin
from .manifest import (
    ChecksumError,
    ConfigDriftError,
    FileEntry,
    IncompleteArtifactError,
    Manifest,
    ShardRecord,
    StoreError,
    config_hash,
    diff_configs,
    is_input_field,
)
from .shards import ShardsMixin, remove_empty_sharded, shard_record_path
from .staging import FolderWriter, StagingMixin

__all__ = [
    "DRIFT_HINT",
    "FILE_MODE",
    "PARQUET_COMPRESSION",
    "ROW_GROUP_ROWS",
    "ArtifactStore",
    "ChecksumError",
    "ConfigDriftError",
    "FileEntry",
    "IncompleteArtifactError",
    "Manifest",
    "ShardRecord",
    "FolderState",
    "FolderWriter",
    "StoreError",
    "config_hash",
    "diff_configs",
    "is_input_field",
    "layout",
    "remove_empty_sharded",
    "sha256_file",
    "shard_record_path",
]

# parsed manifests of local folders by path, each with the (inode, size, mtime) it was read at: a reader of one shard
# at a time (encode units, scoring) parses a 9k-entry manifest once, not once per shard
_MANIFEST_CACHE: KeyedCache[str, tuple[tuple[int, int, int], Manifest]] = KeyedCache(size=32)


class ArtifactStore(ShardsMixin, IntegrityMixin, StagingMixin):
    """All artifact I/O of diffret goes through one of these."""

    def __repr__(self) -> str:
        return f"ArtifactStore({self.root!r})"

    # ----------------------------------------------------------------------------------- paths
    def url(self, rel: str = "") -> str:
        """Where ``rel`` is, as a user gives it back: a local path, or the object store's URL with its protocol
        (``s3://bucket/store/runs/x``; :meth:`abspath` is the filesystem's own path, without it).

        >>> ArtifactStore("/data/store").url("runs/x"), ArtifactStore("memory://st").url("runs/x")
        ('/data/store/runs/x', 'memory:///st/runs/x')
        """
        path = self.abspath(rel)
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def refuse_inside(self, path: str, flag: str = "--out") -> str:
        """``path`` (a file or folder a command writes its result to) made absolute, or :class:`StoreError` when it
        lies inside the store root: a result written there would replace or shadow stored artifacts.

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as root:
        ...     try:
        ...         ArtifactStore(root).refuse_inside(f"{root}/runs/x.csv")
        ...     except StoreError as exc:
        ...         print("inside the store root" in str(exc))
        True
        """
        out = os.path.realpath(os.path.expanduser(path))
        if self.is_local:
            base = os.path.realpath(self.base)
            if out == base or out.startswith(base.rstrip(os.sep) + os.sep):
                raise StoreError(
                    f"{flag} {path} is inside the store root {self.root}: write results outside the "
                    "store (its files are only written by its stages)"
                )
        return out

    def local_path(self, rel: str) -> str:
        """Absolute local path (DuckDB reads the store directly when it is local)."""
        if not self.is_local:
            raise StoreError(f"{self.root} is not a local store; DuckDB views need a local root")
        return self.abspath(rel)

    def put_plan(self, payload: dict[str, Any]) -> str:
        """Store what every unit of a stage run shares (its settings) once; the key its units carry instead.

        A unit sent to another process (a Dask worker) then costs the same few bytes however large the settings
        are. Content-addressed: the same settings give the same key and file, so re-planning writes nothing new.
        The run removes it when it ends (:meth:`remove_plan`).

        Examples
        --------
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as root:
        ...     store = ArtifactStore(root)
        ...     key = store.put_plan({"model": "m", "k": 4})
        ...     store.read_plan(key), key == store.put_plan({"k": 4, "model": "m"})
        ...     store.remove_plan(key)
        ({'k': 4, 'model': 'm'}, True)
        """
        data = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        key = hashlib.sha256(data).hexdigest()[:24]
        if not self.exists(layout.plan_path(key)):
            self.write_bytes(layout.plan_path(key), data)
        return key

    def remove_plan(self, key: str) -> None:
        """Remove the shared settings under ``key`` once the stage run that stored them has ended."""
        rel = layout.plan_path(key)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.abspath(rel))
        if self.is_local:
            with contextlib.suppress(OSError):
                os.rmdir(self.abspath(layout.PLANS_DIR))  # only when empty

    def read_plan(self, key: str) -> dict[str, Any]:
        """The shared settings stored by :meth:`put_plan` under ``key``; StoreError when missing or changed."""
        rel = layout.plan_path(key)
        try:
            data = self.read_bytes(rel)
        except FileNotFoundError as exc:
            raise StoreError(
                f"{self.abspath(rel)}: the stage run's shared settings are missing (removed while "
                "it ran?); run the stage again"
            ) from exc
        if hashlib.sha256(data).hexdigest()[:24] != key:
            raise StoreError(f"{self.abspath(rel)}: changed since it was written; run the stage again")
        return json.loads(data)

    # ------------------------------------------------------------------------------------ reads
    def read_manifest(self, folder: str, trusted: bool = True) -> Manifest | None:
        """The folder's manifest (None when it has none). An unreadable one, or (``trusted``) one edited by hand, is
        a :class:`StoreError` naming the repair; writers deciding what to rebuild pass ``trusted=False``."""
        path = self.abspath(layout.manifest_path(folder))
        try:
            with self.fs.open(path, "rb") as f:
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return None
        except (NotADirectoryError, IsADirectoryError):
            raise StoreError(f"{path}: not a manifest file; {self.repair(folder)}") from None
        try:
            m = Manifest.from_json(text, where=path)
        except StoreError as exc:
            raise StoreError(f"{exc}; {self.repair(folder)}") from None
        if trusted and (line := self.edited_problem(folder, m, subject=path)):
            raise StoreError(line)
        return m

    def require_manifest(self, folder: str) -> Manifest:
        m = self.read_manifest(folder)
        if m is None:
            hint = ""
            if self.exists(folder):
                hint = (
                    f" (the folder exists but has no manifest: an interrupted run or a deleted manifest; "
                    f"{self.repair(folder)})"
                )
            raise IncompleteArtifactError(f"{self.abspath(folder)}: no complete artifact here{hint}")
        return m

    def _manifest_for_read(self, folder: str) -> Manifest:
        """The folder's manifest, parsed once per version of the file (local stores); never mutate it."""
        if not self.is_local:
            return self.require_manifest(folder)
        path = self.abspath(layout.manifest_path(folder))
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return self.require_manifest(folder)  # its error says why
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        hit = _MANIFEST_CACHE.get(path, lambda: (key, self.require_manifest(folder)))
        if hit[0] != key:  # rewritten since it was parsed: parse it again
            _MANIFEST_CACHE.pop(path)
            hit = _MANIFEST_CACHE.get(path, lambda: (key, self.require_manifest(folder)))
        return hit[1]

    def read_table(
        self,
        folder: str,
        name: str,
        columns: list[str] | None = None,
        batch_rows: int | None = None,
    ) -> pa.Table:
        """One file of a complete stage folder, verified against its manifest entry.

        A shard recorded but not yet compacted into the manifest (a sharded stage still running, or killed)
        is read through its record. ``batch_rows``: decode ``batch_rows`` rows at a time (the same table, in chunks):
        Parquet's decoding scratch for nested columns (an encodings shard's vectors) is then that many rows', not the
        file's (162 MB for a 5,000 x 16 x 128 float16 shard read whole, 72 MB by 250 rows).
        """
        self.read_table_entry(folder, name)
        with self.fs.open(self.abspath(f"{folder}/{name}"), "rb") as f:
            if batch_rows is None:
                return pq.read_table(f, columns=columns)
            pf = pq.ParquetFile(f)
            batches = list(pf.iter_batches(batch_size=batch_rows, columns=columns))
            schema = pf.schema_arrow if columns is None else pa.schema([pf.schema_arrow.field(c) for c in columns])
            return pa.Table.from_batches(batches, schema=schema)

    def iter_batches(
        self, folder: str, name: str, columns: list[str] | None = None, batch_size: int = 65_536
    ) -> Iterator[pa.RecordBatch]:
        """:meth:`read_table`'s file (verified the same way) as record batches of at most ``batch_size`` rows, so
        that memory holds one row group and not the file: a corpus of millions of passages read a slice at a time."""
        self.read_table_entry(folder, name)
        with self.fs.open(self.abspath(f"{folder}/{name}"), "rb") as f:
            pf = pq.ParquetFile(f)
            # a row group at a time: ParquetFile.iter_batches keeps memory it read (RSS grew ~200 B a row over a
            # 1M-row corpus, pyarrow 26); read_row_group's is released with the group
            for group in range(pf.metadata.num_row_groups):
                yield from pf.read_row_group(group, columns=columns).to_batches(max_chunksize=batch_size)

    def read_table_entry(self, folder: str, name: str) -> FileEntry:
        """The verified manifest entry of one file of a complete stage folder (a shard recorded but not yet
        compacted into the manifest through its record), as :meth:`read_table` checks it."""
        m = self._manifest_for_read(folder)
        entry = m.files.get(name)
        try:
            if entry is None:
                raise IncompleteArtifactError(f"{self.abspath(folder)}/{name}: not in the stage manifest")
            self.verify_file(folder, name, entry)
            return entry
        except (IncompleteArtifactError, ChecksumError):
            pending = self._pending_entry(folder, name, m.config_hash)  # redone, or not compacted yet
            if pending is None:
                raise
            self.verify_file(folder, name, pending)
            return pending

    # ---------------------------------------------------------------------------------- listings
    def folders(self, pattern: str) -> list[str]:
        """Folders (relative to the root) matching a glob of folders that have a manifest, sorted.

        ``store.folders("runs/*/*/*/*/*/*")`` lists every run folder.
        """
        base = self.abspath("")
        paths = self.fs.glob(self.abspath(f"{pattern}/{layout.MANIFEST_NAME}"))
        return sorted(p[len(base) :].lstrip("/").rsplit("/", 1)[0] for p in paths)

    def fingerprint(self, *patterns: str) -> str:
        """A hash of every folder matching ``patterns``: their config hashes and file checksums.

        A stage built from those folders records it among its inputs, so it is rebuilt when they change. A folder whose
        manifest is unreadable or edited by hand counts as damaged (the views leave it out), so that its repair changes
        the hash too.
        """
        parts: list[list[object]] = []
        for pattern in patterns:
            for folder in self.folders(pattern):
                try:
                    m = self.read_manifest(folder)
                except StoreError:
                    parts.append([folder, "damaged"])
                    continue
                if m is not None:
                    parts.append([folder, m.config_hash, sorted((k, e.sha256) for k, e in m.files.items())])
        return config_hash({"folders": parts})

    def list_partitions(self, folder: str, key: str) -> list[str]:
        """Values of the first partition key under ``folder`` that have a manifest."""
        base = self.abspath(folder)
        if not self.fs.exists(base):
            return []
        out = []
        for p in self.fs.ls(base, detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(f"{key}=") and self.fs.exists(f"{p.rstrip('/')}/{layout.MANIFEST_NAME}"):
                out.append(name.split("=", 1)[1])
        return sorted(out)
