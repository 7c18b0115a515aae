"""Systems on the stage test world (tests/stage_world.py): the registry records each and finds it, the CLI finds
a system by --model alone (and says what differs when several match), every stage has a flow and a deployment,
and a trained model (full weights, or a LoRA adapter) encodes as a system of its own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from stage_world import TRAIN, copy_world
from tiny_models import save_tiny_mlm
from typer.testing import CliRunner

from diffret.retrieval.models.backbones import BackboneConfig, BackboneError, load_backbone
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
from diffret.stages import execute, stages
from diffret.stages.systems import SystemRef, find_system, list_systems
from diffret.storage import ArtifactStore, StoreError


@pytest.fixture
def world(stage_world: dict) -> dict:
    """The stage test world (``stage_world``, tests/conftest.py), built once for the modules that share it."""
    return stage_world


def test_registry_records_each_system_and_finds_it(world: dict) -> None:
    store = ArtifactStore(world["root"])
    recs = {r.kind: r for r, _ in list_systems(store) if "store" not in r.settings}  # the float16 one
    enc = recs["encoder"]
    assert enc.model == str(world["model"]) and enc.readout == "diffretriever" and enc.has_sparse
    assert enc.settings["dtype"] == "float32" and enc.settings["max_length"] == 96
    assert find_system(store, SystemRef(model=str(world["model"]))).system == enc.system
    assert find_system(store, SystemRef(system=enc.system[:-4])).system == enc.system  # a unique prefix
    assert find_system(store, SystemRef(system="bm25")).kind == "bm25"
    with pytest.raises(StoreError, match="no encoder system"):
        find_system(store, SystemRef(model=str(world["model"]), where={"dtype": "bfloat16"}))
    with pytest.raises(StoreError, match="unknown system setting"):
        find_system(store, SystemRef(where={"colour": "red"}))


def test_cli_encode_bfloat16_then_score_and_index_by_model_alone(world: dict, tmp_path: Path, monkeypatch) -> None:
    """The encode options are not repeated: score and index look the system up in the registry."""
    from diffret.flows.cli import app

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    runner = CliRunner()
    root, model = str(tmp_path / "store"), str(world["model"])

    def cli(*args: str) -> str:
        res = runner.invoke(app, [*args, "--root", root])
        assert res.exit_code == 0, res.output
        return res.output

    cli("download", "tiny", "--source", str(world["beir"]))
    cli("encode", "-d", "tiny", "--model", model, "--dtype", "bfloat16", "--k", "1,2", "--max-length", "96")
    assert "18 cell(s) scored" in cli("score", "-d", "tiny", "--model", model, "--kq", "1,2", "--kp", "1,2")
    indexed = cli("index", "-d", "tiny", "--model", model, "--kq", "1", "--kp", "2", "--type", "none")
    assert "1 index(es) built" in indexed and "| 2 | 1 |" in indexed
    # a second system of the same model: --model alone is now ambiguous, and the error says what differs
    cli("encode", "-d", "tiny", "--model", model, "--k", "1", "--max-length", "96")
    res = runner.invoke(app, ["score", "-d", "tiny", "--model", model, "--kq", "1", "--kp", "1", "--root", root])
    assert res.exit_code == 2 and "2 encoder systems match" in res.output and "--dtype" in res.output
    assert "3 cell(s) scored" in cli(
        "score", "-d", "tiny", "--model", model, "--dtype", "float32", "--kq", "1", "--kp", "1"
    )
    listing = cli("systems", "-f", "json")
    assert sorted(r["kind"] for r in json.loads(listing)) == ["encoder", "encoder"]


def test_every_stage_has_a_flow_and_a_deployment() -> None:
    import yaml

    from diffret.flows.runner import flows

    root = Path(__file__).parents[2]
    entries = {d["entrypoint"] for d in yaml.safe_load((root / "prefect.yaml").read_text())["deployments"]}
    for name in stages():
        module, fn = flows()[name]
        assert f"{module}:{fn}" in entries, name


def test_trained_model_encodes_as_a_system_of_its_own(world: dict, tmp_path: Path) -> None:
    """The saved folder loads by path: encoding it registers a system apart from the base model's."""
    w = copy_world(world, tmp_path)
    model = Path(w["root"]) / "models" / "model=tiny-ft"
    assert (model / "config.json").exists() and (model / "loss.png").stat().st_size > 0
    cfg = w["configs"]["encode"].model_copy(update={"backbone": BackboneConfig(model=str(model)), "k": [1]})
    execute(stages()["tokenize"], cfg.tokenize_config(), log=lambda _: None)
    res = execute(stages()["encode"], cfg, log=lambda _: None)
    assert res.done > 0
    base = find_system(ArtifactStore(w["root"]), SystemRef(model=str(w["model"]))).system
    assert res.system != base


def test_lora_adapter_is_saved_alone_and_encodes_as_its_own_system(world: dict, tmp_path: Path) -> None:
    """LoRA saves the peft adapter (not the weights); the folder alone as --model, or --model BASE --adapter
    FOLDER, encodes the same vectors as the merged weights, as systems apart from the base; on another base
    the adapter is refused, naming both."""
    w = copy_world(world, tmp_path)
    lora = TRAIN.model_copy(update={"adapter": "lora", "lr": 5e-2, "max_steps": 2})
    execute(
        stages()["train"],
        w["configs"]["train"].model_copy(update={"name": "tiny-lora", "settings": lora}),
        log=lambda _: None,
    )
    adapter = Path(w["root"]) / "models" / "model=tiny-lora"
    assert (adapter / "adapter_model.safetensors").exists() and not (adapter / "config.json").exists()
    base_cfg = BackboneConfig(model=str(w["model"]))
    ways = {
        "folder": BackboneConfig(model=str(adapter)),
        "explicit": BackboneConfig(model=str(w["model"]), adapter=str(adapter)),
        "merged": BackboneConfig(model=str(w["model"]), adapter=str(adapter), merge_adapter=True),
        "base": base_cfg,
    }
    dense, systems = {}, {}
    for key, bb in ways.items():
        cfg = w["configs"]["encode"].model_copy(update={"backbone": bb, "k": [2]})
        execute(stages()["tokenize"], cfg.tokenize_config(), log=lambda _: None)
        systems[key] = execute(stages()["encode"], cfg, log=lambda _: None).system
        reader = make_reader(load_backbone(bb), ReadoutConfig(), 96)
        dense[key] = reader.encode([[5, 6, 7, 8]], ["cats purr"], "passage", 2)[0].dense.astype("float32")
    assert len(set(systems.values())) == 4 and systems["folder"].startswith("model-tiny-lora-")
    assert np.array_equal(dense["folder"], dense["explicit"])
    assert np.allclose(dense["merged"], dense["explicit"], atol=2e-3)
    assert not np.allclose(dense["base"], dense["explicit"], atol=1e-2)  # the adapter changed the model
    other = save_tiny_mlm(tmp_path / "other", seed=1)
    with pytest.raises(BackboneError, match=f"trained on '.*model', not on '{other}'"):
        load_backbone(BackboneConfig(model=str(other), adapter=str(adapter)))
    with pytest.raises(BackboneError, match="no adapter_config.json"):
        load_backbone(BackboneConfig(model=str(w["model"]), adapter=str(w["model"])))
