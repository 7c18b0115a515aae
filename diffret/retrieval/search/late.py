"""Late-parametric re-scoring (SIDR's beta(m)): each query's first-stage top m, re-scored by any system's mode.

Only the passages some query needs are scored (and, upstream, encoded). The scores are the exact search's own
(:func:`retrieval.search.exact.search_pass` over the candidates), so on its m passages a re-scored run ranks
them exactly as the full-corpus run of that mode does (ties: the earlier passage first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .encodings import Encodings, take
from .exact import SearchSettings, search_pass
from .modes import all_modes, base_modes_needed
from .scoring import NEG, TopK

CHUNK_ENTRIES = 4_000_000  # (query, candidate) scores held at once
QUERY_GRAIN = 256  # the most queries scored together; query slices are cut at its multiples


def chunk_queries(width: int) -> int:
    """Queries scored together when each has up to ``width`` candidates: a power of two up to ``QUERY_GRAIN``, so
    that query slices cut at multiples of ``QUERY_GRAIN`` are scored in the same chunks as all queries at once.

    >>> chunk_queries(10), chunk_queries(150), chunk_queries(1000)
    (256, 128, 4)
    """
    fit = max(1, min(QUERY_GRAIN, CHUNK_ENTRIES // max(1, width * width)))
    return 1 << (fit.bit_length() - 1)


def rescore(
    queries: Encodings,
    candidates: Sequence[np.ndarray],
    passages: Encodings,
    passage_index: np.ndarray,
    modes: Sequence[str],
    kq: int = 1,
    settings: SearchSettings | None = None,
    width: int | None = None,
) -> dict[str, TopK]:
    """Each query's ``candidates`` (global passage indices) ranked in every mode of ``modes`` (fusions over the
    candidates' scores); the TopK indices are global.

    ``passages``: the encodings of every candidate (at least), row j being global passage ``passage_index[j]``
    (ascending). ``width``: the most candidates a query may have (default: the most any of these has); give the
    same to every slice of a query set and the slices are scored exactly as the whole set (:func:`chunk_queries`).

    >>> import torch
    >>> def enc(ids, vecs):
    ...     v = torch.tensor(vecs)[:, None, :]
    ...     none = [np.zeros(0)] * len(ids)
    ...     return Encodings(ids, v, torch.ones(len(ids), 1, dtype=torch.bool), v[:, 0], none, none)
    >>> q = enc(["q"], [[1.0, 0.0]])
    >>> p = enc(["a", "b", "c"], [[0.0, 1.0], [0.6, 0.8], [1.0, 0.0]])
    >>> top = rescore(q, [np.array([5, 9])], p, np.array([2, 5, 9]), ["single_dense"])["single_dense"]
    >>> top.index.tolist(), [round(s, 2) for s in top.scores[0].tolist()]
    ([[9, 5]], [1.0, 0.6])
    """
    st = settings or SearchSettings()
    base = base_modes_needed(modes)
    width = max([len(c) for c in candidates] + [1]) if width is None else width
    out = {
        m: (np.full((len(queries), width), NEG, np.float32), np.full((len(queries), width), -1, np.int64)) for m in base
    }
    step = chunk_queries(width)
    for a in range(0, len(queries), step):
        b = min(a + step, len(queries))
        union = np.unique(np.concatenate([np.asarray(c, np.int64) for c in candidates[a:b]] + [np.zeros(0, np.int64)]))
        if not len(union):
            continue
        rows = np.searchsorted(passage_index, union)
        if rows.max() >= len(passage_index) or not np.array_equal(passage_index[rows], union):
            raise KeyError("a candidate passage has no encoding")
        p = take(passages, rows)
        tops, _ = search_pass(
            {kq: queries.rows(a, b)},
            [p],
            base,
            SearchSettings(len(union), st.ignore_identical_ids, st.block_bytes, st.rules),
        )
        for m in base:
            top = tops[(kq, m)]
            for i in range(b - a):
                own = np.asarray(candidates[a + i], np.int64)
                got = union[top.index[i][top.index[i] >= 0]]
                keep = np.isin(got, own)
                s = top.scores[i][top.index[i] >= 0][keep]
                out[m][0][a + i, : len(s)], out[m][1][a + i, : len(s)] = s, got[keep]
    base_tops = {(kq, m): TopK(*out[m]) for m in base}
    fused = all_modes(base_tops, width, st.rules)
    return {m: fused[(kq, m)] for m in modes}
