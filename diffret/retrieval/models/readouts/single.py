"""The single-vector readouts: DiffEmbed (the mean of the last hidden states) and RepLLaMA (the final EOS)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..prompts import special_wrapping
from .base import (
    Encoded,
    Prepared,
    Readout,
    TrainReps,
    all_real,
    pad_rows,
    to_float16,
)


class _SingleVector(
    Readout,
    multi_vector=False,
    has_sparse=False,
    uses_prompt=False,
    k_values="1",
    k_meaning="always 1: one vector per text",
):
    """A readout with one dense vector per text and no prompt (K must be 1)."""

    def _one(self, k: int) -> None:
        if k > 1:
            raise ValueError(f"the {self.name} readout has one vector per text; use K = 1 (got {k})")

    def prepare(
        self, token_ids: list[list[int]], texts: Sequence[str | Sequence[int]] | None, side: str, k: int
    ) -> Prepared:
        self._one(k)
        return super().prepare(token_ids, texts, side, k)

    def _encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        rows, h = self._vectors(token_ids, side, texts)
        dense = to_float16(h)  # the batch's vectors in one copy to the host
        return [Encoded(dense[i : i + 1], n_tokens=len(rows[i])) for i in range(len(rows))]

    def _vectors(
        self, token_ids: list[list[int]], side: str = "query", texts: list[str] | None = None
    ) -> tuple[list[list[int]], torch.Tensor]:
        """(input rows, one vector per text [B, H])."""
        raise NotImplementedError

    def train_forward(self, token_ids: list[list[int]], side: str, k: int, texts: list[str] | None = None) -> TrainReps:
        """With gradients: the one vector per text (no sparse side); ``texts``: the texts of ``token_ids`` (RepLLaMA
        tokenizes its prefix with them)."""
        self._one(k)
        _, h = self._vectors(self._fit(token_ids, side, k), side, texts)
        return TrainReps(h[:, None], all_real(h[:, None]))


class DiffEmbedReadout(_SingleVector, name="diffembed", needs_causal_lm=False):
    """DiffEmbed: the mean of the last hidden states over the text and its special tokens (no prompt),
    bidirectional."""

    def _vectors(
        self, token_ids: list[list[int]], side: str = "query", texts: list[str] | None = None
    ) -> tuple[list[list[int]], torch.Tensor]:
        head, tail = special_wrapping(self.bb.tokenizer)
        rows = [head + list(t) + tail for t in token_ids]
        ids, att, _ = pad_rows(rows, self.bb.pad_id, self.cfg.padding_side, self.bb.device)
        hidden = self.bb.hidden_states(ids, att, bidirectional=True).float()
        m = att[..., None].float()
        return rows, (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


class RepLlamaReadout(_SingleVector, name="repllama", needs_causal_lm=True):
    """RepLLaMA: the hidden state of the final EOS after ``query: `` / ``passage: `` (causal attention). The prefix
    and the text are tokenized as one string (repllama.py L194-209; ``repllama_prefix`` ``separate``: the prefix's
    ids before the text's)."""

    def _prefix(self, side: str) -> list[int]:
        return list(self.bb.tokenizer(f"{side}: ", add_special_tokens=False)["input_ids"])

    def overhead(self, side: str, k: int) -> tuple[int, int]:
        counted, extra = super().overhead(side, k)
        eos = 1 if self.bb.tokenizer.eos_token_id is not None else 0
        return counted + len(self._prefix(side)) + eos, extra

    def _vectors(
        self, token_ids: list[list[int]], side: str = "query", texts: list[str] | None = None
    ) -> tuple[list[list[int]], torch.Tensor]:
        tok = self.bb.tokenizer
        prefix = self._prefix(side)
        head, _ = special_wrapping(tok)
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        if self.cfg.repllama_prefix == "joined" and texts is not None:  # as many tokens as prefix + (cut) text
            joined = tok([f"{side}: {t}" for t in texts], add_special_tokens=False)["input_ids"]
            body = [list(j[: len(prefix) + len(t)]) for j, t in zip(joined, token_ids, strict=True)]
        else:
            body = [prefix + list(t) for t in token_ids]
        rows = [head + b + eos for b in body]
        ids, att, offs = pad_rows(rows, self.bb.pad_id, self.cfg.padding_side, self.bb.device)
        hidden = self.bb.hidden_states(ids, att, bidirectional=False)
        last = torch.as_tensor([o + len(r) - 1 for o, r in zip(offs, rows, strict=True)], device=ids.device)
        return rows, hidden[torch.arange(len(rows), device=ids.device), last]
