"""Every command in the README, run by a test: a new user's first run, exactly as written, from the repository root,
in a fresh environment (no NLTK_DATA, no Prefect API, a home folder of its own: nothing this machine set up).

- the offline block (`# offline:`): its first command and its `diffret sql` as written, then the Python example
  (`examples/quickstart.py`, the same code) over the store they made, from the wheel `pip install .` builds: its
  means are the demo's stored cell to the last bit; only the store root (`/tmp/r`) moves into the test's temporary
  folder;
- every other `diffret run ...` line needs a hub (a model, a collection) this machine cannot reach: each runs as
  written with `--dry-run`, so its options parse and every stage's settings validate (offline, a released
  checkpoint's plan says that its settings could not be read and what it assumes);
- the Prefect block against a server of the test's own (its port in place of 4200; the worker polls once);
- the install and the test command are what `.ci/run` runs (checked against it).

Skipped when ../shared is absent (the commands read ../shared/data and ../shared/models).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SHARED

pytestmark = pytest.mark.e2e

README = REPO / "README.md"


def blocks(lang: str) -> list[list[str]]:
    """The README's fenced ``lang`` blocks, each as its lines."""
    out, current = [], None
    for line in README.read_text().splitlines():
        if current is None and line.strip() == f"```{lang}":
            current = []
        elif current is not None and line.startswith("```"):
            out.append(current)
            current = None
        elif current is not None:
            current.append(line)
    return out


def commands(lines: list[str]) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments and trailing comments dropped."""
    out, current = [], ""
    for raw in lines:
        line = raw.split("  # ")[0].rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            current += line.rstrip("\\").rstrip() + " "
            continue
        out.append((current + line).strip())
        current = ""
    return out


def all_commands() -> list[str]:
    return [c for b in blocks("bash") for c in commands(b)]


def offline_block() -> list[str]:
    """The command after the ``# offline:`` comment and the `diffret sql` over its store."""
    block = next(b for b in blocks("bash") if any(line.startswith("# offline:") for line in b))
    start = next(i for i, line in enumerate(block) if line.startswith("# offline:"))
    first = commands(block[start:])[0]
    return [first, next(c for c in commands(block) if c.startswith("diffret sql --root /tmp/r "))]


def fresh_env(home: Path) -> dict[str, str]:
    """What a new user's shell has: a PATH with this environment's `diffret`, a home, nothing diffret-specific."""
    bin_dir = str(Path(sys.executable).parent)
    # PYTHONPATH where the test runner sets one: the checkout under test, in place of another's editable install
    keep = {k: os.environ[k] for k in ("LANG", "LC_ALL", "TMPDIR", "PYTHONPATH") if k in os.environ}
    return {**keep, "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "COLUMNS": "200"}


def shell(line: str, env: dict[str, str], timeout: float = 1800) -> str:
    p = subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{line}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def needs_shared() -> None:
    if not (SHARED / "data" / "scifact" / "corpus.jsonl").exists() or not (SHARED / "nltk_data").is_dir():
        pytest.skip("../shared (data, models, nltk_data) is not beside this checkout")


def test_every_readme_command_is_run_by_this_module() -> None:
    """Each command is in exactly one of the groups the tests below run (a new command needs a test here)."""
    offline = offline_block()
    prefect = [c for c in all_commands() if c.startswith(("prefect ", "export PREFECT_API_URL"))]
    online = [c for c in all_commands() if c.startswith("diffret run") and c not in offline]
    install = [c for c in all_commands() if c.startswith(("pip install", "pytest", "bash .ci/run"))]
    assert sorted(offline + prefect + online + install) == sorted(all_commands())
    assert len(offline) == 2 and len(prefect) == 6 and online and len(install) == 2
    ci = (REPO / ".ci" / "run").read_text()
    first, test = install
    assert first.startswith('pip install -e ".[dev]" && diffret run') and '-e ".[dev]"' in ci
    assert test == "pytest -q" and ci.rstrip().endswith("\npytest -q")


def quickstart_code() -> list[str]:
    """examples/quickstart.py without its docstring: the README's Python block, line for line."""
    text = (REPO / "examples" / "quickstart.py").read_text()
    lines = text.splitlines()[ast.parse(text).body[0].end_lineno :]  # after the docstring
    return lines[1:] if lines and not lines[0].strip() else lines


def test_the_readme_python_block_is_the_quickstart() -> None:
    (python,) = blocks("python")
    assert python == quickstart_code()


def test_the_readme_offline_commands_and_python_example_work_as_written(tmp_path: Path, wheel_env) -> None:
    """The demo and its SQL as written; then the Python block over the store they made, from the wheel: the means it
    prints are those the demo stored for the same cell (same checkpoint, collection, K and settings), to the last
    bit, and its last line prints the store's best cells. The corpus is encoded once here, by the Python block."""
    needs_shared()
    root = tmp_path / "r"
    env = fresh_env(tmp_path / "home")
    (tmp_path / "home").mkdir()
    assert "NLTK_DATA" not in env and "PREFECT_API_URL" not in env
    first, sql = offline_block()
    assert "--root /tmp/r" in first and "--preset laptop" in first
    run_out = shell(re.sub(r"/tmp/r\b", str(root), first), env)
    sql_out = shell(re.sub(r"/tmp/r\b", str(root), sql), env)
    assert "NDCG@10" in run_out and "bm25" in run_out  # the leaderboard
    for mode in ("multi_dense", "sparse_max", "fusion_multi_sparse_max"):
        assert mode in sql_out, sql_out
    assert not (root / "_locks").exists() and not (root / "_staging").exists()  # nothing left behind

    (python,) = blocks("python")
    assert (
        'diffret.Store("/tmp/r")' in "\n".join(python)
        and 'search(queries, passages, "fusion_multi_sparse_max")' in "\n".join(python)
        and "k=4)" in "\n".join(python)
    )
    p = wheel_env.run(re.sub(r"/tmp/r\b", str(root), "\n".join(python)), cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    means_line, *table = p.stdout.splitlines()
    means = ast.literal_eval(means_line)  # the dict the block prints: repr of floats, exact
    from diffret.storage import ArtifactStore
    from diffret.storage.sql import StoreSQL

    with StoreSQL(ArtifactStore(root)) as db:
        cols, rows = db.query(
            "select ndcg_10, mrr_10, recall_100, recall_1000 from cells where split = 'test' and "
            "kq = 4 and kp = 4 and mode = 'fusion_multi_sparse_max' and system not like 'bm25%'"
        )
    ((ndcg, mrr, r100, r1000),) = rows
    assert means["ndcg_cut_10"] == ndcg, (means, rows)  # to the last bit
    assert (means["mrr_10"], means["recall_100"], means["recall_1000"]) == (mrr, r100, r1000), (means, rows)
    printed = "\n".join(table)  # store.sql(...) printed: the best cell per mode
    assert printed.startswith("pyarrow.Table") and "fusion_multi_sparse_max" in printed and "ndcg_10" in printed


def test_the_readme_online_runs_parse_and_validate_with_dry_run(tmp_path: Path) -> None:
    env = {**fresh_env(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    (tmp_path / "home").mkdir()
    online = [c for c in all_commands() if c.startswith("diffret run") and c not in offline_block()]
    online += [c.split("&&", 1)[1].strip() for c in all_commands() if c.startswith("pip install")]
    assert len(online) >= 3, online
    before = (REPO / "diffret-store").exists()
    for command in online:
        line = command if "--dry-run" in command else f"{command} --dry-run"
        p = subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"{line}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        out = p.stdout
        if "diffretriever" in command:  # a released checkpoint: offline its settings are unread, and it says so
            assert "cannot read the settings of" in p.stderr and "This plan assumes" in p.stderr, p.stderr
        stages = [row.split(":")[0].split(" ")[0] for row in out.splitlines() if row.strip()]
        assert stages[0] == "download" and "encode" in stages and "score" in stages, out
        assert stages[-1] == "summary", out
        if "--kq 4 --kp 16" in command:  # one query pass at 4, one passage pass at 16
            assert '"kq": [4]' in out and '"kp": [16]' in out, out
    assert (REPO / "diffret-store").exists() == before  # a dry run writes nothing


@pytest.mark.prefect
def test_the_readme_prefect_commands_deploy_every_stage(tmp_path: Path) -> None:
    from prefect_harness import local_prefect_server, prefect_cmd

    prefect = [c for c in all_commands() if c.startswith(("prefect ", "export PREFECT_API_URL"))]
    start, export, pool, automation, deploy, worker = prefect
    assert start.startswith("prefect server start --host 127.0.0.1 --port 4200") and start.endswith("&")
    assert export == "export PREFECT_API_URL=http://127.0.0.1:4200/api"
    with local_prefect_server(tmp_path) as server:  # what `start` does, on a free port, stopped by its pid
        port = server.api_url.split(":")[-1].split("/")[0]
        env = {**server.env, "PATH": f"{Path(prefect_cmd()[0]).parent}:{os.environ['PATH']}", "COLUMNS": "300"}
        assert export.split("=", 1)[1].replace("4200", port) == server.api_url
        for line in (pool, automation, deploy):
            shell(line, env, timeout=600)
        shell(f"{worker} --run-once", env, timeout=300)
        listed = shell("prefect deployment ls", env, timeout=120)
        automations = server.api("POST", "/automations/filter", {})
    # the crash recovery of docs/operations.md: a run whose heartbeats stop (its worker killed) becomes Crashed
    (zombie,) = [a for a in automations if a.get("name") == "diffret-crash-zombie-flows"]  # type: ignore[union-attr]
    assert zombie["enabled"] and zombie["actions"][0]["state"] == "CRASHED", zombie
    import yaml

    names = [d["name"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]]
    assert "pipeline" in names and len(names) > 10
    for name in names:  # "flow/deployment" per row
        assert re.search(rf"/{re.escape(name)}\b", listed), (name, listed)
