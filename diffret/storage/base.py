"""What every part of the store stands on: :class:`StoreBase`, one root (a local folder or any fsspec URL) and its
filesystem primitives (paths, existence, file stats and listings, whole-file reads, atomic writes), which
:class:`storage.store.ArtifactStore` and each of its parts (``storage/integrity.py``, ``storage/shards.py``,
``storage/staging.py``) derive from."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from . import layout
from .files import FILE_MODE, fsync_dir, info_stat
from .manifest import FileEntry, Manifest, ShardRecord, StoreError

if TYPE_CHECKING:  # integrity.py derives from this module's class
    from .integrity import FolderState


class StoreBase:
    """One store root and the filesystem primitives every part of :class:`storage.store.ArtifactStore` uses.

    The methods one part calls on another (manifest reads, checks, locks, shard records) are declared here too, each
    provided by the part named in its docstring; a store is always the whole :class:`storage.store.ArtifactStore`.

    >>> from diffret.storage import ArtifactStore
    >>> isinstance(ArtifactStore("/data/store"), StoreBase), ArtifactStore("/data/store").abspath("runs/x")
    (True, '/data/store/runs/x')
    """

    root: str
    fs: fsspec.AbstractFileSystem
    is_local: bool
    base: str

    def __init__(self, root: str | os.PathLike[str]):
        root = os.fspath(root)
        if not root:
            raise StoreError("store root is empty")
        self.root = root
        try:
            self.fs, base = fsspec.core.url_to_fs(root)
        except ImportError as exc:  # an object store whose filesystem package is not installed
            raise StoreError(f"store root {root}: {exc} (pip install it, or use a local --root)") from None
        except ValueError as exc:
            raise StoreError(f"store root {root}: {exc}") from None
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.base = os.path.abspath(base) if self.is_local else base.rstrip("/")
        if self.is_local and os.path.exists(self.base) and not os.path.isdir(self.base):
            raise StoreError(f"store root {root} is a file, not a folder: check --root")
        # (path, size, mtime ns) -> the sha256 this store last verified the file at
        self._verified: dict[tuple[str, int, int], str] = {}

    # ----------------------------------------------------------------------------------- paths
    def abspath(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def relpath(self, path: str) -> str:
        """``path`` relative to the root when it lies inside the store (an absolute path, as a glob returns), else
        as it is.

        >>> from diffret.storage import ArtifactStore
        >>> store = ArtifactStore("/data/store")
        >>> store.relpath(store.abspath("runs/x")), store.relpath("runs/x")
        ('runs/x', 'runs/x')
        """
        return path[len(self.base) :].lstrip("/") if path.startswith(self.base) else path

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.abspath(rel))

    def file_stat(self, rel: str) -> tuple[int, int | None] | None:
        """(size, mtime in ns) of a file, ``None`` when it is missing (mtime ``None`` where the filesystem
        gives none we can read).

        >>> import tempfile
        >>> from diffret.storage import ArtifactStore
        >>> with tempfile.TemporaryDirectory() as root:
        ...     store = ArtifactStore(root)
        ...     store.write_bytes("a/b.bin", b"abc")
        ...     store.file_stat("a/b.bin")[0], store.file_stat("a/missing")
        (3, None)
        """
        path = self.abspath(rel)
        if self.is_local:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return None
            return st.st_size, st.st_mtime_ns
        try:
            return info_stat(self.fs.info(path))
        except FileNotFoundError:
            return None

    def _listing(self, folder: str) -> dict[str, tuple[int, int | None]]:
        """Name -> (size, mtime ns) of the files directly in a folder: one listing, not one call per file."""
        path = self.abspath(folder)
        out: dict[str, tuple[int, int | None]] = {}
        if self.is_local:
            try:
                with os.scandir(path) as it:
                    for e in it:
                        if e.is_file():
                            st = e.stat()
                            out[e.name] = (st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                pass
            return out
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return out
        for e in entries:
            if e.get("type") == "file":
                out[e["name"].rstrip("/").rsplit("/", 1)[-1]] = info_stat(e)
        return out

    def read_bytes(self, rel: str) -> bytes:
        """A whole (small) file's bytes: a checkpoint, a figure."""
        with self.fs.open(self.abspath(rel), "rb") as f:
            return f.read()

    # ----------------------------------------------------------------------------- atomic writes
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a small file atomically (temporary name in the same folder, then rename)."""
        path = self.abspath(rel)
        if self.is_local:
            folder = os.path.dirname(path)
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
            try:
                os.fchmod(fd, FILE_MODE)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                fsync_dir(folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        else:  # one PUT: the object appears whole or not at all
            self.fs.pipe_file(path, data)

    def write_manifest(self, folder: str, manifest: Manifest) -> None:
        self.write_bytes(layout.manifest_path(folder), manifest.to_json().encode())

    # ------------------------------------------------------------------- provided by the parts
    def read_manifest(self, folder: str, trusted: bool = True) -> Manifest | None:
        """The folder's manifest, or None (:meth:`storage.store.ArtifactStore.read_manifest`)."""
        raise NotImplementedError("read_manifest is ArtifactStore's (storage/store.py)")

    def require_manifest(self, folder: str) -> Manifest:
        """The folder's manifest, or IncompleteArtifactError (:meth:`storage.store.ArtifactStore.require_manifest`)."""
        raise NotImplementedError("require_manifest is ArtifactStore's (storage/store.py)")

    def _manifest_for_read(self, folder: str) -> Manifest:
        """The folder's manifest, parsed once per version (:meth:`storage.store.ArtifactStore._manifest_for_read`)."""
        raise NotImplementedError("_manifest_for_read is ArtifactStore's (storage/store.py)")

    def state(
        self, folder: str, config: dict[str, Any], *, force: bool = False, verify: bool = True, hint: str = ""
    ) -> FolderState:
        """The state of ``folder`` for ``config`` (:meth:`storage.integrity.IntegrityMixin.state`)."""
        raise NotImplementedError("state is IntegrityMixin's (storage/integrity.py)")

    def verify_file(self, folder: str, name: str, entry: FileEntry, *, cached: bool = True) -> None:
        """Check one file against its entry (:meth:`storage.integrity.IntegrityMixin.verify_file`)."""
        raise NotImplementedError("verify_file is IntegrityMixin's (storage/integrity.py)")

    def lock(self, folder: str) -> contextlib.AbstractContextManager[None]:
        """Exclusive lock for one folder (:meth:`storage.staging.StagingMixin.lock`)."""
        raise NotImplementedError("lock is StagingMixin's (storage/staging.py)")

    def remove_folder(self, folder: str) -> None:
        """Remove a folder, its manifest first (:meth:`storage.staging.StagingMixin.remove_folder`)."""
        raise NotImplementedError("remove_folder is StagingMixin's (storage/staging.py)")

    def _pending_records(self, folder: str) -> tuple[list[str], list[ShardRecord | StoreError]]:
        """The shard records not yet compacted (:meth:`storage.shards.ShardsMixin._pending_records`)."""
        raise NotImplementedError("_pending_records is ShardsMixin's (storage/shards.py)")
