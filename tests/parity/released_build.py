"""A checkpoint in the released layout (ielab/diffretriever's save code, diffretriever_trainable.py at 1689527) built on
a tiny Dream or LLaDA checkpoint: peft's ``adapter_config.json`` + ``adapter_model.safetensors`` on the checkpoint's
own module names (LLaDA: ``transformer.blocks.N.attn_out``, ...), ``retriever_config.json`` with every key the
reference writes, and the tokenizer files; no ``config.json``, no base weights.

The LoRA weights are random (seeded, lora_B non-zero), so the adapter changes every vector: a loader that drops it
gives other vectors. The prompt is another variant than diffret's default, so a loader that ignores the stored ids
does too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# native (transformers' Llama) module names -> LLaDA's own, as the reference's LoRA targets name them
_TO_LLADA = (
    (r"model.layers.{i}.self_attn.q_proj", r"model.transformer.blocks.{i}.q_proj"),
    (r"model.layers.{i}.self_attn.k_proj", r"model.transformer.blocks.{i}.k_proj"),
    (r"model.layers.{i}.self_attn.v_proj", r"model.transformer.blocks.{i}.v_proj"),
    (r"model.layers.{i}.self_attn.o_proj", r"model.transformer.blocks.{i}.attn_out"),
    (r"model.layers.{i}.mlp.gate_proj", r"model.transformer.blocks.{i}.ff_proj"),
    (r"model.layers.{i}.mlp.up_proj", r"model.transformer.blocks.{i}.up_proj"),
    (r"model.layers.{i}.mlp.down_proj", r"model.transformer.blocks.{i}.ff_out"),
)
DREAM_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LLADA_TARGETS = ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"]
SKIP = ("config.json", "model.safetensors", "weights_manifest.json", "SOURCE.md", "generation_config.json")


def _llada_name(key: str, layers: int) -> str:
    prefix = "base_model.model."
    inner = key.removeprefix(prefix)
    if inner.startswith("lm_head."):
        return prefix + "model.transformer.ff_out." + inner.removeprefix("lm_head.")
    for i in range(layers):
        for native, own in _TO_LLADA:
            a, b = native.format(i=i) + ".", own.format(i=i) + "."
            if inner.startswith(a):
                return prefix + b + inner.removeprefix(a)
    raise KeyError(key)


def build(
    base: Path, out: Path, family: str, kq: int, kp: int, prompt: str = "three_words", seed: int = 0, rank: int = 4
) -> Path:
    """Write the released layout for ``base`` (a tiny ``dream`` or ``llada`` folder) into ``out``."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file

    from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
    from diffret.retrieval.models.prompts import build_pieces, load_prompt

    out.mkdir(parents=True, exist_ok=True)
    bb = load_backbone(BackboneConfig(model=str(base), device="cpu"))
    torch.manual_seed(seed)
    native = DREAM_TARGETS + (["lm_head"] if family == "llada" else [])  # the reference's ff_out hits LLaDA's head
    peft = get_peft_model(bb.model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=native))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    state = {k: v.contiguous() for k, v in get_peft_model_state_dict(peft, save_embedding_layers=False).items()}
    if family == "llada":
        layers = bb.model.config.num_hidden_layers
        state = {_llada_name(k, layers): v for k, v in state.items()}
        cfg = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            lora_dropout=0.0,
            target_modules=LLADA_TARGETS,
            task_type="CAUSAL_LM",
            bias="none",
        )
    else:
        cfg = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            lora_dropout=0.0,
            target_modules=DREAM_TARGETS,
            task_type="FEATURE_EXTRACTION",
            bias="none",
        )
    cfg.base_model_name_or_path = str(base)
    cfg.save_pretrained(str(out))
    save_file(state, str(out / "adapter_model.safetensors"))
    tok = bb.tokenizer
    ids = {}
    for side, k in (("query", kq), ("passage", kp)):
        pieces = build_pieces(tok, load_prompt(prompt), side, k, bb.turn_end_id, use_chat_template=True)
        ids[f"{side}_prefix_ids"], ids[f"{side}_suffix_ids"] = list(pieces.prefix), list(pieces.suffix)
    options = [k for k in (1, 2, 4, 8, 16) if k <= max(kq, kp)]
    config = {
        "model_type": "dream" if family == "dream" else "llada1",
        "mask_token_id": bb.mask_id,
        "hidden_size": bb.hidden_size,
        "max_length": 512,
        "n_gen_tokens": kq,
        "n_gen_q_tokens": kq,
        "n_gen_p_tokens": kp,
        "temperature": 0.01,
        "flops_weight": 0.0,
        "num_denoise_steps": 1,
        "sparse_weight": 1.0,
        "normalize": True,
        **ids,
        "lora_rank": rank,
        "lora_alpha": 2 * rank,
        "use_eos": False,
        "n_tail": 3,
        "use_k_adapter": False,
        "adapter_weight": 1.0,
        "teacher_temperature": 1.0,
        "k_adapter_options": options,
        "use_k_pre_encoder": False,
        "gumbel_temperature": 1.0,
        "k_cost_lambda": 0.001,
        "k_pre_encoder_options": options,
    }
    (out / "retriever_config.json").write_text(json.dumps(config, indent=2))
    for f in base.iterdir():  # the tokenizer (and its code, Dream's), as tokenizer.save_pretrained leaves it
        if f.is_file() and f.name not in SKIP and not f.name.startswith(("modeling_", "configuration_")):
            shutil.copy(f, out / f.name)
    return out
