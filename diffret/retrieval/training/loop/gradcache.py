"""Gradient caching (GradCache, Gao et al. 2021, as Tevatron offers it): a pool larger than one forward pass's
memory encoded in chunks, with the loss and gradients of one pass over the whole pool."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import torch


class RandContext:
    """The RNG states (CPU, and CUDA where used) at creation, restored on entry: a forward pass run again under it
    draws the same dropout masks (gradient caching's second pass)."""

    def __init__(self, device: torch.device):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def __enter__(self) -> None:
        self._saved = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda is not None else None)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self._saved[0])
        if self._saved[1] is not None:
            torch.cuda.set_rng_state(self._saved[1], self.device)


Chunk = TypeVar("Chunk")
Reps = Sequence[torch.Tensor | None]


def cached_backward(
    chunks: Sequence[Chunk],
    reps: Callable[[Chunk], Reps],
    loss: Callable[[tuple[torch.Tensor | None, ...]], tuple[torch.Tensor, dict[str, float]]],
    device: torch.device,
    n: int = 1,
    constant: Collection[int] = (),
) -> dict[str, float]:
    """Backpropagate ``loss / n`` over the pool that ``chunks`` make up, one chunk's activations at a time; the
    loss's logged parts. ``reps(chunk)`` gives a chunk's representations (a tuple of tensors, dim 0 its rows; None
    for one that is left out); ``loss(leaves)`` the loss over the pool's, each concatenated over the chunks.

    Each chunk is encoded without gradients, under a :class:`RandContext`; the loss over the whole pool gives the
    gradient of every representation (the positions in ``constant``, masks, take none); then each chunk is encoded
    again with gradients, drawing the same dropout masks, and backpropagates its representations' gradients. Loss
    and gradients equal one pass over the whole pool; memory is one chunk's activations plus the pool's
    representations.
    """
    states, first = [], []
    with torch.no_grad():
        for c in chunks:
            states.append(RandContext(device))
            first.append(reps(c))
    leaves: list[torch.Tensor | None] = []
    for j in range(len(first[0])):  # every representation of the pool, a leaf that collects its gradient
        got = [r[j] for r in first]
        present = [r for r in got if r is not None]
        if not present:
            leaves.append(None)
            continue
        assert len(present) == len(got), f"representation {j} is None in some chunks only"
        leaves.append(torch.cat(present).detach().requires_grad_(j not in constant))
    value, parts = loss(tuple(leaves))
    (value / n).backward()
    start = [0] * len(leaves)  # each representation's first row of the chunk
    for c, state in zip(chunks, states, strict=True):
        with state:
            again = reps(c)
        surrogate = torch.zeros((), device=device)
        for j, rep in enumerate(again):
            if rep is None or j in constant:
                continue
            leaf = leaves[j]
            assert leaf is not None and leaf.grad is not None  # present in every chunk, and the loss read it
            grad = leaf.grad[start[j] : start[j] + rep.shape[0]]
            surrogate = surrogate + (rep.float() * grad.float()).sum()
            start[j] += rep.shape[0]
        surrogate.backward()
    return parts
