"""tests/cli_fork.py gives what a plain subprocess gives: the same output, error output and exit code for a command
that succeeds, one that is refused, and one that reads its working folder and environment; a command whose
environment changes what the imports read runs in a plain subprocess; a command past its timeout is killed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import cli_fork
import pytest

ENV = {**os.environ, "PREFECT_API_URL": "", "COLUMNS": "200"}


@pytest.mark.parametrize(
    "argv",
    [["views"], ["--help"], ["sql", "--root", "nowhere", "select 1"], ["evaluate", "--help"]],
    ids=["no store here", "help", "refused", "a command's help"],
)
def test_a_forked_command_gives_what_a_subprocess_gives(argv: list[str], tmp_path: Path) -> None:
    forked = cli_fork.run(argv, env=ENV, cwd=tmp_path, timeout=120)
    plain = cli_fork._plain(argv, env=ENV, cwd=tmp_path, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert cli_fork._server is not None and cli_fork._server.alive()  # it was forked, not run plainly


def test_each_command_gets_its_own_folder_and_environment(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        p = cli_fork.run(["deployments", "--write"], env=ENV, cwd=tmp_path / name, timeout=120)
        assert p.returncode == 0 and (tmp_path / name / "prefect.yaml").is_file(), p.stdout + p.stderr
        p = cli_fork.run(["sql", "select 1"], env={**ENV, "DIFFRET_ROOT": str(tmp_path / name / "r")},
                         cwd=tmp_path / name, timeout=120)  # fmt: skip
        assert p.returncode == 2 and str(tmp_path / name / "r") in p.stdout + p.stderr, p.stdout + p.stderr
    assert cli_fork._server is not None and cli_fork._server.alive()


def test_an_environment_the_imports_read_differently_runs_plainly(tmp_path: Path, monkeypatch) -> None:
    calls: list[list[str]] = []
    plain = cli_fork._plain
    monkeypatch.setattr(cli_fork, "_plain", lambda argv, **kw: calls.append(argv) or plain(argv, **kw))
    cli_fork.run(["views"], env=ENV, cwd=tmp_path, timeout=120)
    assert calls == []
    p = cli_fork.run(["views"], env={**ENV, "COLUMNS": "80"}, cwd=tmp_path, timeout=120)
    assert calls == [["views"]] and p.returncode == 2


def test_a_command_past_its_timeout_is_killed(tmp_path: Path) -> None:
    (tmp_path / "store" / "_plans").mkdir(parents=True)  # a store: SQL runs
    slow = ["sql", "--root", str(tmp_path / "store"), "select count(*) from range(100000000000)"]
    with pytest.raises(subprocess.TimeoutExpired):
        cli_fork.run(slow, env=ENV, cwd=tmp_path, timeout=3)
    assert cli_fork.run(["views"], env=ENV, cwd=tmp_path, timeout=120).returncode == 2  # a new server
