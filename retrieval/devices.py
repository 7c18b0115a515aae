"""Where tensors go: one device resolver for encoding, scoring and training."""

from __future__ import annotations

import os

import torch


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> the first GPU when there is one, else the CPU; any other name as torch reads it. Under a
    launcher (torchrun, accelerate: ``LOCAL_RANK`` set) ``auto`` and ``cuda`` mean this process's own GPU.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        return torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
    return torch.device(device)
