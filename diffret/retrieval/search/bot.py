"""SIDR's binary bag-of-tokens (BoT) index and beta search (Zhou et al., ICLR 2025).

A passage's bag of tokens is the set of its tokenizer ids, binary (not counts), special and ``[unusedN]`` ids
dropped, nothing else filtered (stopwords, punctuation and sub-word pieces stay). Building it needs no model: one
pass over stored token ids. Beta search scores a query's sparse vector against it: the sum of the query's
weights over the tokens the passage contains.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from .encodings import SparseFlat
from .scoring import RunningTopK, SparsePassages, SparseQueries, TopK, query_vocab


def bag_of_tokens(token_ids: pa.Array | pa.ChunkedArray, excluded: Sequence[int]) -> pa.ListArray:
    """Each row's distinct token ids, sorted, without the ``excluded`` ids (a list<int32> column).

    >>> bag_of_tokens(pa.array([[7, 3, 7, 0], []], pa.list_(pa.int32())), excluded=[0]).to_pylist()
    [[3, 7], []]
    """
    arr = token_ids.combine_chunks() if isinstance(token_ids, pa.ChunkedArray) else token_ids
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = arr.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    keep = ~np.isin(flat, np.asarray(list(excluded), np.int64))
    rows, flat = rows[keep], flat[keep]
    if len(flat):  # distinct (row, id) pairs, sorted by row then id: one lexsort over the whole shard
        order = np.lexsort((flat, rows))
        rows, flat = rows[order], flat[order]
        first = np.ones(len(flat), bool)
        first[1:] = (rows[1:] != rows[:-1]) | (flat[1:] != flat[:-1])
        rows, flat = rows[first], flat[first]
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(np.bincount(rows, minlength=len(lengths)), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat.astype(np.int32), pa.int32()))


def binary_flat(bags: pa.Array | pa.ChunkedArray) -> SparseFlat:
    """A bag-of-tokens column as sparse vectors of weight 1.

    >>> binary_flat(pa.array([[3, 7], [5]], pa.list_(pa.int32()))).weights.tolist()
    [1.0, 1.0, 1.0]
    """
    arr = bags.combine_chunks() if isinstance(bags, pa.ChunkedArray) else bags
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = arr.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    return SparseFlat(offsets, ids, np.ones(len(ids), np.float32))


BOT_ROWS = 65_536  # passages of a bag-of-tokens index scored at a time (their [query vocabulary, N] block)


def bot_blocks(bags: SparseFlat, rows: int = BOT_ROWS) -> Iterator[SparseFlat]:
    """A bag-of-tokens index in corpus order, ``rows`` passages at a time (what :func:`beta_search` takes).

    >>> [len(b) for b in bot_blocks(binary_flat(pa.array([[1], [2], [3]], pa.list_(pa.int32()))), rows=2)]
    [2, 1]
    """
    for a in range(0, len(bags), rows):
        yield bags.rows(a, min(a + rows, len(bags)))


def beta_search(
    queries: SparseFlat, blocks: Iterable[SparseFlat], k: int, device: torch.device | str = "cpu", query_rows: int = 256
) -> TopK:
    """SIDR_beta: each query's sparse vector dotted with every passage's bag of tokens, the top ``k`` (ties: the
    earlier passage first). ``blocks``: the passages' bags in corpus order, block by block (bounded memory).

    >>> q = SparseFlat.from_lists([np.array([3, 9])], [np.array([2.0, 0.5], np.float32)])
    >>> bags = binary_flat(pa.array([[9], [3, 9], [4]], pa.list_(pa.int32())))
    >>> top = beta_search(q, [bags.rows(0, 2), bags.rows(2, 3)], k=2)
    >>> top.index.tolist(), top.scores.tolist()
    ([[1, 0]], [[2.5, 0.5]])
    """
    dev = torch.device(device)
    vocab = query_vocab(queries)
    qs = SparseQueries(queries, vocab, dev)
    top = RunningTopK(len(queries), k, dev)
    offset = 0
    for block in blocks:
        ps = SparsePassages(block, vocab, dev)
        for a in range(0, len(queries), query_rows):
            b = min(a + query_rows, len(queries))
            top.update(qs.scores(ps, a, b), offset, row=a)
        offset += len(block)
    return top.result()
