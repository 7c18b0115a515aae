"""Sparse (lexical) representations from logits: log(1 + ReLU), a content-word filter, top-k, pooling over K.

Two ways to build a text's sparse vector from the logits at its K slots (``ReadoutConfig.sparse``):

- ``per_position`` (the reference encoder's for the mask readout): per slot, keep the text's content words,
  log(1 + ReLU), the top ``sparse_topk`` (128 zero-shot, 256 fine-tuned), weights x100 as integers (truncated
  zero-shot, rounded fine-tuned: ``quantise``); then the max over the K slots of every term kept anywhere, held
  as bfloat16 when K > 1 (the reference pools K > 1 shards into bfloat16).
- ``pooled`` (the reference's for fine-tuned PromptReps and S > 1): the max over the K slots of
  log(1 + ReLU(logits)) first, then the content words, then the top ``sparse_topk``, quantised the same way.

Content-word filters (``ReadoutConfig.content_filter``):

- ``nltk`` (the reference's, from PromptReps): NLTK's ``word_tokenize`` of the lowercased raw text, minus
  NLTK's English stopwords and the punctuation characters; each remaining word is tokenized alone (no leading
  space) and its token ids are allowed.
- ``regex``: words by a regex, a vendored stopword list, each word tokenized alone and after a
  space; special tokens excluded.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import multiprocessing
import os
import re
import string
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from functools import lru_cache
from typing import Any

import numpy as np
import torch

# English stopwords (an older NLTK list), for the ``regex`` filter; the ``nltk`` filter reads NLTK's own data.
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
PER_POSITION_TOPK = 128  # the reference keeps the top 128 terms of every slot (zero-shot)
QUANTISE = ("truncate", "round", "none")  # x100 integers: int() (zero-shot), round() (fine-tuned), or the floats


def quantised(vals: torch.Tensor, quantise: str) -> torch.Tensor:
    """Weights as the reference stores them, x100: ``truncate`` (zero-shot encoders), ``round`` (encode.py for
    fine-tuned models) or ``none`` (the floats, x1).

    >>> quantised(torch.tensor([0.6931, 1.0986]), "truncate").tolist()
    [69.0, 109.0]
    >>> quantised(torch.tensor([0.6951]), "round").tolist()
    [70.0]
    """
    if quantise == "truncate":
        return (vals * 100).int().float()
    if quantise == "round":
        return (vals.float() * 100).round()
    if quantise == "none":
        return vals
    raise ValueError(f"unknown sparse quantisation {quantise!r}; expected one of {', '.join(QUANTISE)}")


def content_words(text: str) -> list[str]:
    """Lowercased words of ``text`` without stopwords and punctuation, in order, without repeats (``regex``).

    >>> content_words("What do the cats do in the garden?")
    ['cats', 'garden']
    """
    seen: dict[str, None] = {}
    for w in _WORD.findall(text.lower()):
        if w not in STOPWORDS and w not in seen:
            seen[w] = None
    return list(seen)


@lru_cache(maxsize=1)
def nltk_english() -> tuple[Callable[[str], list[str]], frozenset[str]]:
    """(word_tokenize, stopwords + punctuation) from NLTK's English data.

    The data is looked up where NLTK looks (``NLTK_DATA``, ``~/nltk_data``, ...); when it is missing, NLTK's
    downloader is tried once (the reference encoder does the same), then a clear error says what to install.
    """
    import nltk

    for resource, package in (("tokenizers/punkt_tab/english/", "punkt_tab"), ("corpora/stopwords", "stopwords")):
        try:
            nltk.data.find(resource)
        except LookupError:
            try:
                nltk.download(package, quiet=True, raise_on_error=True)
                nltk.data.find(resource)
            except Exception:  # noqa: BLE001 - no network, no permission: say what to do
                raise ValueError(
                    f"NLTK's {package!r} data is not installed, and could not be downloaded. The reference content "
                    "filter needs it: run `python -m nltk.downloader punkt_tab stopwords` (or point NLTK_DATA at a "
                    "folder that has it), or encode with --content-filter regex"
                ) from None
    from nltk import word_tokenize
    from nltk.corpus import stopwords

    return word_tokenize, frozenset(stopwords.words("english")) | frozenset(string.punctuation)


class ContentFilter:
    """Maps a text to the vocabulary ids of its content words (``kind``: ``nltk`` or ``regex``, see above)."""

    def __init__(self, tokenizer: Any, kind: str = "nltk"):
        if kind not in ("nltk", "regex"):
            raise ValueError(f"unknown content filter {kind!r}; expected nltk, regex or none")
        self.tokenizer = tokenizer
        self.kind = kind
        self.special = set(getattr(tokenizer, "all_special_ids", []) or []) if kind == "regex" else set()
        self._cache: dict[str, tuple[int, ...]] = {}

    def words(self, text: str) -> list[str]:
        return filter_words(self.kind, text)

    def word_ids(self, words: list[str]) -> None:
        """Tokenize the words not seen yet (each alone; ``regex`` also after a space) into the cache."""
        new = [w for w in words if w not in self._cache]
        if not new:
            return
        tok = self.tokenizer
        alone = tok(new, add_special_tokens=False)["input_ids"]
        spaced = tok([" " + w for w in new], add_special_tokens=False)["input_ids"] if self.kind == "regex" else None
        for i, w in enumerate(new):
            got = set(alone[i]) | (set(spaced[i]) if spaced is not None else set())
            self._cache[w] = tuple(sorted(got - self.special))

    def allowed_ids(self, text: str) -> list[int]:
        """The sorted vocabulary ids of ``text``'s content words."""
        return self.allowed_many([text])[0]

    def allowed_many(self, texts: list[str], pool: Executor | None = None) -> list[list[int]]:
        """:meth:`allowed_ids` of many texts, the words none of them had seen tokenized in one call; with a
        ``pool`` (:func:`word_pool`) the texts are split into words by its processes, a chunk each.

        >>> class Tok:  # a word's id is its length
        ...     all_special_ids = []
        ...     def __call__(self, words, add_special_tokens=False):
        ...         return {"input_ids": [[len(w)] for w in words]}
        >>> ContentFilter(Tok(), "regex").allowed_many(["The cats purr.", "a garden"])  # regex: " word" too
        [[4, 5], [6, 7]]
        """
        if pool is None:
            words = [self.words(t) for t in texts]
        else:
            chunks = [texts[s : s + WORD_CHUNK] for s in range(0, len(texts), WORD_CHUNK)]
            words = [ws for part in pool.map(functools.partial(_words_of, self.kind), chunks) for ws in part]
        self.word_ids(list(dict.fromkeys(w for ws in words for w in ws)))
        out = []
        for ws in words:
            ids: set[int] = set()
            for w in ws:
                ids.update(self._cache[w])
            out.append(sorted(ids))
        return out

    def version(self) -> dict[str, str]:
        """What its output depends on besides the tokenizer: the kind, NLTK's version and the stopwords used."""
        stop = nltk_english()[1] if self.kind == "nltk" else STOPWORDS | {_WORD.pattern}
        out = {"kind": self.kind, "stopwords": hashlib.sha256("\n".join(sorted(stop)).encode()).hexdigest()[:16]}
        if self.kind == "nltk":
            import nltk

            out["nltk"] = nltk.__version__
        return out


def filter_words(kind: str, text: str) -> list[str]:
    """A text's content words, in order, without repeats, as the ``kind`` filter splits it.

    >>> filter_words("regex", "Cats, cats and dogs")
    ['cats', 'dogs']
    """
    if kind == "regex":
        return content_words(text)
    tokenize, stop = nltk_english()
    return list(dict.fromkeys(w for w in tokenize(text.lower()) if w not in stop))


def _words_of(kind: str, texts: list[str]) -> list[list[str]]:
    return [filter_words(kind, t) for t in texts]


WORD_CHUNK = 500  # texts per task of a word pool
POOL_MIN_TEXTS = 5000  # fewer texts are split in this process (a worker takes ~2 s to start)


@contextlib.contextmanager
def word_pool(workers: int, n_texts: int) -> Iterator[Executor | None]:
    """Processes that split texts into words for :meth:`ContentFilter.allowed_many` (NLTK's ``word_tokenize`` is
    pure Python, so one core per process), or None where this process is enough: ``workers`` <= 1, or fewer than
    ``POOL_MIN_TEXTS`` texts. ``workers`` 0: one per CPU core.

    >>> with word_pool(0, 10) as pool:
    ...     print(pool)
    None
    """
    workers = workers or os.cpu_count() or 1
    if workers <= 1 or n_texts < POOL_MIN_TEXTS:
        yield None
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def make_filter(tokenizer: Any, kind: str) -> ContentFilter | None:
    return None if kind == "none" else ContentFilter(tokenizer, kind)


_UNUSED = re.compile(r"^[\[<]unused\d+[\]>]$")


def excluded_ids(tokenizer: Any) -> set[int]:
    """Vocabulary ids that never enter a bag of tokens or a SIDR vector: the tokenizer's special tokens and its
    ``[unusedN]`` placeholders (BERT: ids 0-998, as SIDR drops them).

    >>> class Tok:
    ...     all_special_ids = [0, 101]
    ...     def get_vocab(self): return {"[PAD]": 0, "[unused0]": 1, "the": 2, "[CLS]": 101}
    >>> sorted(excluded_ids(Tok()))
    [0, 1, 101]
    """
    out = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    out |= {int(i) for t, i in tokenizer.get_vocab().items() if _UNUSED.match(t)}
    return out


def pooled_weights(logits: torch.Tensor) -> torch.Tensor:
    """[..., K, V] logits -> [..., V]: max over K of log(1 + ReLU(logit)).

    >>> pooled_weights(torch.tensor([[0.0, 1.0], [-2.0, 3.0]])).tolist()   # K = 2 slots over V = 2 terms
    [0.0, 1.3862943649291992]
    """
    return torch.log1p(torch.relu(logits.float())).amax(dim=-2)


def topk_sparse(
    weights: torch.Tensor, allowed: Iterable[int] | None, k: int, quantise: str = "none"
) -> tuple[np.ndarray, np.ndarray]:
    """Keep the ``allowed`` vocabulary ids (None = all), drop zeros, return the top ``k`` as (ids, weights), the
    weights quantised to steps of 0.01 as :func:`quantised` says (``none``: as they are).

    >>> ids, w = topk_sparse(torch.tensor([0.0, 0.6951, 0.2]), None, 1, "round")
    >>> ids.tolist(), w.tolist()
    ([1], [0.699999988079071])
    """
    w = weights.float()
    if allowed is not None:
        idx = torch.as_tensor(list(allowed), dtype=torch.long, device=w.device)
        if idx.numel() == 0:
            return np.zeros(0, np.int32), np.zeros(0, np.float32)
        vals = w[idx]
    else:
        idx = torch.arange(w.shape[-1], device=w.device)
        vals = w
    ids, vals_np = topk_pairs(idx, vals, k)
    if quantise != "none":
        q = quantised(torch.from_numpy(vals_np), quantise) / 100
        keep = q > 0
        ids, vals_np = ids[keep.numpy()], q[keep].numpy().astype(np.float32)
    return ids, vals_np


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


def per_position_sparse(
    ids: torch.Tensor,
    logits: torch.Tensor,
    topk: int = PER_POSITION_TOPK,
    quantise: str = "truncate",
    pooled_bf16: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """The reference's sparse vector from the logits of the candidate ids at each of K slots.

    ``ids`` [C] are the vocabulary ids that may appear (the content words, the mask excluded); ``logits``
    [K, C] their logits at each slot. Per slot: log(1 + ReLU), the top ``topk``, the weights x100 as
    :func:`quantised` says (``truncate``: the zero-shot encoders', ``round``: encode.py's for fine-tuned models);
    then the max over the slots, held as bfloat16 with ``pooled_bf16`` (the reference's storage of K > 1 shards).
    Returns (ids, weights in steps of 0.01), heaviest first, positive weights only.

    >>> ids, w = per_position_sparse(torch.tensor([7, 9]), torch.tensor([[1.0, 0.5], [-1.0, 2.0]]), topk=1)
    >>> ids.tolist(), w.tolist()     # slot 0 keeps 7 (log 2 = 0.693 -> 0.69), slot 1 keeps 9 (log 3 -> 1.09)
    ([9, 7], [1.090000033378601, 0.6899999976158142])
    >>> per_position_sparse(torch.tensor([7, 9]), torch.tensor([[1.0, 0.5], [-1.0, 2.0]]), 1, "round")[1].tolist()
    [1.100000023841858, 0.6899999976158142]
    """
    slots = torch.tensor([logits.shape[0]])
    return per_position_sparse_batch(ids[None], logits[None], slots, topk, quantise, pooled_bf16)[0]


def per_position_sparse_batch(
    ids: torch.Tensor,
    logits: torch.Tensor,
    slots: torch.Tensor,
    topk: int = PER_POSITION_TOPK,
    quantise: str = "truncate",
    pooled_bf16: bool = True,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`per_position_sparse` of a batch of texts at once, with no loop over the texts.

    ``ids`` [B, C]: each text's candidate ids, padded with -1; ``logits`` [B, K, C] their logits at every slot;
    ``slots`` [B]: the slots each text keeps (its first ``slots[b]``). Pads and dropped slots weigh -1, below
    every real weight (>= 0), so each text keeps what it would keep alone.

    >>> ids = torch.tensor([[7, 9], [7, -1]])
    >>> logits = torch.tensor([[[1.0, 0.5], [-1.0, 2.0]], [[3.0, 9.0], [5.0, 9.0]]])
    >>> [(i.tolist(), w.tolist()) for i, w in per_position_sparse_batch(ids, logits, torch.tensor([2, 1]), 1)]
    [([9, 7], [1.090000033378601, 0.6899999976158142]), ([7], [1.3799999952316284])]
    """
    out_ids, heavy, counts = per_position_sparse_tensors(ids, logits, slots, topk, quantise, pooled_bf16)
    return per_position_lists(out_ids.cpu().numpy(), heavy.cpu().numpy(), counts.cpu().numpy())


def per_position_sparse_tensors(
    ids: torch.Tensor,
    logits: torch.Tensor,
    slots: torch.Tensor,
    topk: int = PER_POSITION_TOPK,
    quantise: str = "truncate",
    pooled_bf16: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`per_position_sparse_batch` left on the device of ``logits``, nothing read back: (ids [B, C] int32 and
    weights [B, C] float32, each text's heaviest first, then [B] how many of them are positive); a text's vector is
    its row's first count entries (:func:`per_position_lists`).

    >>> out_ids, w, n = per_position_sparse_tensors(torch.tensor([[7, 9]]), torch.tensor([[[1.0, 0.5]]]),
    ...                                             torch.tensor([1]), 1)
    >>> out_ids.tolist(), w.tolist(), n.tolist()
    ([[7, 9]], [[0.6899999976158142, 0.0]], [1])
    """
    bsz, k, width = logits.shape
    if width == 0 or k == 0:
        return (
            torch.zeros((bsz, 0), dtype=torch.int32, device=logits.device),
            torch.zeros((bsz, 0), dtype=torch.float32, device=logits.device),
            torch.zeros(bsz, dtype=torch.long, device=logits.device),
        )
    kept = torch.arange(k, device=logits.device)[None, :] < slots.to(logits.device)[:, None]  # [B, K]
    real = kept[:, :, None] & (ids >= 0).to(logits.device)[:, None, :]
    w = torch.log1p(torch.relu(logits.float())).masked_fill(~real, -1.0)  # [B, K, C]
    vals, pos = torch.topk(w, min(topk, width), dim=-1)  # [B, K, kk]
    scale = 1.0 if quantise == "none" else 100.0
    vals = quantised(vals, quantise)
    pooled = torch.zeros((bsz, width), dtype=torch.float32, device=w.device)
    pooled.scatter_reduce_(1, pos.reshape(bsz, -1), vals.reshape(bsz, -1), reduce="amax")
    if pooled_bf16:
        pooled = pooled.to(torch.bfloat16).float()  # stored as bfloat16, as the reference stores it
    pooled = pooled / scale
    heavy, order = torch.sort(pooled, dim=1, descending=True, stable=True)  # positive ones first, in id order
    counts = (heavy > 0).sum(1)
    return ids.to(w.device).gather(1, order).to(torch.int32), heavy, counts


def per_position_lists(ids: np.ndarray, weights: np.ndarray, counts: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each text's (ids, weights) from :func:`per_position_sparse_tensors`' arrays on the host.

    >>> per_position_lists(np.array([[7, 9]], np.int32), np.array([[0.5, 0.0]], np.float32), np.array([1]))
    [(array([7], dtype=int32), array([0.5], dtype=float32))]
    """
    return [(ids[b, :n], weights[b, :n]) for b, n in enumerate(counts.tolist())]
