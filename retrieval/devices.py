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


def memory_bytes(device: torch.device) -> int | None:
    """The memory a job on ``device`` may use: a GPU's total memory; on the CPU, the memory available now (and
    under a cgroup limit, what the limit leaves). None when it cannot be read.

    >>> memory_bytes(torch.device("cpu")) > 0
    True
    """
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type != "cpu":
        return None
    try:
        import psutil

        free: int | None = int(psutil.virtual_memory().available)
    except ImportError:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            free = None
    try:  # cgroup v2: the container's limit, less what it uses
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            left = int(limit) - int(open("/sys/fs/cgroup/memory.current").read())
            free = left if free is None else min(free, left)
    except (OSError, ValueError):
        pass
    return free
