"""Released checkpoints' layout (retrieval/models/released.py), read without loading a model: the trained budget,
the prompt ids, the base, the errors; and where the settings take them (encode's budgets, run's grid, the slug)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffret.retrieval.models.backbones import BackboneConfig, BackboneError, with_adapter
from diffret.retrieval.models.released import MODEL_TYPES, ReleasedError, read_released

IDS = {"query_prefix_ids": [1, 2], "query_suffix_ids": [3], "passage_prefix_ids": [4], "passage_suffix_ids": [5, 6]}


def released(folder: Path, base: str, **cfg: object) -> Path:
    """A folder in the released layout (the adapter's tensors are never read here)."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "peft_type": "LORA"}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    settings = {
        "model_type": "dream",
        "mask_token_id": 151666,
        "max_length": 512,
        "n_gen_tokens": 4,
        "n_gen_q_tokens": 4,
        "n_gen_p_tokens": 16,
        "num_denoise_steps": 1,
        "n_tail": 3,
        **IDS,
        **cfg,
    }
    (folder / "retriever_config.json").write_text(json.dumps(settings))
    return folder


def test_the_settings_the_checkpoint_fixes(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    ckpt = read_released(str(released(tmp_path / "ft", str(base))))
    assert (ckpt.kq, ckpt.kp, ckpt.budget("query"), ckpt.budget("passage")) == (4, 16, 4, 16)
    assert ckpt.prefix == {"query": (1, 2), "passage": (4,)} and ckpt.suffix["passage"] == (5, 6)
    assert ckpt.family == "dream" and ckpt.base == str(base.resolve()) and ckpt.n_tail == 3


def test_the_base_is_the_familys_hub_model_when_the_recorded_path_is_not_here(tmp_path):
    gone = released(tmp_path / "a", "/cluster/scratch/Dream-v0-Instruct-7B", model_type="llada1")
    hub = released(tmp_path / "b", "GSAI-ML/LLaDA-1.5", model_type="llada15")
    assert read_released(str(gone)).base == MODEL_TYPES["llada1"][1]
    assert read_released(str(hub)).base == "GSAI-ML/LLaDA-1.5"
    cfg = with_adapter(BackboneConfig(model=str(gone)))
    assert (cfg.model, cfg.adapter) == (MODEL_TYPES["llada1"][1], str(gone.resolve()))


def test_a_symmetric_checkpoint_and_its_legacy_keys(tmp_path):
    ckpt = read_released(
        str(released(tmp_path / "ft", "org/base", n_gen_q_tokens=None, n_gen_p_tokens=None, n_gen_tokens=1))
    )
    assert (ckpt.kq, ckpt.kp) == (1, 1)


@pytest.mark.parametrize(
    ("cfg", "says"),
    [
        ({"model_type": "llada2"}, "model_type 'llada2'"),
        ({"use_k_adapter": True}, "use_k_adapter"),
        ({"query_prefix_ids": "abc"}, "query_prefix_ids must be a list"),
        ({"n_gen_q_tokens": 0, "n_gen_tokens": 0}, "n_gen_q_tokens"),
    ],
)
def test_a_broken_retriever_config_is_one_line_naming_the_file(tmp_path, cfg, says):
    folder = released(tmp_path / "ft", "org/base", **cfg)
    with pytest.raises(ReleasedError, match="retriever_config.json") as err:
        read_released(str(folder))
    assert says in str(err.value)
    with pytest.raises(BackboneError, match=says):  # through the loader too
        with_adapter(BackboneConfig(model=str(folder)))


def test_other_models_are_not_released_checkpoints(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    (plain / "retriever_config.json").write_text("{}")  # a full reference checkpoint: its own config.json
    assert read_released(str(plain)) is None and read_released("org/some-base") is None


def test_encode_and_run_take_the_trained_budget_and_prompt(tmp_path):
    from diffret.stages.encode import EncodeConfig
    from diffret.stages.pipeline import PipelineConfig
    from diffret.stages.systems import EncodeSettings, encoder_slug

    folder = str(released(tmp_path / "ft", "org/base"))
    enc = EncodeConfig(dataset="d", backbone={"model": folder})
    assert enc.budgets("query") == [4] and enc.budgets("passage") == [16]
    assert EncodeConfig(dataset="d", backbone={"model": folder}, k=[1]).budgets("passage") == [1]
    run = PipelineConfig(dataset="d", backbone={"model": folder})
    assert (run.kq, run.kp) == ([4], [16])
    (enc_run,) = run.encodes()  # one encode, each side at its own trained budget
    assert enc_run.budgets("query") == [4] and enc_run.budgets("passage") == [16]
    assert PipelineConfig(dataset="d", backbone={"model": folder}, kq=[1], kp=[1]).kq == [1]
    s = EncodeSettings(backbone={"model": folder})
    assert (s.readout.prompt, s.readout.finetuned) == ("checkpoint", "yes")
    assert EncodeSettings(backbone={"model": folder}, readout={"prompt": "few_words"}).readout.prompt == "few_words"
    assert encoder_slug(s).startswith("ft-diffretriever-")
    with pytest.raises(ValueError, match="released checkpoint"):
        EncodeSettings(backbone={"model": "org/base"}, readout={"prompt": "checkpoint"})


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """The hub offline (HF_HUB_OFFLINE=1) with an empty hub cache, in this process."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


def test_offline_a_released_hub_id_is_planned_saying_what_is_assumed_and_run_refuses(offline, tmp_path):
    """A released checkpoint named by hub id, offline with nothing cached: its trained K and prompt cannot be read.
    The dry run plans on the defaults and says so (stderr); the run refuses in one line before anything is done."""
    from typer.testing import CliRunner

    from diffret.flows.cli import app

    model = ["--model", "ielabgroup/diffretriever-llada-8b-single"]
    plan = CliRunner().invoke(app, ["run", "-d", "beir/nq", *model, "--dry-run"], env={"COLUMNS": "300"})
    assert plan.exit_code == 0, plan.output
    assert "cannot read the settings of 'ielabgroup/diffretriever-llada-8b-single'" in plan.stderr, plan.stderr
    assert "HF_HUB_OFFLINE is set" in plan.stderr and "This plan assumes it is not a released checkpoint" in plan.stderr
    assert '"kq": [1, 2, 4, 8, 16]' in plan.stdout and plan.stdout.startswith("download")  # the plan, on stdout
    run = CliRunner().invoke(
        app, ["run", "-d", "beir/nq", *model, "--root", str(tmp_path / "store")], env={"COLUMNS": "300"}
    )
    lines = [ln for ln in run.output.splitlines() if ln.strip()]
    assert run.exit_code == 2 and len(lines) == 1, run.output
    assert "cannot read the settings of 'ielabgroup/diffretriever-llada-8b-single'" in lines[0]
    assert "retriever_config.json" in lines[0] and "--model" in lines[0], lines[0]
    assert not (tmp_path / "store").exists()


def test_unreadable_settings_are_an_error_and_other_hub_ids_are_not_asked(offline):
    from diffret.retrieval.models.released import ReleasedUnreadable, assume_unreadable_not_released

    with pytest.raises(ReleasedUnreadable, match="HF_HUB_OFFLINE is set"):
        read_released("someone/diffretriever-test-not-cached")
    with pytest.raises(BackboneError, match="cannot read the settings"):  # through the loader: one clear line
        with_adapter(BackboneConfig(model="someone/diffretriever-test-not-cached"))
    with assume_unreadable_not_released() as unread:  # a plan that writes nothing: assumed, and said
        assert read_released("someone/diffretriever-test-not-cached") is None
    assert len(unread) == 1 and "someone/diffretriever-test-not-cached" in unread[0]
    assert read_released("org/some-base") is None  # not named like a released one, not cached: no hub asked


@pytest.mark.parametrize(
    ("recorded", "base"),
    [
        ("/cluster/scratch/Dream-v0-Instruct-7B", MODEL_TYPES["dream"][1]),  # a training machine's path: the family's
        ("nosuch-org/nosuch-base", "nosuch-org/nosuch-base"),  # a hub id it records
    ],
)
def test_a_released_folder_whose_base_is_missing_names_the_base_and_where_it_was_looked_for(
    tmp_path, offline, recorded, base
):
    from diffret.retrieval.models.backbones import raw_config

    folder = released(tmp_path / "ft", recorded)
    with pytest.raises(BackboneError) as err:
        raw_config(BackboneConfig(model=str(folder)))
    says = str(err.value)
    assert f"cannot load the base model {base!r} of {folder.resolve()}" in says, says
    assert "HF_HUB_OFFLINE is set" in says and f"--adapter {folder.resolve()}" in says, says
    if recorded != base:  # a recorded path not on this machine is named beside the hub id used instead
        assert f"records the base {recorded!r}, not a folder on this machine" in says, says


def test_a_released_checkpoint_given_as_adapter_runs_at_its_trained_budget(tmp_path):
    from diffret.stages.pipeline import PipelineConfig

    base = tmp_path / "base"
    base.mkdir()
    folder = str(released(tmp_path / "ft", str(base)))
    run = PipelineConfig(dataset="d", backbone={"model": str(base), "adapter": folder})
    assert (run.kq, run.kp) == ([4], [16])
