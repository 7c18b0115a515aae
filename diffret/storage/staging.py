"""Writers of a folder: the per-folder lock (local stores) and whole folders built in ``_staging/`` and
renamed into place in one step (:class:`FolderWriter`), so a killed run leaves nothing under the stage's glob that
DuckDB or a reader would pick up. Mixed into :class:`storage.store.ArtifactStore`."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from . import layout
from .base import StoreBase
from .files import PARQUET_COMPRESSION, ROW_GROUP_ROWS, fsync_dir, sha256_file
from .manifest import FileEntry, Manifest, StoreError


class StagingMixin(StoreBase):
    """:class:`storage.store.ArtifactStore`'s locks and staged folders (over :class:`storage.base.StoreBase`:
    its ``fs``, ``is_local`` and paths)."""

    # ------------------------------------------------------------------------------------ locks
    @contextlib.contextmanager
    def lock(self, folder: str) -> Iterator[None]:
        """Exclusive lock for one folder (local stores; released by the OS if the process dies). The lock
        file is removed on release (the holder unlinks it before unlocking; a process that opened the old file
        finds it gone and takes a new one), so a finished run leaves no lock files.

        On object stores there is no lock: the flow assigns each partition to one task.
        """
        if not self.is_local:
            yield
            return
        locks = self.abspath(layout.LOCKS_DIR)
        path = os.path.join(locks, layout.lock_name(folder) + ".lock")
        while True:
            try:
                os.makedirs(locks, exist_ok=True)
                fh = open(path, "a")  # noqa: SIM115 - held across the yield
            except (
                FileNotFoundError,
                FileExistsError,
            ):  # the locks folder was removed (or made and removed) in between
                continue
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                raise StoreError(
                    f"{self.abspath(folder)} is being written by another process; wait for it to finish"
                ) from None
            try:
                same = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            fh.close()  # its holder removed the file before we locked it: lock the current one
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()
            with contextlib.suppress(OSError):
                os.rmdir(locks)  # only when no other lock is held

    # --------------------------------------------------------------------------- staged stages
    @contextlib.contextmanager
    def folder_writer(self, folder: str, manifest: Manifest) -> Iterator[FolderWriter]:
        """Build a whole folder; it replaces ``folder`` only when the block finishes cleanly.

        Holds the stage lock for the whole build and clears what an earlier killed run left behind.
        """
        with self.lock(folder):
            writer = FolderWriter(self, folder, manifest)
            try:
                yield writer
                writer._commit()
            finally:
                writer._cleanup()

    def clear_stale_staging(self, folder: str) -> int:
        """Remove staging folders of ``folder`` left by killed runs (call with the lock held)."""
        if not self.is_local:
            return 0
        staging = self.abspath(layout.STAGING_DIR)
        if not os.path.isdir(staging):
            return 0
        prefix = layout.lock_name(folder) + "."
        n = 0
        try:
            entries = os.listdir(staging)
        except FileNotFoundError:  # another writer's cleanup removed it, empty, since the check
            return 0
        for entry in entries:
            if entry.startswith(prefix):
                shutil.rmtree(os.path.join(staging, entry), ignore_errors=True)
                n += 1
        return n

    def remove_folder(self, folder: str) -> None:
        path = self.abspath(folder)
        if self.fs.exists(path):
            # manifest first: from this instant nothing in the folder is accepted
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.abspath(layout.manifest_path(folder)))
            self.fs.rm(path, recursive=True)


class FolderWriter:
    """Writes the files of one folder; see ``ArtifactStore.folder_writer``."""

    def __init__(self, store: StagingMixin, folder: str, manifest: Manifest):
        self.store = store
        self.folder = folder
        self.manifest = manifest
        self._token = uuid.uuid4().hex[:12]
        if store.is_local:
            store.clear_stale_staging(folder)
            self.work_dir = store.abspath(f"{layout.STAGING_DIR}/{layout.lock_name(folder)}.{self._token}")
            for attempt in range(20):  # writers of other folders (units on Dask workers) share _staging/
                try:
                    os.makedirs(self.work_dir)
                    break
                except FileNotFoundError:  # one's cleanup removed _staging/, empty, between our two mkdirs
                    if attempt == 19:
                        raise
        else:
            self.work_dir = tempfile.mkdtemp(prefix="diffret-stage-")
            # the old manifest goes first, so the old files are never mistaken for the new ones
            store.remove_folder(folder)
        self._done = False
        self._uploaded: set[str] = set()  # the files already on an object store (the rest go up at commit)

    def write_parquet(self, name: str, schema: pa.Schema, batches: Iterable[pa.RecordBatch | pa.Table]) -> FileEntry:
        """Stream record batches into ``name`` (zstd Parquet) and record it in the manifest."""
        path = os.path.join(self.work_dir, name)
        rows = 0
        with pq.ParquetWriter(path, schema, compression=PARQUET_COMPRESSION) as w:
            for b in batches:
                if isinstance(b, pa.RecordBatch):
                    b = pa.Table.from_batches([b])
                if b.schema != schema:
                    b = b.cast(schema)
                w.write_table(b, row_group_size=ROW_GROUP_ROWS)
                rows += b.num_rows
        digest, size = sha256_file(path)
        entry = FileEntry(sha256=digest, bytes=size, rows=rows)
        self.manifest.files[name] = entry
        if not self.store.is_local:
            self.store.fs.put_file(path, self.store.abspath(f"{self.folder}/{name}"))
            self._uploaded.add(name)
        return entry

    def write_file(self, name: str, data: bytes) -> FileEntry:
        """A non-Parquet file of the stage (a figure, a markdown summary), recorded in the manifest."""
        path = os.path.join(self.work_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        entry = FileEntry(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
        self.manifest.files[name] = entry
        if not self.store.is_local:
            self.store.fs.put_file(path, self.store.abspath(f"{self.folder}/{name}"))
            self._uploaded.add(name)
        return entry

    def _commit(self) -> None:
        store = self.store
        if store.is_local:
            with open(os.path.join(self.work_dir, layout.MANIFEST_NAME), "w") as f:
                f.write(self.manifest.to_json())
                f.flush()
                os.fsync(f.fileno())
            final = store.abspath(self.folder)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            old = None
            if os.path.exists(final):
                old = f"{self.work_dir}.old"
                os.rename(final, old)
            os.rename(self.work_dir, final)
            fsync_dir(os.path.dirname(final))
            if old:
                shutil.rmtree(old, ignore_errors=True)
        else:
            # files a stage wrote into work_dir itself (a LanceDB table's folder) go up before the manifest that
            # lists them: a reader never sees a manifest whose files are not there
            for name in sorted(set(self.manifest.files) - self._uploaded):
                path = os.path.join(self.work_dir, name)
                if os.path.isfile(path):
                    store.fs.put_file(path, store.abspath(f"{self.folder}/{name}"))
            store.write_manifest(self.folder, self.manifest)
        self._done = True

    def _cleanup(self) -> None:
        if os.path.isdir(self.work_dir):
            shutil.rmtree(self.work_dir, ignore_errors=True)
        if self.store.is_local:
            with contextlib.suppress(OSError):
                os.rmdir(self.store.abspath(layout.STAGING_DIR))  # only when no other build is staged
