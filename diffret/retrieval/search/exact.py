"""Exact search over stored encodings, in every base mode of the modes table (``modes.MODES``).

Search is a blocked matrix product with a running top-k (CPU or GPU), streamed over the passage
encoding block by block: one pass over a passage encoding scores every K_q (and every base mode)
against it. Both sides are cut into blocks so that everything a block holds at once (score blocks,
MaxSim's buffers, the sparse passage matrix, the top-k merge) fits one byte budget
(``SearchSettings.block_bytes``), whatever the number of queries or passages. It is exact, and its
result does not depend on the budget (ties rank by document index); it is the ground truth the
LanceDB index is checked against.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from .encodings import Encodings
from .modes import BASE_MODES, MODES, ScoreContext
from .rules import ScoreRules
from .scoring import NEG, BlockPlan, RunningTopK, TopK, Workspace, plan_blocks, query_vocab

DEFAULT_BLOCK_MB = 256


@dataclass
class SearchSettings:
    topk: int = 1000
    ignore_identical_ids: bool = False  # drop a document whose id equals the query id (BEIR's evaluation does)
    block_bytes: int = DEFAULT_BLOCK_MB << 20  # what the scoring blocks may hold at once (not the inputs)
    rules: ScoreRules = field(default_factory=ScoreRules)  # how each mode scores (the reference's by default)


def search_pass(
    queries: dict[int, Encodings],
    passages: Iterable[Encodings],
    modes: Iterable[str] = BASE_MODES,
    settings: SearchSettings | None = None,
) -> tuple[dict[tuple[int, str], TopK], list[str]]:
    """Score every query set (keyed by K_q) in every base mode against one stream of passage blocks.

    Memory: the query sets, one passage block, the running top-k (8 bytes per query and slot, per
    (K_q, mode)) and at most ``settings.block_bytes`` of scoring blocks (:func:`scoring.plan_blocks`).

    Returns ({(K_q, mode): TopK}, passage ids in stream order; TopK.index points into that list).

    Examples
    --------
    >>> from diffret.retrieval.search.encodings import SparseFlat
    >>> def enc(ids, vecs):
    ...     v = torch.tensor(vecs)[:, None, :]
    ...     return Encodings(ids, v, torch.ones(len(ids), 1, dtype=torch.bool), v[:, 0], [], [],
    ...                      SparseFlat.from_lists([np.zeros(0)] * len(ids), [np.zeros(0)] * len(ids)))
    >>> q = enc(["q"], [[1.0, 0.0]])
    >>> docs = [enc(["a", "b"], [[0.0, 1.0], [1.0, 0.0]]), enc(["c"], [[1.0, 0.0]])]
    >>> tops, ids = search_pass({1: q}, docs, ["single_dense"], SearchSettings(topk=2))
    >>> [ids[i] for i in tops[(1, "single_dense")].index[0]]   # b and c tie at 1.0: the earlier first
    ['b', 'c']
    """
    st = settings or SearchSettings()
    modes = list(modes)
    unknown = [m for m in modes if m not in BASE_MODES]
    if unknown:
        raise ValueError(f"unknown base mode(s) {unknown}; expected a subset of {list(BASE_MODES)}")
    if not queries:
        raise ValueError("no query encodings to score")
    device = next(iter(queries.values())).multi.device
    sparse = "sparse_max" in modes
    vocab = query_vocab(*(q.sparse() for q in queries.values())) if sparse else np.zeros(0, np.int64)
    ctx = ScoreContext(Workspace(), vocab, rules=st.rules)
    tops = {(kq, m): RunningTopK(len(q), st.topk, device) for kq, q in queries.items() for m in modes}
    prepared = {
        (kq, m): prepare(q, ctx, device)
        for kq, q in queries.items()
        for m in modes
        if (prepare := MODES[m].prepare) is not None
    }
    qpos = {kq: {x: i for i, x in enumerate(q.ids)} for kq, q in queries.items()} if st.ignore_identical_ids else {}
    n_queries = max(len(q) for q in queries.values())
    kq_max = max(q.multi.shape[1] for q in queries.values())
    doc_ids: list[str] = []
    for block in passages:
        offset = len(doc_ids)
        doc_ids.extend(block.ids)
        if len(block):
            plan = plan_blocks(
                st.block_bytes, len(block), n_queries, kq_max, st.topk, set(modes), len(ctx.vocab), device
            )
            ctx.tile_elems = plan.tile_elems
            for start in range(0, len(block), plan.passages):
                _score_block(
                    queries,
                    block.rows(start, min(start + plan.passages, len(block))),
                    offset + start,
                    modes=modes,
                    plan=plan,
                    ctx=ctx,
                    prepared=prepared,
                    qpos=qpos,
                    tops=tops,
                    device=device,
                )
        del block  # before the stream reads the next one: one passage block in memory at a time
    return {key: tops.pop(key).result() for key in list(tops)}, doc_ids  # each state freed once decoded


def _score_block(
    queries: dict[int, Encodings],
    p: Encodings,
    offset: int,
    *,
    modes: list[str],
    plan: BlockPlan,
    ctx: ScoreContext,
    prepared: dict,
    qpos: dict[int, dict[str, int]],
    tops: dict[tuple[int, str], RunningTopK],
    device: torch.device,
) -> None:
    """One passage sub-block against every query set, mode and query block."""
    p_prep = {m: prep(p, ctx, device) for m in modes if (prep := MODES[m].prepare_passages) is not None}
    for kq, q in queries.items():
        hits = _self_hits(qpos[kq], p.ids, device) if kq in qpos else None
        for a in range(0, len(q), plan.queries):
            b = min(a + plan.queries, len(q))
            if hits is not None:
                sel = (hits[0] >= a) & (hits[0] < b)
                rows, cols = hits[0][sel] - a, hits[1][sel]
            for mode in modes:
                score = MODES[mode].score
                assert score is not None  # a base mode (search_pass checked them)
                sc = score(q, a, b, p, prepared.get((kq, mode)), p_prep.get(mode), ctx)
                if hits is not None and rows.numel():
                    sc[rows, cols] = NEG
                tops[(kq, mode)].update(sc, offset, row=a)
    del p_prep


def _self_hits(qpos: dict[str, int], doc_ids: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = [], []
    for j, d in enumerate(doc_ids):
        i = qpos.get(d)
        if i is not None:
            rows.append(i)
            cols.append(j)
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(cols, dtype=torch.long, device=device))
