"""Evaluate at scale: a synthetic MS MARCO-shaped run (default 7,000 queries x 1,000 documents = 7M rows,
about 1.1 relevant passages per query, some graded) evaluated on the headline measures by today's path
(``run_from_table`` -> pytrec_eval dicts, what the evaluate stage did) and by the vectorised one
(``evaluate_tables``), in one process: seconds each, their ratio, and whether the two tables are equal value for
value (query by query, bit for bit). Peak memory of each (tracemalloc of Python allocations; Arrow's own pool
reported beside).

    python benchmarks/evaluate.py [--queries 7000] [--depth 1000] [--ties rank|trec]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np
import pyarrow as pa

from diffret.retrieval.evaluation import DEFAULT_MEASURES, evaluate, qrels_from_table, run_from_table
from diffret.retrieval.evaluation.arrays import evaluate_tables


def synthetic(n_queries: int, depth: int, seed: int = 0) -> tuple[pa.Table, pa.Table]:
    rng = np.random.default_rng(seed)
    corpus = 8_841_823
    q_ids = np.array([f"q{i}" for i in range(n_queries)], dtype=object)
    docs = (rng.integers(0, corpus, size=(n_queries, 1)) + np.arange(depth) * 7919) % corpus  # distinct per query
    run = pa.table(
        {
            "query_id": pa.array(np.repeat(q_ids, depth), pa.string()),
            "doc_id": pa.array([f"p{d}" for d in docs.reshape(-1)], pa.string()),
            "rank": pa.array(np.tile(np.arange(1, depth + 1, dtype=np.int32), n_queries)),
            "score": pa.array(
                np.sort(rng.normal(size=(n_queries, depth)).astype(np.float32), axis=1)[:, ::-1].reshape(-1)
            ),
        }
    )
    n_rel = rng.poisson(0.1, size=n_queries) + 1
    qq, dd, gg = [], [], []
    for q in range(n_queries):
        for _ in range(n_rel[q]):
            # half the relevant passages are retrieved somewhere in the top 1000
            d = docs[q, rng.integers(0, depth)] if rng.random() < 0.5 else rng.integers(0, corpus)
            qq.append(q_ids[q])
            dd.append(f"p{d}")
            gg.append(int(rng.integers(1, 4)))
    qrels = pa.table({"query_id": qq, "doc_id": dd, "relevance": pa.array(gg, pa.int32())})
    keys = [f"{a}\x1f{b}" for a, b in zip(qq, dd, strict=True)]
    _, first = np.unique(keys, return_index=True)  # a doc drawn twice for a query: judged once
    return run, qrels.take(pa.array(np.sort(first)))


def timed(fn):  # noqa: ANN001, ANN201
    tracemalloc.start()
    pool0 = pa.default_memory_pool().max_memory()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, seconds, peak, pa.default_memory_pool().max_memory() - pool0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=7000)
    ap.add_argument("--depth", type=int, default=1000)
    ap.add_argument("--ties", choices=["rank", "trec"], default="rank")
    args = ap.parse_args()
    run, qrels = synthetic(args.queries, args.depth)
    print(
        f"run: {run.num_rows:,} rows, {args.queries:,} queries; qrels: {qrels.num_rows:,}; ties {args.ties}; "
        f"measures {', '.join(DEFAULT_MEASURES)}"
    )
    ranked = args.ties == "trec"

    def today() -> pa.Table:
        table = run.sort_by([("query_id", "ascending"), ("rank", "ascending")]) if ranked else run
        return evaluate(
            qrels_from_table(qrels),
            run_from_table(table, order="score" if ranked else "rank"),
            DEFAULT_MEASURES,
            1,
            ranked=ranked,
        )

    old, t_old, m_old, _ = timed(today)
    new, t_new, m_new, a_new = timed(lambda: evaluate_tables(qrels, run, DEFAULT_MEASURES, 1, ties=args.ties))
    print(f"dicts + pytrec_eval: {t_old:8.2f} s  peak Python memory {m_old / 2**20:7.0f} MB")
    print(
        f"evaluate_tables:     {t_new:8.2f} s  peak Python memory {m_new / 2**20:7.0f} MB (+ Arrow pool "
        f"{a_new / 2**20:.0f} MB)"
    )
    print(
        f"speed-up: {t_old / t_new:.1f}x; equal query by query, bit for bit: {new.equals(old)} "
        f"({differing(old, new)} of {old.num_rows:,} (query, measure) values differ)"
    )


def differing(old: pa.Table, new: pa.Table) -> int:
    """How many (query, measure) values differ in their bits (all of them where the (query, measure) lists differ)."""
    if new.num_rows != old.num_rows or not all(new.column(c).equals(old.column(c)) for c in ("query_id", "measure")):
        return old.num_rows
    a, b = (t.column("value").to_numpy().view(np.int64) for t in (old, new))
    return int(np.count_nonzero(a != b))


if __name__ == "__main__":
    main()
