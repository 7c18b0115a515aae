"""Scoring one K_p pass on Dask workers: 2 workers against 1 on the same synthetic store, the runs
compared byte for byte, and each worker's peak memory against ``--block-mb`` plus one shard.

    python benchmarks/distributed_scoring.py                 # 200k passages x K_p 16 x H 128, 128 queries, 8 units
    python benchmarks/distributed_scoring.py --passages 20000 --root /tmp/ds   # smaller; keep the store

The store is built through the store API as encode would leave it (a dataset, a registered system, a query folder
at K_q and a passage folder at K_p in shards), with synthetic unit-norm vectors drawn from a pool (Gaussian, H
dims) and sparse vectors of ~60 terms (Zipf) per passage, ~10 per query. Then ``diffret score`` (the stage, through
``flows.runner.run_stage``) runs every mode (the fusions included) on a local Dask cluster of N CPU workers (one
thread each, as ``--workers`` starts them: ``flows.cluster.local_cluster``) that the benchmark starts and joins
(``--dask-address``), so that it can read each worker's resident set once the code a unit runs is loaded, and its
peak while scoring (sampled every millisecond). The pass is cut into units of
``--unit-passages``; the time is the stage's wall time, planning and the merge included.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffret.flows.cluster import WORKER_ENV, local_cluster  # noqa: E402
from diffret.flows.runner import run_stage  # noqa: E402
from diffret.schemas import encodings_schema  # noqa: E402
from diffret.stages import stages  # noqa: E402
from diffret.stages.score import ScoreConfig  # noqa: E402
from diffret.stages.systems import SystemRecord, SystemRef, register  # noqa: E402
from diffret.storage import ArtifactStore, Manifest  # noqa: E402
from diffret.storage.layout import DATASET_TABLES, dataset_dir, encodings_dir, shard_name  # noqa: E402

SYSTEM = "synthetic-diffretriever-h128"
VOCAB = 150_000
POOL = 1 << 16


def _vectors(rng: np.random.Generator, pool: np.ndarray, n: int, k: int) -> np.ndarray:
    return pool[rng.integers(0, len(pool), n * k)].reshape(n, k, pool.shape[1])


def _sparse(rng: np.random.Generator, n: int, nnz: int) -> tuple[list[list[int]], list[list[float]]]:
    ids, weights = [], []
    for length in np.clip(rng.poisson(nnz, n), 1, 4 * nnz):
        terms = np.unique((rng.zipf(1.2, length) - 1) % VOCAB)
        ids.append(terms.astype(np.int32).tolist())
        weights.append(np.round(rng.random(len(terms)) * 2 + 0.05, 2).astype(np.float32).tolist())
    return ids, weights


def encodings_table(ids: list[str], x: np.ndarray, sparse: tuple[list, list]) -> pa.Table:
    n, k, h = x.shape
    inner = pa.FixedSizeListArray.from_arrays(pa.array(x.astype(np.float16).reshape(-1)), h)
    dense = pa.ListArray.from_arrays(pa.array(np.arange(0, n * k + 1, k, dtype=np.int32)), inner)
    cols = {
        "id": pa.array(ids),
        "n_reps": pa.array(np.full(n, k, np.int16)),
        "dense": dense,
        "sparse_ids": pa.array(sparse[0], pa.list_(pa.int32())),
        "sparse_weights": pa.array(sparse[1], pa.list_(pa.float32())),
        "n_tokens": pa.array(np.full(n, 64, np.int32)),
        "stopped": pa.array([False] * n),
        "tokens": pa.array([[]] * n, pa.list_(pa.int32())),
    }
    return pa.table(cols, schema=encodings_schema(h))


def encoded_folder(store: ArtifactStore, side: str, k: int, tables: Iterator[pa.Table]) -> None:
    """A folder of encodings shards, written and recorded one shard at a time."""
    folder = encodings_dir(SYSTEM, "synth", side, k)
    part = {"system": SYSTEM, "dataset": "synth", "side": side, "k": str(k)}
    m, _ = store.open_sharded(folder, "encodings", part, {"synthetic": True, "k": k})
    for i, t in enumerate(tables):
        store.record_shard(folder, shard_name(i), store.write_shard(folder, shard_name(i), t), m.config_hash)
    store.compact_shards(folder)


def build_store(root: str, passages: int, queries: int, kp: int, kq: int, hidden: int, shard: int) -> None:
    """A store holding what ``diffret encode`` would: the dataset, the system, its query and passage encodings."""
    store = ArtifactStore(root)
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((POOL, hidden), dtype=np.float32)
    pool /= np.linalg.norm(pool, axis=1, keepdims=True)
    qids, dids = [f"q{i}" for i in range(queries)], [f"d{i:07d}" for i in range(passages)]
    tables = {
        "corpus": pa.table(
            {
                "doc_id": dids,
                "title": [""] * passages,
                "text": [""] * passages,
                "metadata": pa.nulls(passages, pa.string()),
            },
            schema=DATASET_TABLES["corpus"],
        ),
        "queries": pa.table(
            {
                "query_id": qids,
                "text": [""] * queries,
                "split": ["test"] * queries,
                "metadata": pa.nulls(queries, pa.string()),
            },
            schema=DATASET_TABLES["queries"],
        ),
        "qrels": pa.table(
            {"query_id": qids, "doc_id": dids[:queries], "relevance": [1] * queries, "split": ["test"] * queries},
            schema=DATASET_TABLES["qrels"],
        ),
    }
    with store.folder_writer(
        dataset_dir("synth"), Manifest.new("datasets", {"dataset": "synth"}, {"n": passages})
    ) as w:
        for name, t in tables.items():
            w.write_parquet(f"{name}.parquet", t.schema, [t])
    register(
        store,
        SystemRecord(
            system=SYSTEM,
            kind="encoder",
            model="synthetic",
            readout="diffretriever",
            multi_vector=True,
            has_sparse=True,
            settings={"hidden": hidden},
        ),
    )
    q = encodings_table(qids, _vectors(rng, pool, queries, kq), _sparse(rng, queries, 10))
    encoded_folder(store, "query", kq, iter([q]))

    def passage_shards() -> Iterator[pa.Table]:
        for a in range(0, passages, shard):
            n = min(shard, passages - a)
            yield encodings_table(dids[a : a + n], _vectors(rng, pool, n, kp), _sparse(rng, n, 60))

    encoded_folder(store, "passage", kp, passage_shards())


def digests(root: str) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).glob("runs/**/run.parquet"))
    }


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _warm() -> float:
    """A worker's resident set once the code a unit runs is loaded (imports, BLAS and sparse kernels, Parquet
    decoding: a tiny search in every mode), before any unit: its idle size."""
    import gc

    import pyarrow.parquet as pq

    from diffret.retrieval.search.encodings import encodings_from_table
    from diffret.retrieval.search.exact import SearchSettings, search_pass

    rng = np.random.default_rng(1)
    pool = rng.standard_normal((64, 8), dtype=np.float32)
    tiny = encodings_table([f"x{i}" for i in range(16)], _vectors(rng, pool, 16, 2), _sparse(rng, 16, 5))
    path = Path(tempfile.mkdtemp()) / "t.parquet"
    pq.write_table(tiny, path)
    enc = encodings_from_table(pq.read_table(path))
    search_pass({2: enc}, [enc], ["single_dense", "multi_dense", "sparse_max"], SearchSettings(topk=4))
    shutil.rmtree(path.parent)
    gc.collect()
    return _rss_mb()


def _start(dask_worker) -> None:  # noqa: ANN001
    """Sample this worker's resident set every millisecond until :func:`_stop` (state kept on the worker)."""
    import threading

    state = {"peak": _rss_mb(), "stop": threading.Event()}

    def watch() -> None:
        while not state["stop"].wait(0.001):
            state["peak"] = max(state["peak"], _rss_mb())

    state["thread"] = threading.Thread(target=watch, daemon=True)
    state["thread"].start()
    dask_worker.diffret_rss = state


def _stop(dask_worker) -> float:  # noqa: ANN001
    state = dask_worker.diffret_rss
    state["stop"].set()
    state["thread"].join()
    return max(state["peak"], _rss_mb())


def shard_peak(root: str, kp: int) -> float:
    """What reading and decoding one passage shard adds to a warm process's resident set (MB): its Parquet decoding
    (scratch that Arrow's allocator keeps and reuses for the next shard) and its float32 vectors; measured in a child
    process, after :func:`_warm`."""
    code = (
        f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]\n"
        "import distributed_scoring as ds, compress\n"
        "from diffret.storage import ArtifactStore\n"
        "from diffret.stages.readers import encoding_manifest, iter_encodings\n"
        f"ds._warm(); store = ArtifactStore({root!r})\n"
        f"stage = ds.encodings_dir(ds.SYSTEM, 'synth', 'passage', {kp})\n"
        "m = encoding_manifest(store, stage)\n"
        "with compress.PeakRSS() as p:\n"
        "    e = next(iter_encodings(store, stage, m))\n"
        "print(p.added_mb)\n"
    )
    env = {**os.environ, **WORKER_ENV}  # as the workers run (flows.cluster.local_cluster)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.split()[-1])


def score_on(root: str, workers: int, args: argparse.Namespace) -> dict:
    import distributed

    shutil.rmtree(Path(root, "runs"), ignore_errors=True)  # every run scores every cell
    with local_cluster(n_workers=workers) as cluster, distributed.Client(cluster, set_as_default=False) as client:
        client.wait_for_workers(workers)
        idle = client.run(_warm)
        config = ScoreConfig(
            root=root,
            dataset="synth",
            system=SystemRef(system=SYSTEM),
            kq=[args.kq],
            kp=[args.kp],
            topk=args.topk,
            block_mb=args.block_mb,
            unit_passages=args.unit_passages,
            dask_address=cluster.scheduler_address,
        )
        client.run(_start)
        start = time.perf_counter()
        res = run_stage(stages()["score"], config, log=lambda m: print("   ", m, flush=True))
        seconds = time.perf_counter() - start
        peak = client.run(_stop)
    added = {w: peak[w] - idle[w] for w in peak}
    print(f"    {seconds:.1f} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    return {
        "workers": workers,
        "seconds": seconds,
        "cells": res.done,
        "idle_mb": idle,
        "peak_mb": peak,
        "added_mb": max(added.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passages", type=int, default=200_000)
    ap.add_argument("--queries", type=int, default=128)
    ap.add_argument("--kp", type=int, default=16)
    ap.add_argument("--kq", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--shard", type=int, default=5000, help="passages per shard")
    ap.add_argument("--unit-passages", type=int, default=None, help="default: an eighth of --passages (8 units)")
    ap.add_argument("--block-mb", type=float, default=64)
    ap.add_argument("--topk", type=int, default=1000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--root", default=None, help="keep the synthetic store here (default: a temporary folder)")
    args = ap.parse_args()
    args.unit_passages = args.unit_passages or max(1, args.passages // 8)
    root = args.root or tempfile.mkdtemp(prefix="diffret-dist-")
    try:
        if not Path(root, "encodings").exists():
            t = time.perf_counter()
            build_store(root, args.passages, args.queries, args.kp, args.kq, args.hidden, args.shard)
            print(
                f"store: {args.passages:,} passages x K_p {args.kp} x H {args.hidden} in shards of {args.shard:,} "
                f"({sum(f.stat().st_size for f in Path(root, 'encodings').rglob('*.parquet')) / 2**20:,.0f} MB), "
                f"{args.queries} queries x K_q {args.kq}; built in {time.perf_counter() - t:.0f} s",
                flush=True,
            )
        shard_mb = shard_peak(root, args.kp)
        decoded = args.shard * (args.kp + 1) * args.hidden * 4 / 2**20  # its float32 vectors and their means
        cells = 3  # base modes at one K_q: the running top-k (8 bytes a slot), the unit's table and file (~24 more)
        state = (args.queries * args.kq * args.hidden * 4 + cells * args.queries * args.topk * 32) / 2**20
        results, runs = [], []
        for n in args.workers:
            print(f"score on {n} worker(s):", flush=True)
            results.append(score_on(root, n, args))
            runs.append(digests(root))
        print(
            f"\none shard read and decoded: +{shard_mb:,.0f} MB ({decoded:,.0f} MB of float32 vectors, the rest its "
            "Parquet decoding, kept by Arrow's allocator for the next shard)"
        )
        print(f"the pass's state in a worker: {state:,.0f} MB (queries, running top-k, the unit's partial top-k)")
        print(
            "\n| workers | time | speed-up | runs as 1 worker's | idle RSS / worker | peak RSS / worker | added | "
            "--block-mb + one shard + state |\n|---:|---:|---:|---|---:|---:|---:|---:|"
        )
        for r, d in zip(results, runs, strict=True):
            idle = max(r["idle_mb"].values())
            peak = max(r["peak_mb"].values())
            bound = args.block_mb + shard_mb + state
            print(
                f"| {r['workers']} | {r['seconds']:.1f} s | {results[0]['seconds'] / r['seconds']:.2f}x | "
                f"{'identical' if d == runs[0] else 'DIFFERENT'} ({len(d)} runs) | {idle:,.0f} MB | {peak:,.0f} MB | "
                f"{r['added_mb']:,.0f} MB | {bound:,.0f} MB ({'within' if r['added_mb'] <= bound else 'ABOVE'}) |"
            )
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    os._exit(0)  # the Dask clusters are closed; skip interpreter teardown of their threads


if __name__ == "__main__":
    main()
