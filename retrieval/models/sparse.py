"""Sparse (lexical) representations from logits: max-pooled log(1 + ReLU), content-word filter, top-k."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

# English stopwords (the NLTK list), kept here so that nothing is downloaded at run time.
STOPWORDS = frozenset(
    """i me my myself we our ours ourselves you you're you've you'll you'd your yours yourself yourselves he him
    his himself she she's her hers herself it it's its itself they them their theirs themselves what which who whom
    this that that'll these those am is are was were be been being have has had having do does did doing a an the
    and but if or because as until while of at by for with about against between into through during before after
    above below to from up down in out on off over under again further then once here there when where why how all
    any both each few more most other some such no nor not only own same so than too very s t can will just don
    don't should should've now d ll m o re ve y ain aren aren't couldn couldn't didn didn't doesn doesn't hadn
    hadn't hasn hasn't haven haven't isn isn't ma mightn mightn't mustn mustn't needn needn't shan shan't shouldn
    shouldn't wasn wasn't weren weren't won won't wouldn wouldn't""".split()
)

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?", re.UNICODE)


def content_words(text: str) -> list[str]:
    """Lowercased words of ``text`` without stopwords and punctuation, in order, without repeats."""
    seen: dict[str, None] = {}
    for w in _WORD.findall(text.lower()):
        if w not in STOPWORDS and w not in seen:
            seen[w] = None
    return list(seen)


class ContentFilter:
    """Maps a text to the vocabulary ids of its content words (PromptReps' filter).

    A word contributes the ids of its tokenization both at the start of a text and after a space,
    so that BPE (``Ġword``) and WordPiece (``word``) vocabularies are both covered.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[str, tuple[int, ...]] = {}

    def word_ids(self, word: str) -> tuple[int, ...]:
        ids = self._cache.get(word)
        if ids is None:
            tok = self.tokenizer
            got = set(tok(word, add_special_tokens=False)["input_ids"])
            got |= set(tok(" " + word, add_special_tokens=False)["input_ids"])
            ids = tuple(sorted(i for i in got if i not in self.special))
            self._cache[word] = ids
        return ids

    def allowed_ids(self, text: str) -> list[int]:
        out: set[int] = set()
        for w in content_words(text):
            out.update(self.word_ids(w))
        return sorted(out)


def pooled_weights(logits: torch.Tensor) -> torch.Tensor:
    """[..., K, V] logits -> [..., V]: max over K of log(1 + ReLU(logit))."""
    return torch.log1p(torch.relu(logits.float())).amax(dim=-2)


def topk_sparse(weights: torch.Tensor, allowed: Iterable[int] | None, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the ``allowed`` vocabulary ids (None = all), drop zeros, return the top ``k`` as (ids, weights)."""
    w = weights.float()
    if allowed is not None:
        idx = torch.as_tensor(list(allowed), dtype=torch.long, device=w.device)
        if idx.numel() == 0:
            return np.zeros(0, np.int32), np.zeros(0, np.float32)
        vals = w[idx]
    else:
        idx = torch.arange(w.shape[-1], device=w.device)
        vals = w
    return topk_pairs(idx, vals, k)


def topk_pairs(idx: torch.Tensor, vals: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` heaviest positive (id, weight) pairs, heaviest first."""
    keep = vals > 0
    idx, vals = idx[keep], vals[keep]
    if vals.numel() > k:
        vals, order = torch.topk(vals, k)
        idx = idx[order]
    else:
        vals, order = torch.sort(vals, descending=True, stable=True)
        idx = idx[order]
    return idx.cpu().numpy().astype(np.int32), vals.cpu().numpy().astype(np.float32)
