"""Run under transformers 4.x: a released-layout checkpoint encoded the reference's way, for diffret's to compare.

    PYTHONPATH=<transformers 4.57 install>:<repo> python tests/parity/released_reference.py FOLDER TEXTS.json OUT.npz

With ``DIFFRET_REFERENCE_SRC`` (a checkout of ielab/diffretriever's ``src/``), the reference's own code runs:
``TrainableDiffusionRetriever.load(FOLDER)`` (its released-adapter path: the base from the family's hub id, here
pointed at the tiny base; float32 instead of its bfloat16, so that the comparison measures loading, not rounding),
``tokenize`` and ``encode``, and its content filter. Without it, the same path step by step: the checkpoint's own
remote code, ``PeftModel.from_pretrained`` on it, merged; the input ids from ``retriever_config.json`` (prefix, text
cut at ``max_length`` - prompt, suffix, K masks, the tail); the hidden states and log(1 + ReLU(logits)) at the
masks. Either way the sparse side is each slot's top 256 over the text's content words, x100 rounded (encode.py's
trained path), max-pooled over the slots. One text per batch: LLaDA's original remote code ignores padding.

TEXTS.json: {"query": [...], "passage": [...]}. Writes OUT.npz: per side, ``<side>_dense`` [N, K, H] and for each
text ``<side>_ids_i`` / ``<side>_vals_i`` (its pooled sparse vector).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import torch

MAX_LENGTH = 256  # encode.py's --max_length from run_encode.sh (the trained path overrides the stored one with it)
TOPK = 256


def _reference_module(src: Path):  # noqa: ANN202
    """The reference's models package without its __init__ (which imports every retriever)."""
    pkg = types.ModuleType("refmodels")
    pkg.__path__ = [str(src / "models")]
    sys.modules["refmodels"] = pkg
    import importlib

    return (
        importlib.import_module("refmodels.diffretriever_trainable"),
        importlib.import_module("refmodels.backbone_adapters"),
        importlib.import_module("refmodels.sparse_utils"),
    )


def _pool(ids: torch.Tensor, vals: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    out: dict[int, float] = {}
    for i, v in zip(ids.reshape(-1).tolist(), vals.reshape(-1).tolist(), strict=True):
        if v > 0:
            out[i] = max(out.get(i, 0.0), v)
    keys = sorted(out)
    return np.asarray(keys, np.int64), np.asarray([out[k] for k in keys], np.float32)


def with_reference_code(folder: Path, base: str, side: str, texts: list[str], src: Path) -> tuple[list, list]:
    trainable, adapters, sparse_utils = _reference_module(src)

    def load_backbone(self, source, device_map=None):  # noqa: ANN001, ANN202 - float32, no flash-attention tries
        return self._auto_class().from_pretrained(source, trust_remote_code=True, torch_dtype=torch.float32)

    for cls in adapters.ADAPTER_REGISTRY.values():
        cls.hub_model_name = base
        cls.load_backbone = load_backbone
    model = trainable.TrainableDiffusionRetriever.load(str(folder))
    if model.model_type.startswith("llada"):
        # load() registers its hidden-state hook on the LoRA-wrapped head (the LLaDA targets' ff_out matches it)
        # and then merges the adapter, which drops that wrapper: its encode would read the logits as the dense
        # vectors ([K, V]). The hook, registered again on the merged model, reads what the reference means (the
        # final hidden states, the head's input). docs/results.md notes this.
        model._last_hidden = {}
        model._hook_registered = model.adapter.register_hidden_hook(model.backbone, model._last_hidden)
    model.max_length = MAX_LENGTH
    model.eval()
    dense, sparse = [], []
    with torch.inference_mode():
        for text in texts:
            ids, mask = model.tokenize([text], is_query=side == "query")
            res = model.encode(ids, mask, is_query=side == "query", compute_sparse=True)
            content = sparse_utils.get_content_token_ids([text], model.tokenizer)[0]
            per = res.get("sparse_acts_per_pos")
            per = per if per is not None else res["sparse_acts"][:, None, :]
            keep = torch.zeros(per.shape[-1], dtype=per.dtype)
            keep[list(content)] = 1.0
            vals, idx = (per * keep).topk(TOPK, dim=-1)
            sparse.append(_pool(idx, (vals.float() * 100).round()))
            dense.append(res["repr_hidden"][0].float().numpy())
    return dense, sparse


def step_by_step(folder: Path, base: str, side: str, texts: list[str]) -> tuple[list, list]:
    from peft import PeftModel
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from diffret.retrieval.models.backbones import bidirectional_mask
    from diffret.retrieval.models.sparse import make_filter

    cfg = json.loads((folder / "retriever_config.json").read_text())
    llada = cfg["model_type"].startswith("llada")
    auto = AutoModelForCausalLM if llada else AutoModel
    model = auto.from_pretrained(base, trust_remote_code=True, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload().eval()
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    k = cfg["n_gen_q_tokens"] if side == "query" else cfg["n_gen_p_tokens"]
    prefix, suffix = cfg[f"{side}_prefix_ids"], cfg[f"{side}_suffix_ids"]
    quote = tok.encode('"', add_special_tokens=False)
    eot = next(
        t
        for t in (tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|eot_id|>"))
        if t is not None and t != tok.unk_token_id and t != tok.eos_token_id
    )
    tail = ([quote[0]] if len(quote) == 1 else [tok.eos_token_id]) + [eot, tok.eos_token_id]
    tail = tail[: cfg["n_tail"]]
    head = model.lm_head if not llada else model.model.transformer.ff_out
    grabbed: dict[str, torch.Tensor] = {}
    head.register_forward_hook(lambda m, inp, out: grabbed.update(h=inp[0]))
    filt = make_filter(tok, "nltk")
    dense, sparse = [], []
    with torch.inference_mode():
        for text in texts:
            words = tok(
                text, add_special_tokens=False, truncation=True, max_length=MAX_LENGTH - len(prefix) - len(suffix)
            )["input_ids"]
            ids = torch.tensor([prefix + words + suffix + [cfg["mask_token_id"]] * k + tail])
            att = torch.ones_like(ids)
            mask = att if llada else bidirectional_mask(att, torch.float32)
            logits = model(input_ids=ids, attention_mask=mask).logits
            start = ids.shape[1] - k - len(tail)
            h = grabbed["h"][0, start : start + k]
            per = torch.log1p(torch.relu(logits[0, start : start + k]))
            keep = torch.zeros(per.shape[-1])
            keep[filt.allowed_ids(text)] = 1.0
            vals, idx = (per * keep).topk(TOPK, dim=-1)
            sparse.append(_pool(idx, (vals * 100).round()))
            dense.append(torch.nn.functional.normalize(h, dim=-1).numpy())
    return dense, sparse


def main(folder: Path, texts_file: Path, out: Path) -> None:
    import transformers

    texts = json.loads(texts_file.read_text())
    base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    src = os.environ.get("DIFFRET_REFERENCE_SRC")
    arrays = {}
    for side in ("query", "passage"):
        if src:
            dense, sparse = with_reference_code(folder, base, side, texts[side], Path(src))
        else:
            dense, sparse = step_by_step(folder, base, side, texts[side])
        arrays[f"{side}_dense"] = np.stack(dense)
        for i, (ids, vals) in enumerate(sparse):
            arrays[f"{side}_ids_{i}"], arrays[f"{side}_vals_{i}"] = ids, vals
    np.savez(out, **arrays)
    print(json.dumps({"transformers": transformers.__version__, "reference_code": bool(src)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
