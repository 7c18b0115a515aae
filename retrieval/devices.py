"""Where tensors go: one device resolver for encoding, scoring and training."""

from __future__ import annotations

import torch


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> the first GPU when there is one, else the CPU; any other name as torch reads it.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
