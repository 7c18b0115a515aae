"""Collection download throughput: diffret's validated, checksummed, atomic ingest vs a bare
json.loads -> pyarrow -> Parquet loop over the same file, in one process.

    python benchmarks/download.py [--docs 200000]

Prints docs/s for both and the ratio (the price of validation + sha256 + staging; target >= 0.7x).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from diffret.retrieval.data.collections import DatasetReport, DocIds, read_corpus
from diffret.schemas import CORPUS_SCHEMA
from diffret.storage import ArtifactStore, Manifest


def make_corpus(path: Path, n: int, seed: int = 0) -> None:
    rnd = random.Random(seed)
    words = [f"w{i}" for i in range(5000)]
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rnd.choices(words, k=rnd.randint(30, 200)))
            f.write(json.dumps({"_id": str(i), "title": f"title {i}", "text": text, "metadata": {}}) + "\n")


def bare(path: Path, out: Path) -> None:
    ids, titles, texts = [], [], []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            ids.append(d["_id"])
            titles.append(d.get("title", ""))
            texts.append(d["text"])
    pq.write_table(pa.table({"doc_id": ids, "title": titles, "text": texts}), out, compression="zstd")


def diffret(path: Path, root: Path) -> None:
    store = ArtifactStore(root)
    m = Manifest.new("datasets", {"dataset": "bench"}, {"bench": True})
    with store.folder_writer("datasets/dataset=bench", m) as w:
        w.write_parquet("corpus.parquet", CORPUS_SCHEMA, read_corpus(path, "jsonl", DatasetReport("bench"), DocIds()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "corpus.jsonl"
        make_corpus(src, args.docs)
        print(f"corpus: {args.docs:,} docs, {src.stat().st_size / 1e6:.0f} MB")
        best = {"bare": float("inf"), "diffret": float("inf")}
        for r in range(args.repeats):
            t = time.perf_counter()
            bare(src, Path(tmp) / f"bare{r}.parquet")
            best["bare"] = min(best["bare"], time.perf_counter() - t)
            t = time.perf_counter()
            diffret(src, Path(tmp) / f"store{r}")
            best["diffret"] = min(best["diffret"], time.perf_counter() - t)
        for k, v in best.items():
            print(f"{k:8s} {args.docs / v:10,.0f} docs/s  ({v:.2f} s)")
        print(f"ratio diffret / bare: {best['bare'] / best['diffret']:.2f}x")


if __name__ == "__main__":
    main()
