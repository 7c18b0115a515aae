"""Sharded folders (tokens, encodings), filled shard by shard: each finished shard gets one record (its
entry and the config hash it was planned against), folded into the folder's manifest in one write when the stage
ends, so a killed run loses nothing and the cost per shard is constant. Mixed into
:class:`storage.store.ArtifactStore`."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import layout
from .base import StoreBase
from .files import PARQUET_COMPRESSION, fsync_dir
from .integrity import FolderState
from .manifest import ChecksumError, FileEntry, Manifest, ShardRecord, StoreError, config_hash

if TYPE_CHECKING:
    from .store import ArtifactStore


def shard_record_path(folder: str, name: str) -> str:
    """Where the record of shard ``name`` waits for compaction on an object store (relative to the root).

    >>> shard_record_path("tokens/tokenizer=t/dataset=d/side=query", "shard=00000.parquet")
    'tokens/tokenizer=t/dataset=d/side=query/_records/shard=00000.parquet.json'
    """
    return f"{folder}/{layout.SHARD_RECORDS_DIR}/{name}.json"


class ShardsMixin(StoreBase):
    """:class:`storage.store.ArtifactStore`'s sharded folders (over :class:`storage.base.StoreBase`: its ``fs``,
    ``is_local``, paths, manifest reads, checks and locks)."""

    # A sharded folder (tokens, encodings) is filled shard by shard. Each finished shard gets one record (its
    # entry and the config hash it was planned against): a line of ``_shards.jsonl`` (local stores: an append log,
    # one fsync per shard), or on object stores (which cannot append) an object ``_records/<shard>.json``.
    # ``compact_shards`` folds the records into the manifest in one write at the end of the stage, and
    # ``open_sharded`` does so first, so a killed run loses nothing. The cost per shard is constant.
    def open_sharded(
        self,
        folder: str,
        kind: str,
        partition: dict[str, str],
        config: dict[str, Any],
        *,
        force: bool = False,
        verify: bool = False,
    ) -> tuple[Manifest, set[str]]:
        """A folder filled shard by shard: its manifest (created when absent, records of a killed run
        compacted into it) and the shards already done.

        A shard is done when the manifest lists it and its file still has the recorded size and mtime; a
        file whose mtime moved (a copied store, an older manifest) is checked by sha256 and its mtime
        recorded again. ``verify`` checks every shard by sha256. A folder of other inputs (or of other
        settings, with ``force``) is removed first; other settings without ``force`` raise
        :class:`ConfigDriftError`.

        Examples
        --------
        >>> import tempfile, pyarrow as pa
        >>> from diffret.storage import ArtifactStore
        >>> with tempfile.TemporaryDirectory() as root:
        ...     store = ArtifactStore(root)
        ...     m, done = store.open_sharded("t/side=q", "t", {"side": "q"}, {"n": 1})
        ...     entry = store.write_shard("t/side=q", "shard=00000.parquet", pa.table({"x": [1, 2]}))
        ...     store.record_shard("t/side=q", "shard=00000.parquet", entry, m.config_hash)
        ...     store.compact_shards("t/side=q"), store.open_sharded("t/side=q", "t", {"side": "q"}, {"n": 1})[1]
        (1, {'shard=00000.parquet'})
        """
        st = self.state(folder, config, force=force, verify=False)
        with self.lock(folder + "/_manifest"):
            if st == FolderState.DAMAGED and self._keep_checked_entries(folder):
                st = FolderState.CURRENT  # only the file list was edited: the shards that still verify are kept
            if st in (FolderState.STALE, FolderState.DAMAGED):  # other inputs, forced, unreadable or edited config
                self.remove_folder(folder)
            m = self.read_manifest(folder)
            if m is None:
                m = Manifest.new(kind, partition, config)
                self.write_manifest(folder, m)
            if self._compact(folder, m):  # what a killed run recorded
                m = self.require_manifest(folder)
        listing = self._listing(folder)
        done = set()
        for name, entry in m.files.items():
            seen = listing.get(name)
            if seen is None or seen[0] != entry.bytes:  # missing or resized: redone
                continue
            if not verify and entry.mtime_ns is not None and seen[1] == entry.mtime_ns:
                done.add(name)
                continue
            try:
                self.verify_file(folder, name, entry, cached=False)
            except ChecksumError:  # a damaged shard is redone
                continue
            done.add(name)
            if seen[1] is not None and seen[1] != entry.mtime_ns:  # whole, but touched: quick-checkable again
                m.files[name] = entry.model_copy(update={"mtime_ns": seen[1]})
                self.record_shard(folder, name, m.files[name], m.config_hash)
        return m, done

    def shard_damage(self, folder: str, config: dict[str, Any], verify: bool = False) -> str | None:
        """What the next ``open_sharded`` of a folder of ``config`` would find damaged, without changing anything:
        files without a manifest, an unreadable or hand-edited manifest, a listed shard missing or resized, or (when
        ``verify``, or its mtime moved) of another sha256; None when whole (or absent, or of other settings).

        >>> import tempfile, pyarrow as pa
        >>> from diffret.storage import ArtifactStore
        >>> with tempfile.TemporaryDirectory() as root:
        ...     store = ArtifactStore(root)
        ...     m, _ = store.open_sharded("t/k=1", "t", {"k": "1"}, {"n": 1})
        ...     store.record_shard("t/k=1", "a.parquet", store.write_shard("t/k=1", "a.parquet", pa.table({"x": [1]})))
        ...     _ = store.compact_shards("t/k=1")
        ...     whole = store.shard_damage("t/k=1", {"n": 1})
        ...     store.write_bytes("t/k=1/a.parquet", b"PAR1")
        ...     whole, store.shard_damage("t/k=1", {"n": 1}).split(", not")[0]
        (None, 'a.parquet: 4 bytes')
        """
        try:
            m = self.read_manifest(folder, trusted=False)
        except StoreError as exc:
            return str(exc)
        listing = self._listing(folder)
        if m is None:
            files = [n for n in listing if not n.startswith((".", "_"))]
            return f"{len(files)} file(s) but no manifest" if files else None
        if config_hash(m.config) != config_hash(config):
            return None
        if what := m.edited():
            return f"manifest edited by hand ({what})"
        for name, entry in sorted(m.files.items()):
            seen = listing.get(name)
            if seen is None or seen[0] != entry.bytes:
                return f"{name}: {'missing' if seen is None else f'{seen[0]} bytes, not {entry.bytes}'}"
            if verify or entry.mtime_ns is None or seen[1] != entry.mtime_ns:
                try:
                    self.verify_file(folder, name, entry, cached=False)
                except ChecksumError:
                    return f"{name}: another sha256 than its manifest's"
        return None

    def drop_shards(self, folder: str, names: Iterable[str]) -> None:
        """Forget shards of a sharded folder (their manifest entries and files): what a cache does with a damaged
        part it will not rewrite."""
        with self.lock(folder + "/_manifest"):
            m = self.read_manifest(folder, trusted=False)
            if m is None:
                return
            for name in names:
                m.files.pop(name, None)
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(self.abspath(f"{folder}/{name}"))
            self.write_manifest(folder, m)

    def _keep_checked_entries(self, folder: str) -> bool:
        """A sharded folder whose manifest's file list was edited by hand (its config intact): keep the entries
        whose file still has that sha256, size and row count, drop the others (their shards are redone) and write
        the manifest back; False when the manifest is unreadable or its config was edited (then nothing is kept).
        Call with the manifest lock held."""
        try:
            m = self.read_manifest(folder, trusted=False)
        except StoreError:
            return False
        if m is None or m.edited() != "its file list (sha256, bytes or rows)":
            return False
        for name, entry in list(m.files.items()):
            try:
                self.verify_file(folder, name, entry, cached=False)
                if entry.rows is not None and name.endswith(".parquet"):
                    with self.fs.open(self.abspath(f"{folder}/{name}"), "rb") as f:
                        if pq.ParquetFile(f).metadata.num_rows != entry.rows:
                            raise ChecksumError(f"{name}: row count edited")
            except (ChecksumError, OSError, pa.ArrowInvalid):
                del m.files[name]
        self.write_manifest(folder, m)
        return True

    def write_shard(self, folder: str, name: str, table: pa.Table) -> FileEntry:
        """Atomically write one shard file (not yet recorded: see :meth:`record_shard`)."""
        buf = io.BytesIO()
        pq.write_table(table, buf, compression=PARQUET_COMPRESSION)
        data = buf.getvalue()
        rel = f"{folder}/{name}"
        self.write_bytes(rel, data)
        stat = self.file_stat(rel)
        mtime = stat[1] if stat is not None and stat[0] == len(data) else None
        return FileEntry(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), rows=table.num_rows, mtime_ns=mtime)

    def record_shard(self, folder: str, name: str, entry: FileEntry, config_hash: str | None = None) -> None:
        """Record one finished shard, in constant time: one line appended (and fsynced) to the folder's
        ``_shards.jsonl`` (local stores) or one ``_records/<name>.json`` object (object stores), folded into
        the manifest by :meth:`compact_shards` (one writer: the flow or the CLI process).

        ``config_hash``: the hash of the manifest the shard was planned against (``open_sharded``'s); a
        record whose hash is not the manifest's when it is compacted is dropped, never merged. Without it,
        the manifest's current hash is used.
        """
        if not name or "/" in name or name.startswith((".", "_")):
            raise StoreError(f"{self.abspath(folder)}: invalid shard name {name!r}")
        if config_hash is None:
            config_hash = self._manifest_for_read(folder).config_hash
        line = ShardRecord(config_hash=config_hash, name=name, file=entry).to_json().encode()
        with self.lock(folder + "/_manifest"):
            if not self.is_local:
                self.write_bytes(shard_record_path(folder, name), line)
                return
            local = self.abspath(folder)
            os.makedirs(local, exist_ok=True)
            fd = os.open(f"{local}/{layout.SHARD_LOG}", os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":  # a line torn by a crash stays a line of its own
                    line = b"\n" + line
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
            if not size:
                fsync_dir(local)

    def compact_shards(self, folder: str) -> int:
        """Fold the folder's shard records into its manifest (one manifest write) and remove them; the
        number of shards merged. Records of another config hash are removed unmerged. Idempotent: a run
        killed half-way through compacts again on its next open.

        >>> import tempfile, pyarrow as pa
        >>> from diffret.storage import ArtifactStore
        >>> with tempfile.TemporaryDirectory() as root:
        ...     store = ArtifactStore(root)
        ...     m, _ = store.open_sharded("t/side=q", "t", {"side": "q"}, {"n": 1})
        ...     for name in ("shard=00000.parquet", "shard=00001.parquet"):
        ...         store.record_shard("t/side=q", name, store.write_shard("t/side=q", name, pa.table({"x": [1]})))
        ...     merged = store.compact_shards("t/side=q")
        ...     merged, sorted(store.read_manifest("t/side=q").files), store.compact_shards("t/side=q")
        (2, ['shard=00000.parquet', 'shard=00001.parquet'], 0)
        """
        with self.lock(folder + "/_manifest"):
            m = self.read_manifest(folder)
            return self._compact(folder, m) if m is not None else 0

    def _pending_records(self, folder: str) -> tuple[list[str], list[ShardRecord | StoreError]]:
        """The record files of ``folder`` and their records in the order written (an unreadable one as its
        error: a line torn by a crash, a file edited by hand)."""
        out: list[ShardRecord | StoreError] = []
        if self.is_local:
            path = self.abspath(f"{folder}/{layout.SHARD_LOG}")
            try:
                with open(path, "rb") as f:
                    lines = f.read().split(b"\n")
            except FileNotFoundError:
                return [], out
            for i, line in enumerate(lines):
                if line.strip():
                    try:
                        out.append(ShardRecord.from_json(line, where=f"{path}:{i + 1}"))
                    except StoreError as exc:
                        out.append(exc)
            return [path], out
        records = self.abspath(f"{folder}/{layout.SHARD_RECORDS_DIR}")
        try:
            listed = self.fs.ls(records, detail=False)
        except FileNotFoundError:
            return [], out
        paths = sorted(p for p in listed if p.endswith(".json") and not p.rsplit("/", 1)[-1].startswith("."))
        contents = self.fs.cat(paths) if paths else {}  # a list of paths: a dict, fetched concurrently
        for p in paths:
            try:
                rec = ShardRecord.from_json(contents[p], where=p)
                if p.rsplit("/", 1)[-1] != f"{rec.name}.json":
                    raise StoreError(f"{p}: a shard record named for another shard ({rec.name})")
                out.append(rec)
            except StoreError as exc:
                out.append(exc)
        return paths, out

    def _compact(self, folder: str, m: Manifest) -> int:
        """:meth:`compact_shards` with the lock held and the manifest read."""
        paths, records = self._pending_records(folder)
        if not paths:
            return 0
        merged = 0
        for rec in records:  # in the order written: a shard redone later wins
            if isinstance(rec, ShardRecord) and rec.config_hash == m.config_hash:
                m.files[rec.name] = rec.file
                merged += 1
        if merged:
            self.write_manifest(folder, m)  # fsynced: the records are removed only once the manifest holds them
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(paths[0])
        else:
            self.fs.rm(paths)
        return merged

    def _pending_entry(self, folder: str, name: str, config_hash: str) -> FileEntry | None:
        """The entry of shard ``name`` last recorded for ``config_hash`` and not yet compacted, if any."""
        if self.is_local:
            found = None
            for rec in self._pending_records(folder)[1]:
                if isinstance(rec, ShardRecord) and rec.name == name and rec.config_hash == config_hash:
                    found = rec.file
            return found
        path = self.abspath(shard_record_path(folder, name))
        try:
            with self.fs.open(path, "rb") as f:
                rec = ShardRecord.from_json(f.read(), where=path)
        except FileNotFoundError:
            return None
        return rec.file if rec.config_hash == config_hash and rec.name == name else None


def remove_empty_sharded(store: ArtifactStore, folders: Iterable[str]) -> list[str]:
    """Remove the sharded folders among ``folders`` that hold no shard (no file in their manifest, no pending
    record): what a failed run opened and never filled, with the folders above each that it leaves empty (up to
    the store's top folder: a failed stage leaves no empty folder tree behind). The removed folders.

    >>> import tempfile
    >>> from diffret.storage import ArtifactStore
    >>> with tempfile.TemporaryDirectory() as root:
    ...     store = ArtifactStore(root)
    ...     _ = store.open_sharded("t/side=q/k=1", "t", {"side": "q", "k": "1"}, {"n": 1})
    ...     remove_empty_sharded(store, ["t/side=q/k=1"]), store.exists("t/side=q"), store.exists("t")
    (['t/side=q/k=1'], False, False)
    """
    removed = []
    for folder in folders:
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(store.lock(folder + "/_manifest"))
            except StoreError:  # a shard being recorded right now (a unit still finishing as the run stops): not
                continue  # empty, and never waited for by a run that is stopping
            try:
                m = store.read_manifest(folder, trusted=False)
            except StoreError:
                continue
            if m is None or m.files or store._pending_records(folder)[0]:
                continue
            store.remove_folder(folder)
            removed.append(folder)
        _remove_empty_parents(store, folder)
    return removed


def _remove_empty_parents(store: ArtifactStore, folder: str) -> None:
    """The folders above ``folder`` that hold nothing, up to and including its top folder (local stores; an object
    store has no empty folders). One that holds anything (another folder's files) stays."""
    if not store.is_local or store.exists(folder):
        return
    parts = folder.strip("/").split("/")
    for depth in range(len(parts) - 1, 0, -1):
        try:
            os.rmdir(store.abspath("/".join(parts[:depth])))
        except OSError:  # not empty (the folders above it are not either), or already gone (look higher)
            if os.path.isdir(store.abspath("/".join(parts[:depth]))):
                return
