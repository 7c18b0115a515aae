"""What a person sees in the Prefect UI: the flows' parameter forms (every field described, fixed choices as
dropdowns, placeholders that survive markdown), run and task names, where progress and summaries attach, and
the size of what each unit task is sent."""

from __future__ import annotations

import importlib
import pickle
import re
import time
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from conftest import write_beir
from tiny_models import save_tiny_mlm

from diffret.flows.runner import flows, unit_parameters
from diffret.retrieval.models.backbones import FAMILIES, BackboneConfig, Family
from diffret.retrieval.search.modes import MODE_NAMES
from diffret.stages import execute, stages
from diffret.stages.base import Context
from diffret.stages.download import DownloadConfig
from diffret.stages.encode import EncodeConfig
from diffret.stages.tokenize import TokenizeConfig
from diffret.storage import ArtifactStore

REPO = Path(__file__).parents[2]
HTML_LIKE = re.compile(r"<[A-Za-z][^>]*>")  # read as a tag by the UI's markdown: the text vanishes
DEV_NOTES = ("renders them as a form", ":meth:", ":class:", ":func:", "``like``")


def flow_functions() -> dict[str, Any]:
    out = {name: getattr(importlib.import_module(mod), fn) for name, (mod, fn) in flows().items()}
    out["pipeline"] = importlib.import_module("diffret.flows.pipeline").pipeline_flow
    return out


def schema_of(flow: Any) -> dict:
    from prefect.utilities.callables import parameter_schema

    return parameter_schema(flow.fn).model_dump_for_openapi()


def test_every_form_field_is_described_without_html_like_placeholders() -> None:
    for name, flow in flow_functions().items():
        assert flow.description and not HTML_LIKE.search(flow.description), name
        schema = schema_of(flow)
        for model, definition in schema["definitions"].items():
            text = definition.get("description") or ""
            assert not HTML_LIKE.search(text) and not any(n in text for n in DEV_NOTES), (name, model, text)
            for field, prop in definition.get("properties", {}).items():
                desc = prop.get("description")
                assert desc, f"{name}: {model}.{field} has no description"
                assert not HTML_LIKE.search(desc), f"{name}: {model}.{field}: {desc}"


def test_fixed_choices_are_dropdowns() -> None:
    assert set(get_args(Family)) == {"auto", *FAMILIES}
    backbone = BackboneConfig.model_json_schema()["properties"]["family"]
    assert backbone["enum"] == list(get_args(Family))
    pipeline = schema_of(flow_functions()["pipeline"])["definitions"]["PipelineConfig"]["properties"]
    assert pipeline["modes"]["items"]["enum"] == list(MODE_NAMES)
    assert pipeline["preset"]["enum"] == ["paper", "laptop"]
    with pytest.raises(ValueError, match="Input should be 'auto'"):
        BackboneConfig(model="m", family="bert")


def test_deployment_descriptions_keep_placeholders_in_code_spans() -> None:
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    for d in spec["deployments"]:
        outside_code = re.sub(r"`[^`]*`", "", d.get("description") or "")
        assert not HTML_LIKE.search(outside_code), (d["name"], outside_code)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("ui")
    words = "cats purr dogs bark tea coffee cocoa garden fox jumps lazy mailman".split()
    corpus = [{"_id": f"d{i}", "title": words[i], "text": " ".join(words[i : i + 4])} for i in range(9)]
    queries = [{"_id": f"q{i}", "text": " ".join(words[2 * i : 2 * i + 2])} for i in range(4)]
    beir = write_beir(base / "tiny", corpus, queries, {"test": [("q0", "d0", 1), ("q1", "d2", 1)]})
    return {"base": base, "beir": beir, "model": save_tiny_mlm(base / "model")}


def test_unit_parameters_do_not_grow_with_the_settings(tiny: dict, tmp_path: Path) -> None:
    """A unit carries a key to the run's shared settings, not the settings: the same bytes with every setting
    at its default or several set (none of which names a folder), and no setting inside."""
    root = str(tmp_path / "store")
    execute(stages()["download"], DownloadConfig(name="tiny", source=str(tiny["beir"]), root=root), log=print)
    bare = BackboneConfig(model=str(tiny["model"]))
    execute(
        stages()["tokenize"],
        TokenizeConfig(dataset="tiny", backbone=bare, max_length=64, shard_size=4, root=root),
        log=print,
    )
    more = BackboneConfig(model=str(tiny["model"]), device="cpu", attn_implementation="eager", turn_end="[SEP]")
    sizes = []
    for bb, batch in ((bare, 32), (more, 7)):
        cfg = EncodeConfig(
            dataset="tiny",
            k=[1, 16],
            backbone=bb,
            max_length=64,
            shard_size=4,
            batch_size=batch,
            readout={"stop_cut": False, "finetuned": "no"},
            root=root,
        )
        ctx = Context(ArtifactStore(root), log=print)
        with ctx.held:
            plan = stages()["encode"].plan(cfg, ctx)
        assert len(plan.units) == 2 * (1 + 3)  # K x shards (queries: 1, passages: 3)
        payloads = [pickle.dumps(unit_parameters(stages()["encode"], root, u)) for u in plan.units]
        assert all(str(tiny["model"]).encode() not in p and b"max_length" not in p for p in payloads)
        sizes.append(sorted(map(len, payloads)))
        shared = ctx.store.read_plan(plan.units[0].plan)  # the settings, stored once per run
        assert shared["settings"]["backbone"]["device"] == bb.device and shared["batch_size"] == batch
    assert sizes[0] == sizes[1] and max(sizes[0]) < 600, sizes


@pytest.mark.prefect
def test_flow_runs_and_unit_tasks_are_named_and_summarised(tiny: dict, tmp_path: Path) -> None:
    """Through Prefect (a temporary server): runs named by stage / dataset / system, one task per shard named
    after it under the encode run itself, progress and the summary (rows, folders, time, next) on that run."""
    from prefect.client.orchestration import get_client
    from prefect.testing.utilities import prefect_test_harness

    from diffret.flows.stage_flows import download_flow, encode_flow

    root = str(tmp_path / "store")
    bb = {"model": str(tiny["model"])}
    with prefect_test_harness(server_startup_timeout=120):
        download_flow(DownloadConfig(name="tiny", source=str(tiny["beir"]), root=root))
        res = encode_flow(EncodeConfig(dataset="tiny", k=[1, 2], backbone=bb, max_length=64, shard_size=4, root=root))
        with get_client(sync_client=True) as client:
            flow_runs = {r.name: r for r in client.read_flow_runs()}
            tasks = client.read_task_runs()
            deadline = time.monotonic() + 60  # task runs reach the server as events, recorded a moment later
            while len(tasks) < 8 and time.monotonic() < deadline:
                time.sleep(0.25)
                tasks = client.read_task_runs()
            artifacts = client.read_artifacts()
    assert res["done"] == 2 * (1 + 3)
    encode_run = flow_runs.pop(f"encode tiny {Path(tiny['model']).name} diffretriever")
    assert set(flow_runs) == {"download tiny"}  # no per-unit sub-flow runs
    names = sorted(t.name for t in tasks)
    assert names[0] == "encode passage K=1 shard=00000" and len(names) == 8, names
    assert {t.flow_run_id for t in tasks} == {encode_run.id}
    progress = [a for a in artifacts if a.type == "progress" and a.key.startswith("encode-")]
    assert progress and {a.flow_run_id for a in progress} == {encode_run.id} and progress[0].data == 100
    summary = next(a for a in artifacts if a.type == "markdown" and a.key == f"encode-{res['system']}")
    assert summary.flow_run_id == encode_run.id
    assert "8 shard(s) encoded" in summary.data and "| `side=passage/k=2` | 3 | 9 |" in summary.data
    assert "Next: score the grid" in summary.data and f"Store: `{root}`" in summary.data
    download = next(a for a in artifacts if a.type == "markdown" and a.key == "download-summary")
    assert "| corpus | 9 |" in download.data and "| queries | 4 |" in download.data
    assert str(tiny["beir"]) in download.data
