"""The shape of every stage: ``plan(config, ctx)`` lists the units still to do, ``run(unit, ctx)`` does one,
``commit`` records it (in the one process that writes manifests), and one :class:`StageResult` says what
happened. :func:`execute` runs a stage in this process; ``flows.runner`` runs the same stage under Prefect.

A stage never calls another stage: it reads the previous stage's artifacts from the store. What is already
done is decided by the store alone (:meth:`storage.ArtifactStore.state`), so any run, killed or not,
through Prefect or not, resumes where the last one stopped.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, Field

from retrieval.fields import cli
from retrieval.search.modes import check_modes
from retrieval.traits import Declared
from storage import ArtifactStore, StageState
from storage.layout import DEFAULT_ROOT

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


KList = Annotated[list[int], AfterValidator(sorted_positive_ks)]
ModeList = Annotated[list[str], AfterValidator(check_modes)]

# (label, done, total, unit, note): absolute progress of one labelled task (units: "docs", "bytes", "cells", ...)
# and a short status shown beside it (a training run's loss and learning rate; "" for none)
ProgressFn = Callable[[str, int, int | None, str, str], None]


class StageConfig(BaseModel):
    """Fields every stage config has: where the store is, and whether to replace artifacts of other settings."""

    root: str = Field(default=DEFAULT_ROOT, description="Artifact store root: a local folder or an fsspec URL.",
                      json_schema_extra=cli(short="-r", envvar="DIFFRET_ROOT"))  # fmt: skip
    force: bool = Field(
        default=False, description="Replace artifacts built with other settings (otherwise refused, naming them)."
    )


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

    def state(self, stage_dir: str, config: dict[str, Any], force: bool, **kwargs: Any) -> StageState:
        """:meth:`ArtifactStore.state`, logging why an existing folder is rebuilt."""
        st = self.store.state(stage_dir, config, force=force, **kwargs)
        if st is StageState.STALE:
            self.log(f"{stage_dir}: built from other inputs or settings; rebuilding it")
        elif st is StageState.DAMAGED:
            self.log(f"{stage_dir}: damaged (a file fails its checksum, or its manifest is unreadable or edited by "
                     "hand); rebuilding it")  # fmt: skip
        return st


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
        if ctx.state(stage_dir, config, force, hint=hint) is StageState.CURRENT:
            self.skipped += 1
            return False
        return True


@dataclass
class Folder:
    """The unit of a stage that builds one folder from one config (a run's metrics, an index, a report)."""

    stage: str
    config: dict[str, Any]


class StageResult(BaseModel):
    """What one stage run did: the same shape for every stage, printed the same way by the CLI and Prefect."""

    stage: str
    system: str | None = None
    done: int = 0  # units done by this run
    skipped: int = 0  # units that were already current
    noun: str = "unit(s)"
    verb: str = "done"
    details: dict[str, Any] = Field(default_factory=dict)

    def line(self) -> str:
        who = f"{self.system}: " if self.system else ""
        total = self.done + self.skipped
        return f"{who}{self.done} {self.noun} {self.verb}, {self.skipped} already done ({total} in all)"

    def markdown(self) -> str:
        """The result as a Prefect markdown artifact (with the stage's own section, ``details["markdown"]``)."""
        extra = self.details.get("markdown")
        return f"# {self.stage}\n\n{self.line()}\n" + (f"\n{extra}\n" if extra else "")


class Stage(Declared, ABC):
    """One pipeline stage. A subclass declares its traits as class keywords, its description as its docstring,
    and implements ``plan`` and ``run``: ``class Score(Stage, name="score", config=ScoreConfig, ...)``.
    """

    name: ClassVar[str]
    config: ClassVar[type[StageConfig]]
    description: ClassVar[str]
    noun: ClassVar[str] = "unit(s)"
    verb: ClassVar[str] = "done"
    distributed: ClassVar[bool] = False  # units may run in other processes (Prefect tasks on Dask)
    reports_progress: ClassVar[bool] = False  # run() calls ctx.advance itself (e.g. per encoded batch)
    task_tags: ClassVar[tuple[str, ...]] = ()  # Prefect tags of its unit tasks (e.g. "gpu", for concurrency limits)

    def __init_subclass__(cls, **traits: Any) -> None:
        super().__init_subclass__(**traits)
        cls.description = (cls.__doc__ or "").strip()

    @abstractmethod
    def plan(self, config: Any, ctx: Context) -> Plan:
        """Check the store and list the units still to do (cheap: no model work)."""

    @abstractmethod
    def run(self, unit: Any, ctx: Context) -> Any:
        """Do one unit. Units are picklable; with ``distributed`` they may run in another process."""

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

    def result(self, plan: Plan, details: dict[str, Any]) -> StageResult:
        return StageResult(
            stage=self.name, system=plan.system, done=len(plan.units) if plan.count is None else plan.count,
            skipped=plan.skipped, noun=self.noun,
            verb=self.verb, details=details,
        )  # fmt: skip

    def work_of(self, unit: Any) -> int:
        """Progress units of one unit (``Plan.work`` is their sum when set)."""
        return 1

    def label(self, plan: Plan) -> str:
        return f"{self.name} {plan.system or ''}".strip()


def execute(
    stage: Stage, config: StageConfig, *, log: Callable[[str], None] = print, report: ProgressFn | None = None
) -> StageResult:
    """Plan and run a stage in this process, unit by unit, committing each one as it finishes."""
    ctx = Context(ArtifactStore(config.root), log, report)
    with ctx.held:
        plan = stage.plan(config, ctx)
        try:
            results = run_units(stage, plan, ctx)
        except BaseException:
            stage.abort(config, plan, ctx)
            raise
        return stage.result(plan, stage.finish(config, plan, results, ctx))


def run_units(stage: Stage, plan: Plan, ctx: Context) -> list[Any]:
    """Run a plan's units in this process, one after another, committing each as it finishes (progress by the
    stage's work, or reported by the stage itself); their results. The caller aborts the stage on failure."""
    total = plan.work if plan.work is not None else sum(stage.work_of(u) for u in plan.units)
    advance = ctx.progress(stage.label(plan), total, plan.work_unit)
    if stage.reports_progress:
        ctx.advance = advance
    results: list[Any] = []
    for unit in plan.units:
        results.append(stage.run(unit, ctx))
        stage.commit(unit, results[-1], ctx)
        if not stage.reports_progress:
            advance(stage.work_of(unit))
    return results
