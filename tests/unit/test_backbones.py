"""Loading Dream / LLaDA: the family checks come before any HF call, and every failure is one clear paragraph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from diffret.retrieval.models.backbones import (
    FAMILIES,
    BackboneConfig,
    BackboneError,
    load_backbone,
    load_tokenizer,
    resolve_family,
)

DREAM = {
    "architectures": ["DreamModel"],
    "model_type": "Dream",
    "auto_map": {"AutoModel": "modeling_dream.DreamModel"},
    "vocab_size": 64,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
LLADA = {
    "architectures": ["LLaDAModelLM"],
    "model_type": "llada",
    "d_model": 8,
    "n_heads": 2,
    "n_layers": 1,
    "mlp_hidden_size": 16,
    "vocab_size": 64,
    "block_type": "llama",
}


def folder(tmp_path: Path, config: dict) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.fixture
def no_hf_calls(monkeypatch):
    """Any tokenizer or model load fails the test: the checks must refuse first."""

    def boom(*a, **k):
        raise AssertionError("an HF loader was called")

    for name in ("AutoTokenizer", "AutoModel", "AutoModelForCausalLM", "Qwen2ForCausalLM", "Qwen2TokenizerFast"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", boom)


def one_paragraph(msg: str, *parts: str) -> None:
    assert "\n" not in msg and "Traceback" not in msg, msg
    for p in parts:
        assert p in msg, (p, msg)


@pytest.mark.parametrize("config,family", [(DREAM, "dream"), (LLADA, "llada")])
def test_remote_without_trust_is_refused_before_any_hf_call(tmp_path, config, family, no_hf_calls):
    cfg = BackboneConfig(model=folder(tmp_path, config), loader="remote")
    for load in (load_backbone, load_tokenizer):
        with pytest.raises(BackboneError) as exc:
            load(cfg)
        one_paragraph(str(exc.value), cfg.model, "--trust-remote-code", "native loader")
    assert resolve_family(BackboneConfig(model=cfg.model)).name == family  # native: nothing to trust


@pytest.mark.parametrize("config", [DREAM, LLADA])
def test_remote_outside_its_transformers_range_is_refused(tmp_path, config, no_hf_calls):
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("this transformers runs the remote code (tests/parity/test_backbone_loading.py compares it)")
    cfg = BackboneConfig(model=folder(tmp_path, config), loader="remote", trust_remote_code=True)
    with pytest.raises(BackboneError) as exc:
        load_backbone(cfg)
    one_paragraph(str(exc.value), f"transformers {transformers.__version__}", ">=4.46,<5", "native loader")


def test_missing_model_and_missing_files(tmp_path):
    with pytest.raises(BackboneError, match="does not exist"):
        load_backbone(BackboneConfig(model=str(tmp_path / "nope")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BackboneError) as exc:
        load_backbone(BackboneConfig(model=str(empty)))
    one_paragraph(str(exc.value), str(empty), "config.json", f"transformers {transformers.__version__}")


@pytest.mark.parametrize("config,arch", [(DREAM, "DreamModel"), (LLADA, "LLaDAModelLM")])
def test_native_load_failure_names_model_architecture_and_version(tmp_path, config, arch):
    """A config without tokenizer or weights: the error names the model, its architecture and transformers."""
    path = folder(tmp_path, config)
    with pytest.raises(BackboneError) as exc:
        load_backbone(BackboneConfig(model=path))
    one_paragraph(str(exc.value), path, arch, f"transformers {transformers.__version__}", "Check")


def test_llada_features_the_native_loader_cannot_map(tmp_path):
    from diffret.retrieval.models.backbones.families import _llama_config

    with pytest.raises(BackboneError, match="loader='remote'"):
        _llama_config({**LLADA, "alibi": True})
    cfg = _llama_config(LLADA)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (8, 1, 16)


def test_family_definitions_carry_their_lora_targets():
    for name in ("dream", "llada", "causal"):
        assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= set(
            FAMILIES[name].lora_targets
        )
    assert FAMILIES["dream"].native and FAMILIES["llada"].native and FAMILIES["llada"].native.key_mapping
