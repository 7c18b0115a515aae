"""Verification and repair: files checked against their manifest entries (size, mtime, sha256), a
folder's state for a config (the one drift policy of every stage), the whole store verified, and the repair each
problem names. Mixed into :class:`storage.store.ArtifactStore`."""

from __future__ import annotations

import enum
import json
import os
from typing import Any

import pyarrow.parquet as pq

from . import layout
from .base import StoreBase
from .files import sha256_file
from .manifest import (
    ChecksumError,
    ConfigDriftError,
    FileEntry,
    Manifest,
    StoreError,
    config_hash,
    diff_configs,
    is_input_field,
)
from .repairs import Damage, Repair, repair_of


class FolderState(enum.StrEnum):
    """What a folder holds for a config (see :meth:`ArtifactStore.state`)."""

    ABSENT = "absent"  # nothing complete there: build it
    CURRENT = "current"  # the same config and every listed file verifies: nothing to do
    STALE = "stale"  # built from other inputs (or replaced with --force): rebuild it
    DAMAGED = "damaged"  # the same config, but a listed file is missing or fails its checksum: rebuild it


DRIFT_HINT = "Pass --force to replace it, or use another store root."


class IntegrityMixin(StoreBase):
    """:class:`storage.store.ArtifactStore`'s checks and repair hints (over :class:`storage.base.StoreBase`: its
    ``fs``, ``is_local``, paths and manifest reads)."""

    def repair(self, rel: str) -> Repair:
        """What rebuilds the folder holding ``rel`` (:func:`storage.repairs.repair_of`): the command that made
        it, with the settings that made it as the store holds them (the folder's manifest config; where the manifest
        is gone, its system's registry record; a tokens folder's tokenizer, from the encodings that read it), and
        which command made a compressed system's folders, whether a model is a reranker, a summary's BM25 system.
        Reads what it can and never raises (it names the repair inside another error).

        >>> import tempfile
        >>> from diffret.storage import ArtifactStore
        >>> with tempfile.TemporaryDirectory() as root:
        ...     r = ArtifactStore(root).repair("summaries/system=s/dataset=d/split=test")
        ...     r.command, r.option("root") == root, r.complete
        ('summary', True, False)
        """
        facts: dict[str, Any] = {}
        parts = rel.lstrip("/").split("/")
        keys = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        try:
            entry = layout.STAGE_FOLDERS.get(parts[0])
            depth = entry[0].count("/") + 1 if entry else 0
            if entry and len(parts) >= depth and (found := self._raw_config("/".join(parts[:depth]))):
                facts["config"] = found[0]
            if parts[0] in ("encodings", "codebooks") and "system" in keys:
                facts.update(self._compressed_facts(keys))
                if "config" not in facts and (record := self._raw_config(layout.system_dir(keys["system"]))):
                    facts["system"] = record[0].get("settings") or {}
            elif parts[0] == "tokens" and {"tokenizer", "dataset", "side"} <= keys.keys():
                facts["tokenizer"] = self._tokenizer_facts(keys)
            elif parts[0] == "models" and len(parts) > 1:
                facts["task"] = self._model_task("/".join(parts[:2]))
            elif parts[0] == "summaries" and len(parts) > 3:
                facts["bm25"] = self._summary_bm25("/".join(parts[:4]))
            elif parts[0] == "systems" and len(parts) > 1:
                facts["kind"] = (facts.get("config") or {}).get("kind")
        except Exception:  # noqa: BLE001  (a repair never hides the error it is part of)
            facts = {k: v for k, v in facts.items() if k == "config"}
        return repair_of(rel, facts, root=self.printed_root())

    def _tokenizer_facts(self, keys: dict[str, str]) -> dict[str, Any]:
        """The tokenizer settings of a tokens folder: those of an encodings folder made from it (its config names
        the tokens), ``{}`` when none is stored."""
        pattern = f"encodings/*/dataset={keys['dataset']}/side={keys['side']}/*/{layout.MANIFEST_NAME}"
        for path in sorted(self.fs.glob(self.abspath(pattern))):
            found = self._raw_config(self.relpath(path).rpartition("/")[0])
            if found is not None and found[0].get("tokens") == keys["tokenizer"]:
                return {k: found[0].get(k) for k in ("model", "gguf_file")}
        return {}

    def printed_root(self) -> str:
        """The store root a command printed for this store must be given (``--root ROOT``; absolute), or ``""`` when
        a command run without ``--root`` finds this store: its root is ``$DIFFRET_ROOT``, or else the default
        (:data:`storage.layout.DEFAULT_ROOT`, from the current folder).

        >>> import tempfile
        >>> from diffret.storage import ArtifactStore
        >>> with tempfile.TemporaryDirectory() as root:
        ...     ArtifactStore(root).printed_root() == root
        True
        """
        default = os.environ.get("DIFFRET_ROOT") or layout.DEFAULT_ROOT
        if self.is_local:
            return "" if os.path.abspath(os.path.expanduser(default)) == self.base else self.base
        return "" if default.rstrip("/") == self.root.rstrip("/") else self.root

    def removal(self, folder: str) -> Repair:
        """The repair of a folder no command can build again as it was: remove it.

        >>> from diffret.storage import ArtifactStore
        >>> str(ArtifactStore("/data/s").removal("runs/system=a b"))
        "repair: remove the folder: `rm -r '/data/s/runs/system=a b'`"
        """
        return Repair(remove=self.abspath(folder), local=self.is_local)

    def edited_problem(self, folder: str, m: Manifest, subject: str = "") -> str | None:
        """The damage line of a manifest edited by hand (:meth:`edited_damage`); ``None`` when it is as written."""
        damage = self.edited_damage(folder, m, subject)
        return None if damage is None else str(damage)

    def edited_damage(self, folder: str, m: Manifest, subject: str = "") -> Damage | None:
        """The damage of a manifest edited by hand (``subject``: what it names first; default its folder), with its
        repair; ``None`` when it is as written. A config that holds a number that is not finite (written as null,
        :meth:`Manifest.non_finite`) was no edit: its settings are refused now, so no command builds the folder again
        as it was, and the repair removes it."""
        what = m.edited()
        if what is None:
            return None
        subject = subject or self.abspath(folder)
        if what == "its config" and (fields := m.non_finite()):
            problem = (
                f"its config holds a number that is not finite ({', '.join(fields)}: NaN or infinity, written as "
                "null), which every setting refuses now, so no command builds the folder again as it was"
            )
            return Damage(subject, problem, self.removal(folder))
        return Damage(subject, f"manifest edited by hand ({what}), so the folder is not trusted", self.repair(folder))

    def _raw_config(self, folder: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(config, stats) of a folder's manifest as written, or None (missing, unreadable): no checks, no hints."""
        try:
            with self.fs.open(self.abspath(layout.manifest_path(folder)), "rb") as f:
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
        return {
            "compressed": {
                "store": spec,
                "seed": settings.get("store_seed", 0),
                "float16_system": f16 if stored else None,
            }
        }

    def _model_task(self, folder: str) -> str:
        """A stored model's task: its manifest's (``reranker`` for train-reranker's), else its train log's."""
        found = self._raw_config(folder)
        if found is not None and found[0].get("task"):
            return str(found[0]["task"])
        with self.fs.open(self.abspath(f"{folder}/{layout.TRAIN_LOG_FILE}"), "rb") as f:
            meta = pq.read_schema(f).metadata or {}
        return meta.get(layout.MODEL_TASK_KEY, b"encoder").decode()

    def _summary_bm25(self, folder: str) -> str | None:
        """A summary's BM25 system: its manifest's, else its leaderboard's BM25 row (None: it has none; unreadable
        both: FileNotFoundError)."""
        found = self._raw_config(folder)
        if found is not None:
            return found[0].get("bm25")
        rows = self.read_bytes(f"{folder}/leaderboard.csv").decode().splitlines()
        return next((r.split(",")[0] for r in rows[1:] if r.split(",")[1:2] == ["bm25"]), None)

    def verify_file(self, folder: str, name: str, entry: FileEntry, *, cached: bool = True) -> None:
        """Check one file's size and sha256 against its entry (``cached``: skip a file this store already
        hashed with the same size and mtime); :class:`ChecksumError` names what differs and its repair."""
        damage = self.file_damage(folder, name, entry, cached=cached)
        if damage is not None:
            raise ChecksumError(str(damage))

    def file_damage(self, folder: str, name: str, entry: FileEntry, *, cached: bool = True) -> Damage | None:
        """What differs between one file and its entry, with its repair (:meth:`verify_file`); ``None`` when it
        matches."""
        path = self.abspath(f"{folder}/{name}")
        stat = self.file_stat(f"{folder}/{name}")
        if stat is None:
            return Damage(path, "listed in the manifest but missing", self.repair(folder))
        size = stat[0]
        key = (path, size, stat[1] or 0)
        if cached and stat[1] is not None and self._verified.get(key) == entry.sha256:
            return None
        if size != entry.bytes:
            return Damage(path, f"{size} bytes, manifest says {entry.bytes}", self.repair(folder))
        digest, _ = sha256_file(path, self.fs)
        if digest != entry.sha256:
            problem = f"sha256 {digest[:12]}… does not match the manifest ({entry.sha256[:12]}…)"
            return Damage(path, problem, self.repair(folder))
        self._verified[key] = digest
        return None

    def check_file(self, folder: str, name: str, entry: FileEntry, since_ns: int | None = None) -> None:
        """The cheap check re-run planning trusts (:meth:`open_sharded`), for a reader: the file is there with its
        recorded size, and its mtime is the one recorded (``entry.mtime_ns``) or, where none was, not later than
        ``since_ns`` (its manifest's, written after its files). A file touched since is checked by sha256
        (:meth:`verify_file`); :class:`ChecksumError` names what differs and the repair.

        >>> import tempfile, pyarrow as pa
        >>> from diffret.storage import ArtifactStore
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
        stat = self.file_stat(f"{folder}/{name}")
        if stat is not None and stat[0] == entry.bytes:
            recorded = entry.mtime_ns if entry.mtime_ns is not None else since_ns
            if stat[1] is None or recorded is None:  # no mtimes to compare: the size decides
                return
            if stat[1] == entry.mtime_ns or (entry.mtime_ns is None and stat[1] <= recorded):
                return
        self.verify_file(folder, name, entry)  # missing, resized or touched: the sha256 decides

    def verify(self, folder: str) -> Manifest:
        """The folder's manifest after checking every file it lists."""
        m = self.require_manifest(folder)
        for name, entry in m.files.items():
            self.verify_file(folder, name, entry)
        return m

    def require_root(self) -> None:
        """Refuse a root that does not exist, or a folder that is not a store: one with entries but none of a store's
        folders (``layout.STORE_TOP_FOLDERS``; hidden entries aside), such as a folder of TREC files. A reader of a
        mistyped --root would otherwise see an empty store. An empty folder is an empty store.

        >>> import os, tempfile
        >>> from diffret.storage import ArtifactStore, StoreError
        >>> with tempfile.TemporaryDirectory() as root:
        ...     ArtifactStore(root).require_root()                  # empty: a new store
        ...     open(os.path.join(root, "run.trec"), "w").close()
        ...     try:
        ...         ArtifactStore(root).require_root()
        ...     except StoreError as exc:
        ...         print(str(exc).replace(root, "ROOT")[:64])
        ROOT is not a diffret store: it holds run.trec but none of a sto
        """
        if not self.fs.exists(self.base):
            raise StoreError(f"no store at {self.root}: check --root (stages create it when they first write)")
        names = sorted(
            n
            for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.base, detail=False))
            if not n.startswith(".")
        )
        if names and not set(names) & layout.STORE_TOP_FOLDERS:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3:,} more" if len(names) > 3 else "")
            raise StoreError(
                f"{self.root} is not a diffret store: it holds {shown} but none of a store's folders "
                "(datasets/, runs/, metrics/, ...): check --root (a TREC run file enters a store through the "
                "import-run command)"
            )

    def verify_all(self) -> tuple[int, list[str]]:
        """Check every file of every folder against its manifest (full sha256, no cache): the number
        of files checked and one line per problem (:meth:`damage_all`, each as its line).

        Examples
        --------
        >>> import tempfile
        >>> from diffret.storage import ArtifactStore
        >>> with tempfile.TemporaryDirectory() as root:
        ...     ArtifactStore(root).verify_all()
        (0, [])
        """
        checked, damage = self.damage_all()
        return checked, [str(d) for d in damage]

    def damage_all(self) -> tuple[int, list[Damage]]:
        """Check every file of every folder against its manifest (full sha256, no cache): the number of files
        checked and what is damaged (a changed or missing file, a manifest edited by hand or deleted), each with
        what repairs it (:class:`storage.repairs.Damage`)."""
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
            except StoreError as exc:  # unreadable: its message names the manifest and its repair
                problems.append(Damage("", str(exc)))
                continue
            if m is None:
                continue
            if edited := self.edited_damage(folder, m):
                problems.append(edited)
            files = dict(m.files)
            for rec in self._pending_records(folder)[1]:  # shards recorded, not yet compacted
                if isinstance(rec, StoreError):
                    problems.append(Damage("", str(rec)))
                elif rec.config_hash == m.config_hash:
                    files[rec.name] = rec.file
            for name, entry in sorted(files.items()):
                checked += 1
                if damage := self.file_damage(folder, name, entry, cached=False):
                    problems.append(damage)
        problems += self.orphan_folders()
        return checked, problems

    def orphan_folders(self) -> list[Damage]:
        """Folders holding files but no manifest (a deleted one): damage, since SQL and the stages would
        silently leave their files out. One each, with the repair."""
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
                    problem = f"{len(files)} file(s) but no manifest (deleted?), so none is trusted"
                    out.append(Damage(path, problem, self.repair(rel)))
        return out

    def state(
        self, folder: str, config: dict[str, Any], *, force: bool = False, verify: bool = True, hint: str = ""
    ) -> FolderState:
        """The one drift policy of every stage: the state of ``folder`` for ``config``.

        A folder built from different settings raises :class:`ConfigDriftError` naming the fields, unless
        ``force`` (then it is ``STALE``: the caller replaces it). Different ``inputs`` alone (upstream
        fingerprints, see :data:`storage.manifest.INPUTS_KEY`) make it ``STALE``. ``verify=False`` skips the
        checksums (sharded folders verify shard by shard).
        """
        try:
            m = self.read_manifest(folder, trusted=False)
        except StoreError:  # unreadable: nothing in the folder is trusted, it is rebuilt
            return FolderState.DAMAGED
        if m is None:
            return FolderState.ABSENT
        stored = config_hash(m.config)  # the config itself, not the hash recorded beside it
        if stored != config_hash(config):
            settings = [d for d in diff_configs(m.config, config) if not is_input_field(d[0])]
            if settings and not force:
                raise ConfigDriftError(self.abspath(folder), settings, hint or DRIFT_HINT)
            return FolderState.STALE
        if m.edited():  # a manifest edited by hand: nothing in the folder is trusted
            return FolderState.DAMAGED
        if verify:
            try:
                for name, entry in m.files.items():
                    self.verify_file(folder, name, entry)
            except ChecksumError:
                return FolderState.DAMAGED
        return FolderState.CURRENT
