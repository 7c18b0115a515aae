"""The whole pipeline at growing corpus sizes, through the CLI, with every stage's cost measured.

For each N (1k, 10k, 100k, 1M: the smallest measures each command's fixed cost) it writes a synthetic MS MARCO-
shaped collection in BEIR layout, deterministic from a seed: N passages of MS MARCO's length (log-normal, mean ~56
words) drawn from a real English word distribution (the word counts of the corpora in ../shared/data), a fixed
number of queries (default 500: the corpus is what grows), each 3-8 words of its one relevant passage. Then it runs,
each stage its own `diffret` command on a small random-weight BERT masked LM built from a config (splade-tiny's
tokenizer, hidden 64, 2 layers): download, tokenize, encode at K 1 and 16 (``--workers 2``: two local Dask workers),
bm25, score (K_q, K_p in {1, 16}^2, every mode), evaluate, index (LanceDB at K_p = 1, checked against exact search),
report, compress (int8, then scored), late (BM25's top 100 re-scored by multi_dense at (16, 16)).

Per stage: wall seconds; the peak RSS of every process of the command (the command and its children, Dask workers
included: sampled every 0.1 s), reported as the largest; bytes and files added to the store. Per stage over N: the
growth exponents of time and peak memory (least squares on log-log). Results go to
``benchmarks/results/scale_e2e.json`` (one entry per N, merged across invocations), and ``--write-docs`` renders the
table, the exponents, the figure (docs/img/scale.png) and the MS MARCO projection into docs/scale.md.

    python benchmarks/scale_e2e.py --n 1000 --n 10000 --n 100000 --n 1000000 [--work /tmp/scale] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
RESULTS = REPO / "benchmarks" / "results" / "scale_e2e.json"
WORD_CORPORA = ("scifact", "nfcorpus", "fiqa", "arguana", "scidocs", "trec-covid", "quora")
FIXES = """## Found and fixed on the way

- **Tokenize held the whole side in memory** (every text of the corpus as Python lists: several GB at MS MARCO):
  it now reads the corpus a Parquet batch at a time and cuts it into the shards still to do
  (`ArtifactStore.iter_batches`, `readers.cut_ranges`), so its memory is a shard's. The harness's shards hold
  50,000 texts, so at 10k the one shard is the whole corpus and at 100k a shard is five times larger: tokenize's and
  encode's peaks double between the two sizes and then stay (bounded by `--shard-size`, not by N).
- **Evaluate built Python dicts per run** (pytrec_eval): per-query measures now come from Arrow tables, vectorised
  over queries, bit-identical to pytrec_eval (`retrieval/evaluation/arrays.py`), without sorting the run's ids:
  query ids coded once, the rows read as stored (grouped by query in rank order), repeated documents found by
  64-bit hashes of their ids, only tied scores ordered by doc_id, the measures taken from the judged rows alone.
  `benchmarks/evaluate.py`, 7M rows (7,000 queries x 1,000), one run each on an idle machine: 20.1 s -> 0.49 s
  with trec ties (the stage default, 41x), 24.5 s -> 0.43 s with rank ties (57x), all 28,000 (query, measure)
  values equal bit for bit; peak Python memory 1.1 GB -> 0.24 GB.
- **Fusion was a loop over queries**: vectorised over queries with the same results (`fuse_runs`).
- **Download kept every id to find duplicates** (~1 GB at MS MARCO): 64-bit hashes of the ids instead (8 B an id).
- **`run --kq 4 --kp 16` encoded the corpus at K = 4 too**: encode takes K per side, one pass each.
- **bm25 held the whole corpus** (the texts, bm25s's token lists and score matrix: 2.7 kB a passage, 3,054 MB at 1M,
  ~25 GB projected to MS MARCO). A corpus above `bm25 --shard-size` (default 1M passages; 50,000 here, so that 100k
  and 1M are both sharded) is now read twice, a shard at a time: the corpus statistics (document frequencies, mean
  length), then each shard's bm25s index built with them and searched, the best k kept
  (`retrieval/search/bm25.py: bm25_search_shards`). Scores equal the whole index's bit for bit for all five bm25s
  variants (`tests/unit/test_bm25_shards.py`; on NFCorpus through the CLI, every rank's score); of the documents
  tied at the cut-off score the first in corpus order are kept, where bm25s picks arbitrarily. At 1M: 3,054 ->
  783 MB, 130 -> 148 s (the corpus is tokenized twice). A corpus of 1M passages or fewer is indexed whole, as before.
- **late held every passage id as Python objects** (an ordered list, an id -> position dict and, when it encodes
  missing passages, a set of those already held: 0.8 kB a passage, 1,919 MB at 1M): the ids are now one Arrow
  array, looked up by hash (`pc.index_in`, `pc.is_in`), and runs are written over the retrieved documents only
  (`retrieved_ids`). At 1M: 1,919 -> 1,318 MB.
- **Reading the corpus kept what it read**: `ParquetFile.iter_batches` (pyarrow 26) grew RSS by ~200 B a row over
  the 1M-row corpus, with or without its pre-buffering, under mimalloc, jemalloc or the system allocator; reading a
  row group at a time does not (`ArtifactStore.iter_batches`). tokenize at 1M: 1,432 -> 1,279 MB (231 -> 60 B a
  passage between 100k and 1M); bm25 reads through it too.

## Known limits: what still grows with N

- **encode** grew 212 B a passage between 100k and 1M (1,948 -> 2,130 MB; 3.9 GB projected to MS MARCO, at the
  bound). Its peak is a Dask worker, which at 100k encodes one or two shards and at 1M about twenty: the growth is
  over the units a long-lived worker runs, not data it holds for the corpus. One process encoding six of the 1M
  corpus's 50,000-passage shards in a row at K = 16 measured, after each, 974, 1,013, 1,034, 1,046, 1,065 and
  1,063 MB: rising by less each unit and levelling off (the allocators' high-water mark), so the projection, which
  extends the growth linearly, overstates it.
- **index** grew 292 B a passage (943 -> 1,193 MB): LanceDB's index build over the K_p = 1 table, and the exact
  search it is checked against, which returns every corpus id as a Python string (70 MB at 1M, ~0.6 GB at MS
  MARCO; score's merge did the same and now keeps the retrieved ids only, not re-measured here).
- **late's** peak varies from run to run by more than it grows: three harness runs of this code measured 1,318,
  1,329 and 1,791 MB at 1M, and 1,176, 1,219 and 1,241 MB at 100k. What it holds is the candidates' encodings
  (queries x depth: 50,000 passages at K = 16 here) and one shard of encodings being read: it follows the
  queries of a unit and the depth, not N. With a 7B model's H = 3584 at K = 16 a candidate is 115 kB in float16,
  so MS MARCO's 6,980 queries x 100 in one unit would be ~80 GB (twice as float32 tensors), and even the smallest
  unit (`--unit-queries 256`) ~3 GB in float16: late at that size is beyond this machine's bound whatever N is.
- **bm25** (75 B a passage) and **score_int8** (79 B) are just above the 64 B line, within what run-to-run variation
  moves at these peaks.
- Time: every corpus-linear stage's exponent above start-up is within 1.0 +/- 0.15 (tokenize 1.01, encode 0.91,
  bm25 0.98, score 0.96, compress 0.87, score_int8 1.02); index (0.50) and late (0.67) grow slower than N.

## What these numbers are

- One run per size, each stage its own command. The stages' code is that of commit ab2c2c9 (later commits change
  SIDR's readout and these benchmarks, not the stages measured) except tokenize, bm25 and late, measured again with
  the changes above (`scale_e2e.py --resume --redo tokenize --redo bm25 --redo late`, which removes their outputs
  first). 1k, 10k and 100k ran on an idle machine. The 1M run's encode (52 min) shared the machine for its first
  ~20 minutes with one-thread benchmarks and a 3-minute test run: its wall time is an upper bound (its CPU seconds
  are not affected). Every other stage at 1M ran alone.
- Wall times on 2 cores; the projection's GPU figures are assumptions, named above, not measurements.
"""
BM25_SHARD = 50_000  # passages per BM25 shard, as tokenize's and encode's here: 100k and 1M both sharded
REDO_OUTPUTS = {
    "tokenize": ["tokens/*"],
    "bm25": ["runs/system=bm25-*"],
    "late": ["runs/*/*/*/*/*/mode=late_*"],
}  # what --redo removes (tokens: rebuilt the same)
MSMARCO = {"passages": 8_841_823, "dev_queries": 6_980, "hidden": 3584, "cells": 25, "modes": 5}


# ----------------------------------------------------------------------------------------- the collection
def word_distribution(limit: int = 50_000) -> tuple[list[str], np.ndarray]:
    """The ``limit`` most frequent lowercase words of the real English corpora in ../shared/data, with their
    relative frequencies (a fixed, real distribution: Zipf-like, as text is)."""
    counts: Counter[str] = Counter()
    word = re.compile(r"[a-z]+(?:'[a-z]+)?")
    for name in WORD_CORPORA:
        path = SHARED / "data" / name / "corpus.jsonl"
        if not path.exists():
            continue
        with path.open(encoding="utf-8") as f:
            for line in f:
                doc = json.loads(line)
                counts.update(word.findall(f"{doc.get('title', '')} {doc.get('text', '')}".lower()))
    if not counts:
        raise SystemExit("no corpora found under ../shared/data: the word distribution comes from them")
    words, n = zip(*counts.most_common(limit), strict=True)
    p = np.array(n, dtype=np.float64)
    return list(words), p / p.sum()


def write_collection(folder: Path, n: int, n_queries: int, seed: int = 0) -> dict:
    """corpus.jsonl, queries.jsonl, qrels/test.tsv in ``folder`` (BEIR layout); deterministic in (n, seed)."""
    done = folder / "_done.json"
    if done.exists():
        return json.loads(done.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    words, p = word_distribution()
    vocab = np.array(words, dtype=object)
    rng = np.random.default_rng(seed)
    # MS MARCO passages: ~56 words on average, long-tailed
    lengths = np.clip(np.round(rng.lognormal(mean=3.93, sigma=0.42, size=n)), 5, 250).astype(np.int64)
    relevant = rng.choice(n, size=n_queries, replace=False)
    rel_words: dict[int, list[str]] = {}
    chunk = 100_000
    with (folder / "corpus.jsonl").open("w", encoding="utf-8") as f:
        for start in range(0, n, chunk):
            ls = lengths[start : start + chunk]
            flat = vocab[rng.choice(len(vocab), size=int(ls.sum()), p=p)]
            offsets = np.r_[0, np.cumsum(ls)]
            lines = []
            for i in range(len(ls)):
                text = flat[offsets[i] : offsets[i + 1]]
                lines.append(json.dumps({"_id": f"p{start + i}", "title": "", "text": " ".join(text)}) + "\n")
            f.writelines(lines)
            for j in np.flatnonzero((relevant >= start) & (relevant < start + len(ls))):
                d = int(relevant[j])
                rel_words[d] = list(flat[offsets[d - start] : offsets[d - start + 1]])
    with (folder / "queries.jsonl").open("w", encoding="utf-8") as f:
        for qi, d in enumerate(relevant.tolist()):
            text = rel_words[d]
            k = int(rng.integers(3, 9))
            picked = [text[i] for i in sorted(rng.choice(len(text), size=min(k, len(text)), replace=False))]
            f.write(json.dumps({"_id": f"q{qi}", "text": " ".join(picked)}) + "\n")
    (folder / "qrels").mkdir(exist_ok=True)
    with (folder / "qrels" / "test.tsv").open("w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        f.writelines(f"q{qi}\tp{d}\t1\n" for qi, d in enumerate(relevant.tolist()))
    info = {
        "passages": n,
        "queries": n_queries,
        "mean_words": float(lengths.mean()),
        "bytes": sum(x.stat().st_size for x in folder.rglob("*") if x.is_file()),
    }
    done.write_text(json.dumps(info))
    return info


def write_model(folder: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A random-weight BertForMaskedLM from a config, with splade-tiny's WordPiece tokenizer."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tok = AutoTokenizer.from_pretrained(SHARED / "models" / "splade-tiny-mlm")
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=512,
    )
    BertForMaskedLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------------------- measuring
def _tree_rss(pid: int, peaks: dict[int, tuple[str, int]], cpu: dict[int, float] | None = None) -> None:
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            rss = p.memory_info().rss
            name = " ".join(p.cmdline()[1:4])[:80]
            if cpu is not None:
                t = p.cpu_times()
                cpu[p.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rss > peaks.get(p.pid, ("", 0))[1]:
            peaks[p.pid] = (name, rss)


def store_size(root: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                size += os.path.getsize(os.path.join(dirpath, n))
                files += 1
            except OSError:
                pass
    return files, size


_children_cpu = [0.0]  # RUSAGE_CHILDREN so far (it accumulates over the commands this process waited for)


def run_stage(name: str, args: list[str], root: Path, log: Path) -> dict:
    """One `diffret` command, timed and watched; what it added to the store."""
    files0, bytes0 = store_size(root)
    env = {
        **os.environ,
        "PREFECT_API_URL": "",
        "HF_HUB_OFFLINE": "1",
        "COLUMNS": "200",
        "NLTK_DATA": str(SHARED / "nltk_data"),
    }  # the reference content filter's English tables
    peaks: dict[int, tuple[str, int]] = {}
    cpu: dict[int, float] = {}  # CPU seconds per process, last sample: the work, apart from waiting for the cores
    t0 = time.perf_counter()
    with log.open("a") as out:
        out.write(f"\n$ diffret {' '.join(args)}\n")
        out.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "diffret.flows.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                _tree_rss(proc.pid, peaks, cpu)
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        rc = proc.wait()
        stop.set()
        watcher.join()
    seconds = time.perf_counter() - t0
    import resource

    # the CPU seconds of the command and every process it waited for (Dask workers included), at its exit; the
    # sampled per-process sum is the floor where a child was not waited for
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = max(own.ru_utime + own.ru_stime - _children_cpu[0], sum(cpu.values()))
    _children_cpu[0] = own.ru_utime + own.ru_stime
    if rc != 0:
        raise SystemExit(f"stage {name} failed ({rc}); see {log}")
    files1, bytes1 = store_size(root)
    top = max(peaks.values(), key=lambda x: x[1]) if peaks else ("", 0)
    return {
        "stage": name,
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),
        "peak_rss_mb": round(top[1] / 2**20, 1),
        "peak_process": top[0],
        "processes": len(peaks),
        "files": files1 - files0,
        "bytes": bytes1 - bytes0,
    }


def pipeline(
    n: int, work: Path, n_queries: int, workers: int, resume: bool = False, redo: tuple[str, ...] = ()
) -> dict:
    """Every stage at corpus size ``n``. With ``resume``, the stages already measured (``stages.json`` beside the
    store) are kept and the run goes on from the first one missing (each command resumes its own work); the stages
    in ``redo`` are measured again, their outputs (:data:`REDO_OUTPUTS`) removed first."""
    base = work / f"n={n}"
    coll = base / "collection"
    info = write_collection(coll, n, n_queries)
    model = str(write_model(work / "model"))
    root = base / "store"
    progress = base / "diffret.stages.json"
    done = json.loads(progress.read_text()) if resume and progress.exists() else []
    done = [s for s in done if s["stage"] not in redo]
    for stage in redo:
        for folder in REDO_OUTPUTS[stage]:
            for path in (base / "store").glob(folder):
                shutil.rmtree(path)
    if root.exists() and not resume:
        shutil.rmtree(root)
    log = base / "log.txt"
    if not resume:
        log.write_text("")
    r = ["--root", str(root)]
    enc = ["--model", model, "--max-length", "96"]
    grid = ["--kq", "1,16", "--kp", "1,16"]
    # fmt: off
    stages = [
        ("download", ["download", "c", "--source", str(coll), *r]),
        ("tokenize", ["tokenize", "-d", "c", "--model", model, "--max-length", "96", "--shard-size", "50000", *r]),
        ("encode", ["encode", "-d", "c", *enc, "--k", "1,16", "--shard-size", "50000", "--batch-size", "64",
                    "--workers", str(workers), *r]),
        ("bm25", ["bm25", "-d", "c", "--shard-size", str(BM25_SHARD), *r]),
        ("score", ["score", "-d", "c", "--model", model, *grid, *r]),
        ("evaluate", ["evaluate", *r]),
        ("index", ["index", "-d", "c", "--model", model, "--kq", "1", "--kp", "1", *r]),
        ("report", ["report", "--out", str(base / "report"), *r]),
        ("compress", ["compress", "-d", "c", "--model", model, "--store", "int8", *r]),
        ("score_int8", ["score", "-d", "c", "--model", model, "--store", "int8", "--kq", "16", "--kp", "16",
                        "--mode", "multi_dense", *r]),
        ("late", ["late", "-d", "c", "--model", model, "--first-stage", "bm25", "--kq", "16", "--kp", "16",
                  "--mode", "multi_dense", "--depth", "100", *r]),
    ]
    # fmt: on
    out = {"n": n, "collection": info, "stages": []}
    measured = {s["stage"]: s for s in done}
    for name, args in stages:
        if name in measured:
            out["stages"].append(measured[name])
            continue
        res = run_stage(name, args, root, log)
        print(
            f"N={n:>9,} {name:<10} {res['seconds']:9.1f} s  cpu {res['cpu_seconds']:9.1f} s  "
            f"peak {res['peak_rss_mb']:8.1f} MB  +{res['files']:6d} files  +{res['bytes'] / 2**20:9.1f} MB",
            flush=True,
        )
        out["stages"].append(res)
        measured[name] = res  # every stage measured so far, those after this one too (a --redo keeps them)
        progress.write_text(json.dumps([measured[s] for s, _ in stages if s in measured], indent=1))
    out["store_bytes"] = store_size(root)[1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, action="append", help="corpus sizes (repeat)")
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", default="/tmp/diffret-scale")
    ap.add_argument("--resume", action="store_true", help="keep the stages already measured at each N, go on")
    ap.add_argument(
        "--redo",
        action="append",
        default=[],
        choices=sorted(REDO_OUTPUTS),
        help="with --resume: measure this stage again (its outputs removed first; repeat)",
    )
    ap.add_argument("--write-docs", action="store_true", help="render docs/scale.md from the results file")
    ap.add_argument("--eval-rows-per-s", type=float, help="evaluate's measured rate (benchmarks/evaluate.py)")
    args = ap.parse_args()
    if args.redo and not args.resume:
        ap.error("--redo goes with --resume (without it every stage is measured afresh)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    stored = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for n in args.n or []:
        stored[str(n)] = pipeline(n, work, args.queries, args.workers, args.resume, tuple(args.redo))
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    results = [stored[k] for k in sorted(stored, key=int)]
    fit = results[1:] if len(results) >= 3 else results  # the smallest N: each command's fixed cost
    if len(fit) >= 2:
        from scale_docs import exponents, marginal_exponents  # benchmarks/scale_docs.py

        for key in ("seconds", "peak_rss_mb"):
            print(key, {k: round(v, 2) for k, v in exponents(fit, key).items()})
        if fit is not results:
            print("seconds above start-up", {k: round(v, 2) for k, v in marginal_exponents(results).items()})
    if args.write_docs:
        from scale_docs import exponents, write_docs

        write_docs(results, exponents(fit, "seconds"), exponents(fit, "peak_rss_mb"), args.eval_rows_per_s, FIXES)


if __name__ == "__main__":
    main()
