"""Reranking with diffusion LMs (DiffuRank): the model-free algorithms (:mod:`.algorithms`)."""

from .algorithms import (
    Decoded,
    assignment_permutation,
    constrained_permutation,
    decode_permutation,
    order_by_scores,
    sliding_window_rerank,
    window_starts,
    yes_no_score,
)

__all__ = [
    "Decoded",
    "assignment_permutation",
    "constrained_permutation",
    "decode_permutation",
    "order_by_scores",
    "sliding_window_rerank",
    "window_starts",
    "yes_no_score",
]
