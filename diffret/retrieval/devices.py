"""Where tensors go: one device resolver for encoding, scoring and training, and which GPU each worker of a
cluster is given (one per GPU: :func:`place_workers`), or how many CPU workers it has (one per core at most:
:func:`count_cpu_workers`)."""

from __future__ import annotations

import math
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
            raise ValueError(
                f"--device {device}: CUDA is not available here (torch {torch.__version__}, {build}, "
                "no usable GPU); use --device cpu or auto"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s)")
    return dev


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as the machine names them: the entries of ``CUDA_VISIBLE_DEVICES`` when it is
    set (indices or UUIDs), else ``0 .. n-1``; none without a usable CUDA.

    >>> isinstance(visible_gpus(), list)
    True
    """
    if not torch.cuda.is_available():
        return []
    n = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(n)]
    return [x.strip() for x in listed.split(",") if x.strip()][:n]


def wants_gpu(device: str, gpus: list[str]) -> bool:
    """Whether a unit set to ``device`` computes on a GPU when ``gpus`` are visible (``auto`` takes one if any).

    >>> wants_gpu("auto", ["0"]), wants_gpu("auto", []), wants_gpu("cuda:1", []), wants_gpu("cpu", ["0"])
    (True, False, True, False)
    """
    return device.startswith("cuda") or (device == "auto" and bool(gpus))


def place_workers(workers: int, gpus: list[str], per_gpu: int = 1) -> list[str]:
    """The GPU each of a local cluster's workers is pinned to (its ``CUDA_VISIBLE_DEVICES``), in worker order:
    one worker per GPU, ``workers`` of them (``-1``: one per GPU). More workers than GPUs is refused in one line
    naming both, unless ``per_gpu`` lets a GPU hold that many workers (they share its memory).

    >>> place_workers(-1, ["0", "1", "2", "3"])
    ['0', '1', '2', '3']
    >>> place_workers(3, ["0", "1"], per_gpu=2)
    ['0', '1', '0']
    >>> try:
    ...     place_workers(8, ["0", "1", "2", "3"])
    ... except ValueError as exc:
    ...     print(str(exc)[:63])
    --workers 8 is more than the 4 GPU(s) visible here (0, 1, 2, 3)
    """
    if not gpus:
        raise ValueError("no GPU is visible here (CUDA_VISIBLE_DEVICES, torch.cuda); use --device cpu")
    n = len(gpus) if workers < 0 else workers
    if n > len(gpus) * per_gpu:
        need = math.ceil(n / len(gpus))
        raise ValueError(
            f"--workers {n} is more than the {len(gpus)} GPU(s) visible here ({', '.join(gpus)}): each "
            f"worker gets a GPU of its own; use --workers {len(gpus) * per_gpu} or fewer, or "
            f"--workers-per-gpu {need} to put {need} workers on each GPU"
        )
    return [gpus[i % len(gpus)] for i in range(n)]


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, which a container or ``taskset`` narrows; the
    machine's count where the system does not say).

    >>> cpu_cores() >= 1
    True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def count_cpu_workers(workers: int, cores: int, per_core: int = 1) -> int | None:
    """How many CPU workers a local cluster starts: ``workers`` (``-1``: None, Dask's default count). More workers
    than cores is refused in one line naming both (each runs one unit at a time and computes: more only contend for
    the same cores and memory), unless ``per_core`` lets a core hold that many.

    >>> count_cpu_workers(2, 2), count_cpu_workers(-1, 2), count_cpu_workers(64, 2, per_core=32)
    (2, None, 64)
    >>> try:
    ...     count_cpu_workers(64, 2)
    ... except ValueError as exc:
    ...     print(str(exc).split(":")[0])
    --workers 64 is more than the 2 CPU core(s) here
    """
    if workers < 0:
        return None
    if workers > cores * per_core:
        need = math.ceil(workers / cores)
        raise ValueError(
            f"--workers {workers} is more than the {cores} CPU core(s) here: each worker computes one "
            f"unit at a time on a core of its own; use --workers {cores * per_core} or fewer, or "
            f"--workers-per-core {need} to put {need} workers on each core"
        )
    return workers


def gpu_name(dev: torch.device) -> str:
    """A device as the machine names it: ``cuda:0`` of a worker pinned to GPU 3 (``CUDA_VISIBLE_DEVICES=3``) is
    ``cuda:0 (GPU 3)``; the CPU is ``cpu``.

    >>> gpu_name(torch.device("cpu"))
    'cpu'
    """
    if dev.type != "cuda":
        return str(dev)
    listed = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    index = dev.index or 0
    return f"{dev} (GPU {listed[index]})" if index < len(listed) else str(dev)


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


def free_memory(device: torch.device) -> int | None:
    """The memory free on ``device`` now: a GPU's free memory (``torch.cuda.mem_get_info``); on the CPU, what
    :func:`memory_bytes` reads (the memory available, within a cgroup limit). None when it cannot be read.

    >>> free_memory(torch.device("cpu")) > 0
    True
    """
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    return memory_bytes(device)
