"""BM25 baseline with bm25s: Lucene variant, k1 = 0.9, b = 0.4, English Snowball stemmer and stopwords.

Passages are indexed as "title. text" (the text the dense encoders read). The result is a ``TopK``
over the corpus order, so BM25 runs are written exactly like every other system's.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from pydantic import BaseModel, Field

from .scoring import NEG, TopK


class BM25Settings(BaseModel):
    method: str = Field(default="lucene", description="bm25s scoring variant (lucene, robertson, atire, bm25l, bm25+)")
    k1: float = Field(default=0.9, gt=0, description="BM25's term-frequency saturation k1 (Lucene / Pyserini: 0.9).")
    b: float = Field(default=0.4, ge=0, le=1, description="BM25's length normalisation b (Lucene / Pyserini: 0.4).")
    stemmer: str | None = Field(default="english", description="PyStemmer language, or null for none")
    stopwords: str | None = Field(default="en", description="bm25s stopword list, or null for none")


def _tokenize(texts: list[str], s: BM25Settings):  # noqa: ANN202 - bm25s.tokenization.Tokenized
    import bm25s

    stemmer = None
    if s.stemmer:
        import Stemmer

        stemmer = Stemmer.Stemmer(s.stemmer)
    return bm25s.tokenize(texts, stopwords=s.stopwords, stemmer=stemmer, show_progress=False)


def bm25_search(
    doc_texts: list[str],
    query_texts: list[str],
    topk: int = 1000,
    settings: BM25Settings | None = None,
    query_ids: list[str] | None = None,
    doc_ids: list[str] | None = None,
    ignore_identical_ids: bool = False,
    clock: dict[str, float] | None = None,
) -> TopK:
    """Top ``topk`` documents per query (indices into ``doc_texts``); documents scoring 0 are left out.
    ``clock``, when given, receives the seconds of the index build (``index_seconds``) and of the search
    (``search_seconds``)."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)  # its index-building DEBUG lines reach Prefect's handler
    s = settings or BM25Settings()
    if not doc_texts:
        raise ValueError("BM25 over an empty corpus")
    start = time.perf_counter()
    retriever = bm25s.BM25(method=s.method, k1=s.k1, b=s.b)
    retriever.index(_tokenize(doc_texts, s), show_progress=False)
    built = time.perf_counter()
    k = min(topk + (1 if ignore_identical_ids else 0), len(doc_texts))
    qtok = _tokenize(query_texts, s)
    # bm25s maps query words to its own vocabulary; an empty query (only stopwords) scores 0 everywhere
    idx, scores = retriever.retrieve(qtok, k=k, show_progress=False, n_threads=1)
    idx = np.asarray(idx, np.int64)
    scores = np.asarray(scores, np.float32)
    scores = np.where(scores > 0, scores, NEG).astype(np.float32)
    if ignore_identical_ids:
        if query_ids is None or doc_ids is None:
            raise ValueError("ignore_identical_ids needs query_ids and doc_ids")
        docs = np.asarray(doc_ids, dtype=object)
        for qi, qid in enumerate(query_ids):
            scores[qi, docs[idx[qi]] == qid] = NEG
    order = np.argsort(-scores, axis=1, kind="stable")[:, :topk]
    scores = np.take_along_axis(scores, order, 1)
    idx = np.take_along_axis(idx, order, 1)
    idx[~np.isfinite(scores)] = -1
    if clock is not None:
        clock.update(index_seconds=built - start, search_seconds=time.perf_counter() - built)
    return TopK(scores, idx)
