"""The CLI in a fresh process without paying its imports each time: a fork server for the tests.

A test that runs `diffret ...` as a user does (`python -c "...main()"` in a subprocess) pays Python's start and the
CLI's imports (torch, pyarrow, DuckDB, pydantic: about 2 s on a CPU core) for every command. :func:`run` gives the
same result, a new process per command with its own argv, environment, working folder, stdout and stderr, and exit
code, forked from a server process that has made those imports once (one server per test process, started on first
use). The server forks only while it runs no Python thread but its main one (checked before every fork; the native
threads its imports start, OpenBLAS's pool and pyarrow's jemalloc, re-initialise themselves in a forked child), so
the child starts as a fresh process would. What a child differs in is only what the imports fixed: the environment
variables read at import time. A command whose environment differs from the server's in such a variable
(``SENSITIVE``) runs in a plain subprocess instead, and so does any command when the server cannot start or has died
(``DIFFRET_TEST_NO_FORK=1`` turns the server off).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# read when the server's modules are imported: torch's threads, Python's own, rich's consoles (made at import by
# diffret/flows/display.py), fsspec's and Arrow's configuration
SENSITIVE = (
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "PYTHON",
    "NO_COLOR",
    "FORCE_COLOR",
    "TERM",
    "COLUMNS",
    "LINES",
    "JUPYTER",
    "FSSPEC",
    "ARROW",
)

SERVER = r"""
import json, os, socket, sys, threading, traceback
sock = socket.socket(fileno=int(sys.argv[1]))
import diffret.flows.cli  # the imports every command pays
f = sock.makefile("rwb", buffering=0)
f.write(b'{"ready": true}\n')
for line in f:
    req = json.loads(line)
    if threading.active_count() != 1:  # a Python thread could hold a lock the child needs: the client falls back
        f.write(b'{"error": "threads"}\n')
        continue
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sock.close()
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, req["out"]), (2, req["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            sys.argv = ["diffret", *req["argv"]]
            from diffret.flows.cli import main
            main()  # leaves the process itself (os._exit)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    f.write((json.dumps({"pid": pid}) + "\n").encode())
    _, status = os.waitpid(pid, 0)
    f.write((json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n").encode())
"""


class _Server:
    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        ours, theirs = socket.socketpair()
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=self.env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self.file = ours.makefile("rwb", buffering=0)
        self.lock = threading.Lock()
        try:  # its imports done (slow on a loaded machine: a generous wait, once)
            ours.settimeout(300)
            if json.loads(self.file.readline() or b"{}").get("ready") is not True:
                raise OSError("the CLI fork server did not start")
        except (OSError, ValueError):
            self.close()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.sock.close()
        if self.alive():
            self.proc.kill()
        self.proc.wait()


_server: _Server | None = None


def _get_server(env: dict[str, str], cwd: Path) -> _Server | None:
    global _server
    if os.environ.get("DIFFRET_TEST_NO_FORK") == "1" or not hasattr(os, "fork"):
        return None
    if _server is None or not _server.alive():
        try:
            _server = _Server(env, cwd)
        except OSError:
            return None
        atexit.register(_server.close)
    return _server


def _same_imports(a: dict[str, str], b: dict[str, str]) -> bool:
    """Whether the variables read at import time are the same in both environments."""
    keys = {k for k in (*a, *b) if k.startswith(SENSITIVE)}
    return all(a.get(k) == b.get(k) for k in keys)


def run(argv: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``diffret ARGV`` in a new process (forked from the server when it can be), as ``subprocess.run`` with
    ``capture_output=True, text=True`` would return it; ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    server = _get_server(env, cwd)
    if server is None or not _same_imports(server.env, env):
        return _plain(argv, env=env, cwd=cwd, timeout=timeout)
    with server.lock, tempfile.TemporaryDirectory(prefix="diffret-cli-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        req = {"argv": list(argv), "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
        try:
            server.sock.settimeout(30)
            server.file.write((json.dumps(req) + "\n").encode())
            first = json.loads(server.file.readline() or b"{}")
        except (OSError, ValueError):
            server.close()
            return _plain(argv, env=env, cwd=cwd, timeout=timeout)
        if "pid" not in first:  # the server would not fork (threads) or died
            return _plain(argv, env=env, cwd=cwd, timeout=timeout)
        server.sock.settimeout(timeout)
        try:
            done = json.loads(server.file.readline() or b"{}")
        except TimeoutError:
            os.kill(first["pid"], 9)
            server.close()
            raise subprocess.TimeoutExpired(["diffret", *argv], timeout) from None
        if "rc" not in done:
            server.close()
            raise RuntimeError(f"the CLI fork server died running diffret {' '.join(argv)}")
        return subprocess.CompletedProcess(
            ["diffret", *argv], done["rc"], out.read_text(errors="replace"), err.read_text(errors="replace")
        )


def _plain(argv: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    code = f"import sys\nsys.argv = ['diffret', *{list(argv)!r}]\nfrom diffret.flows.cli import main\nmain()"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
