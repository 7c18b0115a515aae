"""LanceDB multivector search (ANN + exact MaxSim re-rank) vs exact brute-force MaxSim on synthetic clustered data.

    python benchmarks/search_lance.py [--docs 100000 1000000] [--hidden 128] [--kp 4] [--kq 8] [--queries 100]

Documents are generated batch by batch (deterministically, so the exact reference regenerates them instead of
keeping them): topics -> clusters -> per-document vectors around the cluster centre. Queries perturb some documents'
vectors, so every query has true neighbours. For each size it builds the table, trains the ANN index, runs the
queries through ``retrieval.lance_index.search`` (k=10 and k=100) and a chunked torch brute force, and prints
docs, build s, index s, ANN mean/p95 ms per query, exact ms per query, recall@10 / @100 and the over-fetch used.

Memory: the table is streamed in and the reference is streamed over docs, so the process holds one batch of
documents plus the index build's working set (peak RSS is printed); the table on disk is docs * K_p * H * 4 bytes
(1M x 4 x 128 float32 = 2 GB, float16 halves it).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from retrieval.search import lance as li


class Corpus:
    """Synthetic multi-vector documents, regenerable batch by batch."""

    def __init__(self, n: int, hidden: int, kp: int, variable: bool, seed: int = 0, batch: int = 5000):
        self.n, self.hidden, self.kp, self.variable, self.seed, self.batch = n, hidden, kp, variable, seed, batch
        rng = np.random.default_rng([seed, 0])
        topics = _unit(rng.standard_normal((max(8, n // 5000), hidden)))
        n_clusters = max(16, n // 50)
        self.centres = _unit(
            topics[rng.integers(0, len(topics), n_clusters)] + 0.8 * _unit(rng.standard_normal((n_clusters, hidden)))
        )

    def batches(self) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
        """(doc ids, vectors [b, K_p, H] float16, vector counts [b]) per batch."""
        h, kp = self.hidden, self.kp
        for b_idx, s in enumerate(range(0, self.n, self.batch)):
            rng = np.random.default_rng([self.seed, 1, b_idx])
            b = min(self.batch, self.n - s)
            cluster = rng.integers(0, len(self.centres), b)
            noise = rng.standard_normal((b, kp, h), dtype=np.float32) / np.sqrt(h)
            x = (self.centres[cluster][:, None, :] + noise).astype(np.float16)
            counts = rng.integers(1, kp + 1, b) if self.variable else np.full(b, kp)
            yield [f"d{i}" for i in range(s, s + b)], x, counts

    def for_lance(self) -> Iterator[tuple[list[str], list[np.ndarray]]]:
        for ids, x, counts in self.batches():
            yield ids, [x[j, : counts[j]] for j in range(len(ids))]


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def make_queries(corpus: Corpus, nq: int, kq: int, noise: float = 0.7, seed: int = 1) -> list[np.ndarray]:
    """Perturbed copies of ``nq`` random documents' vectors (K_q of them, drawn with replacement)."""
    rng = np.random.default_rng(seed)
    wanted = set(rng.choice(corpus.n, size=min(nq, corpus.n), replace=False).tolist())
    out = []
    for ids, x, counts in corpus.batches():
        for j, doc_id in enumerate(ids):
            if int(doc_id[1:]) in wanted:
                base = x[j, : counts[j]].astype(np.float32)
                pick = base[rng.integers(0, len(base), kq)]
                out.append(
                    pick + noise * rng.standard_normal((kq, corpus.hidden)).astype(np.float32) / np.sqrt(corpus.hidden)
                )
    return out


def exact_topk(corpus: Corpus, queries: list[np.ndarray], k: int) -> tuple[list[list[str]], float]:
    """Brute-force MaxSim top-``k`` ids per query (running top-k over doc batches) and the scoring seconds."""
    kq = queries[0].shape[0]
    q = torch.from_numpy(np.stack([li.l2_normalise(x) for x in queries]))  # [nq, kq, H]
    nq = q.shape[0]
    best_s = torch.full((nq, k), -float("inf"))
    best_i = torch.full((nq, k), -1, dtype=torch.long)
    seconds = 0.0
    for ids, x, counts in corpus.batches():
        t0 = time.perf_counter()
        d = torch.from_numpy(x).float()
        d = d / d.norm(dim=-1, keepdim=True)  # [b, kp, H]
        sims = (q.reshape(-1, corpus.hidden) @ d.reshape(-1, corpus.hidden).T).view(nq, kq, len(ids), corpus.kp)
        if corpus.variable:  # vectors beyond a document's count do not exist
            pad = torch.arange(corpus.kp)[None, :] >= torch.from_numpy(counts)[:, None]  # [b, kp]
            sims.masked_fill_(pad[None, None], -float("inf"))
        scores = sims.amax(dim=-1).sum(dim=1) / kq  # [nq, b]
        first = int(ids[0][1:])
        cat_s = torch.cat([best_s, scores], dim=1)
        cat_i = torch.cat([best_i, torch.arange(first, first + len(ids)).expand(nq, -1)], dim=1)
        best_s, pos = cat_s.topk(k, dim=1)
        best_i = cat_i.gather(1, pos)
        seconds += time.perf_counter() - t0
    out = []
    for s_row, i_row in zip(best_s.tolist(), best_i.tolist(), strict=True):
        out.append([f"d{i}" for _, i in sorted(zip(s_row, i_row, strict=True), key=lambda t: (-t[0], f"d{t[1]}"))])
    return out, seconds


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_one(args: argparse.Namespace, n: int, root: Path) -> dict:
    corpus = Corpus(n, args.hidden, args.kp, args.variable, seed=args.seed, batch=args.batch)
    db = str(root / f"lance_{n}")
    t0 = time.perf_counter()
    rows = li.build_table(db, corpus.for_lance(), args.hidden, dtype=args.dtype)
    build_s = time.perf_counter() - t0
    info = li.create_index(db, args.index)
    queries = make_queries(corpus, args.queries, args.kq)
    exact, exact_s = exact_topk(corpus, queries, 100)
    kw = {"overfetch": args.overfetch, "nprobes": args.nprobes}
    li.search(db, queries[:5], 10, **kw)  # warm the index cache
    r10 = li.search(db, queries, 10, **kw)
    r100 = li.search(db, queries, 100, **kw)
    return {
        "docs": rows,
        "vectors": info.vectors,
        "build_s": build_s,
        "index_s": info.seconds,
        "partitions": info.params.get("num_partitions", 0),
        "ann_mean": r10.stats.mean_ms,
        "ann_p95": r10.stats.p95_ms,
        "ann100_mean": r100.stats.mean_ms,
        "exact_ms": 1000 * exact_s / len(queries),
        "r10": li.recall_at([e[:10] for e in exact], [[d for d, _ in h] for h in r10], 10),
        "r100": li.recall_at(exact, [[d for d, _ in h] for h in r100], 100),
        "overfetch": args.overfetch,
        "nprobes": f"{r10.stats.nprobes}/{r100.stats.nprobes}",
        "disk_gb": _dir_bytes(Path(db)) / 2**30,
        "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--kp", type=int, default=4, help="vectors per document (the maximum with --variable)")
    ap.add_argument("--kq", type=int, default=8, help="vectors per query")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--variable", action="store_true", help="1..K_p vectors per document instead of K_p")
    ap.add_argument("--index", default="IVF_PQ", choices=li.INDEX_TYPES)
    ap.add_argument("--overfetch", type=int, default=li.DEFAULT_OVERFETCH)
    ap.add_argument("--nprobes", type=int, default=None, help="IVF partitions probed (LanceDB's default if unset)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--batch", type=int, default=5000, help="documents per generated batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default=None, help="folder for the LanceDB databases (default: a temporary one)")
    args = ap.parse_args()

    tmp = None if args.root else tempfile.mkdtemp(prefix="search_lance_")
    root = Path(args.root or tmp)
    root.mkdir(parents=True, exist_ok=True)
    head = (
        f"{'docs':>9} {'vectors':>9} {'build s':>8} {'index s':>8} {'parts':>6} {'ANN ms':>7} {'p95 ms':>7} "
        f"{'ANN@100':>8} {'exact ms':>9} {'R@10':>6} {'R@100':>6} {'overf':>5} {'nprobes':>8} "
        f"{'disk GB':>7} {'RSS GB':>6}"
    )
    print(
        f"H={args.hidden} K_p={args.kp}{' (1..K_p)' if args.variable else ''} K_q={args.kq} "
        f"queries={args.queries} index={args.index} nprobes={args.nprobes or 'default'} dtype={args.dtype}"
    )
    print(head, flush=True)
    try:
        for n in args.docs:
            r = run_one(args, n, root)
            print(
                f"{r['docs']:>9,} {r['vectors']:>9,} {r['build_s']:>8.1f} {r['index_s']:>8.1f} {r['partitions']:>6} "
                f"{r['ann_mean']:>7.1f} {r['ann_p95']:>7.1f} {r['ann100_mean']:>8.1f} {r['exact_ms']:>9.1f} "
                f"{r['r10']:>6.3f} {r['r100']:>6.3f} {r['overfetch']:>5} {r['nprobes']:>8} "
                f"{r['disk_gb']:>7.2f} {r['rss_gb']:>6.2f}",
                flush=True,
            )
            if tmp:
                shutil.rmtree(root / f"lance_{n}", ignore_errors=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
