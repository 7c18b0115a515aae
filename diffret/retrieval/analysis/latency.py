"""Latency as the paper measures it (section 5.4, Figures 1 and 3): encoding time against input length on
synthetic token sequences, the same way for every readout; warm-up runs excluded, CUDA synchronised, repeated
runs kept as min / median / max, and the machine and settings recorded with every row.

Pure functions over a loaded readout; the latency stage stores what they return.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from diffret.retrieval.models.readouts import Readout
from diffret.retrieval.models.sparse import excluded_ids
from diffret.retrieval.search.encodings import Encodings, SparseFlat, normalise
from diffret.retrieval.search.exact import SearchSettings, search_pass


@dataclass
class Timing:
    """Seconds of repeated runs of one thing, warm-up excluded."""

    min_s: float
    median_s: float
    max_s: float
    repeats: int

    def per(self, n: int) -> dict[str, float]:
        """Milliseconds per item of ``n`` items a run: ``{"min_ms", "median_ms", "max_ms"}``."""
        return {
            f"{k}_ms": round(1000 * v / max(1, n), 4)
            for k, v in (("min", self.min_s), ("median", self.median_s), ("max", self.max_s))
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1, device: torch.device | str = "cpu") -> Timing:
    """Time ``fn`` ``repeats`` times after ``warmup`` untimed runs, synchronising CUDA around each run.

    >>> t = measure(lambda: sum(range(1000)), repeats=3)
    >>> t.repeats, t.min_s <= t.median_s <= t.max_s
    (3, True)
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return Timing(min(times), statistics.median(times), max(times), repeats)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(model: torch.nn.Module | None = None, device: torch.device | str = "cpu") -> dict[str, Any]:
    """What a latency depends on besides the settings: the device (its name), the model's dtype and attention
    implementation, torch's thread count and the library versions.

    >>> env = environment()
    >>> sorted(env)[:4], env["device"]
    (['attention', 'cpu', 'device', 'device_name'], 'cpu')
    """
    import transformers

    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    cfg = getattr(model, "config", None)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.") if model is not None else None
    return {
        "device": device.type,
        "device_name": name,
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "attention": getattr(cfg, "_attn_implementation", None),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def synthetic_ids(tokenizer: Any, length: int, n: int = 1, seed: int = 0) -> list[list[int]]:
    """``n`` sequences of ``length`` token ids drawn (seeded) from ``tokenizer``'s vocabulary, its special tokens
    and placeholders left out: inputs of an exact length, whatever the text.

    >>> class Tok:
    ...     all_special_ids = [0]
    ...     def get_vocab(self): return {"[PAD]": 0, "a": 1, "b": 2}
    ...     def __len__(self): return 3
    >>> synthetic_ids(Tok(), 4, n=2)[0].__len__(), set(synthetic_ids(Tok(), 50)[0]) <= {1, 2}
    (4, True)
    """
    if length < 1 or n < 1:
        raise ValueError(f"length and n must be positive, got length={length}, n={n}")
    pool = torch.tensor(sorted(set(range(len(tokenizer))) - excluded_ids(tokenizer)), dtype=torch.long)
    if not pool.numel():
        raise ValueError("the tokenizer has no ordinary tokens to draw from")
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, pool.numel(), (n, length), generator=gen)
    return pool[picks].tolist()


@dataclass
class EncodeLatency:
    """One row of encoding latency: a readout's settings at one input length and batch size."""

    side: str
    length: int  # text tokens (before the prompt)
    batch_size: int
    k: int
    input_tokens: float  # mean model input length, the prompt counted
    slots: float  # mean slots read per text (PromptReps: decoded before it stopped)
    min_ms: float  # per text
    median_ms: float
    max_ms: float
    repeats: int


def encode_latency(
    reader: Readout,
    side: str,
    lengths: list[int],
    batch_sizes: list[int],
    k: int,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Encoding latency per text of ``reader`` at budget ``k`` for synthetic texts of each length, at each batch
    size (``batch_size`` texts a call; milliseconds per text). Lengths beyond what the readout takes are cut by
    it as real texts are (``input_tokens`` says what reached the model).
    """
    rows = []
    for length in lengths:
        for bs in batch_sizes:
            ids = synthetic_ids(reader.bb.tokenizer, length, bs, seed=seed + length)
            # the sparse filter reads the text, as it does for a query at search time
            texts = reader.bb.tokenizer.batch_decode(ids) if reader.filter is not None else None
            out = reader.encode(ids, texts, side, k)
            timing = measure(partial(reader.encode, ids, texts, side, k), repeats, warmup, reader.bb.device)
            row = EncodeLatency(
                side,
                length,
                bs,
                k,
                sum(e.n_tokens for e in out) / len(out),
                sum(e.dense.shape[0] for e in out) / len(out),
                **timing.per(bs),
                repeats=repeats,
            )
            rows.append(asdict(row))
    return rows


def synthetic_encodings(
    n: int, k: int, hidden: int, seed: int = 0, prefix: str = "d", device: torch.device | str = "cpu"
) -> Encodings:
    """``n`` texts of ``k`` random unit vectors each (``hidden`` wide, seeded), no sparse side: an index of any size
    for timing dense search.

    >>> e = synthetic_encodings(3, 2, 4)
    >>> len(e), tuple(e.multi.shape), bool(torch.allclose(e.multi.norm(dim=-1), torch.ones(3, 2)))
    (3, (3, 2, 4), True)
    """
    gen = torch.Generator().manual_seed(seed)
    multi = normalise(torch.randn((n, k, hidden), generator=gen)).to(device)
    empty = [np.zeros(0, np.int64)] * n
    return Encodings(
        [f"{prefix}{i}" for i in range(n)],
        multi,
        torch.ones((n, k), dtype=torch.bool, device=device),
        normalise(multi.mean(1)),
        empty,
        [np.zeros(0, np.float32)] * n,
        SparseFlat.from_lists(empty, [np.zeros(0, np.float32)] * n),
    )


@dataclass
class SearchLatency:
    """One row of exact search latency: an index size and budget, milliseconds per query."""

    engine: str
    index_type: str  # LanceDB's index ("none": its flat search); "" for exact search
    mode: str
    docs: int
    kq: int
    kp: int
    hidden: int
    queries: int
    topk: int
    min_ms: float
    median_ms: float
    max_ms: float
    repeats: int


def exact_search_latency(
    sizes: list[int],
    kq: int,
    kp: int,
    hidden: int,
    modes: list[str],
    *,
    queries: int = 16,
    topk: int = 100,
    repeats: int = 3,
    warmup: int = 1,
    device: torch.device | str = "cpu",
) -> list[dict[str, Any]]:
    """Exact search (the block scorer, :func:`retrieval.search.exact.search_pass`) over synthetic indexes of each
    size: milliseconds per query for a batch of ``queries``, single-vector or multi-vector (K_q against K_p).
    """
    q = synthetic_encodings(queries, kq, hidden, seed=1, prefix="q", device=device)
    rows = []
    for n in sizes:
        docs = synthetic_encodings(n, kp, hidden, seed=2 + n, device=device)
        for mode in modes:
            st = SearchSettings(topk=min(topk, n))
            timing = measure(partial(search_pass, {kq: q}, [docs], [mode], st), repeats, warmup, device)
            rows.append(
                asdict(
                    SearchLatency(
                        "exact", "", mode, n, kq, kp, hidden, queries, st.topk, **timing.per(queries), repeats=repeats
                    )
                )
            )
    return rows


def lance_search_latency(
    sizes: list[int],
    kq: int,
    kp: int,
    hidden: int,
    workdir: str,
    *,
    queries: int = 16,
    topk: int = 100,
    index_type: str = "auto",
    repeats: int = 3,
    warmup: int = 1,
) -> list[dict[str, Any]]:
    """LanceDB search (:func:`retrieval.search.lance.search`: multivector candidates, exact MaxSim re-rank) over
    synthetic tables of each size built under ``workdir``: milliseconds per query. ``index_type`` ``auto``:
    IVF_PQ where the table holds enough vectors to train it, else LanceDB's flat search (``none``).
    """
    from diffret.retrieval.search import lance

    q = synthetic_encodings(queries, kq, hidden, seed=1, prefix="q")
    qs = [q.multi[i].numpy() for i in range(queries)]
    rows = []
    for n in sizes:
        docs = synthetic_encodings(n, kp, hidden, seed=2 + n)
        db = f"{workdir}/docs-{n}-{kp}"
        lance.build_table(db, [(docs.ids, docs.multi.numpy())], hidden)
        kind = index_type
        if kind == "auto":
            need = lance.min_vectors_for_index(
                "IVF_PQ", lance.default_index_params("IVF_PQ", n * kp, hidden)["num_partitions"]
            )
            kind = "IVF_PQ" if n * kp >= need else "none"
        lance.create_index(db, kind)  # type: ignore[arg-type]
        k = min(topk, n)
        timing = measure(partial(lance.search, db, qs, k), repeats, warmup)
        mode = "single_dense" if kq == kp == 1 else "multi_dense"
        rows.append(
            asdict(
                SearchLatency(
                    "lance", kind, mode, n, kq, kp, hidden, queries, k, **timing.per(queries), repeats=repeats
                )
            )
        )
    return rows
