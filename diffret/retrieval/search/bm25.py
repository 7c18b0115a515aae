"""BM25 baseline with bm25s: Lucene variant, k1 = 0.9, b = 0.4, English Snowball stemmer and stopwords.

Passages are indexed as "title. text" (the text the dense encoders read). The result is a ``TopK``
over the corpus order, so BM25 runs are written exactly like every other system's.

:func:`bm25_search` indexes the whole corpus at once (bm25s as is: memory grows with the corpus, ~2.7 kB a
passage). :func:`bm25_search_shards` reads the corpus twice, one shard at a time: the corpus statistics first
(document frequencies, mean length), then each shard's bm25s index built with them and searched, the top k merged.
Its scores equal the whole-corpus index's bit for bit (the same float32 terms, summed in the same query-token
order); its runs equal them up to which of the documents tied at the cut-off score are kept (bm25s picks among
those arbitrarily; the shards keep the first in corpus order).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import numpy as np
from pydantic import Field

from ..fields import Settings
from .scoring import NEG, TopK


class BM25Settings(Settings):
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


def bm25_search_shards(
    shards: Callable[[], Iterable[tuple[list[str], list[str]]]],
    query_texts: list[str],
    topk: int = 1000,
    settings: BM25Settings | None = None,
    query_ids: list[str] | None = None,
    ignore_identical_ids: bool = False,
    clock: dict[str, float] | None = None,
) -> tuple[TopK, list[str]]:
    """:func:`bm25_search` over a corpus read one shard at a time, twice: memory holds one shard's index.

    ``shards()`` yields the corpus's (doc ids, texts) shard by shard, in corpus order, the same on each call.
    Returns the top ``topk`` per query and the ids of the documents it holds: the ``TopK``'s indices point into
    that list (the documents retrieved, not the corpus). Scores equal :func:`bm25_search`'s bit for bit; of the
    documents tied at the cut-off score, the first in corpus order are kept.

    >>> docs = ["cats purr", "dogs bark loudly", "cats and dogs", "birds sing"]
    >>> two = lambda: iter([(["a", "b"], docs[:2]), (["c", "d"], docs[2:])])
    >>> top, ids = bm25_search_shards(two, ["cats dogs"], topk=3)
    >>> [ids[i] for i in top.index[0]]
    ['c', 'a', 'b']
    >>> whole = bm25_search(docs, ["cats dogs"], topk=3)
    >>> top.scores.tolist() == whole.scores.tolist()
    True
    """
    import bm25s
    import scipy.sparse as sp
    from bm25s import scoring

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    s = settings or BM25Settings()
    if ignore_identical_ids and query_ids is None:
        raise ValueError("ignore_identical_ids needs query_ids")
    start = time.perf_counter()
    # pass 1: the corpus statistics bm25s computes over the whole corpus (per stemmed term: documents holding it)
    df: dict[str, int] = {}
    n_docs = total_len = 0
    for _, texts in shards():
        tok = _tokenize(texts, s)
        n_docs += len(tok.ids)
        total_len += sum(len(d) for d in tok.ids)
        counts = _doc_freqs(tok).tolist()
        for word, term in tok.vocab.items():
            df[word] = df.get(word, 0) + counts[term]
    if n_docs == 0:
        raise ValueError("BM25 over an empty corpus")
    avg_len = np.float64(total_len) / np.float64(n_docs)  # as bm25s's mean of the lengths: a float64 scalar
    stats = time.perf_counter() - start
    q_terms = bm25s.tokenization.convert_tokenized_to_string_list(_tokenize(query_texts, s))
    n_q = len(query_texts)
    query_vocab = [w for w in dict.fromkeys(w for terms in q_terms for w in terms) if w in df]
    best = np.full((n_q, 0), NEG, np.float32)
    best_pos = np.zeros((n_q, 0), np.int64)  # corpus positions
    best_ids = np.empty((n_q, 0), dtype=object)
    qids = np.asarray(query_ids, dtype=object) if query_ids is not None else None
    built = searched = 0.0
    at = 0  # the shard's first corpus position
    # pass 2: each shard's index with the corpus statistics, searched; the best k kept
    for ids, texts in shards():
        t0 = time.perf_counter()
        retriever = bm25s.BM25(method=s.method, k1=s.k1, b=s.b)
        tok = _tokenize(texts, s)
        shard_df = _doc_freqs(tok)
        # the shard's terms, and the query terms of the corpus it lacks (no postings here): a query then sums the
        # same terms in the same order as over the whole corpus (BM25L / BM25+ add a score for each term absent)
        vocab = dict(tok.vocab)
        for word in query_vocab:
            vocab.setdefault(word, len(vocab))
        if not vocab:  # no query term in the corpus: every document scores 0, none is kept
            at += len(ids)
            continue
        global_df = {term: df[word] for word, term in vocab.items()}
        idf_fn = scoring._select_idf_scorer(retriever.idf_method)
        nonocc = None
        if retriever.method in retriever.methods_requiring_nonoccurrence:
            nonocc = scoring._build_nonoccurrence_array(
                doc_frequencies=global_df,
                n_docs=n_docs,
                compute_idf_fn=idf_fn,
                calculate_tfc_fn=scoring._select_tfc_scorer(retriever.method),
                l_d=avg_len,
                l_avg=avg_len,
                k1=retriever.k1,
                b=retriever.b,
                delta=retriever.delta,
                dtype=retriever.dtype,
            )
        idf = scoring._build_idf_array(
            doc_frequencies=global_df, n_docs=n_docs, compute_idf_fn=idf_fn, dtype=retriever.dtype
        )
        data, rows, cols = scoring._build_scores_and_indices_for_matrix(
            corpus_token_ids=tok.ids,
            idf_array=idf,
            avg_doc_len=avg_len,
            doc_frequencies={i: int(c) for i, c in enumerate(shard_df)},
            k1=retriever.k1,
            b=retriever.b,
            delta=retriever.delta,
            nonoccurrence_array=nonocc,
            method=retriever.method,
            dtype=retriever.dtype,
            int_dtype=retriever.int_dtype,
            show_progress=False,
        )
        m = sp.csc_matrix((data, (rows, cols)), shape=(len(tok.ids), len(vocab)), dtype=retriever.dtype)
        retriever.scores = {"data": m.data, "indices": m.indices, "indptr": m.indptr, "num_docs": len(tok.ids)}
        retriever.nonoccurrence_array = nonocc
        retriever.vocab_dict = {**vocab, "": len(vocab)} if "" not in vocab else vocab
        retriever.unique_token_ids_set = set(retriever.vocab_dict.values())
        del data, rows, cols, m
        t1 = time.perf_counter()
        own = {d: i for i, d in enumerate(ids)} if ignore_identical_ids else {}
        scores = np.full((n_q, topk), NEG, np.float32)
        pos = np.full((n_q, topk), -1, np.int64)
        for qi, terms in enumerate(q_terms):
            if not terms:  # only stopwords: it scores 0 everywhere
                continue
            row = retriever.get_scores(terms)  # what bm25s's retrieve ranks by
            if qids is not None and qids[qi] in own:
                row[own[qids[qi]]] = 0  # its self-hit: not kept
            s_q, p_q = _best_first(row, topk)
            scores[qi, : len(s_q)], pos[qi, : len(p_q)] = s_q, p_q
        shard_ids = np.asarray(ids, dtype=object)[np.maximum(pos, 0)]
        best, best_pos, best_ids = _keep_best(
            np.hstack([best, scores]), np.hstack([best_pos, pos + at]), np.hstack([best_ids, shard_ids]), topk
        )
        at += len(ids)
        built += t1 - t0
        searched += time.perf_counter() - t1
    found = np.isfinite(best)
    hit_pos, inverse = np.unique(best_pos[found], return_inverse=True)
    index = np.full(best.shape, -1, np.int64)
    index[found] = inverse
    hit_ids = np.empty(len(hit_pos), dtype=object)
    hit_ids[inverse] = best_ids[found]
    if clock is not None:
        clock.update(index_seconds=stats + built, search_seconds=searched)
    return TopK(best, index), hit_ids.tolist()


def _doc_freqs(tok) -> np.ndarray:  # noqa: ANN001 - bm25s.tokenization.Tokenized
    """Documents holding each term of a tokenized shard, by the shard's term id."""
    lengths = np.fromiter((len(d) for d in tok.ids), np.int64, len(tok.ids))
    flat = np.fromiter((t for d in tok.ids for t in d), np.int64, int(lengths.sum()))
    doc = np.repeat(np.arange(len(tok.ids), dtype=np.int64), lengths)
    pairs = np.unique(doc * max(len(tok.vocab), 1) + flat)
    return np.bincount(pairs % max(len(tok.vocab), 1), minlength=len(tok.vocab))


def _best_first(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best positive scores of one query's row, best first, ties (at the cut-off too) in position order.

    >>> _best_first(np.array([0.5, 0, 2, 0.5, 0.5], np.float32), 3)
    (array([2. , 0.5, 0.5], dtype=float32), array([2, 0, 3]))
    """
    pos = np.flatnonzero(row > 0)
    if len(pos) > k:
        v = row[pos]
        cut = np.partition(v, len(v) - k)[len(v) - k]  # the k-th highest score
        above = pos[v > cut]
        pos = np.concatenate([above, pos[v == cut][: k - len(above)]])
    order = np.lexsort((pos, -row[pos].astype(np.float64)))
    return row[pos][order], pos[order]


def _keep_best(
    scores: np.ndarray, pos: np.ndarray, ids: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, the ``k`` highest scores, ties by corpus position (pads, -inf, last), with their positions and ids."""
    order = np.lexsort((pos, -scores.astype(np.float64)), axis=1)[:, :k]
    return (np.take_along_axis(scores, order, 1), np.take_along_axis(pos, order, 1), np.take_along_axis(ids, order, 1))
