"""The pipeline's stages, importable without Prefect: each plans its units from the store, runs them, and
records what it wrote (see stages/base.py). :func:`stages` maps a stage's name to it; the CLI command, the
Prefect flow and the deployment of every stage follow from it (flows/commands.py, flows/stage_flows.py,
flows/deployments.py), so adding a stage is writing its module and registering it (docs/ARCHITECTURE.md).

    download -> tokenize -> encode -> (compress) -> (index) -> score / bm25 -> evaluate -> summary -> report
                                                   import-run / fuse (any runs) -> evaluate -> compare
                                                   bm25 (train split) -> training (groups) -> train
                                                   bm25 (train split) + qrels -> train-reranker -> rerank
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from importlib import import_module
from typing import Any

from diffret.storage import ArtifactStore

from .base import Context, Plan, Stage, StageConfig, StageResult, execute
from .presentation import Presentation

_MODULES = (
    "download",
    "tokenize",
    "encode",
    "compress",
    "bot",
    "index",
    "score",
    "beta",
    "late",
    "bm25",
    "import_run",
    "fuse",
    "rerank",
    "training_data",
    "train",
    "train_reranker",
    "evaluate",
    "compare",
    "budget",
    "summary",
    "report",
    "latency",
)
ENTRY_POINTS = "diffret.stages"  # another package's stages: [project.entry-points."diffret.stages"] name = "module"
_REGISTERED: list[str] = []


def register(module: str) -> Stage:
    """Add the stage that ``module`` (any importable module) defines as ``stage``: from then on it has its CLI
    command, its Prefect flow and its deployment like the built-in stages. Another package registers its stages
    once installed through the ``diffret.stages`` entry-point group instead.

    >>> register("diffret.stages.score").name  # a module registered twice is one stage
    'score'
    """
    st = import_module(module).stage
    if not isinstance(st, Stage):
        raise TypeError(f"{module}.stage is a {type(st).__name__}, not a diffret Stage")
    if module not in _REGISTERED and f"{__name__}.{module}" not in _REGISTERED:
        _REGISTERED.append(module)
    return st


@lru_cache(maxsize=1)
def _entry_point_modules() -> tuple[str, ...]:
    from importlib.metadata import entry_points

    return tuple(ep.value.split(":")[0] for ep in entry_points(group=ENTRY_POINTS))


def stages() -> dict[str, Stage]:
    """Every stage by name, in pipeline order, then the registered ones (modules are imported on first use).

    >>> list(stages())[:3]
    ['download', 'tokenize', 'encode']
    """
    out: dict[str, Stage] = {}
    for mod in [f"{__name__}.{m}" for m in _MODULES] + _REGISTERED + list(_entry_point_modules()):
        st = import_module(mod).stage
        if st.name in out and out[st.name] is not st:
            raise ValueError(f"two stages named {st.name!r}: {type(out[st.name]).__module__} and {mod}")
        out[st.name] = st
    return out


__all__ = [
    "ENTRY_POINTS",
    "Context",
    "Plan",
    "Presentation",
    "Stage",
    "StageConfig",
    "StageResult",
    "execute",
    "presentation_of",
    "register",
    "run_unit",
    "stages",
]


def presentation_of(stage: Stage) -> Presentation:
    """How ``stage`` shows itself: its module's ``presentation`` (a stage without one: the defaults, its docstring as
    the deployment's description).

    >>> presentation_of(stages()["score"]).next_step
    'evaluate the runs: `diffret evaluate -d {dataset}` (the evaluate deployment).'
    """
    found = getattr(import_module(type(stage).__module__), "presentation", None)
    if found is None:
        return Presentation(deployment=stage.description)
    if not isinstance(found, Presentation):
        raise TypeError(f"{type(stage).__module__}.presentation is a {type(found).__name__}, not a Presentation")
    return found if found.deployment else replace(found, deployment=stage.description)


def run_unit(stage: Stage | str, root: str, unit: Any) -> Any:
    """Run one unit of ``stage`` (the stage, sent whole to a Dask worker, or its registered name, as a Prefect task
    records it) over the store at ``root``, wherever a runner put it; the process that planned it commits the result
    (:func:`diffret.stages.base.run_units`)."""
    found = stages()[stage] if isinstance(stage, str) else stage
    return found.run(unit, Context(ArtifactStore(root)))
