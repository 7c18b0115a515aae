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
    settings = {"model_type": "dream", "mask_token_id": 151666, "max_length": 512, "n_gen_tokens": 4,
                "n_gen_q_tokens": 4, "n_gen_p_tokens": 16, "num_denoise_steps": 1, "n_tail": 3, **IDS, **cfg}
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
    ckpt = read_released(str(released(tmp_path / "ft", "org/base", n_gen_q_tokens=None, n_gen_p_tokens=None,
                                      n_gen_tokens=1)))  # fmt: skip
    assert (ckpt.kq, ckpt.kp) == (1, 1)


@pytest.mark.parametrize(("cfg", "says"), [
    ({"model_type": "llada2"}, "model_type 'llada2'"),
    ({"use_k_adapter": True}, "use_k_adapter"),
    ({"query_prefix_ids": "abc"}, "query_prefix_ids must be a list"),
    ({"n_gen_q_tokens": 0, "n_gen_tokens": 0}, "n_gen_q_tokens"),
])  # fmt: skip
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
