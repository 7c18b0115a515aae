"""prefect.yaml end to end: a local Prefect server, `prefect deploy`, a deployment run, a process worker.

On the session's server (PREFECT_HOME in a temporary folder, a free port; tests/conftest.py), with the
process work pool prefect.yaml names, deploys ``download`` from the repository's prefect.yaml, runs it on
../shared/data/scifact into a temporary store through ``prefect worker start --run-once``, and checks the run's
state and the store. Runs the deployment a second time to check that a stored collection is left as it is (resume).
Skips when ../shared/data/scifact is not beside the checkout. Every process it starts is in a process
group of its own, ended by that group's id.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, SHARED
from prefect_harness import POOL, PrefectServer, deploy, run_deployment, work_off

SCIFACT = SHARED / "data" / "scifact"
SCIFACT_CORPUS_ROWS = 5183
DEPLOYMENT = "download/download"

pytestmark = [pytest.mark.prefect, pytest.mark.e2e]


@pytest.fixture
def scifact() -> Path:
    if not (SCIFACT / "corpus.jsonl").exists():
        pytest.skip(f"{SCIFACT} is not beside this checkout")
    return SCIFACT


def test_download_deployment_runs_on_a_process_worker(scifact: Path, prefect_session: PrefectServer, tmp_path: Path):
    # `scifact` comes first so that a missing ../shared skips before a server is started
    import pyarrow.parquet as pq

    server = prefect_session.for_test(tmp_path, pool=POOL)  # the pool prefect.yaml names, this test's alone
    out = deploy(server)
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
    flow_run_id = run_deployment(server, config, DEPLOYMENT)
    run = work_off(server, flow_run_id, "worker")
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
    second = run_deployment(server, config, DEPLOYMENT)
    assert second != flow_run_id
    work_off(server, second, "worker-rerun")
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in stage.iterdir()} == before


def test_pipeline_deployment_resumes_a_failed_run(scifact: Path, prefect_server: PrefectServer, tmp_path: Path) -> None:
    """A pipeline run that fails at encoding (model weights missing), then the same deployment run again
    with the same parameters: the second run completes and does not redo the download."""
    import shutil

    splade = SHARED / "models" / "splade-tiny-mlm"
    if not (splade / "model.safetensors").exists():
        pytest.skip("../shared/models/splade-tiny-mlm is absent")
    model = tmp_path / "model"
    shutil.copytree(splade, model)
    weights = model / "model.safetensors"
    weights.rename(weights.with_suffix(".away"))

    server = prefect_server
    deploy(server, "pipeline")
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
    first = run_deployment(server, config, "pipeline/pipeline")
    failed = work_off(server, first, "pipeline-1", expect="FAILED")
    assert failed["state_type"] == "FAILED"
    stage = root / "datasets" / "dataset=scifact"
    tokens = sorted((root / "tokens").rglob("_manifest.json"))
    assert (stage / "_manifest.json").is_file() and len(tokens) == 2  # downloaded and tokenized before failing
    assert not (root / "runs").exists() and not list(root.glob("encodings/**/*.parquet"))
    before = {p: p.stat().st_mtime_ns for p in [*stage.iterdir(), *tokens]}

    weights.with_suffix(".away").rename(weights)
    second = run_deployment(server, config, "pipeline/pipeline")
    work_off(server, second, "pipeline-2")
    assert {p: p.stat().st_mtime_ns for p in before} == before  # resumed: nothing before the failure redone
    summary = next((root / "summaries").rglob("summary.md"))
    assert "bm25" in summary.read_text() and "multi_dense" in summary.read_text()
    assert len(list((root / "runs").rglob("run.parquet"))) == 5 + 1
