"""Scoring over compressed encodings against float16, in one process on the same vectors.

    python benchmarks/compress.py                               # 20,000 passages x K_p 16, H 128
    python benchmarks/compress.py --passages 50000 --hidden 256 --stores int8 residual:2 pq:32

What is timed is what the score stage does with a passage folder: read each shard's Parquet bytes, decode its
vectors (``encodings_from_table``, retrieval/search/codecs.py), and run ``search_pass`` (multi_dense and single_dense,
running top-100) under ``--block-mb``. The vectors are synthetic but clustered (points around random centres, as a
model's are), coded per storage choice with a codebook trained on a seeded sample of them. Per choice it prints:
bytes per vector on disk, float16's time over its own (higher: faster), recall@10 of its top 10 against
float16's, and the peak memory the scoring added above the process before it (resident set, sampled every
millisecond, glibc made to return large blocks when freed), beside the ``--block-mb`` budget and one decoded
shard (float32), which the budget does not cover: the decoded shard, the scoring blocks and the running top-k.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffret.retrieval.search.codecs import Codec, compress_table, parse_store, train_codebook, vectors_of  # noqa: E402
from diffret.retrieval.search.encodings import encodings_from_table  # noqa: E402
from diffret.retrieval.search.exact import SearchSettings, search_pass  # noqa: E402
from diffret.stages.codebooks import codebook_sample  # noqa: E402
from diffret.storage.layout import encodings_schema  # noqa: E402


def clustered(n: int, k: int, h: int, centres: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centres, h)).astype(np.float32)
    x = c[rng.integers(0, centres, n * k)] + 0.35 * rng.standard_normal((n * k, h)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).reshape(n, k, h)


def shard_table(x: np.ndarray, start: int) -> pa.Table:
    n, k, h = x.shape
    flat = pa.array(x.astype(np.float16).reshape(-1))
    inner = pa.FixedSizeListArray.from_arrays(flat, h)
    dense = pa.ListArray.from_arrays(pa.array(np.arange(0, n * k + 1, k, dtype=np.int32)), inner)
    cols = {
        "id": pa.array([f"d{start + i}" for i in range(n)]),
        "n_reps": pa.array(np.full(n, k, np.int16)),
        "dense": dense,
        "sparse_ids": pa.array([[]] * n, pa.list_(pa.int32())),
        "sparse_weights": pa.array([[]] * n, pa.list_(pa.float32())),
        "n_tokens": pa.array(np.full(n, 8, np.int32)),
        "stopped": pa.array([False] * n),
        "tokens": pa.array([[]] * n, pa.list_(pa.int32())),
    }
    return pa.table(cols, schema=encodings_schema(h))


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def vector_column_bytes(data: bytes) -> int:
    md = pq.ParquetFile(io.BytesIO(data)).metadata
    return sum(
        md.row_group(g).column(c).total_compressed_size
        for g in range(md.num_row_groups)
        for c in range(md.num_columns)
        if md.row_group(g).column(c).path_in_schema.split(".")[0] in ("dense", "codes")
    )


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRSS:
    """The largest resident set seen while the block runs (sampled every millisecond), above the one before it."""

    def __enter__(self) -> PeakRSS:
        gc.collect()
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())

    @property
    def added_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def score(shards: list[bytes], queries: object, codec: Codec | None, settings: SearchSettings) -> tuple:
    def stream():  # noqa: ANN202
        for data in shards:
            yield encodings_from_table(pq.read_table(io.BytesIO(data)), codec=codec)

    return search_pass({8: queries}, stream(), ["multi_dense", "single_dense"], settings)


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # large blocks mmapped and given back when freed: the resident
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # set then measures each run, not glibc's cache
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=20_000)
    ap.add_argument("--kp", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--kq", type=int, default=8)
    ap.add_argument("--shard", type=int, default=2_000, help="passages per shard")
    ap.add_argument("--block-mb", type=float, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stores", nargs="+", default=["float16", "int8", "residual:2", "residual:4", "pq:32"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    centres = max(64, args.passages // 20)
    docs = clustered(args.passages, args.kp, args.hidden, centres, seed=0)
    qs = clustered(args.queries, args.kq, args.hidden, centres, seed=1)
    queries = encodings_from_table(shard_table(qs, 0))
    tables = [shard_table(docs[s : s + args.shard], s) for s in range(0, args.passages, args.shard)]
    settings = SearchSettings(topk=100, block_bytes=int(args.block_mb * 2**20))
    decoded_mb = args.shard * args.kp * args.hidden * 4 / 2**20
    print(
        f"{args.passages:,} passages x K_p {args.kp}, H {args.hidden}, {args.queries} queries x K_q {args.kq}, "
        f"shards of {args.shard:,} (one decoded: {decoded_mb:.0f} MB), --block-mb {args.block_mb:g}, "
        f"{args.threads} thread(s), best of {args.repeats}"
    )
    print("| store | bytes / vector | float16 time / this | recall@10 (multi) | recall@10 (single) | peak added MB |")
    print("|---|---:|---:|---:|---:|---:|")
    base_time, base_top = None, None
    by_name = {f"shard={i:05d}": t for i, t in enumerate(tables)}
    names = sorted(by_name)
    for spec in ["float16"] + [s for s in args.stores if s != "float16"]:
        cb = None
        if parse_store(spec).trained:
            x = codebook_sample(names, lambda s: vectors_of(by_name[s]), 65536, seed=0)
            cb = train_codebook(x, spec, seed=0, n_corpus=args.passages * args.kp)
        codec = None if spec == "float16" else Codec(spec, args.hidden, cb)
        shards = [parquet_bytes(t if codec is None else compress_table(t, codec)) for t in tables]
        per_vector = sum(vector_column_bytes(d) for d in shards) / (args.passages * args.kp)
        score(shards, queries, codec, settings)  # warm-up
        times = []
        for _ in range(args.repeats):
            with PeakRSS() as mem:
                start = time.perf_counter()
                tops, _ = score(shards, queries, codec, settings)
                times.append(time.perf_counter() - start)
        best = min(times)
        top = {m: tops[8, m].index[:, :10] for m in ("multi_dense", "single_dense")}
        if base_time is None:
            base_time, base_top = best, top
        recall = {
            m: np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top[m], base_top[m], strict=True)]) for m in top
        }
        print(
            f"| {spec} | {per_vector:.1f} | {base_time / best:.2f}x ({best:.2f} s) | {recall['multi_dense']:.3f} | "
            f"{recall['single_dense']:.3f} | {mem.added_mb:.0f} |"
        )


if __name__ == "__main__":
    main()
