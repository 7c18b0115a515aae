"""The Prefect UI as a person uses it, in headless Chromium: a local Prefect server with its UI, the deployments
of prefect.yaml, `download` then `pipeline` started from each deployment's Custom run form (the config entered
as JSON) on the 50-passage scifact-mini with splade-tiny, a process worker; then the runs' names, the download
summary's row counts, and the leaderboard artifact's heatmaps loading in the browser (no broken image).

Skips cleanly without Playwright or Chromium (`.ci/run` installs both), or without the fixtures in ../shared.
``DIFFRET_UI_SHOTS=<folder>`` saves screenshots of the form, the finished run and the leaderboard (docs/img's).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from browser import PrefectUI, browser_page
from conftest import SHARED
from prefect_harness import PrefectServer, deploy, work_off

MINI = SHARED / "fixtures" / "reference-parity" / "scifact-mini"
SPLADE = SHARED / "models" / "splade-tiny-mlm"
MODES = 5

pytestmark = [pytest.mark.prefect, pytest.mark.e2e]


def artifacts_of(server, flow_run_id: str) -> dict[str, dict]:  # noqa: ANN001
    found = server.api("POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    return {a["key"]: a for a in found if a.get("key")}  # type: ignore[union-attr]


def test_download_and_pipeline_from_the_custom_run_form(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if not (MINI / "corpus.jsonl").exists() or not (SPLADE / "model.safetensors").exists():
        pytest.skip("../shared/fixtures/reference-parity/scifact-mini or ../shared/models/splade-tiny-mlm is absent")
    shots = Path(os.environ["DIFFRET_UI_SHOTS"]) if os.environ.get("DIFFRET_UI_SHOTS") else None
    root, cache = tmp_path / "store", tmp_path / "cache"
    with browser_page() as page:
        server: PrefectServer = request.getfixturevalue("prefect_server")  # after the browser check: it may skip
        deploy(server, "download", "pipeline")
        ui = PrefectUI(page, server.base_url, shots)

        download = server.api("GET", "/deployments/name/download/download")["id"]  # type: ignore[index]
        config = {"name": "scifact-mini", "source": str(MINI), "root": str(root), "cache_dir": str(cache)}
        run_id = ui.custom_run(download, config)
        run = work_off(server, run_id, "worker-download")
        assert run["name"] == "download scifact-mini" and run["parameters"]["config"]["source"] == str(MINI)
        summary = artifacts_of(server, run_id)["download-summary"]["data"]
        for table, rows in (("corpus", 50), ("queries", 20), ("qrels", 22)):
            assert f"| {table} | {rows} |" in summary, summary
        assert "datasets/dataset=scifact-mini" in summary and str(MINI) in summary

        pipeline = server.api("GET", "/deployments/name/pipeline/pipeline")["id"]  # type: ignore[index]
        config = {
            "root": str(root),
            "dataset": "scifact-mini",
            "source": str(MINI),
            "cache_dir": str(cache),
            "kq": [1, 2],
            "kp": [1, 2],
            "max_length": 64,
            "shard_size": 25,
            "batch_size": 16,
            "backbone": {"model": str(SPLADE)},
        }
        run_id = ui.custom_run(pipeline, config, shot="ui-deployment-form")
        run = work_off(server, run_id, "worker-pipeline")
        assert run["name"] == "pipeline scifact-mini splade-tiny-mlm diffretriever"
        ui.flow_run(run_id, shot="ui-pipeline-run")
        board = artifacts_of(server, run_id)["leaderboard-test"]
        images = ui.artifact_images(board["id"], shot="ui-leaderboard")
        assert len(images) == MODES and all(i["width"] > 0 for i in images), images  # every heatmap loads
        assert all(i["src"].startswith("data:image/png") for i in images)
        text = ui.text()
        assert "multi_dense" in text and "bm25" in text

        # every stage's own run (a subflow of this pipeline run): named after it, its summary with the folders' rows
        runs = server.api(
            "POST",
            "/flow_runs/filter",
            {"flow_runs": {"parent_task_run_id": {"is_null_": False}, "parent_flow_run_id": {"any_": [run_id]}}},
        )
        names = {r["name"]: r["id"] for r in runs}  # type: ignore[union-attr]
        encode = next(i for n, i in names.items() if n.startswith("encode scifact-mini splade-tiny-mlm"))
        encoded = next(
            a["data"]
            for k, a in artifacts_of(server, encode).items()
            if k.startswith("encode-splade") and a["type"] == "markdown"
        )
        assert "| `side=passage/k=2` | 2 | 50 |" in encoded and "Next: score the grid" in encoded, encoded
