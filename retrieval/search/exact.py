"""Exact search over stored encodings, in every base mode of the modes table (``modes.MODES``).

Search is a chunked matrix product with a running top-k (CPU or GPU), streamed over the passage
encoding block by block: one pass over a passage encoding scores every K_q (and every base mode)
against it. It is exact and is the ground truth the LanceDB index is checked against.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .encodings import Encodings
from .modes import BASE_MODES, MODES, ScoreContext
from .scoring import NEG, RunningTopK, TopK, Workspace


@dataclass
class SearchSettings:
    topk: int = 1000
    ignore_identical_ids: bool = False  # BEIR drops a document whose id equals the query id (ArguAna, Quora)
    chunk_elems: int = 1 << 26  # score-buffer entries per block (bounds memory: 4 bytes each)
    query_block: int = 512


def search_pass(
    queries: dict[int, Encodings],
    passages: Iterable[Encodings],
    modes: Iterable[str] = BASE_MODES,
    settings: SearchSettings | None = None,
) -> tuple[dict[tuple[int, str], TopK], list[str]]:
    """Score every query set (keyed by K_q) in every base mode against one stream of passage blocks.

    Returns ({(K_q, mode): TopK}, passage ids in stream order; TopK.index points into that list).
    """
    st = settings or SearchSettings()
    modes = list(modes)
    unknown = [m for m in modes if m not in BASE_MODES]
    if unknown:
        raise ValueError(f"unknown base mode(s) {unknown}; expected a subset of {list(BASE_MODES)}")
    if not queries:
        raise ValueError("no query encodings to score")
    device = next(iter(queries.values())).multi.device
    tops = {(kq, m): RunningTopK(len(q), st.topk, device) for kq, q in queries.items() for m in modes}
    prepared = {(kq, m): MODES[m].prepare(q, device) for kq, q in queries.items() for m in modes if MODES[m].prepare}
    qpos = {kq: {x: i for i, x in enumerate(q.ids)} for kq, q in queries.items()} if st.ignore_identical_ids else {}
    doc_ids: list[str] = []
    ctx = ScoreContext(Workspace(), st.query_block)
    for block in passages:
        offset = len(doc_ids)
        doc_ids.extend(block.ids)
        for start, p in _split_block(block, queries, st):
            self_hits = {kq: _self_hits(qpos[kq], p.ids) for kq in qpos}
            for kq, q in queries.items():
                for mode in modes:
                    sc = MODES[mode].score(q, p, prepared.get((kq, mode)), ctx)
                    if st.ignore_identical_ids and self_hits[kq][0].numel():
                        sc[self_hits[kq][0], self_hits[kq][1]] = NEG
                    tops[(kq, mode)].update(sc, offset + start)
    return {key: t.result() for key, t in tops.items()}, doc_ids


def _split_block(
    block: Encodings, queries: dict[int, Encodings], st: SearchSettings
) -> Iterator[tuple[int, Encodings]]:
    """(offset, sub-block) of passages small enough that a [Q*K_q, N*K_p] block fits the budget (maxsim's two
    [Q*K_q, N] buffers fit in it for K_p >= 2; the other modes' [Q, N] scores scale with it)."""
    kp = block.multi.shape[1]
    widest = max(min(len(q), st.query_block) * q.multi.shape[1] for q in queries.values())
    step = max(1, st.chunk_elems // max(1, widest * kp))
    for s in range(0, len(block), step):
        yield s, block.rows(s, min(s + step, len(block)))


def _self_hits(qpos: dict[str, int], doc_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = [], []
    for j, d in enumerate(doc_ids):
        i = qpos.get(d)
        if i is not None:
            rows.append(i)
            cols.append(j)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
