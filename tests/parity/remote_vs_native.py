"""Run under transformers 4.x (where the checkpoints' own code runs): encode the same texts through the native and
the remote loader and print, per family, the smallest dense cosine and whether the sparse term sets agree.

    PYTHONPATH=<transformers 4.57 install>:<repo> python tests/parity/remote_vs_native.py <shared>

Batch size 1: LLaDA's original remote code ignores the attention mask, so padded batches would differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import transformers

from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader


def main(shared: Path) -> None:
    out: dict[str, object] = {"transformers": transformers.__version__}
    texts = [
        json.loads(line)["text"]
        for line in (shared / "fixtures/reference-parity/scifact-mini/queries.jsonl").read_text().splitlines()[:8]
    ]
    for family in ("dream", "llada"):
        model = str(shared / "models" / f"tiny-{family}-random")
        encs = {}
        for loader in ("native", "remote"):
            bb = load_backbone(BackboneConfig(model=model, loader=loader, trust_remote_code=loader == "remote"))
            reader = make_reader(bb, ReadoutConfig(), 512)
            toks = [bb.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            encs[loader] = [reader.encode([tk], [tx], "query", 4)[0] for tk, tx in zip(toks, texts, strict=True)]
        cos, same_sparse = 1.0, True
        for a, b in zip(encs["native"], encs["remote"], strict=True):
            x, y = a.dense.astype(np.float64), b.dense.astype(np.float64)
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            y /= np.linalg.norm(y, axis=1, keepdims=True)
            cos = min(cos, float((x * y).sum(1).min()) if x.shape == y.shape else -1.0)
            same_sparse &= set(a.sparse_ids.tolist()) == set(b.sparse_ids.tolist())
        out[family] = {"min_cos": cos, "same_sparse": same_sparse}
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
