"""Readouts: token ids of a text -> dense vectors [n, H] (+ sparse vocabulary weights).

- ``diffretriever`` (paper §3.2, eq. 1-2): prompt + text + K masks + tail, ONE bidirectional forward
  pass (S = 1); the hidden states at the K mask positions are the dense multi-vector, the logits there the
  sparse vector. As the reference encoder does, the argmax token of every slot is read and the slots from
  the first special token on are dropped (``stop_cut``). ``denoise_steps`` S > 1 unmasks by confidence
  (negative entropy) on the reference's schedule over S passes (appendix A.1), each slot's hidden state and
  logits frozen at the step that reveals it.
- ``promptreps``: greedy decoding after the assistant prefix with a KV cache, at most K (the cap N) slots:
  the hidden state at the opening quote, then at each generated token; it stops at the closing quote.
- ``diffembed``: mean of the last hidden states over the text (no prompt), bidirectional.
- ``repllama``: hidden state of the final EOS after ``query: `` / ``passage: `` (causal).
- ``sidr``: SIDR's V_theta: a vocabulary score per position (the official head or the model's LM head), elu1p or
  log(1 + ReLU), max-pooled over the text's positions, top 768 (the sparse vector; the dense one is the mean).

The reference encoder's behaviour is the default; every other choice is a named setting of ``ReadoutConfig``
(docs/ARCHITECTURE.md, parity table). One module a readout (``diffretriever``, ``promptreps``, ``single``,
``sidr``) over ``base`` and ``config``; ``READOUTS`` here is the registry, and every public name is importable from
this package (a private helper from the module that defines it).
"""

from __future__ import annotations

from typing import get_args

from ..backbones import Backbone
from .base import (
    DEFAULT_MAX_LENGTH,
    HEAD_CHUNK_BYTES,
    SIDR_BLOCK_BYTES,
    Encoded,
    HostCopy,
    Pending,
    Prepared,
    Readout,
    TrainReps,
)
from .config import SIDR_ONLY, SIDR_TOPK, ReadoutConfig, ReadoutName
from .diffretriever import DiffRetrieverReadout
from .promptreps import PromptRepsReadout
from .sidr import SidrReadout
from .single import DiffEmbedReadout, RepLlamaReadout

__all__ = [
    "ReadoutName",
    "SIDR_TOPK",
    "SIDR_ONLY",
    "ReadoutConfig",
    "DEFAULT_MAX_LENGTH",
    "Encoded",
    "HostCopy",
    "Pending",
    "TrainReps",
    "Prepared",
    "HEAD_CHUNK_BYTES",
    "SIDR_BLOCK_BYTES",
    "Readout",
    "DiffRetrieverReadout",
    "PromptRepsReadout",
    "DiffEmbedReadout",
    "RepLlamaReadout",
    "SidrReadout",
    "READOUTS",
    "readout_class",
    "sparse_quantised",
    "make_reader",
]

READOUTS: dict[str, type[Readout]] = {
    cls.name: cls for cls in (DiffRetrieverReadout, PromptRepsReadout, DiffEmbedReadout, RepLlamaReadout, SidrReadout)
}
assert set(get_args(ReadoutName)) == set(READOUTS)  # the config's choices are the registry's


def readout_class(name: str) -> type[Readout]:
    """The registered readout called ``name`` (ValueError listing the known ones)."""
    try:
        return READOUTS[name]
    except KeyError:
        raise ValueError(f"unknown readout {name!r}; expected one of {', '.join(READOUTS)}") from None


def sparse_quantised(readout: str | None, settings: dict | None) -> bool:
    """Whether a system's stored sparse weights are multiples of 0.01 (the reference stores them as x100
    integers): ``sparse_quantise`` truncate or round. Zero-shot PromptReps' are stored unscaled, as the reference's.

    >>> sparse_quantised("diffretriever", {}), sparse_quantised("promptreps", {"finetuned": "no"})
    (True, False)
    """
    if readout is None or not readout_class(readout).has_sparse:
        return False
    cfg = ReadoutConfig.model_validate({**(settings or {}), "readout": readout}).resolved()
    return cfg.sparse_quantise != "none"


def make_reader(backbone: Backbone, config: ReadoutConfig, max_length: int = DEFAULT_MAX_LENGTH) -> Readout:
    """The readout of ``config`` over a loaded backbone; ``max_length`` bounds each input (see ``truncation``)."""
    return readout_class(config.readout)(backbone, config, max_length)
