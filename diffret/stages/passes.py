"""A search pass cut into units: each unit's partial top-k is a file of the pass's ``partials/`` folder, recorded as
it completes (a killed pass keeps its finished units); when the last one is in, the planning process merges them
into the pass's runs and removes the folder.

A score or beta pass is cut into contiguous blocks of passages (every query against a block: the runs are the top
k of the blocks' top k, :func:`retrieval.search.scoring.merge_topk`); a late pass into slices of queries (each
slice's rows are its queries' runs). The folder is named by the pass's settings, so a pass planned with other
settings never reads another's units.

A unit's file holds only what its inputs decide (no timing, no host): a unit Dask computes again after a worker died
writes the same bytes, so the record of its first result still holds. What its search cost goes beside it
(``storage.layout.unit_seconds_path``), summed into the runs' manifests.
"""

from __future__ import annotations

import contextlib
import json
import os
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import pyarrow as pa

from diffret.caching import KeyedCache
from diffret.retrieval.search.encodings import Encodings
from diffret.retrieval.search.rules import ScoreRules
from diffret.retrieval.search.runs import topk_from_table
from diffret.retrieval.search.scoring import TopK, merge_topk
from diffret.storage import ArtifactStore, ChecksumError, FileEntry, StoreError, config_hash, remove_empty_sharded
from diffret.storage.layout import pass_units_dir, unit_seconds_path

from .base import Context, Plan, Shared, Stage, put_shared
from .readers import query_encodings


@dataclass
class PassUnit:
    """One unit of a cut pass: passages ``start:end`` (their shards ``shards``, when read from an encoding folder) or
    query rows ``start:end``. What every unit of the pass shares is stored once and named by ``plan``."""

    plan: str  # key of the pass's shared settings (ArtifactStore.put_plan)
    folder: str  # the pass's partials folder
    name: str  # this unit's file there
    config_hash: str  # of that folder's manifest: the unit is recorded against it
    start: int
    end: int
    shards: list[str] = field(default_factory=list)
    label: str = ""  # how a person reads it: "K_p=16 passages 0-99,999"


class PassShared(Shared):
    """What every unit of a pass shares, as its stage declares it (a subclass); the queries a score or beta pass
    reads (:func:`pass_queries`) are named here. ``query_folders``: K_q -> its query encodings' folder."""

    query_folders: dict[int, str] = {}
    query_ids: list[str] = []
    sparse_factor: float = 1.0

    # fields that do not change a unit's result (a memory budget), as pydantic's ``exclude``: out of the pass's key
    unkeyed: ClassVar[dict[str, Any]] = {}

    def pass_config(self, **more: Any) -> dict[str, Any]:
        """The config that names the pass's partials folder: these settings (the query ids by their hash, the
        unkeyed fields left out) and ``more`` (its inputs' hashes, its cut): a pass planned with other settings
        never reads another's units."""
        cfg = self.model_dump(mode="json", exclude={"query_ids": True, **self.unkeyed})
        return {**cfg, "query_ids": config_hash({"ids": self.query_ids}), **more}


def unit_file(i: int) -> str:
    """A unit's file in its partials folder.

    >>> unit_file(3)
    'block=00003.parquet'
    """
    return f"block={i:05d}.parquet"


def cut(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """Contiguous runs ``[a, b)`` of the items whose ``sizes`` add up to at most ``limit`` (at least one item each).

    >>> cut([40, 40, 40, 10], 80), cut([100, 5], 50), cut([], 10)
    ([(0, 2), (2, 4)], [(0, 1), (1, 2)], [])
    """
    out, a, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > a and total + n > limit:
            out.append((a, i))
            a, total = i, 0
        total += n
    if a < len(sizes):
        out.append((a, len(sizes)))
    return out


def open_pass(ctx: Context, system: str, dataset: str, kp: int, config: dict[str, Any]) -> tuple[str, str, set[str]]:
    """The partials folder of a pass with these settings (held by this run; units a killed run finished are kept),
    its manifest's config hash, and the unit files already done. The folders of passes over the same cells planned
    with other settings (a killed run's, left behind) are removed, unless another run holds them."""
    key = config_hash(config)[:16]
    folder = pass_units_dir(system, dataset, kp, key)
    parent = folder.rsplit("/", 1)[0]
    for other in ctx.store.list_partitions(parent, "key"):
        if other != key:
            _remove_unheld(ctx.store, f"{parent}/key={other}")
    ctx.hold(folder)
    part = {"system": system, "dataset": dataset, "kp": str(kp), "key": key}
    m, done = ctx.store.open_sharded(folder, "partials", part, config)
    return folder, m.config_hash, done


def close_passes(ctx: Context, folders: list[str], plan_keys: list[str]) -> None:
    """A failed run's passes: their partials folders kept where a unit finished (the next run resumes from them),
    removed where none did (nothing is left of a run refused before its first unit); their shared settings
    removed."""
    for folder in remove_empty_sharded(ctx.store, folders):
        prune_partials(ctx.store, folder)
    for key in plan_keys:
        ctx.store.remove_plan(key)


def merged_pass(ctx: Context, folder: str, plan_key: str, tracker: PassTracker) -> None:
    """A pass whose runs are written: its partials folder removed with the folders above it that it leaves empty
    (up to ``partials/``: a finished run leaves nothing there), its shared settings removed, and the run's tracker
    told."""
    ctx.store.remove_folder(folder)
    prune_partials(ctx.store, folder)
    ctx.store.remove_plan(plan_key)
    tracker.merged.add(folder)


def prune_partials(store: ArtifactStore, folder: str) -> None:
    """The empty folders above a removed pass folder, up to and including ``partials/`` (local stores; a folder
    another pass still uses is not empty and stays)."""
    if not store.is_local:
        return
    parts = folder.split("/")
    for depth in range(len(parts) - 1, 0, -1):
        with contextlib.suppress(OSError):  # not empty (another pass), or already gone
            os.rmdir(store.abspath("/".join(parts[:depth])))


def _remove_unheld(store: ArtifactStore, folder: str) -> None:
    with contextlib.suppress(StoreError), store.lock(folder + "/_run"):
        store.remove_folder(folder)


def write_unit(store: ArtifactStore, unit: PassUnit, table: pa.Table, seconds: float | None = None) -> FileEntry:
    """Write one unit's partial top-k (a :func:`retrieval.search.runs.topk_table`) atomically; recorded by the
    planning process (:meth:`PassTracker.done`). ``table`` holds only what the unit's inputs decide (the same bytes
    each time it runs); ``seconds``, what its search cost, is written beside it (:func:`unit_seconds`)."""
    if seconds is not None:
        store.write_bytes(unit_seconds_path(unit.folder, unit.name), json.dumps({"seconds": seconds}).encode())
    return store.write_shard(unit.folder, unit.name, table)


def unit_seconds(store: ArtifactStore, folder: str, name: str) -> float:
    """The search seconds unit ``name`` of a pass recorded beside its file (:func:`write_unit`); 0 when it recorded
    none or the record is unreadable (a timing, never a reason to redo a unit).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as root:
    ...     store = ArtifactStore(root)
    ...     unit = PassUnit("k", "partials/p", "block=00000.parquet", "h", 0, 3)
    ...     _ = write_unit(store, unit, pa.table({"x": [1, 2, 3]}), seconds=1.25)
    ...     unit_seconds(store, "partials/p", "block=00000.parquet"), unit_seconds(store, "partials/p", "block=1")
    (1.25, 0.0)
    """
    try:
        with store.fs.open(store.abspath(unit_seconds_path(folder, name)), "rb") as f:
            return float(json.loads(f.read())["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def read_units(store: ArtifactStore, folder: str) -> Iterator[tuple[str, pa.Table]]:
    """The unit files of a complete pass, in order, each verified against its record."""
    store.compact_shards(folder)
    m = store.require_manifest(folder)
    for name in sorted(m.files):
        yield name, store.read_table(folder, name)


def merged_blocks(store: ArtifactStore, folder: str, k: int, columns: int) -> tuple[dict[tuple[int, str], TopK], float]:
    """The (K_q, mode) -> TopK of a pass cut into passage blocks: the top ``k`` of the blocks' top k (ties: the earlier
    passage), ``columns`` passages in all; and the blocks' search seconds, summed. Two blocks' top k in memory at once.
    """
    out: dict[tuple[int, str], TopK] = {}
    seconds = 0.0
    for name, table in read_units(store, folder):
        seconds += unit_seconds(store, folder, name)
        for key, top in topk_from_table(table).items():
            out[key] = top if key not in out else merge_topk([out[key], top], k)
    return {key: merge_topk([top], k, columns) for key, top in out.items()}, seconds


def stacked_slices(store: ArtifactStore, folder: str, rows: int) -> tuple[dict[tuple[int, str], TopK], float]:
    """The (K_q, mode) -> TopK of a pass cut into query slices: each slice's rows in place, ``rows`` queries in all;
    and the slices' search seconds, summed."""
    tables, seconds = [], 0.0
    for name, table in read_units(store, folder):
        seconds += unit_seconds(store, folder, name)
        tables.append(table)
    return topk_from_table(pa.concat_tables(tables), rows=rows), seconds


@dataclass
class PassTracker:
    """The planning process's view of its cut passes: which units each still waits for, which it merged, and the
    bytes of each unit it recorded."""

    pending: dict[str, set[str]] = field(default_factory=dict)  # partials folder -> unit files not yet done
    merged: set[str] = field(default_factory=set)
    recorded: dict[tuple[str, str], str] = field(default_factory=dict)  # (folder, unit file) -> sha256, this run's

    def expect(self, folder: str, names: list[str]) -> None:
        self.pending[folder] = set(names)

    def done(self, ctx: Context, unit: PassUnit, entry: FileEntry) -> bool:
        """Record a finished unit; True when its pass is now complete (and not yet merged).

        A unit whose result comes in twice (computed again after the worker that held its first result died) is
        recorded once: the same bytes are accepted as they are, other bytes are refused as damage (its file no
        longer is what its record says)."""
        first = self.recorded.get((unit.folder, unit.name))
        if first is not None:
            if first != entry.sha256:
                where = f"{ctx.store.abspath(unit.folder)}/{unit.name}"
                raise ChecksumError(
                    f"{where}: computed twice with different bytes (sha256 {first[:12]}… recorded, "
                    f"{entry.sha256[:12]}… now), so it is not trusted; run the same command again "
                    "to redo it"
                )
            return False
        ctx.store.record_shard(unit.folder, unit.name, entry, unit.config_hash)
        self.recorded[(unit.folder, unit.name)] = entry.sha256
        waiting = self.pending.setdefault(unit.folder, set())
        waiting.discard(unit.name)
        return not waiting and unit.folder not in self.merged

    def complete(self) -> list[str]:
        """The passes with nothing pending that are not merged yet (all their units done by an earlier run)."""
        return [s for s, waiting in self.pending.items() if not waiting and s not in self.merged]


_QUERIES: KeyedCache[tuple[str, str, str], dict[int, Encodings]] = KeyedCache()  # one pass's query sets


def pass_queries(
    ctx: Context, key: str, shared: PassShared, device: str, rules: ScoreRules | None = None
) -> dict[int, Encodings]:
    """A pass's query encodings by K_q (``shared``: its ``query_folders``, ``query_ids`` and ``sparse_factor``) on
    ``device``: every unit of the pass a process runs reads them once."""
    return _QUERIES.get(
        (ctx.store.root, key, device),
        lambda: {
            kq: query_encodings(ctx.store, folder, shared.query_ids, device, rules, shared.sparse_factor)
            for kq, folder in shared.query_folders.items()
        },
    )


MergeT = TypeVar("MergeT")


@dataclass
class Pass(Generic[MergeT]):
    """One cut pass of a run: its partials folder, the key of what its units share (:func:`stages.base.put_shared`),
    what its stage's :meth:`PassStage.merge` needs, as the stage's own record, and the sharded folders it opens for
    its units to fill (removed by a failed run that left them empty)."""

    folder: str
    plan_key: str
    merge: MergeT
    opened: list[str] = field(default_factory=list)


@dataclass
class Block:
    """One unit a pass is cut into, as its stage plans it: items ``start:end`` (passages or query rows), the shards
    they are read from (a score pass's), how a person reads it."""

    start: int
    end: int
    label: str
    shards: list[str] = field(default_factory=list)


def even_blocks(n: int, size: int, noun: str, prefix: str = "") -> list[Block]:
    """``n`` items cut into blocks of ``size`` (the last one shorter).

    >>> [(b.start, b.end, b.label) for b in even_blocks(5, 2, "queries")]
    [(0, 2, 'queries 0-1'), (2, 4, 'queries 2-3'), (4, 5, 'queries 4-4')]
    """
    return [Block(a, min(a + size, n), f"{prefix}{noun} {a:,}-{min(a + size, n) - 1:,}") for a in range(0, n, size)]


@dataclass
class PassPlan(Plan, Generic[MergeT]):
    """The plan of a pass stage: its units (:class:`PassUnit`) and, by partials folder, its passes and what each
    still waits for."""

    passes: dict[str, Pass[MergeT]] = field(default_factory=dict)
    tracker: PassTracker = field(default_factory=PassTracker)


class PassStage(Stage, Generic[MergeT]):
    """A stage whose work is one or more passes cut into units (score's and beta's passage blocks, late's and
    rerank's query slices), each unit writing a partial result of its pass. It owns the protocol: units named and
    counted, each one's file recorded as it completes (a unit computed twice is recorded once), a pass merged into
    its runs by the planning process when its last unit is in (or, resuming, when every unit was done before), its
    partials and shared settings removed then, and a failed run's finished units kept for the next one.

    A subclass plans its passes with :meth:`add_pass` on a :class:`PassPlan`, and implements :meth:`run` (one unit:
    its partial result, through :func:`write_unit`) and :meth:`merge` (a complete pass: its runs). ``MergeT`` is its
    record of what a merge needs (``Score(PassStage[ScoreMerge])``), so a merge reads typed fields.
    """

    distributed: ClassVar[bool] = True

    def add_pass(
        self,
        ctx: Context,
        plan: PassPlan[MergeT],
        *,
        system: str,
        dataset: str,
        kp: int,
        config: dict[str, Any],
        shared: Shared,
        blocks: list[Block],
        merge: MergeT,
        opened: list[str] | None = None,
    ) -> int:
        """Plan one pass: its partials folder (named by ``config``; the units a killed run finished are kept), its
        ``shared`` record stored once, a unit per block not yet done, ``merge``, what :meth:`merge` needs, and
        ``opened``, sharded folders the pass opens for its units to fill. Returns how many blocks an earlier run
        finished."""
        folder, chash, done = open_pass(ctx, system, dataset, kp, config)
        key = put_shared(ctx, shared)
        waiting = []
        for i, block in enumerate(blocks):
            name = unit_file(i)
            if name in done:
                continue
            plan.units.append(PassUnit(key, folder, name, chash, block.start, block.end, block.shards, block.label))
            plan.work = (plan.work or 0) + block.end - block.start
            waiting.append(name)
        plan.tracker.expect(folder, waiting)
        plan.passes[folder] = Pass(folder, key, merge, list(opened or []))
        return len(blocks) - len(waiting)

    @abstractmethod
    def merge(self, done: Pass[MergeT], ctx: Context) -> None:
        """Write the runs of a pass whose units are all recorded (read them with :func:`merged_blocks` or
        :func:`stacked_slices`)."""

    def unit_name(self, unit: PassUnit) -> str:
        return unit.label

    def work_of(self, unit: PassUnit) -> int:
        return unit.end - unit.start

    def commit(self, unit: PassUnit, result: FileEntry, ctx: Context) -> None:
        plan = pass_plan(ctx)
        if plan.tracker.done(ctx, unit, result):
            self._merged(plan, plan.passes[unit.folder], ctx)

    def _merged(self, plan: PassPlan[MergeT], done: Pass[MergeT], ctx: Context) -> None:
        self.merge(done, ctx)
        merged_pass(ctx, done.folder, done.plan_key, plan.tracker)

    def finish(self, config: Any, plan: Plan, results: list[Any], ctx: Context) -> dict[str, Any]:
        """Merge the passes whose units were all done before this run (a run killed after its last unit)."""
        assert isinstance(plan, PassPlan)
        for folder in plan.tracker.complete():
            self._merged(plan, plan.passes[folder], ctx)
        return plan.details

    def abort(self, config: Any, plan: Plan, ctx: Context) -> None:
        """A failed run keeps the units it finished (recorded in each pass's partials folder); a pass none of whose
        units finished leaves nothing, nor does a folder it opened and never filled."""
        assert isinstance(plan, PassPlan)
        remove_empty_sharded(ctx.store, [f for p in plan.passes.values() for f in p.opened])
        close_passes(ctx, list(plan.passes), [p.plan_key for p in plan.passes.values()])


def pass_plan(ctx: Context) -> PassPlan[Any]:
    """The plan of the pass stage ``ctx`` runs (in the planning process, where units are committed)."""
    if not isinstance(ctx.plan, PassPlan):
        raise TypeError(f"a pass stage's units are committed where it was planned, with its PassPlan, not {ctx.plan!r}")
    return ctx.plan
