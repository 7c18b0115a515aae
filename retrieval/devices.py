"""Where tensors go: one device resolver for encoding, scoring and training."""

from __future__ import annotations

import os

import torch


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> the first GPU when there is one, else the CPU; any other name as torch reads it. Under a
    launcher (torchrun, accelerate: ``LOCAL_RANK`` set) ``auto`` and ``cuda`` mean this process's own GPU.

    A device this process cannot use (CUDA on a CPU-only torch or machine, a GPU index beyond the count, a name
    torch does not know) is a ValueError saying so, before any work.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        why = str(exc).splitlines()[0]
        raise ValueError(f"unknown device {device!r} ({why}); use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(f"--device {device}: CUDA is not available here (torch {torch.__version__}, {build}, "
                             "no usable GPU); use --device cpu or auto")  # fmt: skip
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s)")
    return dev
