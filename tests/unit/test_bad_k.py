"""The bad-input catalogue for budgets: ``--k 0``, ``--k -1``, ``--k abc``, ``--k 1,1`` and an
empty list (here through ``diffret run --kq``, which validates before any stage runs) each end with a clear
error, a non-zero exit code and nothing written to the store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from diffret.stages.base import sorted_positive_ks

ENV = {**os.environ, "PREFECT_API_URL": "", "COLUMNS": "200"}


@pytest.mark.parametrize(
    ("k", "message"),
    [
        ("0", "K must be positive integers, got [0]"),
        ("-1", "K must be positive integers, got [-1]"),
        ("abc", "expected comma-separated integers, got 'abc'"),
        ("1,1", "K values repeat in [1, 1]"),
        ("4,1,4", "K values repeat in [4, 1, 4]"),
        ("", "expected comma-separated integers, got ''"),
    ],
)
def test_bad_budgets_fail_clearly_and_write_nothing(tmp_path: Path, tiny_beir: Path, k: str, message: str) -> None:
    root = tmp_path / "store"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffret.flows.cli",
            "run",
            "--source",
            str(tiny_beir),
            "--model",
            str(tmp_path / "no-model"),
            "--root",
            str(root),
            f"--kq={k}",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=REPO,
        timeout=120,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in " ".join((p.stdout + p.stderr).split())
    assert not root.exists() or not any(root.rglob("*.parquet"))


def test_budget_lists_are_sorted_and_unique() -> None:
    assert sorted_positive_ks([16, 1, 4]) == [1, 4, 16]
    for bad in ([], [0], [2, 2]):
        with pytest.raises(ValueError):
            sorted_positive_ks(bad)
