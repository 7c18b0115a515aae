"""The shape of every stage: ``plan(config, ctx)`` lists the units still to do, ``run(unit, ctx)`` does one,
``commit`` records it (in the one process that writes manifests), and one :class:`StageResult` says what
happened. :func:`execute` runs a stage in this process; ``flows.runner`` runs the same stage under Prefect.

A stage never calls another stage: it reads the previous stage's artifacts from the store. What is already
done is decided by the store alone (:meth:`storage.ArtifactStore.state`), so any run, killed or not,
through Prefect or not, resumes where the last one stopped.
"""

from __future__ import annotations

import base64
import contextlib
import posixpath
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from diffret.caching import KeyedCache
from diffret.retrieval.devices import resolve_device
from diffret.retrieval.fields import Settings, cli
from diffret.retrieval.search.modes import MODE_NAMES, check_modes
from diffret.retrieval.traits import Declared
from diffret.storage import ArtifactStore, FolderState, StoreError, remove_empty_sharded
from diffret.storage.layout import DEFAULT_ROOT

GRID_K = (1, 2, 4, 8, 16)  # the paper's budgets: K_q, K_p in {1, 2, 4, 8, 16}


def sorted_positive_ks(v: list[int]) -> list[int]:
    """A budget list as the flows take it: positive integers, each once, sorted.

    >>> sorted_positive_ks([4, 1, 16])
    [1, 4, 16]
    >>> sorted_positive_ks([1, 1])
    Traceback (most recent call last):
    ...
    ValueError: K values repeat in [1, 1]: give each budget once
    """
    if not v or any(k <= 0 for k in v):
        raise ValueError(f"K must be positive integers, got {v}")
    if len(set(v)) != len(v):
        raise ValueError(f"K values repeat in {v}: give each budget once")
    return sorted(v)


def _budgets_first(v: Any) -> Any:
    """A budget list's own refusal of a K below 1 (:func:`sorted_positive_ks`), before the items' bound answers."""
    if isinstance(v, list) and any(isinstance(k, int) and k <= 0 for k in v):
        sorted_positive_ks(v)
    return v


Positive = Annotated[int, Field(ge=1)]  # an item of a list of counts, sizes or depths
KList = Annotated[list[Positive], BeforeValidator(_budgets_first), AfterValidator(sorted_positive_ks)]
# a dropdown of the modes in the Prefect UI; check_modes refuses an empty list
ModeList = Annotated[list[Literal[MODE_NAMES]], AfterValidator(check_modes)]  # type: ignore[valid-type]

# (label, done, total, unit, note): absolute progress of one labelled task (units: "docs", "bytes", "cells", ...)
# and a short status shown beside it (a training run's loss and learning rate; "" for none)
ProgressFn = Callable[[str, int, int | None, str, str], None]


class StageConfig(Settings):
    """Fields every stage config has: where the store is, and whether to replace artifacts of other settings."""

    root: str = Field(
        default=DEFAULT_ROOT,
        description="Artifact store root: a local folder or an fsspec URL.",
        json_schema_extra=cli(short="-r", envvar="DIFFRET_ROOT"),
    )
    force: bool = Field(
        default=False, description="Replace artifacts built with other settings (otherwise refused, naming them)."
    )

    def dataset_label(self) -> str:
        """The dataset(s) a run of this config is about, as its next step names them: its ``dataset`` setting when it
        declares one, else its ``datasets`` joined, else DATASET (a config whose dataset is derived overrides it)."""
        for name in ("dataset", "datasets"):
            value = getattr(self, name, None) if name in type(self).model_fields else None
            if value:
                return value if isinstance(value, str) else ",".join(value)
        return "DATASET"


class ClusterConfig(Settings):
    """Where a distributed stage's units run: in this process, on a local Dask cluster, or on one joined by address
    (flows/cluster.py). Runs do not depend on it."""

    workers: int = Field(
        default=0,
        ge=-1,
        description="Local Dask workers for the units: 0 runs them in this "
        "process; N starts N, each on a GPU of its own when the device is a GPU (more workers than "
        "GPUs is refused unless --workers-per-gpu), else on a core of its own (more workers than "
        "cores is refused unless --workers-per-core); -1 one per visible GPU (on a CPU: Dask's "
        "default count).",
    )
    workers_per_gpu: int = Field(
        default=1,
        ge=1,
        description="Local workers one GPU may hold (they share its "
        "memory): allows --workers up to this many times the GPUs.",
    )
    workers_per_core: int = Field(
        default=1,
        ge=1,
        description="Local CPU workers one core may hold (they share "
        "it): allows --workers up to this many times the cores.",
    )
    dask_address: str | None = Field(
        default=None,
        description="Join an existing Dask cluster (tcp://host:8786) "
        "instead; its GPU workers are started one per GPU with --resources GPU=1 "
        "(docs/operations.md).",
    )


def check_device(device: str, config: Any) -> None:
    """Refuse, before any work, a device this machine lacks; a joined cluster's workers check their own (the
    planning process may have no GPU)."""
    if not getattr(config, "dask_address", None):
        resolve_device(device)


class Shared(BaseModel):
    """What every unit of a stage run shares (its settings, its inputs' folders), stored once in the store
    (:func:`put_shared`) and read back, typed, by each process that runs a unit (:func:`read_shared`): a unit sent to a
    Dask worker carries only the key. A stage declares its own subclass, every field typed.

    Examples
    --------
    >>> import tempfile
    >>> class Toy(Shared):
    ...     folders: dict[int, str]
    ...     depth: int
    >>> with tempfile.TemporaryDirectory() as root:
    ...     ctx = Context(ArtifactStore(root))
    ...     key = put_shared(ctx, Toy(folders={4: "encodings/x/k=4"}, depth=10))
    ...     read_shared(ctx, key, Toy)
    Toy(folders={4: 'encodings/x/k=4'}, depth=10)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")


SharedT = TypeVar("SharedT", bound=Shared)
_SHARED: KeyedCache[str, Shared] = KeyedCache(size=16)  # stage runs' shared records by key


def put_shared(ctx: Context, record: Shared) -> str:
    """Store ``record`` once (``ArtifactStore.put_plan``, content-addressed) and return the key its units carry; the
    run removes it when it ends (``ArtifactStore.remove_plan``)."""
    return ctx.store.put_plan(record.model_dump(mode="json"))


def read_shared(ctx: Context, key: str, kind: type[SharedT]) -> SharedT:
    """The record :func:`put_shared` stored under ``key``, as ``kind``, read from the store the first time a process
    needs it, not once per unit; a stored record of another shape is refused (``pydantic.ValidationError``)."""
    record = _SHARED.get(key, lambda: kind.model_validate(ctx.store.read_plan(key)))
    if not isinstance(record, kind):
        raise TypeError(f"shared record {key}: a {type(record).__name__}, not a {kind.__name__}")
    return record


def _ignore(_n: int) -> None:
    pass


@dataclass
class Context:
    """What a stage's plan and units may use: the store, a log, a progress reporter, and ``advance(n)``,
    which moves the current stage's progress on by ``n`` of its work units (set by the executor); ``note``
    is shown beside the progress from the next ``advance`` on."""

    store: ArtifactStore
    log: Callable[[str], None] = print
    report: ProgressFn | None = None
    advance: Callable[[int], None] = _ignore
    note: str = ""
    held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # released when the stage ends
    plan: Plan | None = None  # the stage's plan, in the planning process (``commit`` may read its details)
    stale: list[str] = field(default_factory=list)  # folders built from other inputs, rebuilt (logged once, planned)

    def hold(self, stage_dir: str) -> None:
        """Hold ``stage_dir``'s run lock until the stage ends: a second process writing the same folder at the
        same time is refused (it would redo the same work), not raced."""
        self.held.enter_context(self.store.lock(stage_dir + "/_run"))

    def progress(self, label: str, total: int | None, unit: str = "units") -> Callable[[int], None]:
        """An ``advance(n)`` callback for one labelled task of ``total`` units."""
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            if self.report is not None:
                self.report(label, done[0], total, unit, self.note)

        return advance

    def state(self, stage_dir: str, config: dict[str, Any], force: bool, **kwargs: Any) -> FolderState:
        """:meth:`ArtifactStore.state`, logging why an existing folder is rebuilt (stale ones together, once
        planned: :meth:`log_stale`)."""
        st = self.store.state(stage_dir, config, force=force, **kwargs)
        if st is FolderState.STALE:
            self.stale.append(stage_dir)
        elif st is FolderState.DAMAGED:
            self.log(
                f"{stage_dir}: damaged (a file fails its checksum, or its manifest is unreadable or edited by "
                "hand); rebuilding it"
            )
        return st

    def log_stale(self, show: int = 3) -> None:
        """One line for the folders found built from other inputs or settings (the first ``show`` named)."""
        if not self.stale:
            return
        if len(self.stale) == 1:
            self.log(f"{self.stale[0]}: built from other inputs or settings; rebuilding it")
        else:
            more = f", and {len(self.stale) - show} more" if len(self.stale) > show else ""
            self.log(
                f"{len(self.stale)} folders built from other inputs or settings; rebuilding them: "
                f"{', '.join(self.stale[:show])}{more}"
            )
        self.stale.clear()


@dataclass
class Plan:
    """The units a stage still has to do, and what it found already done."""

    system: str | None = None
    units: list[Any] = field(default_factory=list)
    skipped: int = 0  # things (shards, cells, runs, ...) already current in the store
    count: int | None = None  # things the units cover, when a unit covers several (default: one each)
    work: int | None = None  # total progress units (e.g. texts to encode); None: one per unit
    work_unit: str = "units"
    details: dict[str, Any] = field(default_factory=dict)

    def add_folder(self, ctx: Context, stage_dir: str, config: dict[str, Any], force: bool) -> None:
        """Plan a :class:`Folder` unit for ``stage_dir`` unless it is current."""
        if self.needs(ctx, stage_dir, config, force):
            self.units.append(Folder(stage_dir, config))

    def needs(self, ctx: Context, stage_dir: str, config: dict[str, Any], force: bool) -> bool:
        """Whether ``stage_dir`` must be (re)built for ``config``; a current folder is counted as skipped.
        Drift raises (:meth:`storage.ArtifactStore.state`)."""
        return self.needs_folder(ctx, stage_dir, config, force)

    def needs_folder(self, ctx: Context, stage_dir: str, config: dict[str, Any], force: bool, hint: str = "") -> bool:
        """:meth:`needs`, with the drift error's ``hint`` (what to do instead of --force)."""
        if ctx.state(stage_dir, config, force, hint=hint) is FolderState.CURRENT:
            self.skipped += 1
            return False
        return True


@dataclass
class ShardedPlan(Plan):
    """The plan of a stage that fills sharded folders (tokenize, encode, compress): the folders it opened, by what a
    person reads (``passage/k=16``); its finish compacts their shard records, a failed run removes those it left
    empty."""

    folders: dict[str, str] = field(default_factory=dict)


@dataclass
class Folder:
    """The unit of a stage that builds one folder from one config (a run's metrics, an index, a report)."""

    stage: str
    config: dict[str, Any]


class Output(BaseModel):
    """One store folder a stage run wrote (or found current), as its manifest lists it."""

    folder: str  # relative to the store root
    files: int = 0
    rows: int = 0
    bytes: int = 0


class StageResult(BaseModel):
    """What one stage run did: the same shape for every stage, printed the same way by the CLI and Prefect."""

    stage: str
    system: str | None = None
    done: int = 0  # units done by this run
    skipped: int = 0  # units that were already current
    noun: str = "unit(s)"
    verb: str = "done"
    details: dict[str, Any] = Field(default_factory=dict)
    seconds: float | None = None  # wall time of the stage run (plan, units, finish)
    store: str | None = None  # the store root, absolute
    outputs: list[Output] = Field(default_factory=list)
    next: str = ""  # what a person runs after it

    def line(self) -> str:
        who = f"{self.system}: " if self.system else ""
        total = self.done + self.skipped
        return f"{who}{self.done} {self.noun} {self.verb}, {self.skipped} already done ({total} in all)"

    def markdown(self, max_folders: int = 12) -> str:
        """The result as a person reads it in the Prefect UI: what it did and how long it took, the folders it
        wrote with their files, rows and bytes, the store, what comes next, and the stage's own section
        (``details["markdown"]``).

        >>> r = StageResult(stage="download", done=1, noun="collection(s)", verb="written", seconds=2.5,
        ...                 outputs=[Output(folder="datasets/dataset=x", files=3, rows=120, bytes=4096)])
        >>> print(r.markdown().splitlines()[2])
        **1 collection(s) written, 0 already done (1 in all)** in 2.5 s.
        """
        took = f" in {_duration(self.seconds)}" if self.seconds is not None else ""
        lines = [f"# {self.stage}" + (f": `{self.system}`" if self.system else ""), "", f"**{self.line()}**{took}."]
        if self.outputs:
            # several folders: their common part once, each by the rest (a table that fits the page)
            folders = [o.folder for o in self.outputs]
            common = posixpath.commonpath(folders) if len(folders) > 1 else ""
            common = posixpath.dirname(common) if common in folders else common
            if common:
                lines += ["", f"Under `{common}/`:"]
            lines += ["", "| folder | files | rows | size |", "|---|---:|---:|---:|"]
            for o in self.outputs[:max_folders]:
                name = posixpath.relpath(o.folder, common) if common else o.folder
                lines.append(f"| `{name}` | {o.files} | {o.rows:,} | {_size(o.bytes)} |")
            if len(self.outputs) > max_folders:
                rest = self.outputs[max_folders:]
                lines.append(
                    f"| … and {len(rest)} more folder(s) | {sum(o.files for o in rest)} | "
                    f"{sum(o.rows for o in rest):,} | {_size(sum(o.bytes for o in rest))} |"
                )
        if self.store:
            lines += ["", f"Store: `{self.store}`"]
        if self.next:
            lines += ["", f"Next: {self.next}"]
        extra = self.details.get("markdown")
        return "\n".join(lines) + "\n" + (f"\n{extra}\n" if extra else "")


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _size(n: int) -> str:
    step = min(max(n.bit_length() - 1, 0) // 10, 3)  # 0: bytes, 1: KB, 2: MB, 3: GB
    return f"{n} B" if step == 0 else f"{n / 1024**step:.1f} {('KB', 'MB', 'GB')[step - 1]}"


def inline_figures(markdown: str, store: ArtifactStore) -> str:
    """``markdown`` with each linked PNG of the store (a path relative to its root, or absolute inside it) embedded
    as a data URI, so that a browser shows it wherever the page is read (a Prefect artifact cannot point at the
    server's files). Links to anything else are left as they are.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as root:
    ...     store = ArtifactStore(root)
    ...     store.write_bytes("s/fig.png", b"\\x89PNG")
    ...     inline_figures("![f](s/fig.png) ![g](gone.png)", store)
    '![f](data:image/png;base64,iVBORw==) ![g](gone.png)'
    """

    def embed(m: re.Match[str]) -> str:
        path = m.group(2)
        rel = store.relpath(path)
        if path.startswith("data:") or not store.exists(rel):
            return m.group(0)
        return f"{m.group(1)}(data:image/png;base64,{base64.b64encode(store.read_bytes(rel)).decode()})"

    return re.sub(r"(!\[[^\]]*\])\(([^)\s]+\.png)\)", embed, markdown)


@dataclass(frozen=True)
class Published:
    """One markdown page a stage's flow run publishes (a Prefect artifact): its key's parts, its text (figures
    already embedded) and a short description."""

    key: tuple[str, ...]
    markdown: str
    description: str


class Stage(Declared, ABC):
    """One pipeline stage: its lifecycle. A subclass declares its traits as class keywords, its description as its
    docstring, and implements ``plan`` and ``run``: ``class Score(Stage, name="score", config=ScoreConfig, ...)``.
    How it shows itself (the deployment's description and example, what its command prints, the next step) is its
    module's ``presentation`` (:mod:`diffret.stages.presentation`), which the command line and the flows read.
    """

    name: ClassVar[str]
    config: ClassVar[type[StageConfig]]
    description: ClassVar[str]
    noun: ClassVar[str] = "unit(s)"
    verb: ClassVar[str] = "done"
    distributed: ClassVar[bool] = False  # units may run in other processes (Prefect tasks on Dask)
    reports_progress: ClassVar[bool] = False  # run() calls ctx.advance itself (e.g. per encoded batch)
    task_tags: ClassVar[tuple[str, ...]] = ()  # Prefect tags of its unit tasks (e.g. "gpu", for concurrency limits)
    command: ClassVar[str] = ""  # its CLI command, Prefect flow and deployment name (default: its name)

    def __init_subclass__(cls, **traits: Any) -> None:
        super().__init_subclass__(**traits)
        cls.description = (cls.__doc__ or "").strip()
        cls.command = str(cls.__dict__.get("command") or getattr(cls, "name", ""))

    @abstractmethod
    def plan(self, config: Any, ctx: Context) -> Plan:
        """Check the store and list the units still to do (cheap: no model work)."""

    @abstractmethod
    def run(self, unit: Any, ctx: Context) -> Any:
        """Do one unit. Units are picklable; with ``distributed`` they may run in another process."""

    def prerequisites(self, config: Any) -> list[tuple[str, StageConfig]]:
        """Stages run before this one, by name, each with its config: the command, the stage's flow and the pipeline
        run them first through the same runner (encode and bot: ``tokenize`` what is missing). Default: none."""
        return []

    def prepare(self, config: Any, plan: Plan, ctx: Context) -> None:
        """Work every unit needs first, done once in the planning process before the units run (late: encoding the
        candidates no earlier run needed); default: none."""
        return None

    def commit(self, unit: Any, result: Any, ctx: Context) -> None:
        """Record a finished unit (always in the process that planned; default: nothing to record)."""
        return None

    def finish(self, config: Any, plan: Plan, results: list[Any], ctx: Context) -> dict[str, Any]:
        """Details of the result, once every unit is done (``results``: what each ``run`` returned)."""
        return plan.details

    def abort(self, config: Any, plan: Plan, ctx: Context) -> None:
        """Undo what ``plan`` prepared and no finished unit needs, when a unit failed: the store is left as it
        was before the stage started, plus the units that finished (default: nothing prepared)."""
        return None

    def result(
        self,
        plan: Plan,
        details: dict[str, Any],
        config: Any = None,
        ctx: Context | None = None,
        seconds: float | None = None,
    ) -> StageResult:
        """The run's :class:`StageResult`; with ``config`` and ``ctx``, its output folders (read from their
        manifests) and the store too."""
        res = StageResult(
            stage=self.name,
            system=plan.system,
            done=len(plan.units) if plan.count is None else plan.count,
            skipped=plan.skipped,
            noun=self.noun,
            verb=self.verb,
            details=details,
            seconds=seconds,
        )
        if config is not None and ctx is not None:
            res.store = ctx.store.url()
            res.outputs = [o for f in self.outputs(config, plan, details) if (o := _output(ctx.store, f))]
        return res

    def outputs(self, config: Any, plan: Plan, details: dict[str, Any]) -> list[str]:
        """The store folders this run wrote or found current (relative or absolute): by default the folders its
        :class:`Folder` units built and those its details name (``stages``, ``folders``, ``stage``, ``folder``,
        ``model_dir``)."""
        out = [u.stage for u in plan.units if isinstance(u, Folder)]
        for key in ("stages", "folders"):
            if isinstance(details.get(key), dict):
                out += [v for v in details[key].values() if isinstance(v, str)]
        out += [details[k] for k in ("stage", "folder", "model_dir") if isinstance(details.get(k), str)]
        return list(dict.fromkeys(out))

    def device_of(self, config: Any) -> str:
        """The device its units compute on, as the config asks for it (``auto``, ``cuda``, ``cpu``): the config's
        ``device``, else its backbone's; ``cpu`` for a stage without one (units that may run on any worker)."""
        device = getattr(config, "device", None)
        if device is None and getattr(config, "backbone", None) is not None:
            device = getattr(config.backbone, "device", None)
        return str(device or "cpu")

    def work_of(self, unit: Any) -> int:
        """Progress units of one unit (``Plan.work`` is their sum when set)."""
        return 1

    def unit_name(self, unit: Any) -> str:
        """A unit as a person reads it (a Prefect task run's name): e.g. ``passage K=16 shard=00003``."""
        return getattr(unit, "stage", None) or type(unit).__name__

    def label(self, plan: Plan) -> str:
        return f"{self.name} {plan.system or ''}".strip()


# runs a plan's units and commits each (run_units: one after another in this process; Prefect: as tasks)
UnitsRunner = Callable[["Stage", Plan, Context], list[Any]]


def execute(
    stage: Stage,
    config: StageConfig,
    *,
    log: Callable[[str], None] = print,
    report: ProgressFn | None = None,
    units: UnitsRunner | None = None,
) -> StageResult:
    """Plan a stage, prepare what its units share, run its units (``units``; default: in this process, one after
    another), committing each one as it finishes, then finish it; the failed run's ``abort`` undoes what the plan
    prepared."""
    started = time.monotonic()
    ctx = Context(ArtifactStore(config.root), log, report)
    with ctx.held:
        try:
            plan = ctx.plan = stage.plan(config, ctx)
        finally:
            ctx.log_stale()
        try:
            stage.prepare(config, plan, ctx)
            results = (units or run_units)(stage, plan, ctx)
        except BaseException:
            stage.abort(config, plan, ctx)
            raise
        details = stage.finish(config, plan, results, ctx)
        return stage.result(plan, details, config, ctx, time.monotonic() - started)


def _output(store: ArtifactStore, folder: str) -> Output | None:
    """A folder's files, rows and bytes from its manifest; None when it has none (nothing to show)."""
    rel = store.relpath(folder)
    try:
        m = store.read_manifest(rel)
    except StoreError:
        m = None
    if m is None:
        return None
    files = m.files.values()
    return Output(folder=rel, files=len(files), rows=sum(e.rows or 0 for e in files), bytes=sum(e.bytes for e in files))


class ShardedStage(Stage):
    """A stage that fills sharded folders (tokenize, encode, compress) and plans a :class:`ShardedPlan`: when its
    units are done it compacts each folder's shard records into its manifest (one write per folder); a failed run
    keeps the shards it finished and removes the folders it opened that hold none."""

    def finish(self, config: Any, plan: Plan, results: list[Any], ctx: Context) -> dict[str, Any]:
        assert isinstance(plan, ShardedPlan)
        for folder in plan.folders.values():
            ctx.store.compact_shards(folder)
        return {"stages": dict(plan.folders)}

    def abort(self, config: Any, plan: Plan, ctx: Context) -> None:
        assert isinstance(plan, ShardedPlan)
        remove_empty_sharded(ctx.store, plan.folders.values())


# what ran a plan's units elsewhere yields: each unit with its result, as they complete
Outcomes = Iterable[tuple[Any, Any]]


def run_units(stage: Stage, plan: Plan, ctx: Context, elsewhere: Callable[[], Outcomes] | None = None) -> list[Any]:
    """The one unit loop: every unit of a plan run, each committed in this process as it completes (the one writer of
    manifests), progress by the stage's work; their results, in completion order. The caller aborts the stage on
    failure.

    Without ``elsewhere`` the units run here, one after another (a stage that reports its own progress advances it
    from inside ``run``); ``elsewhere`` starts them on other workers (Dask, Prefect tasks) and yields each unit with
    its result as it completes.

    >>> import tempfile
    >>> from diffret.stages import stages
    >>> with tempfile.TemporaryDirectory() as root:
    ...     ctx = Context(ArtifactStore(root), log=lambda _: None)
    ...     run_units(stages()["bot"], Plan(), ctx, elsewhere=lambda: iter([]))
    []
    """
    total = plan.work if plan.work is not None else sum(stage.work_of(u) for u in plan.units)
    advance = ctx.progress(stage.label(plan), total, plan.work_unit)
    here = elsewhere is None
    if here and stage.reports_progress:
        ctx.advance = advance
    outcomes = ((unit, stage.run(unit, ctx)) for unit in plan.units) if elsewhere is None else elsewhere()
    results: list[Any] = []
    for unit, result in outcomes:
        results.append(result)
        stage.commit(unit, result, ctx)
        if not (here and stage.reports_progress):
            advance(stage.work_of(unit))
    return results
