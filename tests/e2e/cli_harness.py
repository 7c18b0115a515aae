"""The `diffret` command in a subprocess, for the end-to-end tests: one environment (no Prefect API, no hub,
wide output), ``run`` (a new process per command, forked by tests/cli_fork.py; fails with the command's output
unless ``check=False``) and ``sql`` (a query's rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cli_fork

DIFFRET = [sys.executable, "-m", "diffret.flows.cli"]
ENV = {**os.environ, "COLUMNS": "200", "PREFECT_API_URL": "", "HF_HUB_OFFLINE": "1"}


def run(*args: str, check: bool = True, env: dict | None = None, timeout: int = 1200) -> subprocess.CompletedProcess:
    """``diffret *args``; an AssertionError with its stdout and stderr when it fails and ``check``."""
    # a new process each time, forked from one that has the CLI's imports (tests/cli_fork.py)
    p = cli_fork.run(list(args), env=env or ENV, cwd=Path.cwd(), timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"diffret {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def sql(root: Path, query: str) -> list[dict]:
    """The rows of ``query`` over the store at ``root`` (`diffret sql --format json`)."""
    return json.loads(run("sql", "--root", str(root), "--format", "json", query).stdout)
