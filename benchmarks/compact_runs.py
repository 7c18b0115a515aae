"""Compact runs: the runs stage's size and the metrics of two stores of the same grid.

Per split: run files, rows, bytes (run.parquet only) and bytes per row; then, per split, the sha256 of a
canonical dump of the metrics tables (every row of every per_query.parquet: system, kq, kp, mode, query_id,
measure, repr(value), sorted) and whether the per_query.parquet files are byte-identical. When a split's
dumps differ, the dump without recall_1000 is compared too (train runs kept at depth 100 have a recall_1000
equal to their recall_100).

    python benchmarks/compact_runs.py BEFORE_ROOT AFTER_ROOT
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys

import duckdb

SPLITS = ("train", "test")


def run_stats(root: str) -> dict[str, tuple[int, int, int]]:
    """split -> (run files, rows, bytes of run.parquet)."""
    files = glob.glob(f"{root}/runs/*/*/*/*/*/*/run.parquet")
    out = {}
    for split in SPLITS:
        fs = [f for f in files if f"/split={split}/" in f]
        rows = 0
        for f in fs:
            with open(os.path.join(os.path.dirname(f), "_manifest.json")) as fh:
                rows += json.load(fh)["files"]["run.parquet"]["rows"]
        out[split] = (len(fs), rows, sum(os.path.getsize(f) for f in fs))
    return out


def canonical(root: str, split: str, measures: list[str] | None = None) -> tuple[str, int]:
    """sha256 of the split's metrics rows, sorted, values as repr (exact); and the row count."""
    where = f"split = '{split}'"
    if measures:
        where += f" and measure in ({', '.join(repr(m) for m in measures)})"
    rows = duckdb.sql(
        "select system, kq, kp, mode, query_id, measure, value from read_parquet("
        f"'{root}/metrics/*/*/*/*/*/*/per_query.parquet', hive_partitioning = true) where {where} order by all"
    ).fetchall()
    text = "\n".join("\t".join(repr(x) for x in r) for r in rows)
    return hashlib.sha256(text.encode()).hexdigest(), len(rows)


def file_shas(root: str, split: str) -> dict[str, str]:
    out = {}
    for f in glob.glob(f"{root}/metrics/*/*/split={split}/*/*/*/per_query.parquet"):
        with open(f, "rb") as fh:
            out[f[len(root) :]] = hashlib.sha256(fh.read()).hexdigest()
    return out


def main(before: str, after: str) -> None:
    ra, rb = run_stats(before), run_stats(after)
    for split in SPLITS:
        (na, rows_a, ba), (nb, rows_b, bb) = ra[split], rb[split]
        print(
            f"runs {split}: {na} files {rows_a:,} rows {ba / 1e6:.2f} MB -> {nb} files {rows_b:,} rows "
            f"{bb / 1e6:.2f} MB: {ba / max(bb, 1):.2f}x; bytes/row {ba / max(rows_a, 1):.2f} -> "
            f"{bb / max(rows_b, 1):.2f}"
        )
    total_a, total_b = sum(v[2] for v in ra.values()), sum(v[2] for v in rb.values())
    print(f"runs total: {total_a / 1e6:.2f} MB -> {total_b / 1e6:.2f} MB: {total_a / max(total_b, 1):.2f}x smaller")
    for split in SPLITS:
        ca, cb = canonical(before, split), canonical(after, split)
        same = file_shas(before, split) == file_shas(after, split)
        print(
            f"metrics {split}: sha256 {ca[0]} ({ca[1]} rows) vs {cb[0]} ({cb[1]} rows): "
            f"{'EQUAL' if ca == cb else 'DIFFERENT'}; per_query.parquet byte-identical: {same}"
        )
        if ca != cb:
            sub = ["ndcg_cut_10", "mrr_10", "recall_100"]
            sa, sb = canonical(before, split, sub), canonical(after, split, sub)
            print(
                f"  {split} without recall_1000: {sa[0]} vs {sb[0]}: {'EQUAL' if sa == sb else 'DIFFERENT'} "
                f"({sa[1]} rows)"
            )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    main(sys.argv[1], sys.argv[2])
