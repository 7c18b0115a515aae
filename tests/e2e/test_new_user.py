"""A new user's first run: the README's offline commands exactly as written, from the repository root, in a fresh
environment (no NLTK_DATA, no Prefect API, a home folder of its own: nothing this machine set up beforehand).

Only the store root (`/tmp/r` in the README) is moved into the test's temporary folder. Skipped when ../shared is
absent (the commands read ../shared/data and ../shared/models).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SHARED

pytestmark = pytest.mark.e2e

README = REPO / "README.md"


def offline_commands() -> list[str]:
    """The README's offline block: the command after the ``# offline:`` comment (with its continuation lines) and
    the `diffret sql` line of the same block that reads its store."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# offline:"))
    commands, i = [], start + 1
    current = ""
    while i < len(lines) and lines[i].strip() and not lines[i].startswith("```"):
        line = lines[i].split("  # ")[0].rstrip()  # a trailing comment is not part of the command
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(current.strip())
            current = ""
        i += 1
    first = commands[0]
    sql = [c for c in commands if c.startswith("diffret sql --root /tmp/r ")]
    assert "--root /tmp/r" in first and sql, commands
    return [first, sql[0]]


def fresh_env(home: Path) -> dict[str, str]:
    """What a new user's shell has: a PATH with this environment's `diffret`, a home, nothing diffret-specific."""
    bin_dir = str(Path(sys.executable).parent)
    keep = {k: os.environ[k] for k in ("LANG", "LC_ALL", "TMPDIR") if k in os.environ}
    return {**keep, "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "COLUMNS": "200"}


def test_the_readme_offline_commands_work_as_written(tmp_path: Path) -> None:
    if not (SHARED / "data" / "scifact" / "corpus.jsonl").exists() or not (SHARED / "nltk_data").is_dir():
        pytest.skip("../shared (data, models, nltk_data) is not beside this checkout")
    root = tmp_path / "r"
    env = fresh_env(tmp_path / "home")
    (tmp_path / "home").mkdir()
    assert "NLTK_DATA" not in env and "PREFECT_API_URL" not in env
    outputs = []
    for command in offline_commands():
        line = re.sub(r"/tmp/r\b", str(root), command)
        p = subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, f"{command}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        outputs.append(p.stdout)
    run_out, sql_out = outputs
    assert "NDCG@10" in run_out and "bm25" in run_out  # the leaderboard
    for mode in ("multi_dense", "sparse_max", "fusion_multi_sparse_max"):
        assert mode in sql_out, sql_out
    assert not (root / "_locks").exists() and not (root / "_staging").exists()  # nothing left behind
