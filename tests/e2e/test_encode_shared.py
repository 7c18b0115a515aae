"""End-to-end encoding with the real small checkpoints in ../shared/models (skipped when absent)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_harness import DIFFRET, ENV, run
from conftest import SHARED

SPLADE = SHARED / "models" / "splade-tiny-mlm"
SMOL = SHARED / "models" / "smollm2-135m-instruct-gguf"


@pytest.fixture
def scifact_store(tmp_path, shared_data) -> Path:
    if not (SPLADE / "model.safetensors").exists():
        pytest.skip("../shared/models/splade-tiny-mlm is absent")
    root = tmp_path / "store"
    run("download", "scifact", "--source", str(shared_data / "scifact"), "--root", str(root))
    return root


def _manifests(root: Path) -> dict[str, dict]:
    """Per encodings folder, the shards it holds: listed in its manifest or recorded in its _shards.jsonl (not
    yet compacted), each by sha256, bytes and rows (not mtime: two stores write at different times)."""
    out = {}
    for p in sorted((root / "encodings").rglob("_manifest.json")):
        files = dict(json.loads(p.read_text())["files"])
        log = p.parent / "_shards.jsonl"
        if log.exists():
            for line in log.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    files[rec["name"]] = rec["file"]
        out[str(p.parent.relative_to(root))] = {
            name: {k: v for k, v in entry.items() if k != "mtime_ns"} for name, entry in files.items()
        }
    return out


ARGS = [
    "--model",
    str(SPLADE),
    "--dataset",
    "scifact",
    "--side",
    "passage",
    "--max-length",
    "96",
    "--shard-size",
    "500",
]


@pytest.mark.e2e
def test_encode_kill_9_resumes_with_identical_shards(tmp_path, scifact_store, shared_data):
    # an uninterrupted run as the reference
    ref_root = tmp_path / "ref"
    run("download", "scifact", "--source", str(shared_data / "scifact"), "--root", str(ref_root))
    run("encode", *ARGS, "--k", "1,4", "--root", str(ref_root))
    reference = _manifests(ref_root)
    assert sorted(reference) == [
        f"encodings/{m}/dataset=scifact/side=passage/k={k}"
        for m in [next((ref_root / "encodings").iterdir()).name]
        for k in (1, 4)
    ]
    assert all(len(files) == 11 for files in reference.values())  # 5,183 passages in shards of 500
    assert sum(e["rows"] for e in next(iter(reference.values())).values()) == 5183

    # the same run, killed with SIGKILL once a few shards are recorded, then run again
    proc = subprocess.Popen(
        [*DIFFRET, "encode", *ARGS, "--k", "1,4", "--root", str(scifact_store)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ms = _manifests(scifact_store) if (scifact_store / "encodings").exists() else {}
            if sum(len(f) for f in ms.values()) >= 3:
                break
            assert proc.poll() is None, "encode finished before it could be killed"
            time.sleep(0.2)
        else:
            pytest.fail("no shard was recorded in time")
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    done_before = sum(len(f) for f in _manifests(scifact_store).values())
    assert 3 <= done_before < 22

    again = run("encode", *ARGS, "--k", "1,4", "--root", str(scifact_store))
    m = re.search(r"(\d+) shard\(s\) encoded, (\d+) already done \((\d+) in all\)", again.stderr)
    assert m, again.stderr
    encoded, skipped, total = map(int, m.groups())
    assert (skipped, encoded, total) == (done_before, 22 - done_before, 22)
    assert _manifests(scifact_store) == reference  # same sha256 per shard as the uninterrupted run

    # a third run does no model work
    third = run("encode", *ARGS, "--k", "1,4", "--root", str(scifact_store))
    assert "0 shard(s) encoded, 22 already done" in third.stderr


@pytest.mark.e2e
def test_encode_errors_are_clear(tmp_path, scifact_store):
    root = str(scifact_store)
    cases = [
        (["--model", str(tmp_path / "nope"), "--dataset", "scifact"], "does not exist"),
        (["--model", str(SPLADE), "--dataset", "scifact", "--k", "0,4"], "K must be positive"),
        (
            ["--model", str(SPLADE), "--dataset", "scifact", "--family", "transformer-xl"],
            "'transformer-xl' is not one of 'auto', 'mlm', 'dream', 'llada', 'causal'",
        ),  # the choices, in the usage error
        (["--model", str(SPLADE), "--dataset", "nosuch"], "no complete artifact"),
    ]
    if SMOL.exists():
        cases += [
            (
                ["--model", str(SMOL), "--gguf-file", "missing.gguf", "--dataset", "scifact"],
                "GGUF file 'missing.gguf' not found",
            ),
            (
                [
                    "--model",
                    str(SMOL),
                    "--gguf-file",
                    "SmolLM2-135M-Instruct.Q4_1.gguf",
                    "--dataset",
                    "scifact",
                    "--side",
                    "query",
                    "--k",
                    "1",
                    "--max-length",
                    "8",
                ],
                "no mask token",
            ),
        ]
    for args, message in cases:
        p = run("encode", *args, "--root", root, check=False)
        assert p.returncode == 2, (args, p.stderr)
        assert message in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr


@pytest.mark.e2e
def test_dask_workers_write_the_same_shards_as_in_process(tmp_path, shared_data):
    """--workers 2: a local Dask cluster through Prefect (temporary server) gives byte-identical shards."""
    if not (SPLADE / "model.safetensors").exists():
        pytest.skip("../shared/models/splade-tiny-mlm is absent")
    args = ["--model", str(SPLADE), "--dataset", "cranfield", "--side", "query", "--k", "1,2", "--shard-size", "100"]
    roots = {}
    for mode, extra in (("local", []), ("dask", ["--workers", "2"])):
        root = tmp_path / mode
        run("download", "cranfield", "--source", str(shared_data / "cranfield"), "--root", str(root))
        env_home = tmp_path / f"prefect-{mode}"
        p = subprocess.run(
            [*DIFFRET, "encode", *args, *extra, "--root", str(root)],
            capture_output=True,
            text=True,
            timeout=600,
            env={
                **ENV,
                "PREFECT_HOME": str(env_home),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "DO_NOT_TRACK": "1",
            },
        )
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "6 shard(s) encoded, 0 already done" in p.stdout + p.stderr
        roots[mode] = root
    assert _manifests(roots["local"]) == _manifests(roots["dask"])
