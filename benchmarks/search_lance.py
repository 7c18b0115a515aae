"""LanceDB multivector search (ANN + exact MaxSim re-rank) and a flat faiss baseline against exact brute-force MaxSim,
on synthetic clustered multi-vector documents.

    python benchmarks/search_lance.py [--docs 100000 1000000] [--hidden 128] [--kp 4] [--kq 8] [--queries 100]
        [--index IVF_PQ] [--overfetch 20] [--refine-factor 4] [--no-faiss]

Documents are generated batch by batch (deterministically, so the exact reference regenerates them instead of
keeping them): topics -> clusters -> per-document vectors around the cluster centre. Queries perturb some documents'
vectors, so every query has true neighbours. For each size it builds the table, trains the ANN index, computes the
exact MaxSim top-100 by a chunked torch brute force, then for k = 10 and k = 100 runs the queries one ``search()``
call each (as a service would) and reports per-query latency and recall@k against the exact top-k.

The faiss baseline (``faiss.IndexFlatIP`` over every passage vector, exact inner products) generates candidates the
same way LanceDB does - each query vector's ``k x overfetch`` nearest passage vectors, their documents pooled - and
re-ranks them with the same exact MaxSim; it needs no training but holds every vector in memory.

Several ``--overfetch`` / ``--refine-factor`` / ``--nprobes`` / ``--ef`` values give one row each on the same built
index. Memory: the table is streamed in and the reference is streamed over docs; faiss holds docs * K_p * H * 4 bytes
(1M x 4 x 128 = 2 GB); the table on disk is about the same (float16 halves it). Peak RSS is printed.
"""

from __future__ import annotations

import argparse
import itertools
import resource
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from diffret.retrieval.search import lance as li


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


class FaissFlat:
    """Exact per-vector candidates from a ``faiss.IndexFlatIP`` over every normalised passage vector, pooled per
    document and re-ranked with exact MaxSim (the baseline the LanceDB index is compared with)."""

    def __init__(self, corpus: Corpus):
        import faiss

        t0 = time.perf_counter()
        self.index = faiss.IndexFlatIP(corpus.hidden)
        owners, lengths = [], []
        for ids, x, counts in corpus.batches():
            first = int(ids[0][1:])
            vecs = np.concatenate([x[j, : counts[j]] for j in range(len(ids))]).astype(np.float32)
            self.index.add(li.l2_normalise(vecs))
            owners.append(np.repeat(np.arange(first, first + len(ids), dtype=np.int64), counts))
            lengths.append(np.asarray(counts, dtype=np.int64))
        self.owner = np.concatenate(owners)  # vector -> doc number
        self.lengths = np.concatenate(lengths)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)])
        n_vec = self.index.ntotal
        self.xb = faiss.rev_swig_ptr(self.index.get_xb(), n_vec * corpus.hidden).reshape(n_vec, corpus.hidden)
        self.seconds = time.perf_counter() - t0

    def search(self, queries: list[np.ndarray], k: int, overfetch: int) -> tuple[list[list[str]], list[float]]:
        """Top-``k`` doc ids per query and per-query milliseconds."""
        out, ms = [], []
        depth = li.candidate_budget(k, overfetch)
        for q in queries:
            t0 = time.perf_counter()
            qn = li.l2_normalise(q)
            _, idx = self.index.search(qn, depth)
            docs = np.unique(self.owner[idx[idx >= 0]])
            vecs = np.concatenate([self.xb[self.starts[d] : self.starts[d + 1]] for d in docs])
            scores = li.maxsim_scores(qn, vecs, self.lengths[docs])
            out.append([d for d, _ in li.rank([f"d{d}" for d in docs], scores, k)])
            ms.append((time.perf_counter() - t0) * 1000.0)
        return out, ms


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _index_overrides(args: argparse.Namespace) -> dict:
    keys = ("num_partitions", "num_sub_vectors", "max_iterations", "sample_rate", "m", "ef_construction")
    given = {key: getattr(args, key) for key in keys if getattr(args, key) is not None}
    defaults = li.default_index_params(args.index, 1, args.hidden)
    return {key: value for key, value in given.items() if key in defaults or key == "num_partitions"}


def run_one(args: argparse.Namespace, n: int, root: Path) -> Iterator[dict]:
    """Build the table and index for ``n`` docs, then yield one result row per method and search setting."""
    corpus = Corpus(n, args.hidden, args.kp, args.variable, seed=args.seed, batch=args.batch)
    db = str(root / f"lance_{n}")
    t0 = time.perf_counter()
    rows = li.build_table(db, corpus.for_lance(), args.hidden, dtype=args.dtype)
    table_s = time.perf_counter() - t0
    info = li.create_index(db, args.index, **_index_overrides(args))
    queries = make_queries(corpus, args.queries, args.kq)
    exact, exact_s = exact_topk(corpus, queries, 100)
    common = {"docs": rows, "vectors": info.vectors, "exact_ms": 1000 * exact_s / len(queries)}
    if args.faiss:
        flat = FaissFlat(corpus)
        row = {**common, "method": "faiss flat", "build_s": flat.seconds, "params": f"overfetch {args.overfetch[0]}"}
        for k in (10, 100):
            got, ms = flat.search(queries, k, args.overfetch[0])
            row[f"r{k}"] = li.recall_at([e[:k] for e in exact], got, k)
            row[f"ms{k}"], row[f"p95_{k}"] = float(np.mean(ms)), float(np.percentile(ms, 95))
        row["rss_gb"] = _rss_gb()
        del flat
        yield row
    params = ", ".join(f"{key} {value}" for key, value in info.params.items() if key != "num_bits")
    li.search(db, queries[:3], 10)  # warm the caches
    for overfetch, refine, nprobes, ef in itertools.product(args.overfetch, args.refine_factor, args.nprobes, args.ef):
        kw = {"overfetch": overfetch, "refine_factor": refine, "nprobes": nprobes, "ef": ef}
        row = {**common, "method": f"lance {args.index}", "build_s": table_s + info.seconds, "index_s": info.seconds}
        for k in (10, 100):
            res = li.search(db, queries, k, **{key: v for key, v in kw.items() if v is not None})
            row[f"r{k}"] = li.recall_at([e[:k] for e in exact], [[d for d, _ in h] for h in res], k)
            row[f"ms{k}"], row[f"p95_{k}"] = res.stats.mean_ms, res.stats.p95_ms
            s = res.stats
            row[f"search{k}"] = f"limit {s.limit}, nprobes {s.nprobes}, refine {s.refine_factor}, ef {s.ef}"
        row["params"] = f"{params}; overfetch {overfetch}; k=100: {row['search100']}"
        row["disk_gb"] = _dir_bytes(Path(db)) / 2**30
        row["rss_gb"] = _rss_gb()
        yield row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--kp", type=int, default=4, help="vectors per document (the maximum with --variable)")
    ap.add_argument("--kq", type=int, default=8, help="vectors per query")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--variable", action="store_true", help="1..K_p vectors per document instead of K_p")
    ap.add_argument("--index", default="IVF_PQ", choices=[t for t in li.INDEX_TYPES if t != "none"])
    ap.add_argument("--num-partitions", dest="num_partitions", type=int, default=None)
    ap.add_argument("--num-sub-vectors", dest="num_sub_vectors", type=int, default=None)
    ap.add_argument("--max-iterations", dest="max_iterations", type=int, default=None)
    ap.add_argument("--sample-rate", dest="sample_rate", type=int, default=None)
    ap.add_argument("--m", type=int, default=None, help="HNSW graph degree")
    ap.add_argument("--ef-construction", dest="ef_construction", type=int, default=None)
    ap.add_argument("--overfetch", type=int, nargs="+", default=[li.DEFAULT_OVERFETCH], help="candidates = k x this")
    ap.add_argument("--refine-factor", dest="refine_factor", type=int, nargs="+", default=[None])
    ap.add_argument("--nprobes", type=int, nargs="+", default=[None], help="IVF partitions probed (default: ours)")
    ap.add_argument("--ef", type=int, nargs="+", default=[None], help="HNSW search breadth (default: ours)")
    ap.add_argument("--no-faiss", dest="faiss", action="store_false", help="skip the flat faiss baseline")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--batch", type=int, default=5000, help="documents per generated batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default=None, help="folder for the LanceDB databases (default: a temporary one)")
    args = ap.parse_args()

    tmp = None if args.root else tempfile.mkdtemp(prefix="search_lance_")
    root = Path(args.root or tmp)
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"H={args.hidden} K_p={args.kp}{' (1..K_p)' if args.variable else ''} K_q={args.kq} "
        f"queries={args.queries} index={args.index} dtype={args.dtype}; latencies are per query, one search() call "
        "each; recall against exact MaxSim",
        flush=True,
    )
    print(
        "| docs | vectors | method | build s | R@10 | R@100 | ms/query k=10 (p95) | ms/query k=100 (p95) "
        "| exact ms/query | RSS GB | parameters |\n|---|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    try:
        for n in args.docs:
            for r in run_one(args, n, root):
                print(
                    f"| {r['docs']:,} | {r['vectors']:,} | {r['method']} | {r['build_s']:.1f} | {r['r10']:.3f} "
                    f"| {r['r100']:.3f} | {r['ms10']:.1f} ({r['p95_10']:.1f}) | {r['ms100']:.1f} ({r['p95_100']:.1f}) "
                    f"| {r['exact_ms']:.1f} | {r['rss_gb']:.2f} | {r['params']} |",
                    flush=True,
                )
            if tmp:
                shutil.rmtree(root / f"lance_{n}", ignore_errors=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
