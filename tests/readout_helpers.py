"""Helpers of the readout tests (tests/unit/test_readouts*.py): encoding a few texts, comparing encodings."""

from __future__ import annotations

import numpy as np
import torch
from tiny_models import ARCHS, CAUSAL_ARCHS

from diffret.retrieval.models.backbones import (
    Backbone,
)
from diffret.retrieval.models.readouts import Encoded, Readout, ReadoutConfig, make_reader

MLM_ARCHS = tuple(a for a in ARCHS if a not in CAUSAL_ARCHS)
SIDES = ("left", "right")


def ids_of(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def encode(
    bb: Backbone, texts: list[str], k: int = 4, side: str = "query", max_length: int = 256, **cfg
) -> list[Encoded]:
    reader = make_reader(bb, ReadoutConfig(**cfg), max_length)
    return reader.encode([ids_of(bb.tokenizer, t) for t in texts], texts, side, k)


def sparse_dict(e: Encoded) -> dict[int, float]:
    return dict(zip(e.sparse_ids.tolist(), e.sparse_weights.tolist(), strict=True))


def assert_same_encoding(a: Encoded, b: Encoded, atol: float = 1e-2, rtol: float = 1e-3) -> None:
    assert a.dense.shape == b.dense.shape
    np.testing.assert_allclose(a.dense.astype(np.float32), b.dense.astype(np.float32), atol=atol)
    if a.sparse_ids is None:
        assert b.sparse_ids is None
        return
    da, db = sparse_dict(a), sparse_dict(b)
    for i in set(da) | set(db):  # a weight at the zero threshold may be kept on one side only
        np.testing.assert_allclose(da.get(i, 0.0), db.get(i, 0.0), rtol=rtol, atol=1e-5, err_msg=f"vocab id {i}")
    strong = [i for i, w in da.items() if w > 1e-3]
    assert set(strong) <= set(db)


def no_quote_head(reader: Readout):
    """A head that never predicts a quote token (so PromptReps runs to its cap)."""
    head = reader.bb.head
    quote = sorted(reader.stop_tokens())

    def patched(h: torch.Tensor) -> torch.Tensor:
        out = head(h).clone()
        out[..., quote] = -1e4
        return out

    return patched
