"""Encode bookkeeping at MS MARCO scale: the cost of recording, compacting and re-planning N shards of one
sharded folder (an encodings k-folder holds ~9k shards at MS MARCO's 8.8M passages), against the old
rewrite-the-manifest-per-shard approach measured in the same process.

    python benchmarks/scale.py                       # 1k, 10k, 100k shards; the old approach at 1k and 10k
    python benchmarks/scale.py --sizes 1000 --old-sizes 1000
    python benchmarks/scale.py rss|speed|msmarco ...  # the memory half: scoring under the byte budget
                                                     # (benchmarks/scale_scoring.py, same arguments)

Shard files are tiny Parquet tables written once without timing (the point is the bookkeeping, not the
Parquet writing); every bookkeeping call goes through the real :class:`storage.ArtifactStore`:

- record:  ``record_shard`` once per shard (one atomic, fsynced record file each), as a stage's commits do;
- compact: ``compact_shards`` once (one manifest write), as a stage's ``finish`` does;
- plan:    ``open_sharded`` on a fresh store object, as a re-run plans: size and mtime of every shard;
- resume:  ``open_sharded`` after a run killed before its compaction (the N records put back): the
           compaction on open plus the plan (not part of the total: it replaces compact + plan);
- verify:  ``open_sharded(verify=True)`` (sha256 of every shard; opt-in, not part of the total).

The old approach (reimplemented below as it was): ``record_shard`` read the manifest, added the entry
and rewrote it under the lock (quadratic); planning re-hashed every recorded shard. Prints seconds per
phase, microseconds per shard, and the old/new ratio of the total.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

from diffret.storage import ArtifactStore, FileEntry
from diffret.storage.layout import SHARD_LOG
from diffret.storage.store import PARQUET_COMPRESSION

STAGE = "encodings/system=bench/dataset=msmarco/side=passage/k=16"
PART = {"system": "bench", "dataset": "msmarco", "side": "passage", "k": "16"}
CONFIG = {"system": "bench", "k": 16, "inputs": {"tokens": "0" * 64}}


def shard_name(i: int) -> str:
    return f"shard={i:06d}.parquet"


def write_shards(store: ArtifactStore, n: int) -> list[tuple[str, FileEntry]]:
    """``n`` tiny shard files (untimed setup, no fsync; one tiny Parquet table's bytes each) and their
    entries, as ``write_shard`` returns them."""
    folder = store.abspath(STAGE)
    os.makedirs(folder, exist_ok=True)
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ["p0"], "n_reps": pa.array([16], pa.int16())}), buf, compression=PARQUET_COMPRESSION)
    data = buf.getvalue()
    out = []
    for i in range(n):
        path = os.path.join(folder, shard_name(i))
        with open(path, "wb") as f:
            f.write(data)
        st = os.stat(path)
        entry = FileEntry(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), rows=1, mtime_ns=st.st_mtime_ns)
        out.append((shard_name(i), entry))
    return out


def new_bookkeeping(root: str, shards: list[tuple[str, FileEntry]]) -> dict[str, float]:
    store = ArtifactStore(root)
    t = {}
    m, done = store.open_sharded(STAGE, "encodings", PART, CONFIG)
    assert not done
    t0 = time.perf_counter()
    for name, entry in shards:
        store.record_shard(STAGE, name, entry, m.config_hash)
    t["record"] = time.perf_counter() - t0
    log = store.abspath(f"{STAGE}/{SHARD_LOG}")
    shutil.copyfile(log, log + ".kept")  # untimed: the records as a killed run leaves them
    t0 = time.perf_counter()
    merged = store.compact_shards(STAGE)
    t["compact"] = time.perf_counter() - t0
    assert merged == len(shards)
    t0 = time.perf_counter()
    _, done = ArtifactStore(root).open_sharded(STAGE, "encodings", PART, CONFIG)
    t["plan"] = time.perf_counter() - t0
    assert len(done) == len(shards)
    os.replace(log + ".kept", log)  # killed before compacting: the next run finds the records
    t0 = time.perf_counter()
    _, done = ArtifactStore(root).open_sharded(STAGE, "encodings", PART, CONFIG)
    t["resume"] = time.perf_counter() - t0
    assert len(done) == len(shards) and not os.path.exists(log)
    t0 = time.perf_counter()
    _, done = ArtifactStore(root).open_sharded(STAGE, "encodings", PART, CONFIG, verify=True)
    t["verify"] = time.perf_counter() - t0
    assert len(done) == len(shards)
    return t


# ------------------------------------------------------------------- the old approach, as it was
def old_record_shard(store: ArtifactStore, stage_dir: str, name: str, entry: FileEntry) -> None:
    with store.lock(stage_dir + "/_manifest"):
        m = store.require_manifest(stage_dir)
        m.files[name] = entry
        store.write_manifest(stage_dir, m)


def old_plan(store: ArtifactStore, stage_dir: str) -> set[str]:
    m = store.read_manifest(stage_dir)
    done = set()
    for name, entry in m.files.items():
        store.verify_file(stage_dir, name, entry, cached=False)  # sha256 of every recorded shard
        done.add(name)
    return done


def old_bookkeeping(root: str, shards: list[tuple[str, FileEntry]]) -> dict[str, float]:
    store = ArtifactStore(root)
    store.open_sharded(STAGE, "encodings", PART, CONFIG)
    t = {}
    t0 = time.perf_counter()
    for name, entry in shards:
        old_record_shard(store, STAGE, name, entry.model_copy(update={"mtime_ns": None}))
    t["record"] = time.perf_counter() - t0
    t["compact"] = 0.0
    t0 = time.perf_counter()
    assert len(old_plan(ArtifactStore(root), STAGE)) == len(shards)
    t["plan"] = time.perf_counter() - t0
    return t


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("rss", "speed", "msmarco", "child"):
        from scale_scoring import main as scoring  # this folder is on the path when run as a script

        return scoring()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000", help="Shard counts (comma-separated).")
    ap.add_argument("--old-sizes", default="1000,10000", help="Shard counts to run the old approach at too.")
    ap.add_argument("--dir", default=None, help="Where the temporary stores go (default: the system's temp).")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    old_sizes = {int(x) for x in args.old_sizes.split(",") if x}
    print(
        f"{'shards':>7} | {'record s':>8} {'compact s':>9} {'plan s':>7} {'total s':>8} {'us/shard':>8} "
        f"{'resume s':>8} {'verify s':>8} | {'old total s':>11} {'old us/shard':>12} {'old/new':>7}"
    )
    for n in sizes:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            shards = write_shards(ArtifactStore(f"{tmp}/new"), n)
            new = new_bookkeeping(f"{tmp}/new", shards)
            old = None
            if n in old_sizes:
                write_shards(ArtifactStore(f"{tmp}/old"), n)
                old = old_bookkeeping(f"{tmp}/old", shards)
        total = new["record"] + new["compact"] + new["plan"]
        line = (
            f"{n:>7} | {new['record']:>8.2f} {new['compact']:>9.2f} {new['plan']:>7.2f} {total:>8.2f} "
            f"{1e6 * total / n:>8.0f} {new['resume']:>8.2f} {new['verify']:>8.2f} | "
        )
        if old is not None:
            old_total = old["record"] + old["plan"]
            line += f"{old_total:>11.2f} {1e6 * old_total / n:>12.0f} {old_total / total:>6.1f}x"
        else:
            line += f"{'-':>11} {'-':>12} {'-':>7}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
