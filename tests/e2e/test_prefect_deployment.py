"""prefect.yaml end to end: a local Prefect server, `prefect deploy`, a deployment run, a process worker.

Starts its own server (PREFECT_HOME in a temporary folder, a free port), creates the process work pool,
deploys ``download`` from the repository's prefect.yaml, runs it on ../shared/data/scifact into a
temporary store through ``prefect worker start --run-once``, and checks the run's state and the store.
Runs the deployment a second time to check that a stored collection is left as it is (resume).
Skips when ../shared/data/scifact is not beside the checkout. Every process it starts is in a process
group of its own, ended by that group's id at teardown.
"""

from __future__ import annotations

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
from conftest import REPO, SHARED

SCIFACT = SHARED / "data" / "scifact"
SCIFACT_CORPUS_ROWS = 5183
POOL = "diffret-process"
DEPLOYMENT = "download/download"

SERVER_START_TIMEOUT_S = 120
CLI_TIMEOUT_S = 120
WORKER_TIMEOUT_S = 300
TERMINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}

pytestmark = [pytest.mark.prefect, pytest.mark.e2e]


def _prefect_cmd() -> list[str]:
    """The prefect CLI of this interpreter's environment (the worker runs flows with the same one)."""
    exe = Path(sys.executable).parent / "prefect"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "prefect"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(lines[-n:])


def _stop_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
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


@dataclass
class PrefectServer:
    api_url: str
    env: dict[str, str]
    log: Path
    tmp: Path

    def cli(self, *args: str, cwd: Path | None = None, timeout: float = CLI_TIMEOUT_S) -> str:
        """Run a prefect CLI command against this server; fail with its output when it fails."""
        cmd = [*_prefect_cmd(), *args]
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
                f"--- server log ({self.log})\n{_tail(self.log)}"
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


@pytest.fixture
def scifact() -> Path:
    if not (SCIFACT / "corpus.jsonl").exists():
        pytest.skip(f"{SCIFACT} is not beside this checkout")
    return SCIFACT


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[PrefectServer]:
    port = _free_port()
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
        PREFECT_SERVER_UI_ENABLED="false",
    )
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*_prefect_cmd(), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
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
                pytest.fail(f"prefect server exited {proc.returncode} before it was healthy\n{_tail(log)}")
            try:
                with urllib.request.urlopen(f"{api_url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prefect server not healthy after {SERVER_START_TIMEOUT_S} s at {api_url}\n{_tail(log)}")
            time.sleep(0.5)
        yield PrefectServer(api_url=api_url, env=env, log=log, tmp=tmp_path)
    finally:
        _stop_group(proc)


def _run_deployment(server: PrefectServer, config: dict, deployment: str = DEPLOYMENT) -> str:
    out = server.cli("deployment", "run", deployment, "--param", f"config={json.dumps(config)}")
    m = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
    assert m, f"no flow run id in the output of `prefect deployment run`:\n{out}"
    return m.group(1)


def _work_off(server: PrefectServer, flow_run_id: str, name: str, expect: str = "COMPLETED") -> dict:
    """Start `prefect worker start --run-once` (again, if the run was not picked up) until the run ends."""
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    attempt = 0
    while True:
        attempt += 1
        log = server.tmp / f"{name}-{attempt}.log"
        with log.open("wb") as out:
            worker = subprocess.Popen(
                [*_prefect_cmd(), "worker", "start", "--pool", POOL, "--run-once"],
                cwd=server.tmp,
                env=server.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            worker.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            _stop_group(worker, grace_s=10)
        run = server.flow_run(flow_run_id)
        state = run.get("state_type")
        if state in TERMINAL_STATES:
            if state != expect:
                pytest.fail(
                    f"flow run {flow_run_id} ended {state}: {(run.get('state') or {}).get('message')}\n"
                    f"--- worker log ({log})\n{_tail(log)}\n--- flow run logs\n{server.flow_run_logs(flow_run_id)}\n"
                    f"--- server log ({server.log})\n{_tail(server.log, 30)}"
                )
            return run
        if time.monotonic() > deadline or attempt >= 5:
            pytest.fail(
                f"flow run {flow_run_id} still {state} after {attempt} worker run(s) / {WORKER_TIMEOUT_S} s\n"
                f"--- worker log ({log})\n{_tail(log)}\n--- flow run logs\n{server.flow_run_logs(flow_run_id)}\n"
                f"--- server log ({server.log})\n{_tail(server.log, 30)}"
            )
        time.sleep(1)


def test_download_deployment_runs_on_a_process_worker(
    scifact: Path, prefect_server: PrefectServer, tmp_path: Path
) -> None:
    # `scifact` comes first so that a missing ../shared skips before a server is started
    import pyarrow.parquet as pq

    server = prefect_server
    server.cli("work-pool", "create", POOL, "--type", "process")
    out = server.cli("--no-prompt", "deploy", "--all", cwd=REPO)
    assert "download/download" in out, out
    encode = server.api("GET", "/deployments/name/encode/encode")  # every deployment of prefect.yaml deploys
    assert encode["parameters"]["config"]["k"] == [1, 2, 4, 8, 16]  # type: ignore[index]

    deployment = server.api("GET", "/deployments/name/download/download")
    assert deployment["work_pool_name"] == POOL  # type: ignore[index]
    assert deployment["parameters"] == {  # type: ignore[index]
        "config": {"name": "scifact", "source": None, "root": "./diffret-store"}
    }
    # the pull step returns to this checkout, wherever it was cloned
    assert deployment["pull_steps"] == [  # type: ignore[index]
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
    ], deployment["pull_steps"]  # type: ignore[index]

    root = tmp_path / "store"
    config = {"name": "scifact", "source": str(scifact), "root": str(root), "cache_dir": str(tmp_path / "cache")}
    flow_run_id = _run_deployment(server, config)
    run = _work_off(server, flow_run_id, "worker")
    assert run["state_type"] == "COMPLETED"
    assert run["parameters"]["config"]["source"] == str(scifact)

    stage = root / "datasets" / "dataset=scifact"
    manifest_path = stage / "_manifest.json"
    assert manifest_path.is_file(), f"no manifest; the store holds {sorted(p.name for p in root.rglob('*'))}"
    manifest = json.loads(manifest_path.read_text())
    for table in ("corpus", "queries", "qrels"):
        assert (stage / f"{table}.parquet").is_file(), f"{table}.parquet missing in {stage}"
        assert f"{table}.parquet" in manifest["files"], manifest["files"].keys()
    assert pq.read_table(stage / "corpus.parquet").num_rows == SCIFACT_CORPUS_ROWS
    assert manifest["files"]["corpus.parquet"]["rows"] == SCIFACT_CORPUS_ROWS
    assert pq.read_table(stage / "queries.parquet").num_rows > 0
    assert pq.read_table(stage / "qrels.parquet").num_rows > 0

    # Resume: the same deployment again completes without rewriting the stored collection.
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in stage.iterdir()}
    second = _run_deployment(server, config)
    assert second != flow_run_id
    _work_off(server, second, "worker-rerun")
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in stage.iterdir()} == before


def test_pipeline_deployment_resumes_a_failed_run(scifact: Path, prefect_server: PrefectServer, tmp_path: Path) -> None:
    """A pipeline run that fails at encoding (model weights missing), then the same deployment run again
    with the same parameters: the second run completes and does not redo the download or tokenization."""
    import shutil

    splade = SHARED / "models" / "splade-tiny-mlm"
    if not (splade / "model.safetensors").exists():
        pytest.skip("../shared/models/splade-tiny-mlm is absent")
    model = tmp_path / "model"
    shutil.copytree(splade, model)
    weights = model / "model.safetensors"
    weights.rename(weights.with_suffix(".away"))

    server = prefect_server
    server.cli("work-pool", "create", POOL, "--type", "process")
    server.cli("--no-prompt", "deploy", "--all", cwd=REPO)
    root = tmp_path / "store"
    config = {
        "root": str(root),
        "dataset": "scifact",
        "source": str(scifact),
        "cache_dir": str(tmp_path / "cache"),
        "kq": [1],
        "kp": [1],
        "max_length": 64,
        "backbone": {"model": str(model)},
    }
    first = _run_deployment(server, config, "pipeline/pipeline")
    failed = _work_off(server, first, "pipeline-1", expect="FAILED")
    assert failed["state_type"] == "FAILED"
    stage = root / "datasets" / "dataset=scifact"
    tokens = sorted((root / "tokens").rglob("_manifest.json"))
    assert (stage / "_manifest.json").is_file() and len(tokens) == 2  # downloaded and tokenized before failing
    assert not (root / "runs").exists()
    before = {p: p.stat().st_mtime_ns for p in [*stage.iterdir(), *tokens]}

    weights.with_suffix(".away").rename(weights)
    second = _run_deployment(server, config, "pipeline/pipeline")
    _work_off(server, second, "pipeline-2")
    assert {p: p.stat().st_mtime_ns for p in before} == before  # resumed: nothing before the failure redone
    summary = next((root / "summaries").rglob("summary.md"))
    assert "bm25" in summary.read_text() and "multi_dense" in summary.read_text()
    assert len(list((root / "runs").rglob("run.parquet"))) == 5 + 1
