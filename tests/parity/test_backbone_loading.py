"""Dream and LLaDA loading on the real tiny checkpoints: the remote code against the native loader (under a
transformers 4.x install, when CI provides one), and load failures as one paragraph through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, SHARED

pytestmark = pytest.mark.e2e

MODELS = {fam: SHARED / "models" / f"tiny-{fam}-random" for fam in ("dream", "llada")}
ENV = {**os.environ, "COLUMNS": "200", "PREFECT_API_URL": "", "HF_HUB_OFFLINE": "1"}
TF4 = os.environ.get("DIFFRET_TRANSFORMERS4")  # a `pip install --target` of transformers 4.57 (see .ci/run)


def need_models() -> None:
    if not all((m / "config.json").exists() for m in MODELS.values()):
        pytest.skip("../shared/models/tiny-{dream,llada}-random are absent")


def test_remote_code_agrees_with_native_loading():
    """Where the checkpoints' own code runs (transformers 4.46-4.57), it gives the native loader's vectors."""
    need_models()
    if not TF4:
        pytest.skip("DIFFRET_TRANSFORMERS4 (a transformers 4.57 install, as .ci/run makes) is not set")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([TF4, str(REPO)])}
    p = subprocess.run(
        [sys.executable, str(REPO / "tests" / "parity" / "remote_vs_native.py"), str(SHARED)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["transformers"].startswith("4."), out
    for family in MODELS:
        assert out[family]["min_cos"] >= 0.9999 and out[family]["same_sparse"], out


def cli_error(*args: str) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "diffret.flows.cli", *args], capture_output=True, text=True, env=ENV, timeout=600
    )
    assert p.returncode != 0, p.stdout
    err = p.stderr.strip()
    assert "Traceback" not in err and "Traceback" not in p.stdout, err
    return err


@pytest.mark.parametrize("family", sorted(MODELS))
def test_load_failures_are_one_paragraph_through_the_cli(tmp_path, family):
    need_models()
    root = str(tmp_path / "store")
    mini = SHARED / "fixtures" / "reference-parity" / "scifact-mini"
    subprocess.run(
        [sys.executable, "-m", "diffret.flows.cli", "download", "mini", "--source", str(mini), "--root", root],
        check=True,
        capture_output=True,
        env=ENV,
        timeout=600,
    )
    model = str(MODELS[family])
    # remote code without --trust-remote-code: refused before any of it runs
    err = cli_error("encode", "-d", "mini", "--model", model, "--loader", "remote", "--k", "1", "--root", root)
    assert "--trust-remote-code" in err and model in err
    # remote code on a transformers it does not run on
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        err = cli_error(
            "encode",
            "-d",
            "mini",
            "--model",
            model,
            "--loader",
            "remote",
            "--trust-remote-code",
            "--k",
            "1",
            "--root",
            root,
        )
        assert f"transformers {transformers.__version__}" in err and "native loader" in err
    # damaged weights: the model, its architecture and the transformers version, in one paragraph
    broken = tmp_path / "broken"
    shutil.copytree(MODELS[family], broken)
    for w in broken.glob("*.safetensors"):
        w.write_bytes(w.read_bytes()[:1000])
    err = cli_error("encode", "-d", "mini", "--model", str(broken), "--k", "1", "--root", root)
    arch = json.loads((broken / "config.json").read_text())["architectures"][0]
    assert str(broken) in err and arch in err and f"transformers {transformers.__version__}" in err, err
