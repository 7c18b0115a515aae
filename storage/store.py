"""The artifact store: one root (a local folder or any fsspec URL), atomic writes, verified reads.

Rules (docs/ARCHITECTURE.md, "The store"):
- every write is atomic: a file is written under a temporary name and renamed into place (on object
  stores, where a single PUT is already atomic, the object is uploaded whole);
- a stage folder is trusted only through its ``_manifest.json``: the producing config and its hash,
  row counts, sha256 and size of every file, library versions. The manifest is written last;
- a reader verifies checksums and refuses artifacts whose config differs from the one it expects,
  naming the differing fields.

Whole stage folders (a dataset's three tables) are built in ``_staging/`` and renamed into place in
one step on local filesystems, so a killed run leaves nothing under the stage's glob that DuckDB or a
reader would pick up.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import io
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from . import layout
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

PARQUET_COMPRESSION = "zstd"
ROW_GROUP_ROWS = 100_000
_HASH_CHUNK = 8 << 20
# shards recorded but not yet compacted into their folder's manifest: an append log on local stores (one line per
# shard, one fsync), one small object per shard on object stores (which cannot append)
_MANIFEST_CACHE_SIZE = 32
# parsed manifests of local folders, keyed by path and (inode, size, mtime): a reader of one shard at a time
# (encode units, scoring) parses a 9k-entry manifest once, not once per shard
_MANIFEST_CACHE: dict[str, tuple[tuple[int, int, int], Manifest]] = {}


def shard_record_path(stage_dir: str, name: str) -> str:
    """Where the record of shard ``name`` waits for compaction on an object store (relative to the root).

    >>> shard_record_path("tokens/tokenizer=t/dataset=d/side=query", "shard=00000.parquet")
    'tokens/tokenizer=t/dataset=d/side=query/_records/shard=00000.parquet.json'
    """
    return f"{stage_dir}/{layout.SHARD_RECORDS_DIR}/{name}.json"


def _info_stat(info: dict[str, Any]) -> tuple[int, int | None]:
    """(size, mtime in ns or None) from an fsspec ``info`` / ``ls(detail=True)`` entry."""
    size = int(info.get("size") or 0)
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    try:
        return size, int(round(float(mtime) * 1e9)) if mtime else None
    except (TypeError, ValueError):  # a format we do not know: no quick check, the sha256 decides
        return size, None


def sha256_file(path: str, fs: fsspec.AbstractFileSystem | None = None) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    opener = fs.open if fs is not None else open
    with opener(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


class StageState(enum.StrEnum):
    """What a stage folder holds for a config (see :meth:`ArtifactStore.state`)."""

    ABSENT = "absent"  # nothing complete there: build it
    CURRENT = "current"  # the same config and every listed file verifies: nothing to do
    STALE = "stale"  # built from other inputs (or replaced with --force): rebuild it
    DAMAGED = "damaged"  # the same config, but a listed file is missing or fails its checksum: rebuild it


DRIFT_HINT = "Pass --force to replace it, or use another store root."


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() would give a new file (mkstemp gives 0600)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class ArtifactStore:
    """All artifact I/O of diffret goes through one of these."""

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
        self._verified: dict[tuple[str, int, int], str] = {}

    def __repr__(self) -> str:
        return f"ArtifactStore({self.root!r})"

    # ----------------------------------------------------------------------------------- paths
    def abspath(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def relpath(self, path: str) -> str:
        """``path`` relative to the root when it lies inside the store (an absolute path, as a glob returns), else
        as it is.

        >>> store = ArtifactStore("/data/store")
        >>> store.relpath(store.abspath("runs/x")), store.relpath("runs/x")
        ('runs/x', 'runs/x')
        """
        return path[len(self.base) :].lstrip("/") if path.startswith(self.base) else path

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.abspath(rel))

    def read_bytes(self, rel: str) -> bytes:
        """A whole (small) file's bytes: a checkpoint, a figure."""
        with self.fs.open(self.abspath(rel), "rb") as f:
            return f.read()

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
                raise StoreError(f"{flag} {path} is inside the store root {self.root}: write results outside the "
                                 "store (its files are only written by its stages)")  # fmt: skip
        return out

    def local_path(self, rel: str) -> str:
        """Absolute local path (DuckDB reads the store directly when it is local)."""
        if not self.is_local:
            raise StoreError(f"{self.root} is not a local store; DuckDB views need a local root")
        return self.abspath(rel)

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
                _fsync_dir(folder)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        else:  # one PUT: the object appears whole or not at all
            self.fs.pipe_file(path, data)

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
            raise StoreError(f"{self.abspath(rel)}: the stage run's shared settings are missing (removed while "
                             "it ran?); run the stage again") from exc  # fmt: skip
        if hashlib.sha256(data).hexdigest()[:24] != key:
            raise StoreError(f"{self.abspath(rel)}: changed since it was written; run the stage again")
        return json.loads(data)

    def write_manifest(self, stage_dir: str, manifest: Manifest) -> None:
        self.write_bytes(layout.manifest_path(stage_dir), manifest.to_json().encode())

    # ------------------------------------------------------------------------------------ reads
    def read_manifest(self, stage_dir: str, trusted: bool = True) -> Manifest | None:
        """The folder's manifest (None when it has none). An unreadable one, or (``trusted``) one edited by hand, is
        a :class:`StoreError` naming the repair; writers deciding what to rebuild pass ``trusted=False``."""
        path = self.abspath(layout.manifest_path(stage_dir))
        try:
            with self.fs.open(path, "rb") as f:
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return None
        except (NotADirectoryError, IsADirectoryError):
            raise StoreError(f"{path}: not a manifest file; {self.repair_hint(stage_dir)}") from None
        try:
            m = Manifest.from_json(text, where=path)
        except StoreError as exc:
            raise StoreError(f"{exc}; {self.repair_hint(stage_dir)}") from None
        if trusted and (what := m.edited()):
            raise StoreError(f"{path}: manifest edited by hand ({what}), so the folder is not trusted; "
                             f"{self.repair_hint(stage_dir)}")  # fmt: skip
        return m

    def repair_hint(self, rel: str) -> str:
        """How to rebuild the stage folder holding ``rel``: the command that made it
        (:func:`storage.layout.repair_hint`), told by what the store holds where the path alone does not say it:
        which command made a compressed system's folders, whether a model is a reranker, a summary's BM25 system.
        Reads what it can and never raises (it names the repair inside another error).

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as root:
        ...     ArtifactStore(root).repair_hint("summaries/system=s/dataset=d/split=test")
        'repair: run `diffret summary` again with the settings that made it'
        """
        facts: dict[str, Any] = {}
        parts = rel.lstrip("/").split("/")
        keys = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        try:
            if parts[0] in ("encodings", "codebooks") and "system" in keys:
                facts = self._compressed_facts(keys)
            elif parts[0] == "models" and len(parts) > 1:
                facts = {"task": self._model_task("/".join(parts[:2]))}
            elif parts[0] == "summaries" and len(parts) > 3:
                facts = {"bm25": self._summary_bm25("/".join(parts[:4]))}
        except Exception:  # noqa: BLE001  (a hint never hides the error it is part of)
            facts = {}
        return layout.repair_hint(rel, facts)

    def _raw_config(self, stage_dir: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(config, stats) of a folder's manifest as written, or None (missing, unreadable): no checks, no hints."""
        try:
            with self.fs.open(self.abspath(layout.manifest_path(stage_dir)), "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError):
            return None
        return (data.get("config") or {}), (data.get("stats") or {})

    def _compressed_facts(self, keys: dict[str, str]) -> dict[str, Any]:
        record = self._raw_config(layout.system_dir(keys["system"]))
        if record is None:
            return {}
        settings, stats = record[0].get("settings") or {}, record[1]
        spec = settings.get("store", "float16")
        if spec == "float16":
            return {}
        f16 = stats.get("float16_system")
        side = keys.get("side", "passage")
        source = f"encodings/system={f16}/dataset={keys.get('dataset')}/side={side}/k={keys.get('k')}"
        stored = f16 is not None and self.exists(layout.manifest_path(source))
        return {"compressed": {"store": spec, "seed": settings.get("store_seed", 0),
                               "float16_system": f16 if stored else None}}  # fmt: skip

    def _model_task(self, stage_dir: str) -> str:
        """A stored model's task: its manifest's (``reranker`` for train-reranker's), else its train log's."""
        found = self._raw_config(stage_dir)
        if found is not None and found[0].get("task"):
            return str(found[0]["task"])
        with self.fs.open(self.abspath(f"{stage_dir}/{layout.TRAIN_LOG_FILE}"), "rb") as f:
            meta = pq.read_schema(f).metadata or {}
        return meta.get(layout.MODEL_TASK_KEY, b"encoder").decode()

    def _summary_bm25(self, stage_dir: str) -> str | None:
        """A summary's BM25 system: its manifest's, else its leaderboard's BM25 row (None: it has none; unreadable
        both: FileNotFoundError)."""
        found = self._raw_config(stage_dir)
        if found is not None:
            return found[0].get("bm25")
        rows = self.read_bytes(f"{stage_dir}/leaderboard.csv").decode().splitlines()
        return next((r.split(",")[0] for r in rows[1:] if r.split(",")[1:2] == ["bm25"]), None)

    def require_manifest(self, stage_dir: str) -> Manifest:
        m = self.read_manifest(stage_dir)
        if m is None:
            hint = ""
            if self.exists(stage_dir):
                hint = (f" (the folder exists but has no manifest: an interrupted run or a deleted manifest; "
                        f"{self.repair_hint(stage_dir)})")  # fmt: skip
            raise IncompleteArtifactError(f"{self.abspath(stage_dir)}: no complete artifact here{hint}")
        return m

    def file_stat(self, rel: str) -> tuple[int, int | None] | None:
        """(size, mtime in ns) of a file, ``None`` when it is missing (mtime ``None`` where the filesystem
        gives none we can read).

        >>> import tempfile
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
            return _info_stat(self.fs.info(path))
        except FileNotFoundError:
            return None

    def _listing(self, stage_dir: str) -> dict[str, tuple[int, int | None]]:
        """Name -> (size, mtime ns) of the files directly in a folder: one listing, not one call per file."""
        path = self.abspath(stage_dir)
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
                out[e["name"].rstrip("/").rsplit("/", 1)[-1]] = _info_stat(e)
        return out

    def verify_file(self, stage_dir: str, name: str, entry: FileEntry, *, cached: bool = True) -> None:
        """Check one file's size and sha256 against its entry (``cached``: skip a file this store already
        hashed with the same size and mtime); :class:`ChecksumError` names what differs."""
        path = self.abspath(f"{stage_dir}/{name}")
        stat = self.file_stat(f"{stage_dir}/{name}")
        repair = self.repair_hint(stage_dir)
        if stat is None:
            raise ChecksumError(f"{path}: listed in the manifest but missing; {repair}")
        size = stat[0]
        key = (path, size, stat[1] or 0)
        if cached and stat[1] is not None and self._verified.get(key) == entry.sha256:
            return
        if size != entry.bytes:
            raise ChecksumError(f"{path}: {size} bytes, manifest says {entry.bytes}; {repair}")
        digest, _ = sha256_file(path, self.fs)
        if digest != entry.sha256:
            raise ChecksumError(f"{path}: sha256 {digest[:12]}… does not match the manifest ({entry.sha256[:12]}…); "
                                f"{repair}")  # fmt: skip
        self._verified[key] = digest

    def check_file(self, stage_dir: str, name: str, entry: FileEntry, since_ns: int | None = None) -> None:
        """The cheap check re-run planning trusts (:meth:`open_sharded`), for a reader: the file is there with its
        recorded size, and its mtime is the one recorded (``entry.mtime_ns``) or, where none was, not later than
        ``since_ns`` (its manifest's, written after its files). A file touched since is checked by sha256
        (:meth:`verify_file`); :class:`ChecksumError` names what differs and the repair.

        >>> import tempfile, pyarrow as pa
        >>> with tempfile.TemporaryDirectory() as root:
        ...     store = ArtifactStore(root)
        ...     entry = store.write_shard("t", "a.parquet", pa.table({"x": [1]}))
        ...     store.check_file("t", "a.parquet", entry)
        ...     with open(store.abspath("t/a.parquet"), "ab") as f:
        ...         _ = f.write(b"x")
        ...     try:
        ...         store.check_file("t", "a.parquet", entry)
        ...     except ChecksumError as e:
        ...         print("bytes, manifest says" in str(e))
        True
        """
        stat = self.file_stat(f"{stage_dir}/{name}")
        if stat is not None and stat[0] == entry.bytes:
            recorded = entry.mtime_ns if entry.mtime_ns is not None else since_ns
            if stat[1] is None or recorded is None:  # no mtimes to compare: the size decides
                return
            if stat[1] == entry.mtime_ns or (entry.mtime_ns is None and stat[1] <= recorded):
                return
        self.verify_file(stage_dir, name, entry)  # missing, resized or touched: the sha256 decides

    def verify(self, stage_dir: str) -> Manifest:
        """The stage's manifest after checking every file it lists."""
        m = self.require_manifest(stage_dir)
        for name, entry in m.files.items():
            self.verify_file(stage_dir, name, entry)
        return m

    def require_root(self) -> None:
        """Refuse a root that does not exist (a reader of a mistyped --root would otherwise see an empty store)."""
        if not self.fs.exists(self.base):
            raise StoreError(f"no store at {self.root}: check --root (stages create it when they first write)")

    def verify_all(self) -> tuple[int, list[str]]:
        """Check every file of every stage folder against its manifest (full sha256, no cache): the number
        of files checked and one line per problem (a changed or missing file, a manifest edited by hand).

        Examples
        --------
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as root:
        ...     ArtifactStore(root).verify_all()
        (0, [])
        """
        self.require_root()
        base = self.abspath("")
        checked, problems = 0, []
        for path in sorted(self.fs.glob(self.abspath(f"**/{layout.MANIFEST_NAME}"))):
            rel = path[len(base) :].lstrip("/")
            folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
            if folder.startswith((layout.STAGING_DIR, layout.LOCKS_DIR)):
                continue
            try:
                m = self.read_manifest(folder, trusted=False)
            except StoreError as exc:
                problems.append(str(exc))
                continue
            if m is None:
                continue
            if what := m.edited():
                problems.append(f"{self.abspath(folder)}: manifest edited by hand ({what}); "
                                f"{self.repair_hint(folder)}")  # fmt: skip
            files = dict(m.files)
            for rec in self._pending_records(folder)[1]:  # shards recorded, not yet compacted
                if isinstance(rec, StoreError):
                    problems.append(str(rec))
                elif rec.config_hash == m.config_hash:
                    files[rec.name] = rec.file
            for name, entry in sorted(files.items()):
                checked += 1
                try:
                    self.verify_file(folder, name, entry, cached=False)
                except ChecksumError as exc:
                    problems.append(str(exc))
        problems += self.orphan_folders()
        return checked, problems

    def orphan_folders(self) -> list[str]:
        """Stage folders holding files but no manifest (a deleted one): damage, since SQL and the stages would
        silently leave their files out. One problem line each, with the repair."""
        out = []
        base = self.abspath("")
        for glob, _ in layout.STAGE_FOLDERS.values():
            for path in sorted(self.fs.glob(self.abspath(glob))):
                if not self.fs.isdir(path):
                    continue
                rel = path[len(base) :].lstrip("/")
                if self.fs.exists(self.abspath(layout.manifest_path(rel))):
                    continue
                files = [p for p in self.fs.find(path) if not p.rsplit("/", 1)[-1].startswith((".", "_"))]
                if files:
                    out.append(f"{path}: {len(files)} file(s) but no manifest (deleted?), so none is trusted; "
                               f"{self.repair_hint(rel)}")  # fmt: skip
        return out

    def state(
        self, stage_dir: str, config: dict[str, Any], *, force: bool = False, verify: bool = True, hint: str = ""
    ) -> StageState:
        """The one drift policy of every stage: the state of ``stage_dir`` for ``config``.

        A folder built from different settings raises :class:`ConfigDriftError` naming the fields, unless
        ``force`` (then it is ``STALE``: the caller replaces it). Different ``inputs`` alone (upstream
        fingerprints, see :data:`storage.manifest.INPUTS_KEY`) make it ``STALE``. ``verify=False`` skips the
        checksums (sharded folders verify shard by shard).
        """
        try:
            m = self.read_manifest(stage_dir, trusted=False)
        except StoreError:  # unreadable: nothing in the folder is trusted, it is rebuilt
            return StageState.DAMAGED
        if m is None:
            return StageState.ABSENT
        stored = config_hash(m.config)  # the config itself, not the hash recorded beside it
        if stored != config_hash(config):
            settings = [d for d in diff_configs(m.config, config) if not is_input_field(d[0])]
            if settings and not force:
                raise ConfigDriftError(self.abspath(stage_dir), settings, hint or DRIFT_HINT)
            return StageState.STALE
        if m.edited():  # a manifest edited by hand: nothing in the folder is trusted
            return StageState.DAMAGED
        if verify:
            try:
                for name, entry in m.files.items():
                    self.verify_file(stage_dir, name, entry)
            except ChecksumError:
                return StageState.DAMAGED
        return StageState.CURRENT

    # ---------------------------------------------------------------------------- sharded stages
    # A sharded folder (tokens, encodings) is filled shard by shard. Each finished shard gets one record (its
    # entry and the config hash it was planned against): a line of ``_shards.jsonl``, or on object stores an
    # object ``_records/<shard>.json``. ``compact_shards`` folds the records into the manifest in one write at
    # the end of the stage, and ``open_sharded`` does so first, so a killed run loses nothing. The cost per
    # shard is constant.
    def open_sharded(
        self,
        stage_dir: str,
        stage: str,
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
        >>> with tempfile.TemporaryDirectory() as root:
        ...     store = ArtifactStore(root)
        ...     m, done = store.open_sharded("t/side=q", "t", {"side": "q"}, {"n": 1})
        ...     entry = store.write_shard("t/side=q", "shard=00000.parquet", pa.table({"x": [1, 2]}))
        ...     store.record_shard("t/side=q", "shard=00000.parquet", entry, m.config_hash)
        ...     store.compact_shards("t/side=q"), store.open_sharded("t/side=q", "t", {"side": "q"}, {"n": 1})[1]
        (1, {'shard=00000.parquet'})
        """
        st = self.state(stage_dir, config, force=force, verify=False)
        with self.lock(stage_dir + "/_manifest"):
            if st == StageState.DAMAGED and self._keep_checked_entries(stage_dir):
                st = StageState.CURRENT  # only the file list was edited: the shards that still verify are kept
            if st in (StageState.STALE, StageState.DAMAGED):  # other inputs, forced, unreadable or edited config
                self.remove_stage(stage_dir)
            m = self.read_manifest(stage_dir)
            if m is None:
                m = Manifest.new(stage, partition, config)
                self.write_manifest(stage_dir, m)
            if self._compact(stage_dir, m):  # what a killed run recorded
                m = self.require_manifest(stage_dir)
        listing = self._listing(stage_dir)
        done = set()
        for name, entry in m.files.items():
            seen = listing.get(name)
            if seen is None or seen[0] != entry.bytes:  # missing or resized: redone
                continue
            if not verify and entry.mtime_ns is not None and seen[1] == entry.mtime_ns:
                done.add(name)
                continue
            try:
                self.verify_file(stage_dir, name, entry, cached=False)
            except ChecksumError:  # a damaged shard is redone
                continue
            done.add(name)
            if seen[1] is not None and seen[1] != entry.mtime_ns:  # whole, but touched: quick-checkable again
                m.files[name] = entry.model_copy(update={"mtime_ns": seen[1]})
                self.record_shard(stage_dir, name, m.files[name], m.config_hash)
        return m, done

    def shard_damage(self, stage_dir: str, config: dict[str, Any], verify: bool = False) -> str | None:
        """What the next ``open_sharded`` of a folder of ``config`` would find damaged, without changing anything:
        files without a manifest, an unreadable or hand-edited manifest, a listed shard missing or resized, or (when
        ``verify``, or its mtime moved) of another sha256; None when whole (or absent, or of other settings).

        >>> import tempfile, pyarrow as pa
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
            m = self.read_manifest(stage_dir, trusted=False)
        except StoreError as exc:
            return str(exc)
        listing = self._listing(stage_dir)
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
                    self.verify_file(stage_dir, name, entry, cached=False)
                except ChecksumError:
                    return f"{name}: another sha256 than its manifest's"
        return None

    def drop_shards(self, stage_dir: str, names: Iterable[str]) -> None:
        """Forget shards of a sharded folder (their manifest entries and files): what a cache does with a damaged
        part it will not rewrite."""
        with self.lock(stage_dir + "/_manifest"):
            m = self.read_manifest(stage_dir, trusted=False)
            if m is None:
                return
            for name in names:
                m.files.pop(name, None)
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(self.abspath(f"{stage_dir}/{name}"))
            self.write_manifest(stage_dir, m)

    def _keep_checked_entries(self, stage_dir: str) -> bool:
        """A sharded folder whose manifest's file list was edited by hand (its config intact): keep the entries
        whose file still has that sha256, size and row count, drop the others (their shards are redone) and write
        the manifest back; False when the manifest is unreadable or its config was edited (then nothing is kept).
        Call with the manifest lock held."""
        try:
            m = self.read_manifest(stage_dir, trusted=False)
        except StoreError:
            return False
        if m is None or m.edited() != "its file list (sha256, bytes or rows)":
            return False
        for name, entry in list(m.files.items()):
            try:
                self.verify_file(stage_dir, name, entry, cached=False)
                if entry.rows is not None and name.endswith(".parquet"):
                    with self.fs.open(self.abspath(f"{stage_dir}/{name}"), "rb") as f:
                        if pq.ParquetFile(f).metadata.num_rows != entry.rows:
                            raise ChecksumError(f"{name}: row count edited")
            except (ChecksumError, OSError, pa.ArrowInvalid):
                del m.files[name]
        self.write_manifest(stage_dir, m)
        return True

    def write_shard(self, stage_dir: str, name: str, table: pa.Table) -> FileEntry:
        """Atomically write one shard file (not yet recorded: see :meth:`record_shard`)."""
        buf = io.BytesIO()
        pq.write_table(table, buf, compression=PARQUET_COMPRESSION)
        data = buf.getvalue()
        rel = f"{stage_dir}/{name}"
        self.write_bytes(rel, data)
        stat = self.file_stat(rel)
        mtime = stat[1] if stat is not None and stat[0] == len(data) else None
        return FileEntry(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), rows=table.num_rows, mtime_ns=mtime)

    def record_shard(self, stage_dir: str, name: str, entry: FileEntry, config_hash: str | None = None) -> None:
        """Record one finished shard, in constant time: one line appended (and fsynced) to the folder's
        ``_shards.jsonl`` (local stores) or one ``_records/<name>.json`` object (object stores), folded into
        the manifest by :meth:`compact_shards` (one writer: the flow or the CLI process).

        ``config_hash``: the hash of the manifest the shard was planned against (``open_sharded``'s); a
        record whose hash is not the manifest's when it is compacted is dropped, never merged. Without it,
        the manifest's current hash is used.
        """
        if not name or "/" in name or name.startswith((".", "_")):
            raise StoreError(f"{self.abspath(stage_dir)}: invalid shard name {name!r}")
        if config_hash is None:
            config_hash = self._manifest_for_read(stage_dir).config_hash
        line = ShardRecord(config_hash=config_hash, name=name, file=entry).to_json().encode()
        with self.lock(stage_dir + "/_manifest"):
            if not self.is_local:
                self.write_bytes(shard_record_path(stage_dir, name), line)
                return
            folder = self.abspath(stage_dir)
            os.makedirs(folder, exist_ok=True)
            fd = os.open(f"{folder}/{layout.SHARD_LOG}", os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":  # a line torn by a crash stays a line of its own
                    line = b"\n" + line
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
            if not size:
                _fsync_dir(folder)

    def compact_shards(self, stage_dir: str) -> int:
        """Fold the folder's shard records into its manifest (one manifest write) and remove them; the
        number of shards merged. Records of another config hash are removed unmerged. Idempotent: a run
        killed half-way through compacts again on its next open.

        >>> import tempfile, pyarrow as pa
        >>> with tempfile.TemporaryDirectory() as root:
        ...     store = ArtifactStore(root)
        ...     m, _ = store.open_sharded("t/side=q", "t", {"side": "q"}, {"n": 1})
        ...     for name in ("shard=00000.parquet", "shard=00001.parquet"):
        ...         store.record_shard("t/side=q", name, store.write_shard("t/side=q", name, pa.table({"x": [1]})))
        ...     merged = store.compact_shards("t/side=q")
        ...     merged, sorted(store.read_manifest("t/side=q").files), store.compact_shards("t/side=q")
        (2, ['shard=00000.parquet', 'shard=00001.parquet'], 0)
        """
        with self.lock(stage_dir + "/_manifest"):
            m = self.read_manifest(stage_dir)
            return self._compact(stage_dir, m) if m is not None else 0

    def _pending_records(self, stage_dir: str) -> tuple[list[str], list[ShardRecord | StoreError]]:
        """The record files of ``stage_dir`` and their records in the order written (an unreadable one as its
        error: a line torn by a crash, a file edited by hand)."""
        out: list[ShardRecord | StoreError] = []
        if self.is_local:
            path = self.abspath(f"{stage_dir}/{layout.SHARD_LOG}")
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
        folder = self.abspath(f"{stage_dir}/{layout.SHARD_RECORDS_DIR}")
        try:
            listed = self.fs.ls(folder, detail=False)
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

    def _compact(self, stage_dir: str, m: Manifest) -> int:
        """:meth:`compact_shards` with the lock held and the manifest read."""
        paths, records = self._pending_records(stage_dir)
        if not paths:
            return 0
        merged = 0
        for rec in records:  # in the order written: a shard redone later wins
            if isinstance(rec, ShardRecord) and rec.config_hash == m.config_hash:
                m.files[rec.name] = rec.file
                merged += 1
        if merged:
            self.write_manifest(stage_dir, m)  # fsynced: the records are removed only once the manifest holds them
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(paths[0])
        else:
            self.fs.rm(paths)
        return merged

    def _manifest_for_read(self, stage_dir: str) -> Manifest:
        """The folder's manifest, parsed once per version of the file (local stores); never mutate it."""
        if not self.is_local:
            return self.require_manifest(stage_dir)
        path = self.abspath(layout.manifest_path(stage_dir))
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return self.require_manifest(stage_dir)  # its error says why
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        hit = _MANIFEST_CACHE.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        m = self.require_manifest(stage_dir)
        _MANIFEST_CACHE.pop(path, None)
        while len(_MANIFEST_CACHE) >= _MANIFEST_CACHE_SIZE:
            _MANIFEST_CACHE.pop(next(iter(_MANIFEST_CACHE)))
        _MANIFEST_CACHE[path] = (key, m)
        return m

    def _pending_entry(self, stage_dir: str, name: str, config_hash: str) -> FileEntry | None:
        """The entry of shard ``name`` last recorded for ``config_hash`` and not yet compacted, if any."""
        if self.is_local:
            found = None
            for rec in self._pending_records(stage_dir)[1]:
                if isinstance(rec, ShardRecord) and rec.name == name and rec.config_hash == config_hash:
                    found = rec.file
            return found
        path = self.abspath(shard_record_path(stage_dir, name))
        try:
            with self.fs.open(path, "rb") as f:
                rec = ShardRecord.from_json(f.read(), where=path)
        except FileNotFoundError:
            return None
        return rec.file if rec.config_hash == config_hash and rec.name == name else None

    def read_table(
        self,
        stage_dir: str,
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
        self.read_table_entry(stage_dir, name)
        with self.fs.open(self.abspath(f"{stage_dir}/{name}"), "rb") as f:
            if batch_rows is None:
                return pq.read_table(f, columns=columns)
            pf = pq.ParquetFile(f)
            batches = list(pf.iter_batches(batch_size=batch_rows, columns=columns))
            schema = pf.schema_arrow if columns is None else pa.schema([pf.schema_arrow.field(c) for c in columns])
            return pa.Table.from_batches(batches, schema=schema)

    def iter_batches(self, stage_dir: str, name: str, columns: list[str] | None = None,
                     batch_size: int = 65_536) -> Iterator[pa.RecordBatch]:  # fmt: skip
        """:meth:`read_table`'s file (verified the same way) as record batches, so that memory holds one batch
        and not the file: a corpus of millions of passages read a slice at a time."""
        self.read_table_entry(stage_dir, name)
        with self.fs.open(self.abspath(f"{stage_dir}/{name}"), "rb") as f:
            yield from pq.ParquetFile(f).iter_batches(batch_size=batch_size, columns=columns)

    def read_table_entry(self, stage_dir: str, name: str) -> FileEntry:
        """The verified manifest entry of one file of a complete stage folder (a shard recorded but not yet
        compacted into the manifest through its record), as :meth:`read_table` checks it."""
        m = self._manifest_for_read(stage_dir)
        entry = m.files.get(name)
        try:
            if entry is None:
                raise IncompleteArtifactError(f"{self.abspath(stage_dir)}/{name}: not in the stage manifest")
            self.verify_file(stage_dir, name, entry)
            return entry
        except (IncompleteArtifactError, ChecksumError):
            pending = self._pending_entry(stage_dir, name, m.config_hash)  # redone, or not compacted yet
            if pending is None:
                raise
            self.verify_file(stage_dir, name, pending)
            return pending

    # ------------------------------------------------------------------------------------ locks
    @contextlib.contextmanager
    def lock(self, stage_dir: str) -> Iterator[None]:
        """Exclusive lock for one stage folder (local stores; released by the OS if the process dies). The lock
        file is removed on release (the holder unlinks it before unlocking; a process that opened the old file
        finds it gone and takes a new one), so a finished run leaves no lock files.

        On object stores there is no lock: the flow assigns each partition to one task.
        """
        if not self.is_local:
            yield
            return
        folder = self.abspath(layout.LOCKS_DIR)
        path = os.path.join(folder, layout.lock_name(stage_dir) + ".lock")
        while True:
            try:
                os.makedirs(folder, exist_ok=True)
                fh = open(path, "a")  # noqa: SIM115 - held across the yield
            except (FileNotFoundError, FileExistsError):  # the folder was removed (or made and removed) in between
                continue
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                raise StoreError(
                    f"{self.abspath(stage_dir)} is being written by another process; wait for it to finish"
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
                os.rmdir(folder)  # only when no other lock is held

    # --------------------------------------------------------------------------- staged stages
    @contextlib.contextmanager
    def stage_writer(self, stage_dir: str, manifest: Manifest) -> Iterator[StageWriter]:
        """Build a whole stage folder; it replaces ``stage_dir`` only when the block finishes cleanly.

        Holds the stage lock for the whole build and clears what an earlier killed run left behind.
        """
        with self.lock(stage_dir):
            writer = StageWriter(self, stage_dir, manifest)
            try:
                yield writer
                writer._commit()
            finally:
                writer._cleanup()

    def clear_stale_staging(self, stage_dir: str) -> int:
        """Remove staging folders of ``stage_dir`` left by killed runs (call with the lock held)."""
        if not self.is_local:
            return 0
        folder = self.abspath(layout.STAGING_DIR)
        if not os.path.isdir(folder):
            return 0
        prefix = layout.lock_name(stage_dir) + "."
        n = 0
        try:
            entries = os.listdir(folder)
        except FileNotFoundError:  # another writer's cleanup removed it, empty, since the check
            return 0
        for entry in entries:
            if entry.startswith(prefix):
                shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
                n += 1
        return n

    def remove_stage(self, stage_dir: str) -> None:
        path = self.abspath(stage_dir)
        if self.fs.exists(path):
            # manifest first: from this instant nothing in the folder is accepted
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.abspath(layout.manifest_path(stage_dir)))
            self.fs.rm(path, recursive=True)

    def stage_dirs(self, pattern: str) -> list[str]:
        """Stage folders (relative to the root) matching a glob of folders that have a manifest, sorted.

        ``store.stage_dirs("runs/*/*/*/*/*/*")`` lists every run folder.
        """
        base = self.abspath("")
        paths = self.fs.glob(self.abspath(f"{pattern}/{layout.MANIFEST_NAME}"))
        return sorted(p[len(base) :].lstrip("/").rsplit("/", 1)[0] for p in paths)

    def fingerprint(self, *patterns: str) -> str:
        """A hash of every stage folder matching ``patterns``: their config hashes and file checksums.

        A stage built from those folders records it among its inputs, so it is rebuilt when they change.
        """
        parts = []
        for pattern in patterns:
            for stage in self.stage_dirs(pattern):
                m = self.read_manifest(stage)
                if m is not None:
                    parts.append([stage, m.config_hash, sorted((k, e.sha256) for k, e in m.files.items())])
        return config_hash({"folders": parts})

    def list_partitions(self, stage: str, key: str) -> list[str]:
        """Values of the first partition key under ``stage`` that have a manifest."""
        base = self.abspath(stage)
        if not self.fs.exists(base):
            return []
        out = []
        for p in self.fs.ls(base, detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(f"{key}=") and self.fs.exists(f"{p.rstrip('/')}/{layout.MANIFEST_NAME}"):
                out.append(name.split("=", 1)[1])
        return sorted(out)


def remove_empty_sharded(store: ArtifactStore, stage_dirs: Iterable[str]) -> list[str]:
    """Remove the sharded folders among ``stage_dirs`` that hold no shard (no file in their manifest, no pending
    record): what a failed run opened and never filled. The removed folders.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as root:
    ...     store = ArtifactStore(root)
    ...     _ = store.open_sharded("t/side=q", "t", {"side": "q"}, {"n": 1})
    ...     remove_empty_sharded(store, ["t/side=q"]), store.exists("t/side=q")
    (['t/side=q'], False)
    """
    removed = []
    for stage in stage_dirs:
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(store.lock(stage + "/_manifest"))
            except StoreError:  # a shard being recorded right now (a unit still finishing as the run stops): not
                continue  # empty, and never waited for by a run that is stopping
            try:
                m = store.read_manifest(stage, trusted=False)
            except StoreError:
                continue
            if m is None or m.files or store._pending_records(stage)[0]:
                continue
            store.remove_stage(stage)
            removed.append(stage)
    return removed


class StageWriter:
    """Writes the files of one stage folder; see ``ArtifactStore.stage_writer``."""

    def __init__(self, store: ArtifactStore, stage_dir: str, manifest: Manifest):
        self.store = store
        self.stage_dir = stage_dir
        self.manifest = manifest
        self._token = uuid.uuid4().hex[:12]
        if store.is_local:
            store.clear_stale_staging(stage_dir)
            self.work_dir = store.abspath(f"{layout.STAGING_DIR}/{layout.lock_name(stage_dir)}.{self._token}")
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
            store.remove_stage(stage_dir)
        self._done = False

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
            self.store.fs.put_file(path, self.store.abspath(f"{self.stage_dir}/{name}"))
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
            self.store.fs.put_file(path, self.store.abspath(f"{self.stage_dir}/{name}"))
        return entry

    def _commit(self) -> None:
        store = self.store
        if store.is_local:
            with open(os.path.join(self.work_dir, layout.MANIFEST_NAME), "w") as f:
                f.write(self.manifest.to_json())
                f.flush()
                os.fsync(f.fileno())
            final = store.abspath(self.stage_dir)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            old = None
            if os.path.exists(final):
                old = f"{self.work_dir}.old"
                os.rename(final, old)
            os.rename(self.work_dir, final)
            _fsync_dir(os.path.dirname(final))
            if old:
                shutil.rmtree(old, ignore_errors=True)
        else:
            store.write_manifest(self.stage_dir, self.manifest)
        self._done = True

    def _cleanup(self) -> None:
        if os.path.isdir(self.work_dir):
            shutil.rmtree(self.work_dir, ignore_errors=True)
        if self.store.is_local:
            with contextlib.suppress(OSError):
                os.rmdir(self.store.abspath(layout.STAGING_DIR))  # only when no other build is staged
