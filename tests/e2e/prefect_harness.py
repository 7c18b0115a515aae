"""A local Prefect server, process workers and deployment runs for the e2e tests (not a test module).

The server runs with PREFECT_HOME in the test's temporary folder, on a free port, analytics off; every
process started here is in a process group of its own and is ended by that group's id (and, for a
worker killed on purpose, by the ids of its own child processes), never by name.

The tests share one server per session (the ``prefect_server`` fixture of tests/conftest.py: a server takes
10-20 s to start on a fresh database); each test gets a view of it (:meth:`PrefectServer.for_test`) with a work
pool of its own, so that its workers run only its own flow runs, and its logs in its own temporary folder.
``local_prefect_server`` starts a server for a block.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

POOL = "diffret-process"
SERVER_START_TIMEOUT_S = 120
CLI_TIMEOUT_S = 120
WORKER_TIMEOUT_S = 300
TERMINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
_pools = 0  # work pools made by PrefectServer.for_test in this process


def prefect_cmd() -> list[str]:
    """The prefect CLI of this interpreter's environment (the worker runs flows with the same one)."""
    exe = Path(sys.executable).parent / "prefect"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "prefect"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(lines[-n:])


def stop_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """End a process started with start_new_session=True, and everything in its process group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # its session id == its pid == its process group id
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # children may outlive the leader: clear the group either way
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state, past the command's ")"
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_9_tree(proc: subprocess.Popen) -> list[int]:
    """kill -9 a process started with start_new_session=True: its process group and every descendant
    (a Prefect process worker starts each flow run in a session of its own). The pids killed."""
    below = descendants(proc.pid)  # read before the kill: orphans are re-parented
    groups = {proc.pid}
    for pid in below:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pgid in groups:  # the worker's group, and the groups its children lead
        if pgid in below or pgid == proc.pid:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait(timeout=30)
    return [proc.pid, *below]


@dataclass
class PrefectServer:
    api_url: str
    env: dict[str, str]
    log: Path
    tmp: Path
    pool: str = POOL  # the process work pool this test's deployments and workers use

    def for_test(self, tmp_path: Path, pool: str | None = None) -> PrefectServer:
        """A view of this server for one test: logs and worker folders in ``tmp_path``, its own environment copy,
        and its own work pool (``pool``, else a new name), created here, so no other test's runs reach its
        workers."""
        global _pools
        _pools += 1
        view = PrefectServer(self.api_url, dict(self.env), self.log, tmp_path, pool or f"{POOL}-{_pools}")
        view.cli("work-pool", "create", view.pool, "--type", "process")
        return view

    @property
    def base_url(self) -> str:
        """Where the UI is served (when the server was started with ``ui=True``)."""
        return self.api_url.removesuffix("/api")

    def cli(self, *args: str, cwd: Path | None = None, timeout: float = CLI_TIMEOUT_S) -> str:
        """Run a prefect CLI command against this server; fail with its output when it fails."""
        cmd = [*prefect_cmd(), *args]
        try:
            res = subprocess.run(
                cmd,
                cwd=cwd or self.tmp,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"`{' '.join(cmd)}` did not finish in {timeout} s\n{exc.stdout}\n{exc.stderr}")
        if res.returncode != 0:
            pytest.fail(
                f"`{' '.join(cmd)}` exited {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}\n"
                f"--- server log ({self.log})\n{tail(self.log)}"
            )
        return res.stdout + res.stderr

    def api(self, method: str, path: str, body: dict | None = None) -> object:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"{self.api_url}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def flow_run(self, flow_run_id: str) -> dict:
        return self.api("GET", f"/flow_runs/{flow_run_id}")  # type: ignore[return-value]

    def flow_run_logs(self, flow_run_id: str) -> str:
        try:
            logs = self.api("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200})
        except (urllib.error.URLError, OSError) as exc:
            return f"<cannot read the flow run's logs: {exc}>"
        return "\n".join(f"{x.get('timestamp')} {x.get('level')} {x.get('message')}" for x in logs)  # type: ignore[union-attr]

    def start_worker(self, name: str) -> tuple[subprocess.Popen, Path]:
        """``prefect worker start --run-once`` on the process pool, in a process group of its own."""
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            worker = subprocess.Popen(
                [*prefect_cmd(), "worker", "start", "--pool", self.pool, "--run-once"],
                cwd=self.tmp,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return worker, log


@contextlib.contextmanager
def local_prefect_server(tmp_path: Path, ui: bool = False) -> Iterator[PrefectServer]:
    """A Prefect server of its own (tests/conftest.py's session fixture wraps it), serving the UI too with ``ui``;
    stopped, by its process group, when the block ends."""
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    home = tmp_path / "prefect-home"
    home.mkdir()
    # a clean Prefect environment: no profile, key or API URL of the caller leaks into the test
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api_url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        PREFECT_CLI_PROMPT="false",
        PREFECT_SERVER_UI_ENABLED="true" if ui else "false",
    )
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*prefect_cmd(), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prefect server exited {proc.returncode} before it was healthy\n{tail(log)}")
            try:
                with urllib.request.urlopen(f"{api_url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prefect server not healthy after {SERVER_START_TIMEOUT_S} s at {api_url}\n{tail(log)}")
            time.sleep(0.5)
        yield PrefectServer(api_url=api_url, env=env, log=log, tmp=tmp_path)
    finally:
        stop_group(proc)


def deploy(server: PrefectServer, *names: str) -> str:
    """The named deployments of the repository's prefect.yaml (every one without names; each costs a few
    seconds) on the test's work pool: prefect.yaml's own (``diffret-process``) or, for another, ``--pool``."""
    if server.pool == POOL:
        which = [a for n in names for a in ("--name", n)] or ["--all"]
        return server.cli("--no-prompt", "deploy", *which, cwd=REPO)
    assert names, "another work pool than prefect.yaml's: name the deployments (--pool takes one at a time)"
    return "".join(server.cli("--no-prompt", "deploy", "--name", n, "--pool", server.pool, cwd=REPO) for n in names)


def create_zombie_automation(server: PrefectServer) -> None:
    """The crash-recovery automation, created by the command docs/operations.md and prefect.yaml give (once per
    server: it watches every tagged flow run)."""
    found = server.api("POST", "/automations/filter", {})
    if not any(a.get("name") == "diffret-crash-zombie-flows" for a in found):  # type: ignore[union-attr]
        server.cli("automation", "create", "--from-file", str(REPO / "automations" / "zombie-flows.yaml"))


def wait_state(server: PrefectServer, flow_run_id: str, state: str, timeout_s: float) -> float:
    """Seconds until the flow run is in ``state`` (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    while (now := server.flow_run(flow_run_id).get("state_type")) != state:
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(
                f"flow run {flow_run_id} still {now}, not {state}, after {timeout_s} s\n"
                f"--- server log\n{tail(server.log, 30)}"
            )
        time.sleep(1)
    return time.monotonic() - t0


def run_deployment(server: PrefectServer, config: dict, deployment: str) -> str:
    """`prefect deployment run` with ``config`` as its parameter; the new flow run's id."""
    out = server.cli("deployment", "run", deployment, "--param", f"config={json.dumps(config)}")
    m = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
    assert m, f"no flow run id in the output of `prefect deployment run`:\n{out}"
    return m.group(1)


def work_off(server: PrefectServer, flow_run_id: str, name: str, expect: str = "COMPLETED") -> dict:
    """Start `prefect worker start --run-once` (again, if the run was not picked up) until the run ends."""
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    attempt = 0
    while True:
        attempt += 1
        worker, log = server.start_worker(f"{name}-{attempt}")
        try:
            worker.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            stop_group(worker, grace_s=10)
        run = server.flow_run(flow_run_id)
        state = run.get("state_type")
        if state in TERMINAL_STATES:
            if state != expect:
                pytest.fail(
                    f"flow run {flow_run_id} ended {state}: {(run.get('state') or {}).get('message')}\n"
                    f"--- worker log ({log})\n{tail(log)}\n--- flow run logs\n{server.flow_run_logs(flow_run_id)}\n"
                    f"--- server log ({server.log})\n{tail(server.log, 30)}"
                )
            return run
        if time.monotonic() > deadline or attempt >= 5:
            pytest.fail(
                f"flow run {flow_run_id} still {state} after {attempt} worker run(s) / {WORKER_TIMEOUT_S} s\n"
                f"--- worker log ({log})\n{tail(log)}\n--- flow run logs\n{server.flow_run_logs(flow_run_id)}\n"
                f"--- server log ({server.log})\n{tail(server.log, 30)}"
            )
        time.sleep(1)
