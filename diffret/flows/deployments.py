"""The Prefect deployments users deploy (``prefect.yaml``), generated from the stage registry: a deployment per
stage (its command's name; its description and default parameters from the stage class's ``deployment`` and
``example``; its flow from diffret/flows/stage_flows.py or the stage's own flow module) and the pipeline's.

``diffret deployments`` prints the file, ``diffret deployments --write`` rewrites ``prefect.yaml`` in the
current folder; tests/unit/test_commands.py checks that the file in the repository is what this module writes.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from diffret.storage.layout import DEFAULT_ROOT

HEADER = """# Prefect deployments of diffret (Prefect 3.8.8). See docs/operations.md.
#
#   prefect work-pool create diffret-process --type process   # once per server
#   prefect automation create --from-file automations/zombie-flows.yaml   # once per server: crash recovery
#   prefect deploy --all                                      # from the repository root
#   prefect worker start --pool diffret-process
#   prefect deployment run 'download/download' --param config='{"name": "scifact"}'
#
# `prefect deploy` runs from the repository root (the default store root ./diffret-store is relative to it); the
# entrypoints are modules of the installed diffret, by their one import name.
name: diffret
prefect-version: 3.8.8

# Runs on every `prefect deploy`, in the directory it is run from: records the absolute path of
# this checkout, wherever it was cloned, so that the pull step below can return to it.
build:
- prefect.deployments.steps.run_shell_script:
    id: repo-root
    script: pwd
    stream_output: false

push: null

# Runs at the start of every flow run, in the worker's flow-run process (which a process worker
# starts in a fresh temporary folder): move into the checkout so that relative
# paths such as the default store root ./diffret-store resolve against the repository.
pull:
- prefect.deployments.steps.set_working_directory:
    directory: '{{ repo-root.stdout }}'

# Shared pieces; each deployment below picks them up with YAML aliases / merge keys.
definitions:
  work_pools:
    diffret_process: &diffret_process
      name: diffret-process
      work_queue_name: default
      # heartbeats every 30 s (Prefect's minimum; its default is 180): automations/zombie-flows.yaml marks a
      # run Crashed 90 s after its last one, so that a run whose process was killed can be retried
      job_variables:
        env:
          PREFECT_FLOWS_HEARTBEAT_FREQUENCY: "30"
  tags: &diffret_tags
  - diffret

deployments:"""


def _pipeline() -> dict[str, Any]:
    from diffret.stages.pipeline import DEPLOYMENT

    return {"name": "pipeline", "entrypoint": ("diffret.flows.pipeline", "pipeline_flow"), **DEPLOYMENT}


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    text = str(value)
    special = ": " in text or " #" in text or text.lower() in ("null", "true", "false", "yes", "no", "on", "off")
    plain = text and (text[0].isalnum() or text[0] in "./_") and not special and not _number(text)
    return text if plain else json.dumps(text)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _yaml(value: Any, indent: int) -> list[str]:
    """Block YAML of a parameters mapping (lists of scalars in flow style, as people write them)."""
    pad = " " * indent
    out = []
    for key, v in value.items():
        if isinstance(v, dict) and v:
            out += [f"{pad}{key}:", *_yaml(v, indent + 2)]
        elif isinstance(v, list) and all(not isinstance(x, dict | list) for x in v):
            out.append(f"{pad}{key}: [{', '.join(_scalar(x) for x in v)}]")
        else:
            out.append(f"{pad}{key}: {_scalar(v) if not isinstance(v, dict) else '{}'}")
    return out


def _deployment(name: str, entrypoint: tuple[str, str], description: str, example: dict[str, Any]) -> str:
    module, fn = entrypoint
    folded = textwrap.wrap(" ".join(description.split()), 106, break_long_words=False, break_on_hyphens=False)
    lines = [
        f"- name: {name}",
        "  version: null",
        "  tags: *diffret_tags",
        "  description: >-",
        *(f"    {line}" for line in folded),
        f"  entrypoint: {module}:{fn}",  # the module by its one import name (a file path would load a second copy)
        "  parameters:",
        "    config:",
        *_yaml({"root": DEFAULT_ROOT, **example}, 6),
        "  work_pool: *diffret_process",
        "  schedules: []",
    ]
    return "\n".join(lines)


def deployments() -> list[dict[str, Any]]:
    """Every deployment as name, entrypoint (module, function), description and example parameters: the whole
    pipeline first (where a new user starts), then every stage in pipeline order."""
    from diffret.stages import presentation_of, stages

    from .runner import flow_ref

    return [_pipeline()] + [
        {
            "name": st.command,
            "entrypoint": flow_ref(st.name),
            "description": presentation_of(st).deployment,
            "example": dict(presentation_of(st).example),
        }
        for st in stages().values()
    ]


def render() -> str:
    """The whole ``prefect.yaml``.

    >>> text = render()
    >>> "entrypoint: diffret.flows.stage_flows:score_flow" in text and "- name: training-data" in text
    True
    """
    body = "\n\n".join(_deployment(d["name"], d["entrypoint"], d["description"], d["example"]) for d in deployments())
    return f"{HEADER}\n{body}\n"
