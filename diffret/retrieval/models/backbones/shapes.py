"""Published model shapes for random weights (``BackboneConfig.load_format="random"``, ``shape``): a family's full
config.json without its checkpoint, so that a 7-8B network can be built on a GPU in seconds, with no weight file, to
measure what does not depend on the weights (throughput, memory, the stages' plumbing at full width).

Each preset is the published ``config.json`` of the checkpoint it names (the fields a loader reads; ``auto_map``,
``_name_or_path`` and ``transformers_version`` left out); the tokenizer and special tokens come from ``--model``, a
folder of the same family (the tiny shared checkpoints hold the real tokenizers). ``NAME:key=value,...`` changes
fields of a preset (a scaled-down network of the same family: ``dream-7b:num_hidden_layers=2``).
"""

from __future__ import annotations

import json
from typing import Any

from .errors import BackboneError

# Dream-org/Dream-v0-Instruct-7B, config.json on the Hugging Face hub (Qwen2.5-7B's network: 28 layers of width
# 3,584, 28 query / 4 key-value heads, MLP 18,944, an untied 152,064-row head; 7.62e9 parameters). Its fields other than
# the sizes are those of ../shared/models/tiny-dream-random/config.json, which is that file with the sizes changed.
DREAM_7B: dict[str, Any] = {
    "architectures": ["DreamModel"],
    "model_type": "Dream",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "pad_token_id": 151643,
    "mask_token_id": 151666,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_window_layers": 28,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 152064,
}

# GSAI-ML/LLaDA-8B-Instruct, config.json on the Hugging Face hub (an OLMo-style llama block: 32 layers of width
# 4,096, 32 heads without grouping, MLP 12,288, an untied 126,464-row head; 8.02e9 parameters). Its fields other
# than the sizes are those of ../shared/models/tiny-llada-random/config.json.
LLADA_8B: dict[str, Any] = {
    "architectures": ["LLaDAModelLM"],
    "model_type": "llada",
    "activation_type": "silu",
    "alibi": False,
    "alibi_bias_max": 8.0,
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "d_model": 4096,
    "embedding_dropout": 0.0,
    "embedding_size": 126464,
    "eos_token_id": 126081,
    "flash_attention": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "init_cutoff_factor": None,
    "init_device": "meta",
    "init_fn": "mitchell",
    "init_std": 0.02,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "mask_token_id": 126336,
    "max_sequence_length": 4096,
    "mlp_hidden_size": 12288,
    "mlp_ratio": 4,
    "multi_query_attention": None,
    "n_heads": 32,
    "n_kv_heads": 32,
    "n_layers": 32,
    "pad_token_id": 126081,
    "precision": "amp_bf16",
    "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope": True,
    "rope_full_precision": True,
    "rope_theta": 500000.0,
    "scale_logits": False,
    "use_cache": False,
    "vocab_size": 126464,
    "weight_tying": False,
    "torch_dtype": "bfloat16",
}

SHAPES: dict[str, dict[str, Any]] = {"dream-7b": DREAM_7B, "llada-8b": LLADA_8B}


def split_shape(shape: str) -> tuple[str, dict[str, Any]]:
    """(preset name, changed fields) of a ``shape`` value ``NAME[:key=value,...]`` (values read as JSON).

    >>> split_shape("dream-7b:num_hidden_layers=2,rope_theta=10000.0")
    ('dream-7b', {'num_hidden_layers': 2, 'rope_theta': 10000.0})
    """
    name, _, rest = shape.partition(":")
    changes: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise BackboneError(f"shape {shape!r}: {item!r} is not key=value (e.g. dream-7b:num_hidden_layers=2)")
        try:
            changes[key.strip()] = json.loads(value)
        except ValueError:
            raise BackboneError(
                f"shape {shape!r}: the value of {key.strip()!r} is not a number, true/false or null ({value!r})"
            ) from None
    return name.strip(), changes


def shape_config(shape: str) -> dict[str, Any]:
    """The config.json (a dict) of a ``shape`` value: a preset of :data:`SHAPES`, its named fields changed.

    >>> cfg = shape_config("llada-8b:n_layers=2")
    >>> cfg["d_model"], cfg["n_layers"], shape_config("llada-8b")["n_layers"]
    (4096, 2, 32)
    """
    name, changes = split_shape(shape)
    if name not in SHAPES:
        raise BackboneError(f"unknown shape {name!r}; the presets: {', '.join(SHAPES)}")
    unknown = sorted(set(changes) - set(SHAPES[name]))
    if unknown:
        raise BackboneError(
            f"shape {shape!r}: {name} has no field {unknown[0]!r} (its fields: {', '.join(sorted(SHAPES[name]))})"
        )
    return {**SHAPES[name], **changes}
