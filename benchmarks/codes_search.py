"""Quality and search latency of every lossy storage choice on a stored system, against exact float16 scoring, in
one process (the fine-tuned proxy: splade-tiny fine-tuned on SciFact, docs/results.md's recipe).

    python benchmarks/codes_search.py --root R --system SLUG --kq 8 16 --kp 16

For the float16 system's passages at K_p and its test queries at each K_q: exact float16 search (what `diffret score`
does: the shards read, decoded and scored, every query at once) is the reference. For each storage choice the codebook
is trained as `diffret compress` trains it (the same seeded sample and seed), the shards are coded, and then:

- exact search over the decoded codes (`diffret score` on the compressed system), every choice;
- for residual:B, search over the codes (`diffret score --search codes`, retrieval/search/codes.py) at each
  ``--setting PROBESxCANDIDATES``, the codes index built as `diffret index` builds it.

Per row: NDCG@10 of multi_dense and of the hybrid (fusion_multi_sparse_max: the row's multi_dense fused with exact
sparse_max, which no choice changes), its change against exact float16, recall@10 of its multi_dense top 10 against
float16's, and milliseconds a query (exact: the pass's time over its queries; over the codes: each query's own
search, the codes and the index already loaded; their loading is reported once). Results:
``benchmarks/results/codes_search.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "codes_search.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--system", required=True, help="the float16 system (slug)")
    ap.add_argument("--dataset", default="scifact")
    ap.add_argument("--split", default="test")
    ap.add_argument("--kq", type=int, nargs="+", default=[8])
    ap.add_argument("--kp", type=int, default=16)
    ap.add_argument(
        "--stores", nargs="+", default=["int8", "residual:1", "residual:2", "residual:4", "pq:16", "pq:32", "pq:64"]
    )
    ap.add_argument("--setting", nargs="+", default=["1x64", "1x256", "2x256", "2x1024", "4x1024", "8x1024"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", type=int, default=65536)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (the best is kept)")
    ap.add_argument("--label", default="ft-splade-tiny-scifact")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from diffret.api import evaluate
    from diffret.retrieval.search.codecs import (
        Codec,
        codes_of,
        colbert_centroids,
        compress_table,
        parse_store,
        train_codebook,
        vectors_of,
    )
    from diffret.retrieval.search.codes import CodedPassages, CodesIndex, CodesSearchStats, search_codes
    from diffret.retrieval.search.encodings import encodings_from_table
    from diffret.retrieval.search.exact import SearchSettings, search_pass
    from diffret.retrieval.search.modes import all_modes
    from diffret.retrieval.search.rules import ScoreRules
    from diffret.retrieval.search.runs import run_table
    from diffret.stages.codebooks import codebook_sample
    from diffret.stages.readers import encoding_manifest, qrels_table, query_encodings, split_queries
    from diffret.storage import ArtifactStore
    from diffret.storage.layout import encodings_dir

    store = ArtifactStore(args.root)
    rules = ScoreRules()
    p_folder = encodings_dir(args.system, args.dataset, "passage", args.kp)
    p_man = encoding_manifest(store, p_folder)
    names = sorted(p_man.files)
    tables = {n: store.read_table(p_folder, n) for n in names}
    n_passages = sum(t.num_rows for t in tables.values())
    ids = split_queries(store, args.dataset, args.split)
    qrels = qrels_table(store, args.dataset, args.split)
    queries = {
        kq: query_encodings(store, encodings_dir(args.system, args.dataset, "query", kq), ids, "cpu", rules)
        for kq in args.kq
    }
    doc_ids = [i for n in names for i in tables[n].column("id").to_pylist()]
    hidden = tables[names[0]].schema.field("dense").type.value_type.list_size
    print(
        f"{args.system}: {n_passages:,} passages x K_p {args.kp}, H {hidden}; {len(ids)} {args.split} queries at "
        f"K_q {args.kq}; {args.threads} thread(s)",
        flush=True,
    )

    def parquet(table: pa.Table) -> bytes:
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        return buf.getvalue()

    def exact(shards: list[bytes], codec: Codec | None, kq: int, modes: list[str]) -> tuple[dict, float]:
        best, out = float("inf"), None
        for _ in range(args.repeats):
            start = time.perf_counter()
            stream = (encodings_from_table(pq.read_table(io.BytesIO(d)), "cpu", rules, 1.0, codec) for d in shards)
            tops, _ = search_pass({kq: queries[kq]}, stream, modes, SearchSettings(topk=1000, rules=rules))
            best = min(best, time.perf_counter() - start)
            out = tops
        return out, best * 1000 / len(ids)

    def scores(md: Any, sparse: Any, kq: int) -> dict[str, float]:
        fused = all_modes({(kq, "multi_dense"): md, (kq, "sparse_max"): sparse}, 1000, rules)
        out = {}
        for mode in ("multi_dense", "fusion_multi_sparse_max"):
            out[mode] = evaluate(run_table(fused[(kq, mode)], ids, doc_ids), qrels, ["ndcg_cut_10"])["ndcg_cut_10"]
        return out

    def recall10(a: Any, b: Any) -> float:
        return float(np.mean([len(set(x[:10]) & set(y[:10])) / 10 for x, y in zip(a.index, b.index, strict=True)]))

    f16_shards = [parquet(tables[n]) for n in names]
    rows: list[dict[str, Any]] = []
    ref: dict[int, Any] = {}
    for kq in args.kq:
        tops, ms = exact(f16_shards, None, kq, ["multi_dense", "sparse_max"])
        ref[kq] = {"md": tops[(kq, "multi_dense")], "sparse": tops[(kq, "sparse_max")], "ms": ms}
        ref[kq]["ndcg"] = scores(ref[kq]["md"], ref[kq]["sparse"], kq)
        rows.append(
            {
                "kq": kq,
                "store": "float16",
                "search": "exact",
                "bytes_per_vector": 2 * hidden,
                "ndcg_multi": ref[kq]["ndcg"]["multi_dense"],
                "ndcg_fused": ref[kq]["ndcg"]["fusion_multi_sparse_max"],
                "recall_10": 1.0,
                "ms_per_query": ms,
                "speedup": 1.0,
            }
        )
        print(rows[-1], flush=True)
    # exact multi_dense alone over float16 (the latency a codes search replaces), per K_q
    md_ms = {}
    for kq in args.kq:
        md_ms[kq] = exact(f16_shards, None, kq, ["multi_dense"])[1]
    for spec in args.stores:
        s = parse_store(spec)
        if s.kind == "pq" and hidden % s.m:
            continue
        t0 = time.perf_counter()
        cb = None
        if s.trained:
            x = codebook_sample(names, lambda n: vectors_of(tables[n]), args.sample, args.seed)
            cb = train_codebook(x, spec, args.seed, n_passages * args.kp)
        codec = Codec(spec, hidden if s.trained else 0, cb)
        coded_tables = [compress_table(tables[n], codec) for n in names]
        train_s = time.perf_counter() - t0
        shards = [parquet(t) for t in coded_tables]
        per_vector = sum(len(codes_of(t)) for t in coded_tables)
        bytes_per_vector = sum(codes_of(t).nbytes for t in coded_tables) / per_vector
        coded = index = None
        load_ms = None
        if s.kind == "residual":
            t0 = time.perf_counter()
            blocks = [(codes_of(t), t.column("n_reps").to_numpy().astype(np.int64)) for t in coded_tables]
            coded = CodedPassages.from_blocks(blocks, codec)
            index = CodesIndex.build(
                [(coded.cells, np.concatenate([b[1] for b in blocks]))], len(cb.arrays["centroids"])
            )
            load_ms = (time.perf_counter() - t0) * 1000
        for kq in args.kq:
            tops, ms = exact(shards, codec, kq, ["multi_dense"])
            md = tops[(kq, "multi_dense")]
            nd = scores(md, ref[kq]["sparse"], kq)
            rows.append(
                {
                    "kq": kq,
                    "store": spec,
                    "search": "exact",
                    "bytes_per_vector": bytes_per_vector,
                    "ndcg_multi": nd["multi_dense"],
                    "ndcg_fused": nd["fusion_multi_sparse_max"],
                    "recall_10": recall10(md, ref[kq]["md"]),
                    "ms_per_query": ms,
                    "speedup": md_ms[kq] / ms,
                    "codebook_seconds": round(train_s, 1),
                }
            )
            print(rows[-1], flush=True)
            if coded is None:
                continue
            for setting in args.setting:
                probes, cands = (int(v) for v in setting.split("x"))
                best, got, st = float("inf"), None, None
                for _ in range(args.repeats):
                    st = CodesSearchStats()
                    got = search_codes(queries[kq], coded, index, 1000, probes, cands, rules, st)
                    best = min(best, float(np.sum(st.latencies_ms)) / len(ids))
                nd = scores(got, ref[kq]["sparse"], kq)
                rows.append(
                    {
                        "kq": kq,
                        "store": spec,
                        "search": f"codes {setting}",
                        "probes": probes,
                        "candidates": cands,
                        "bytes_per_vector": bytes_per_vector,
                        "ndcg_multi": nd["multi_dense"],
                        "ndcg_fused": nd["fusion_multi_sparse_max"],
                        "recall_10": recall10(got, ref[kq]["md"]),
                        "ms_per_query": best,
                        "speedup": md_ms[kq] / best,
                        "probed_mean": float(np.mean(st.probed)),
                        "decoded_mean": float(np.mean(st.decoded)),
                        "load_ms": load_ms,
                        "cells": index.n_centroids,
                    }
                )
                print(rows[-1], flush=True)
    for r in rows:
        base = ref[r["kq"]]["ndcg"]
        r["delta_multi"] = r["ndcg_multi"] - base["multi_dense"]
        r["delta_fused"] = r["ndcg_fused"] - base["fusion_multi_sparse_max"]
        r["exact_f16_multi_ms"] = md_ms[r["kq"]]
    result = {
        "label": args.label,
        "system": args.system,
        "dataset": args.dataset,
        "split": args.split,
        "queries": len(ids),
        "passages": n_passages,
        "kp": args.kp,
        "hidden": hidden,
        "threads": args.threads,
        "repeats": args.repeats,
        "cells_default": colbert_centroids(n_passages * args.kp),
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[args.label] = result
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
