"""Stage manifests: what produced a folder of artifacts, and the checksums that say it is whole."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import platform
from collections.abc import Iterator
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from typing import Any

from pydantic import BaseModel, Field

MANIFEST_VERSION = 1
_VERSIONED_PACKAGES = ("diffret", "pyarrow", "duckdb", "prefect", "torch", "transformers", "lancedb")


class StoreError(RuntimeError):
    """Base class for every artifact-store error; the message names the artifact and the fix."""


class ChecksumError(StoreError):
    """A file's bytes differ from the sha256 recorded in its folder's manifest."""


class IncompleteArtifactError(StoreError):
    """A folder without a manifest (or a file without a manifest entry): never read."""


class ConfigDriftError(StoreError):
    """Two configs that must agree do not; ``differences`` lists (field, stored, requested)."""

    def __init__(self, where: str, differences: list[tuple[str, Any, Any]], hint: str = ""):
        self.where = where
        self.differences = differences
        shown = "; ".join(f"{f}: {_shown(a)} stored, {_shown(b)} now" for f, a, b in differences[:6])
        more = f"; and {len(differences) - 6} more" if len(differences) > 6 else ""
        super().__init__(f"{where} was built with other settings ({shown}{more})" + (f". {hint}" if hint else ""))


def _shown(value: Any) -> str:
    """A config value in an error line: ``unset`` for a missing field, ``none`` for an empty mapping."""
    if value == _MISSING:
        return "unset"
    if value == {} or value is None:
        return "none"
    return repr(value)


# A stage config may hold the fingerprints of what it was computed from (upstream config hashes, file
# checksums) under this key. When only those differ, the artifact is stale: it is recomputed from the new
# inputs. Any other difference is drift: a setting the user changed, refused unless forced.
INPUTS_KEY = "inputs"


def is_input_field(name: str) -> bool:
    return name == INPUTS_KEY or name.startswith(INPUTS_KEY + ".")


class FileEntry(BaseModel):
    """One file of a folder: its checksum, size, rows (tables) and, for shards, the modification time
    seen when it was written (``mtime_ns``; absent in manifests written before it existed).

    Re-run planning trusts a shard whose size and mtime still match (``open_sharded``); anything else,
    and ``diffret verify`` always, checks the sha256.

    >>> FileEntry(sha256="ab" * 32, bytes=10, rows=2).mtime_ns is None
    True
    """

    sha256: str
    bytes: int
    rows: int | None = None
    mtime_ns: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The entry as JSON-ready data, without ``mtime_ns`` when it is unknown (as manifests always were).

        >>> FileEntry(sha256="0" * 64, bytes=3).to_dict()
        {'sha256': '0000000000000000000000000000000000000000000000000000000000000000', 'bytes': 3, 'rows': None}
        """
        out = self.model_dump(mode="json")
        if out["mtime_ns"] is None:
            del out["mtime_ns"]
        return out


class ShardRecord(BaseModel):
    """One finished shard of a sharded folder, waiting to be compacted into its manifest.

    One line of ``<folder>/_shards.jsonl``, or on object stores the object ``<folder>/_records/<name>.json``
    (see ``ArtifactStore.record_shard``). The ``config_hash`` is the one of the manifest the shard was
    planned against: a record of another config is never merged.

    >>> r = ShardRecord(config_hash="c" * 64, name="shard=00000.parquet", file=FileEntry(sha256="0" * 64, bytes=1))
    >>> ShardRecord.from_json(r.to_json()) == r
    True
    """

    config_hash: str
    name: str
    file: FileEntry

    def to_json(self) -> str:
        return (
            json.dumps(
                {"config_hash": self.config_hash, "name": self.name, "file": self.file.to_dict()}, sort_keys=True
            )
            + "\n"
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "shard record") -> ShardRecord:
        try:
            return cls.model_validate_json(text)
        except ValueError as exc:
            raise StoreError(f"{where}: unreadable shard record ({exc.__class__.__name__})") from exc


class Manifest(BaseModel):
    manifest_version: int = MANIFEST_VERSION
    stage: str
    partition: dict[str, str] = Field(default_factory=dict)
    config: dict[str, Any]
    config_hash: str
    created_at: str
    versions: dict[str, str] = Field(default_factory=dict)
    files: dict[str, FileEntry] = Field(default_factory=dict)
    stats: dict[str, Any] = Field(default_factory=dict)
    files_hash: str | None = None  # of ``files`` (sha256, bytes, rows) when written; None in older manifests

    @classmethod
    def new(cls, stage: str, partition: dict[str, str], config: dict[str, Any], stats: dict | None = None) -> Manifest:
        return cls(
            stage=stage,
            partition=partition,
            config=config,
            config_hash=config_hash(config),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            versions=library_versions(),
            stats=stats or {},
        )

    def to_json(self) -> str:
        """The manifest as written (its ``files_hash`` set to the hash of the files it lists)."""
        self.files_hash = self.compute_files_hash()
        data = self.model_dump(mode="json")
        data["files"] = {name: entry.to_dict() for name, entry in self.files.items()}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def compute_files_hash(self) -> str:
        """A hash of every file entry's sha256, size and rows (not mtimes: a touched file is re-hashed anyway).

        >>> m = Manifest.new("s", {}, {"a": 1})
        >>> m.compute_files_hash() == Manifest.from_json(m.to_json()).files_hash
        True
        """
        return config_hash({n: [e.sha256, e.bytes, e.rows] for n, e in sorted(self.files.items())})

    def edited(self) -> str | None:
        """What was edited by hand, if anything: the config (it no longer matches its hash) or the file list (it
        no longer matches the hash written with it). A manifest edited by hand is not trusted.

        >>> m = Manifest.from_json(Manifest.new("s", {}, {"a": 1}).to_json())
        >>> m.edited() is None, m.model_copy(update={"config": {"a": 2}}).edited()
        (True, 'its config')
        >>> m.model_copy(update={"stats": {"check": {"1": {"recall": float("nan")}}}}).edited()
        'its stats (stats.check.1.recall is nan, a number that is not finite)'
        """
        if self.config_hash != config_hash(self.config):
            return "its config"
        if self.files_hash is not None and self.files_hash != self.compute_files_hash():
            return "its file list (sha256, bytes or rows)"
        bad = next(_non_finite_numbers(self.stats, "stats"), None)
        if bad:  # diffret writes such a number as null: a NaN or an infinity here was put there by hand
            return f"its stats ({bad[0]} is {bad[1]}, a number that is not finite)"
        return None

    def non_finite(self, tries: int = 4096) -> list[str]:
        """The config's fields that held a number that is not finite (NaN, +-inf) when it was written: JSON writes one
        as null, so the config no longer gives its hash; putting NaN or an infinity back where a null is gives it
        again. Settings refuse such numbers now, so the folder cannot be built again as it was. ``[]`` when the config
        gives its hash, or when no choice of at most ``tries`` puts it back (an edit by hand).

        >>> m = Manifest.new("runs", {}, {"fusion": {"weights": [float("nan"), 1.0]}, "corpus": None})
        >>> Manifest.from_json(m.to_json()).non_finite(), m.non_finite()
        (['fusion.weights[0]'], [])
        """
        if self.config_hash == config_hash(self.config):
            return []
        config = json.loads(json.dumps(self.config))  # a copy to fill in
        nulls = list(_nulls(config))
        for k in range(1, len(nulls) + 1):
            for where in itertools.combinations(nulls, k):
                for values in itertools.product(_NON_FINITE, repeat=k):
                    tries -= 1
                    if tries < 0:
                        return []
                    for (parent, key, _), value in zip(where, values, strict=True):
                        parent[key] = value
                    found = config_hash(config) == self.config_hash
                    for parent, key, _ in where:
                        parent[key] = None
                    if found:
                        return [name for _, _, name in where]
        return []

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> Manifest:
        try:
            return cls.model_validate_json(text)
        except ValueError as exc:
            errors = getattr(exc, "errors", None)
            first = errors()[0] if callable(errors) and errors() else None
            loc = ".".join(map(str, first["loc"])) if first else ""
            reason = (first["msg"] + (f", field {loc}" if loc else "")) if first else str(exc)
            raise StoreError(f"{where}: unreadable manifest ({' '.join(reason.split())})") from None

    def total_rows(self) -> int:
        return sum(e.rows or 0 for e in self.files.values())

    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.files.values())


_NON_FINITE = (math.nan, math.inf, -math.inf)


def _non_finite_numbers(obj: Any, name: str) -> Iterator[tuple[str, float]]:
    """(dotted name, value) of every number in a JSON value that is NaN or infinite, in order."""
    if isinstance(obj, float) and not math.isfinite(obj):
        yield name, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        yield from _non_finite_numbers(value, f"{name}[{key}]" if isinstance(obj, list) else f"{name}.{key}")


def _nulls(obj: Any, name: str = "") -> Iterator[tuple[Any, Any, str]]:
    """(container, key, dotted name) of every null in a JSON value, in order."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        sub = f"{name}[{key}]" if isinstance(obj, list) else f"{name}.{key}" if name else str(key)
        if value is None:
            yield obj, key, sub
        else:
            yield from _nulls(value, sub)


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        if not obj and prefix:
            out[prefix] = {}
        return out
    return {prefix: obj}


_MISSING = "<absent>"


def diff_configs(stored: dict[str, Any], requested: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Dotted field names whose values differ between two configs (nested dicts are flattened)."""
    a, b = _flatten(stored), _flatten(requested)
    out = [
        (k, a.get(k, _MISSING), b.get(k, _MISSING))
        for k in sorted(set(a) | set(b))
        if a.get(k, _MISSING) != b.get(k, _MISSING)
    ]
    # an empty mapping on one side and its fields on the other: the fields say it (not "{} vs unset" as well)
    return [
        d
        for d in out
        if not (d[1] in ({}, _MISSING) and d[2] in ({}, _MISSING) and any(o[0].startswith(d[0] + ".") for o in out))
    ]


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _VERSIONED_PACKAGES:
        try:
            out[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            pass
    return out
