"""The CLI leaves the process with ``os._exit`` (no C++ static destructors: pyarrow's and DuckDB's
thread pools could abort a finished command with SIGABRT). What Python's own shutdown guarantees must
still hold: the exit code, buffered output, atexit handlers and non-daemon threads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import REPO, write_beir

ENV = {**os.environ, "PREFECT_API_URL": "", "COLUMNS": "200"}


def main_with(tmp_path: Path, argv: list[str], prelude: str = "") -> subprocess.CompletedProcess:
    code = "\n".join(
        [
            "import atexit, sys, threading, time",
            prelude,
            f"sys.argv = ['diffret', *{argv!r}]",
            "from diffret.flows.cli import main",
            "main()",
            "print('not reached')",
        ]
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)


def test_success_flushes_output_and_runs_atexit_and_joins_threads(tmp_path: Path, tiny_beir: Path) -> None:
    root = tmp_path / "store"
    p = main_with(tmp_path, ["download", "tiny", "--source", str(tiny_beir), "--root", str(root)])
    assert p.returncode == 0, p.stderr
    prelude = """
atexit.register(lambda: print("atexit handler ran"))
def late():
    time.sleep(0.5)
    print("thread finished")
threading.Thread(target=late).start()
"""
    p = main_with(tmp_path, ["sql", "--root", str(root), "-f", "csv", "select count(*) as n from corpus"], prelude)
    assert p.returncode == 0, p.stderr
    # stdout is a pipe (block-buffered): everything printed reaches it, the atexit handler last (after the
    # thread was joined), and nothing after main()
    lines = p.stdout.splitlines()
    assert sorted(lines) == sorted(["n", "3", "thread finished", "atexit handler ran"])
    assert lines[-1] == "atexit handler ran" and lines.index("n") + 1 == lines.index("3")


def test_error_exit_code_and_message(tmp_path: Path) -> None:
    p = main_with(tmp_path, ["score", "-d", "nope", "--system", "x", "--root", str(tmp_path / "empty")])
    assert p.returncode == 2 and "error:" in p.stderr and "not reached" not in p.stdout


def test_usage_error_and_unexpected_exception(tmp_path: Path) -> None:
    p = main_with(tmp_path, ["no-such-command"])
    assert p.returncode == 2 and "No such command" in p.stderr
    # an error the CLI does not expect still prints its traceback and exits 1
    write_beir(tmp_path / "bad", None, [{"_id": "q1", "text": "x"}], {"test": [("q1", "d1", 1)]})
    prelude = (
        "import diffret.flows.cli as c; c._known_errors = lambda: (KeyError,)\n"
        "import diffret.stages.download as d\n"
        "def boom(*a, **k): raise RuntimeError('unexpected failure')\nd.materialise = boom"
    )
    p = main_with(
        tmp_path, ["download", "bad", "--source", str(tmp_path / "bad"), "--root", str(tmp_path / "s")], prelude
    )
    assert p.returncode == 1 and "Traceback" in p.stderr and "RuntimeError: unexpected failure" in p.stderr


def test_a_prefect_api_that_does_not_answer_is_one_line_with_the_way_out(tmp_path: Path, tiny_beir: Path) -> None:
    """PREFECT_API_URL set, nothing listening there: the command says so in one line naming the API and the ways out
    (start the server, or --no-prefect), exits 2 and writes nothing; --no-prefect then runs it in this process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: a port nothing listens on
    api = f"http://127.0.0.1:{port}/api"
    env = {**ENV, "PREFECT_API_URL": api, "PREFECT_HOME": str(tmp_path / "prefect")}
    args = [
        sys.executable,
        "-m",
        "diffret.flows.cli",
        "download",
        "tiny",
        "--source",
        str(tiny_beir),
        "--root",
        str(tmp_path / "store"),
    ]
    p = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr
    assert lines[0].startswith(f"error: the Prefect API at {api} does not answer"), lines
    assert "prefect server start" in lines[0] and "--no-prefect" in lines[0], lines
    assert not (tmp_path / "store").exists()
    p = subprocess.run([*args, "--no-prefect"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert p.returncode == 0 and "1 collection(s) written" in p.stdout + p.stderr, p.stdout + p.stderr
