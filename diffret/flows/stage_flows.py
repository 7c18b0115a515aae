"""Every stage's Prefect flow, generated from the stage registry at import: ``<command>_flow(config: <its
config>)`` (``score_flow``, ``import_run_flow``, ``training_data_flow``, ...), named after the stage's command,
described by its docstring, its body :func:`flows.runner.run_in_flow` (which runs the stages it needs first and
publishes its pages). The config's class is the flow's typed signature, so the Prefect UI's run form shows the
config's fields.

Deployments point here: ``entrypoint: flows/stage_flows.py:score_flow`` (flows/deployments.py writes them).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from diffret.flows.runner import flow_name, run_in_flow, run_name  # absolute: Prefect loads this file by path
from diffret.stages import Stage, stages

__all__: list[str] = []


def make_flow(stage: Stage) -> Any:
    """The Prefect flow of ``stage``: one parameter, ``config``, typed by the stage's config class."""

    def body(config: Any) -> dict:
        return run_in_flow(stage, config)

    body.__name__ = body.__qualname__ = flow_name(stage.command)
    body.__module__ = __name__
    body.__doc__ = stage.description
    body.__annotations__ = {"config": stage.config, "return": dict}
    return flow(name=stage.command, flow_run_name=run_name, description=stage.description)(body)


def _generate() -> None:
    for st in stages().values():
        globals()[flow_name(st.command)] = make_flow(st)
        __all__.append(flow_name(st.command))


_generate()


def __getattr__(name: str) -> Any:
    """A flow of a stage registered after this module was imported."""
    for st in stages().values():
        if flow_name(st.command) == name:
            globals()[name] = make_flow(st)
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
