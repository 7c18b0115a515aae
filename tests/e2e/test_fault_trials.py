"""Fault trials: `diffret run` killed with SIGKILL at random points, a Prefect worker killed mid-run, a flipped
byte in a stored encoding shard. Each time the same command (or a Retry from the Prefect UI) finishes without
--force and without cleaning up by hand, with metrics identical to an uninterrupted run's.

The collection is a 300-passage, 30-query subset of ../shared/data/cranfield (every judged passage of the
first 30 test queries, then the first unjudged ones), encoded by splade-tiny at K_q = K_p = 1, 64 tokens,
50 passages per shard: download, tokenize, 7 encoding shards, 5 scored cells, BM25, evaluate, summary.

Three trials a run, one per phase (``DIFFRET_FAULT_TRIALS=10`` for the exhaustive ten). Random points: the
uninterrupted run records when each stage output appears in the store. Each trial draws
a time, from a seeded generator, uniformly over its phase of that run (early: download (from 1 s before the
collection is stored), tokenize; middle: model loading, encode; late: score, BM25, evaluate, summary), waits
for the last output before that time, sleeps the rest, and kills the whole process group. The seed is printed
(``-s`` shows it, a failure names it); ``DIFFRET_FAULT_SEED=<seed>`` replays the same points.

Skips when ../shared/data/cranfield or ../shared/models/splade-tiny-mlm is absent.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from browser import PrefectUI, browser_available, browser_page
from conftest import FAULT_SEED, SHARED, write_beir
from prefect_harness import (
    PrefectServer,
    create_zombie_automation,
    deploy,
    kill_9_tree,
    run_deployment,
    tail,
    wait_state,
    work_off,
)

from diffret.storage import ArtifactStore
from diffret.storage.sql import StoreSQL

DIFFRET = [sys.executable, "-m", "diffret.flows.cli"]
# one thread: the tiny model is fastest so, and several threads spin badly when the CPUs are shared
ENV = {**os.environ, "COLUMNS": "200", "PREFECT_API_URL": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
CRANFIELD = SHARED / "data" / "cranfield"
SPLADE = SHARED / "models" / "splade-tiny-mlm"
QUERIES, PASSAGES, SHARD = 30, 300, 50
# Three trials a run, one per phase; the points move from run to run with the seed, so the runs together cover each
# phase. DIFFRET_FAULT_TRIALS=10 (or more) is the exhaustive version: phases in turn, the middle (encoding) twice.
TRIALS = int(os.environ.get("DIFFRET_FAULT_TRIALS") or 3)
PHASES = [["early", "middle", "late"][i % 3] if i < 9 else "middle" for i in range(TRIALS)]
SEED = FAULT_SEED  # one per session, new each run (pytest's header prints it); DIFFRET_FAULT_SEED=<seed> replays
TIMEOUT_S = 600

pytestmark = pytest.mark.e2e


def run_args(source: Path, root: Path) -> list[str]:
    return [
        "run",
        "--source",
        str(source),
        "-d",
        "mini",
        "--root",
        str(root),
        "--model",
        str(SPLADE),
        "--kq",
        "1",
        "--kp",
        "1",
        "--max-length",
        "64",
        "--shard-size",
        str(SHARD),
    ]


def pipeline_config(source: Path, root: Path, cache: Path) -> dict:
    """The same run as ``run_args`` as the pipeline deployment's ``config``."""
    return {
        "root": str(root),
        "dataset": "mini",
        "source": str(source),
        "cache_dir": str(cache),
        "kq": [1],
        "kp": [1],
        "max_length": 64,
        "shard_size": SHARD,
        "backbone": {"model": str(SPLADE)},
    }


def diffret(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DIFFRET, *args], capture_output=True, text=True, env=ENV, timeout=TIMEOUT_S)


def recorded_shards(root: Path) -> set[str]:
    """The encoding shards the store counts as finished (relative paths): named by a line of their folder's
    ``_shards.jsonl`` or by its manifest. A shard file is written first and recorded after (by the process that
    planned it, once the unit returns), so a kill between the two leaves a file that is not finished: the resume
    writes it again, as it must."""
    out = set()
    for log in root.glob("encodings/**/_shards.jsonl"):
        for line in log.read_text().splitlines():
            try:
                out.add(os.path.relpath(log.parent / json.loads(line)["name"], root))
            except (ValueError, KeyError):
                pass  # a line cut by the kill
    for manifest in root.glob("encodings/**/_manifest.json"):
        try:
            files = json.loads(manifest.read_text()).get("files", {})
        except ValueError:
            continue
        out |= {os.path.relpath(manifest.parent / name, root) for name in files}
    return out


def outputs(root: Path) -> dict[str, os.stat_result]:
    """Every stage output in the store (relative path -> stat): data files and stage manifests, outside the
    store's own ``_`` folders (staging, locks); no other bookkeeping (shard records, which come and go) and
    no hidden file (a write in progress)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        for name in files:
            if name.startswith(".") or (name.startswith("_") and name != "_manifest.json"):
                continue
            path = os.path.join(folder, name)
            try:
                out[os.path.relpath(path, root)] = os.stat(path)
            except FileNotFoundError:
                pass
    return out


@dataclass
class Result:
    """What a finished store holds: the metrics table, a digest of every run, the stage manifests."""

    metrics: list[tuple]
    runs: list[tuple]
    manifests: list[str]

    @classmethod
    def of(cls, root: Path) -> Result:
        with StoreSQL(ArtifactStore(root)) as db:
            metrics = db.query("select * from metrics order by all")[1]
            runs = db.query(
                "select system, dataset, split, kq, kp, mode, count(*) n, "
                "bit_xor(hash(query_id, doc_id, rank, score)) digest from runs group by all order by all"
            )[1]
        return cls(metrics, runs, sorted(p for p in outputs(root) if p.endswith("_manifest.json")))

    def assert_same(self, other: Result, what: str) -> None:
        assert len(other.metrics) == len(self.metrics) and other.metrics == self.metrics, f"{what}: metrics differ"
        assert other.runs == self.runs, f"{what}: runs differ"
        assert other.manifests == self.manifests, f"{what}: other stage folders"


def assert_clean(root: Path, what: str) -> None:
    """Every stored file matches its manifest, and no staging folder is left behind."""
    checked, problems = ArtifactStore(root).verify_all()
    assert checked > 0 and not problems, f"{what}: {problems}"
    staging = root / "_staging"
    assert not staging.exists() or not any(staging.iterdir()), f"{what}: left in _staging: {list(staging.iterdir())}"


@dataclass
class Baseline:
    root: Path
    source: Path
    result: Result
    events: list[tuple[float, str]]  # (seconds after start, stage output), in the order they appeared
    seconds: float


@pytest.fixture(scope="module")
def mini(tmp_path_factory) -> Path:
    if not (CRANFIELD / "corpus.jsonl").exists() or not (SPLADE / "model.safetensors").exists():
        pytest.skip("../shared/data/cranfield or ../shared/models/splade-tiny-mlm is absent")
    docs = [json.loads(line) for line in (CRANFIELD / "corpus.jsonl").read_text().splitlines()]
    queries = [json.loads(line) for line in (CRANFIELD / "queries.jsonl").read_text().splitlines()][:QUERIES]
    qids = {q["_id"] for q in queries}
    qrels = [line.split("\t") for line in (CRANFIELD / "qrels" / "test.tsv").read_text().splitlines()[1:]]
    qrels = [(q, d, int(r)) for q, d, r in qrels if q in qids]
    judged = {d for _, d, _ in qrels}
    keep = [d for d in docs if d["_id"] in judged]
    keep += [d for d in docs if d["_id"] not in judged][: max(0, PASSAGES - len(keep))]
    assert len(keep) == PASSAGES, len(keep)
    return write_beir(tmp_path_factory.mktemp("fault") / "mini", keep, queries, {"test": qrels})


@pytest.fixture(scope="module")
def baseline(mini: Path) -> Baseline:
    """The uninterrupted run, watched: when each stage output first appears."""
    root = mini.parent / "baseline"
    events: list[tuple[float, str]] = []
    seen: set[str] = set()
    done = threading.Event()
    start = time.monotonic()

    def watch() -> None:
        while not done.is_set():
            for rel in outputs(root):
                if rel not in seen:
                    seen.add(rel)
                    events.append((time.monotonic() - start, rel))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        p = diffret(*run_args(mini, root))
    finally:
        done.set()
        watcher.join()
    seconds = time.monotonic() - start
    assert p.returncode == 0, f"the uninterrupted run failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    result = Result.of(root)
    assert len(result.metrics) > 0 and len(result.runs) == 3 + 1  # 3 modes at (1, 1) (no multi), and BM25
    assert_clean(root, "the uninterrupted run")
    print(f"\nuninterrupted run: {seconds:.1f} s, {len(events)} stage outputs")
    return Baseline(root, mini, result, events, seconds)


@dataclass
class KillPoint:
    phase: str
    anchor: str | None  # a stage output to wait for (None: the start of the command)
    delay: float  # then sleep this long, at most until ``until`` appears
    until: str | None

    def __str__(self) -> str:
        return f"{self.delay:.2f} s after {self.anchor or 'the start'} ({self.phase})"


def kill_points(baseline: Baseline, seed: int) -> list[KillPoint]:
    """One point per trial, uniform in time over its phase of the uninterrupted run (early: from 1 s before
    the collection is stored to the first encoding output; middle: to the last encoding output; late: to the
    last output), expressed as the last output before it and the delay after that output; ``until`` is the
    output after it, which the trial does not wait past (a slower trial run is killed when it appears)."""
    rng = random.Random(seed)
    events = baseline.events

    def times(folder: str) -> list[float]:
        return [t for t, rel in events if rel.split(os.sep)[0] == folder]

    encode = times("encodings")
    # fmt: off
    spans = {"early": (max(0.0, times("datasets")[0] - 1.0), encode[0]), "middle": (encode[0], encode[-1]),
             "late": (encode[-1], events[-1][0])}
    # fmt: on
    points = []
    for phase in PHASES:
        at = rng.uniform(*spans[phase])
        before = [(t, rel) for t, rel in events if t <= at]
        t0, anchor = before[-1] if before else (0.0, None)
        until = next(rel for t, rel in events if t > t0)
        points.append(KillPoint(phase, anchor, at - t0, until))
    return points


@pytest.mark.parametrize("trial", range(TRIALS))
def test_kill_9_at_a_random_point_then_rerun(trial: int, baseline: Baseline, tmp_path: Path) -> None:
    point = kill_points(baseline, SEED)[trial]
    what = f"seed {SEED} (DIFFRET_FAULT_SEED), trial {trial}: kill -9 {point}"
    print(f"\n{what}")
    t0 = time.monotonic()
    root = tmp_path / "store"
    log = tmp_path / "killed.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*DIFFRET, *run_args(baseline.source, root)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=ENV,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while point.anchor is not None and not (root / point.anchor).exists():
            assert proc.poll() is None, f"{what}: the run ended ({proc.returncode}) first\n{tail(log)}"
            assert time.monotonic() < deadline, f"{what}: {point.anchor} never appeared"
            time.sleep(0.01)
        kill_at = time.monotonic() + point.delay
        while time.monotonic() < kill_at and not (point.until and (root / point.until).exists()):
            time.sleep(0.01)
        assert proc.poll() is None, f"{what}: the run ended ({proc.returncode}) before the kill\n{tail(log)}"
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI's group: it and anything it started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = outputs(root) if root.exists() else {}

    p = diffret(*run_args(baseline.source, root))  # the same command: no --force, nothing cleaned by hand
    assert p.returncode == 0, f"{what}: the re-run failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    baseline.result.assert_same(Result.of(root), what)
    assert_clean(root, what)
    after = outputs(root)
    data = {rel: st for rel, st in left.items() if not os.path.basename(rel).startswith("_")}
    kept = sum(1 for rel, st in data.items() if rel in after and after[rel].st_ino == st.st_ino)
    print(f"{len(data)} data file(s) at the kill, {kept} kept as they were; trial {time.monotonic() - t0:.1f} s")


def test_flipped_byte_in_an_encoding_shard_is_named_and_redone(baseline: Baseline, tmp_path: Path) -> None:
    """Bit rot: one byte flipped, size and mtime kept. `diffret verify` names the file; a run's quick check
    (size, mtime) cannot see it, `diffret run --verify` re-hashes the shards and encodes that one again."""
    root = tmp_path / "store"
    shutil.copytree(baseline.root, root)  # copy2: sizes and mtimes kept
    shards = sorted(root.glob("encodings/**/side=passage/**/shard=*.parquet"))
    assert len(shards) == PASSAGES // SHARD, shards
    shard = shards[len(shards) // 2]
    original, st = shard.read_bytes(), shard.stat()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))

    p = diffret("verify", "--root", str(root))
    assert p.returncode == 1, f"verify passed a damaged shard:\n{p.stdout}\n{p.stderr}"
    rel = str(shard.relative_to(root))
    assert rel in " ".join((p.stdout + p.stderr).split()), f"{rel} not named:\n{p.stdout}\n{p.stderr}"

    p = diffret(*run_args(baseline.source, root), "--verify")
    assert p.returncode == 0, f"the run after the flip failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    assert shard.read_bytes() == original  # redone, byte-identical
    baseline.result.assert_same(Result.of(root), "after a flipped byte")
    p = diffret("verify", "--root", str(root))
    assert p.returncode == 0, f"verify after the re-run:\n{p.stdout}\n{p.stderr}"


ENCODED = re.compile(r"(\d+) shard\(s\) encoded, (\d+) already done \((\d+) in all\)")


CRASHED_WITHIN_S = 120  # the automation's 90 s after the last heartbeat, which comes every 30 s, and its checks


@pytest.mark.prefect
def test_prefect_worker_killed_mid_encode_then_retried_from_the_ui(
    baseline: Baseline, prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """The pipeline deployment on a process worker, with the zombie-flow automation of automations/ created as
    docs/operations.md says; kill -9 the worker and the flow run it started while it encodes: nobody tells the
    server, and the automation marks the run Crashed within 2 minutes (its heartbeats stopped). Then Retry from
    the UI (the flow run's menu, in headless Chromium; `prefect flow-run retry` where there is no browser) on a
    new worker: it completes, keeps every file finished before the kill as it was (same inode and mtime),
    encodes only the missing shards, and ends with the uninterrupted run's metrics."""
    ui = browser_available()
    server = prefect_server
    create_zombie_automation(server)
    deploy(server, "pipeline")
    root = tmp_path / "store"
    config = pipeline_config(baseline.source, root, tmp_path / "cache")
    flow_run_id = run_deployment(server, config, "pipeline/pipeline")

    worker, log = server.start_worker("worker-killed")
    try:
        seen: list[float] = []
        deadline = time.monotonic() + TIMEOUT_S
        while len(seen) < 2:  # two encoding shards recorded, then half the time one takes
            n = len(recorded_shards(root))
            seen += [time.monotonic()] * (n - len(seen))
            assert worker.poll() is None, f"the worker ended ({worker.returncode}) first\n{tail(log)}"
            assert time.monotonic() < deadline, f"no encoding shard after {TIMEOUT_S} s\n{tail(log)}"
            time.sleep(0.02)
        time.sleep(max(0.05, (seen[1] - seen[0]) / 2))
        assert worker.poll() is None, f"the worker ended ({worker.returncode}) before the kill\n{tail(log)}"
    finally:
        killed = kill_9_tree(worker)
    assert len(killed) >= 2, f"the worker had no flow run process to kill: {killed}"
    finished = recorded_shards(root)
    left = {
        rel: st
        for rel, st in outputs(root).items()  # an encoding shard not yet recorded is not finished
        if "encodings" not in rel or not rel.endswith(".parquet") or rel in finished
    }
    assert len(finished) >= 2, finished
    shards_left = [rel for rel in left if "encodings" in rel and rel.endswith(".parquet")]
    assert server.flow_run(flow_run_id)["state_type"] == "RUNNING"  # nobody told the server

    took = wait_state(server, flow_run_id, "CRASHED", CRASHED_WITHIN_S)
    print(f"marked Crashed by the automation {took:.0f} s after the kill")
    if ui:
        with browser_page() as page:
            PrefectUI(page, server.base_url).retry(flow_run_id)
    else:
        server.cli("flow-run", "retry", flow_run_id)
    assert server.flow_run(flow_run_id)["state_name"] == "AwaitingRetry"
    run = work_off(server, flow_run_id, "worker-retry")
    assert run["state_type"] == "COMPLETED"
    logs = server.flow_run_logs(flow_run_id)

    after = outputs(root)
    same = {
        rel
        for rel, st in left.items()
        if rel in after and (after[rel].st_ino, after[rel].st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    }
    # data files only: the bookkeeping of the stage that was running (its manifest, shard records) is rewritten
    changed = sorted(rel for rel in set(left) - same if not os.path.basename(rel).startswith("_"))
    assert not changed, f"finished before the kill, redone after it: {changed}"
    m = ENCODED.findall(logs)
    assert len(m) == 1, f"one encode result line expected in the flow run's logs:\n{logs}"
    encoded, already, total = map(int, m[0])
    assert already >= len(shards_left) and encoded + already == total, (m, shards_left)
    assert encoded > 0, "the kill came after encoding"
    assert re.search(r"download mini: (unchanged|already)", logs), logs
    baseline.result.assert_same(Result.of(root), "after the retry")
    assert_clean(root, "after the retry")
