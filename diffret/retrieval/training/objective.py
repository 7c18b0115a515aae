"""The training objective (paper section 3.4): L = L_dense + L_sparse, both InfoNCE over a pool of passages.

The pool of every query is its positive, its hard negatives and the other queries' passages in the batch.
L_dense scores with the same dense score the scorer uses (MaxSim over (K_q, K_p) for the mask readout, as the
reference: the sum over query slots of the best passage slot, over K_q, on L2-normalised vectors) at
temperature tau = 0.01. L_sparse is InfoNCE without a temperature on the dot product of the sparse vectors
(max over the slots of the logits, then log(1 + ReLU), the text's content words only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def maxsim_matrix(q: torch.Tensor, q_mask: torch.Tensor, p: torch.Tensor, p_mask: torch.Tensor) -> torch.Tensor:
    """[Q, Kq, H] x [P, Kp, H] -> [Q, P]: mean over the real query slots of the best real passage slot.

    >>> q = torch.tensor([[[1.0, 0.0]]]); p = torch.tensor([[[0.0, 1.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]])
    >>> maxsim_matrix(q, torch.ones(1, 1, dtype=torch.bool), p, torch.ones(2, 2, dtype=torch.bool)).tolist()
    [[1.0, 0.0]]
    """
    q = F.normalize(q.float(), dim=-1)
    p = F.normalize(p.float(), dim=-1)
    sim = torch.einsum("qah,pbh->qpab", q, p)
    sim = sim.masked_fill(~p_mask[None, :, None, :], float("-inf")).amax(-1)  # [Q, P, Kq]
    sim = sim.masked_fill(~q_mask[:, None, :], 0.0)
    return sim.sum(-1) / q_mask.sum(-1, keepdim=True).clamp(min=1)


def sparse_vectors(
    logits: torch.Tensor, allowed: torch.Tensor | None, slots: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, K, V] logits -> [B, V]: log(1 + ReLU(max over the real ``slots`` [B, K])), zero outside ``allowed``
    ([B, V] bool)."""
    logits = logits.float()
    if slots is not None:
        logits = logits.masked_fill(~slots[..., None], float("-inf"))
    w = torch.log1p(torch.relu(logits.amax(dim=1)))
    return w if allowed is None else w * allowed


def info_nce(scores: torch.Tensor, targets: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Cross-entropy of each query's positive among its pool: ``scores`` [Q, P] / tau, ``targets`` [Q].

    >>> round(float(info_nce(torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1]))), 4)
    0.1269
    """
    return F.cross_entropy(scores / tau, targets)


def contrastive_loss(
    q_dense: torch.Tensor,
    q_mask: torch.Tensor,
    p_dense: torch.Tensor,
    p_mask: torch.Tensor,
    group: int,
    *,
    tau: float = 0.01,
    q_sparse: torch.Tensor | None = None,
    p_sparse: torch.Tensor | None = None,
    offset: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_dense + L_sparse for Q queries and the pool's passages in groups of ``group`` (each query's positive
    first in its group; query i's group is ``offset + i``, the other groups in-batch negatives).

    Returns the loss and its parts (floats, for the log).
    """
    targets = (torch.arange(q_dense.shape[0], device=q_dense.device) + offset) * group
    dense = info_nce(maxsim_matrix(q_dense, q_mask, p_dense, p_mask), targets, tau)
    parts = {"dense": float(dense.detach())}
    loss = dense
    if q_sparse is not None and p_sparse is not None:
        sparse = info_nce(q_sparse @ p_sparse.T, targets)
        parts["sparse"] = float(sparse.detach())
        loss = loss + sparse
    parts["loss"] = float(loss.detach())
    return loss, parts


def symmetric_nce(q: torch.Tensor, p: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """SIDR's symmetric InfoNCE (temperature 1, dot product): each query against every passage of the pool, plus
    each query's positive passage against every query.

    >>> q = torch.tensor([[1.0, 0.0], [0.0, 1.0]]); p = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    >>> round(float(symmetric_nce(q, p, torch.tensor([0, 1]))), 4)
    0.2539
    """
    scores = q.float() @ p.float().T
    back = scores[:, targets].T  # [Q positives, Q queries]
    return F.cross_entropy(scores, targets) + F.cross_entropy(back, torch.arange(len(targets), device=q.device))


def topk_own(v: torch.Tensor, own: torch.Tensor, k: int) -> torch.Tensor:
    """``v`` [B, V] kept on its top ``k`` entries and the text's own tokens (``own`` [B, V], 1 where present).

    >>> topk_own(torch.tensor([[3.0, 1.0, 2.0]]), torch.tensor([[0.0, 1.0, 0.0]]), 1).tolist()
    [[3.0, 1.0, 0.0]]
    """
    keep = torch.zeros_like(v, dtype=torch.bool)
    keep.scatter_(1, torch.topk(v.detach(), min(k, v.shape[1]), dim=1).indices, True)
    return v * (keep | (own > 0))


def sidr_loss(
    q: torch.Tensor,
    q_bin: torch.Tensor,
    p: torch.Tensor,
    p_bin: torch.Tensor,
    group: int,
    topk: int = 768,
    offset: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SIDR's semi-parametric objective: 1/4 [L(q_topk, p) + L(q, p_topk) + L(q_bin, p) + L(q, p_bin)], each L
    symmetric (:func:`symmetric_nce`); ``q`` / ``p`` [N, V] the parametric vectors, ``*_bin`` the texts' binary bags
    of tokens, passages in groups of ``group`` with each query's positive first.

    >>> q = torch.tensor([[1.0, 0.0]]); p = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> loss, parts = sidr_loss(q, q, p, p, group=2)
    >>> sorted(parts)
    ['bot', 'loss', 'topk']
    """
    targets = (torch.arange(q.shape[0], device=q.device) + offset) * group
    topk_part = (
        symmetric_nce(topk_own(q, q_bin, topk), p, targets) + symmetric_nce(q, topk_own(p, p_bin, topk), targets)
    ) / 4
    bot_part = (symmetric_nce(q_bin, p, targets) + symmetric_nce(q, p_bin, targets)) / 4
    loss = topk_part + bot_part
    return loss, {"topk": float(topk_part.detach()), "bot": float(bot_part.detach()), "loss": float(loss.detach())}
