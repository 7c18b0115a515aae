"""`diffret train` as processes: killed with SIGKILL mid-training and run again, it ends with an
adapter bit-identical to an uninterrupted run's; under torchrun with 2 CPU processes (gloo) it computes the same
per-step loss as one process at the same global batch (within 1e-5), the pool gathered across the processes
with gradients flowing back to their owners, with or without the AdamW state sharded (ZeRO stage 1); killed
and resumed under torchrun with the sharded state, it also ends bit-identical.

A tiny random BERT with dropout 0 (LoRA dropout 0 too) in the DDP check, so the two runs differ only by how the
work is split.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import save_tiny_mlm

from diffret.storage import ArtifactStore
from diffret.storage.sql import StoreSQL

pytestmark = pytest.mark.e2e
ENV = {**os.environ, "COLUMNS": "200", "PREFECT_API_URL": "", "OMP_NUM_THREADS": "1"}
WORDS = "cats purr dogs bark tea coffee cocoa garden fox jumps lazy mailman river stone cloud wheat".split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own), from /proc."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        ppid = todo.pop()
        kids = [c for c, p in parent.items() if p == ppid]
        out += kids
        todo += kids
    return out


def launcher(procs: int) -> list[str]:
    if procs == 1:
        return [sys.executable, "-m", "diffret.flows.cli"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(procs),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        "-m",
        "diffret.flows.cli",
    ]


def run(*args: str, procs: int = 1) -> subprocess.CompletedProcess:
    p = subprocess.run([*launcher(procs), *args], capture_output=True, text=True, env=ENV, timeout=900)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def _groups_file(path: Path, n: int = 16) -> Path:
    with path.open("w") as f:
        for i in range(n):
            a, b = WORDS[i % len(WORDS)], WORDS[(i + 3) % len(WORDS)]
            negs = [
                {"docid": f"n{i}-{j}", "title": "", "text": f"{WORDS[(i + 5 + j) % len(WORDS)]} tea"} for j in range(3)
            ]
            pos = [{"docid": f"p{i}", "title": a, "text": f"{a} {b} {a}"}]
            rec = {"query_id": f"q{i}", "query": f"{a} {b}", "positive_passages": pos, "negative_passages": negs}
            f.write(json.dumps(rec) + "\n")
    return path


def test_two_gloo_processes_match_one_at_the_same_global_batch(tmp_path):
    model = save_tiny_mlm(tmp_path / "bert")
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (model / "config.json").write_text(json.dumps(cfg))
    root = str(tmp_path / "store")
    run("training-data", "--source", str(_groups_file(tmp_path / "groups.jsonl")), "--name", "tiny", "--root", root)
    common = [
        "train",
        "-t",
        "tiny",
        "--model",
        str(model),
        "--kq",
        "2",
        "--kp",
        "2",
        "--n-negatives",
        "2",
        "--lora-dropout",
        "0",
        "--lr",
        "5e-3",
        "--warmup-ratio",
        "0",
        "--pool-size",
        "8",
        "--global-batch",
        "8",
        "--epochs",
        "2",
        "--q-max-len",
        "8",
        "--p-max-len",
        "12",
        "--content-filter",
        "regex",
        "--root",
        root,
    ]
    # one pool of 8 queries a step: 1 process in gradient-cached chunks of 4, 2 processes 4 each in chunks of 2
    run(*common, "--batch-size", "4", "--name", "one")
    out = run(*common, "--batch-size", "2", "--name", "two", procs=2)
    assert "2 processes" in out.stdout + out.stderr
    # the AdamW state sharded across the 2 processes (ZeRO stage 1), consolidated into every checkpoint
    run(*common, "--batch-size", "2", "--name", "zero", "--shard-optimizer", "--checkpoint-every", "1", procs=2)
    with StoreSQL(ArtifactStore(root)) as db:
        _, rows = db.query("select model, step, loss, dense, sparse from train_log order by model, step")
    one = [r[1:] for r in rows if r[0] == "one"]
    for other in ("two", "zero"):
        two = [r[1:] for r in rows if r[0] == other]
        assert len(one) == len(two) == 4  # 16 groups / 8 a step x 2 epochs
        for a, b in zip(one, two, strict=True):
            assert a[0] == b[0]
            for x, y in zip(a[1:], b[1:], strict=True):
                assert abs(x - y) < 1e-5, (other, one, two)
    assert one[-1][1] < one[0][1]  # and it trains
    manifest = json.loads((Path(root) / "models" / "model=two" / "_manifest.json").read_text())
    assert manifest["stats"]["processes"] == 2 and manifest["config"]["world_size"] == 2


@pytest.mark.parametrize("procs", [1, 2], ids=["one-process", "two-processes-sharded-optimizer"])
def test_sigkill_mid_training_then_rerun_is_bit_identical(tmp_path, procs):
    model = save_tiny_mlm(tmp_path / "bert")
    root = str(tmp_path / "store")
    run("training-data", "--source", str(_groups_file(tmp_path / "groups.jsonl")), "--name", "tiny", "--root", root)
    args = [
        "train",
        "-t",
        "tiny",
        "--model",
        str(model),
        "--kq",
        "2",
        "--kp",
        "2",
        "--n-negatives",
        "2",
        "--batch-size",
        "2",
        "--pool-size",
        "2",
        "--global-batch",
        "2",
        "--max-steps",
        "150",
        "--checkpoint-every",
        "5",
        "--q-max-len",
        "8",
        "--p-max-len",
        "12",
        "--content-filter",
        "regex",
        "--root",
        root,
    ]
    if procs > 1:  # torchrun, the AdamW state sharded: the checkpoint consolidates it, the resume re-shards it
        args.append("--shard-optimizer")
    run(*args, "--name", "straight", procs=procs)
    proc = subprocess.Popen(
        launcher(procs) + [*args, "--name", "killed"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV
    )
    ckpts = Path(root) / "checkpoints"
    deadline = time.monotonic() + 300
    while not list(ckpts.glob("model=killed-*/last.pt")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in [proc.pid, *_descendants(proc.pid)]:  # the launcher and every process it started
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert list(ckpts.glob("model=killed-*/last.pt")), "killed before its first checkpoint"
    assert not (Path(root) / "models" / "model=killed").exists()
    out = run(*args, "--name", "killed", procs=procs)
    assert "resumed killed at step " in out.stdout + out.stderr
    adapter = "adapter_model.safetensors"
    straight = (Path(root) / "models" / "model=straight" / adapter).read_bytes()
    assert (Path(root) / "models" / "model=killed" / adapter).read_bytes() == straight
