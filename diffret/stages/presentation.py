"""How a stage shows itself to a person, kept apart from its lifecycle (``Stage``: plan, run, commit, merge): the
Prefect deployment's description and example parameters, what its command prints after the result line, what it
writes to standard output, the pages its flow run publishes, and the step to run next. A stage module declares one
``presentation`` beside its ``stage``; the command line and the flows read it (:func:`diffret.stages.presentation_of`)
and nothing in a stage's plan or units does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diffret.storage import ArtifactStore

from .base import Published, StageConfig, StageResult


def _no_lines(result: StageResult) -> list[str]:
    return []


def _no_text(result: StageResult) -> str:
    return ""


def _no_pages(result: StageResult, store: ArtifactStore) -> list[Published]:
    return []


@dataclass(frozen=True)
class Presentation:
    """A stage's presentation. Every part is optional: a stage without one gets its docstring as the deployment's
    description and prints its result line only.

    Examples
    --------
    >>> p = Presentation(next_step="evaluate the runs: `diffret evaluate -d {dataset}`")
    >>> from diffret.stages.score import ScoreConfig
    >>> p.next_for(ScoreConfig(dataset="scifact"), "sys")
    'evaluate the runs: `diffret evaluate -d scifact`'
    >>> p.printed(StageResult(stage="score"))
    []
    """

    deployment: str = ""  # the Prefect deployment's description (default: the stage's docstring)
    example: Mapping[str, Any] = field(default_factory=dict)  # the deployment's parameters, besides root
    next_step: str = ""  # what a person runs after it ({dataset}, {system}: the run's)
    printed: Callable[[StageResult], list[str]] = _no_lines  # lines the command prints after the result line
    shown: Callable[[StageResult], str] = _no_text  # what the command writes to standard output (a table to pipe)
    published: Callable[[StageResult, ArtifactStore], list[Published]] = _no_pages  # a flow run's extra pages

    def next_for(self, config: StageConfig, system: str | None) -> str:
        """The next step of a run of ``config`` that made ``system``, its placeholders filled."""
        return self.next_step.replace("{dataset}", config.dataset_label()).replace("{system}", system or "SYSTEM")
