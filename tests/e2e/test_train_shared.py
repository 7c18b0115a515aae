"""Fine-tuning end to end on SciFact with splade-tiny (../shared; skipped when absent): BM25 hard negatives from
the train split, a short full fine-tune through `diffret train`, then the fine-tuned model encoded and scored
by path as a system of its own. The quality figure (the whole run) is in README.md; this checks the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import SHARED

from diffret.storage import ArtifactStore
from diffret.storage.sql import StoreSQL

pytestmark = pytest.mark.e2e
SPLADE = SHARED / "models" / "splade-tiny-mlm"
ENV = {**os.environ, "COLUMNS": "200", "PREFECT_API_URL": "", "HF_HUB_OFFLINE": "1"}


def cli(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [sys.executable, "-m", "diffret.flows.cli", *args], capture_output=True, text=True, env=ENV, timeout=1800
    )
    if p.returncode != 0:
        raise AssertionError(f"diffret {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def test_train_on_scifact_then_encode_and_score_the_fine_tuned_model(tmp_path, shared_data):
    if not (SPLADE / "model.safetensors").exists():
        pytest.skip("../shared/models/splade-tiny-mlm is absent")
    root = str(tmp_path / "store")
    cli("download", "scifact", "--source", str(shared_data / "scifact"), "--root", root)
    cli("bm25", "-d", "scifact", "--split", "train", "--root", root)
    cli("training-data", "-d", "scifact", "--root", root)
    out = cli(
        "train",
        "-t",
        "scifact",
        "--model",
        str(SPLADE),
        "--full",
        "--kq",
        "4",
        "--kp",
        "4",
        "--max-steps",
        "6",
        "--batch-size",
        "4",
        "--pool-size",
        "4",
        "--global-batch",
        "4",
        "--n-negatives",
        "3",
        "--lr",
        "1e-4",
        "--root",
        root,
    )
    model = next(x for x in (out.stdout + out.stderr).splitlines() if x.startswith("model: "))[len("model: ") :]
    manifest = json.loads(open(os.path.join(model, "_manifest.json")).read())
    assert manifest["stats"]["steps"] == 6 and manifest["stats"]["trainable"] == manifest["stats"]["parameters"]
    with StoreSQL(ArtifactStore(root)) as db:
        _, rows = db.query("select count(*), count(distinct model) from train_log")
        _, groups = db.query("select count(*), min(n_negatives) from training_groups")
    assert rows == [(6, 1)] and groups[0][0] > 700 and groups[0][1] == 15
    cli(
        "encode", "-d", "scifact", "--model", model, "--k", "4", "--side", "query", "--max-length", "96", "--root", root
    )
    systems = cli("systems", "--root", root, "--format", "json").stdout
    assert model in systems and str(SPLADE) not in systems  # its own system; the base was never encoded here
