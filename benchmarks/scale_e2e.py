"""The whole pipeline at growing corpus sizes, through the CLI, with every stage's cost measured (issue 41).

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

## Known limits: what still grows with N

- **bm25** holds the whole corpus: every passage's text, bm25s's token lists and its score matrix (2.7 kB a
  passage between 100k and 1M; about 25 GB at MS MARCO). A bounded BM25 needs the corpus statistics (document
  frequencies, mean length) from a first pass and then one shard's score matrix at a time, its top k merged into
  the run: equal to bm25s's scores, and to its runs up to ties at the cut-off. Not done.
- **late** holds every passage id of the corpus as Python objects (the ordered list and an id -> position dict, and
  when it encodes missing passages the set of ids already encoded, in `_encode_missing`): 0.8 kB a passage. Arrow
  id arrays and hashed lookups (as evaluate now does) would leave the run's candidates only. Not done.
- **tokenize, encode, index, score_int8** grew 80-290 B a passage between 100k and 1M (0.1-0.3 GB). One run per size
  cannot tell a per-passage cost from run-to-run variation at these peaks; a third size or a memory profile would.
  Encode's projected 3.9 GB at MS MARCO is at the bound.
- Time: every corpus-linear stage's exponent above start-up is within 1.0 +/- 0.15 (tokenize 1.09, encode 0.91,
  bm25 0.97, score 0.96, compress 0.87, score_int8 1.02); index (0.50) and late (0.63) grow slower than N.

## What these numbers are

- One run per size, each stage its own command, with the stages' code of commit ab2c2c9 (later commits change SIDR's
  readout and these benchmarks, not the stages measured). 1k, 10k and 100k ran on an idle machine. The 1M run's
  encode (52 min) shared the machine for its first ~20 minutes with one-thread benchmarks and a 3-minute test run:
  its wall time is an upper bound (its CPU seconds are not affected). Every other stage at 1M ran alone.
- Wall times on 2 cores; the projection's GPU figures are assumptions, named above, not measurements.
"""
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
    info = {"passages": n, "queries": n_queries, "mean_words": float(lengths.mean()),
            "bytes": sum(x.stat().st_size for x in folder.rglob("*") if x.is_file())}  # fmt: skip
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
    cfg = BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=2 * hidden, max_position_embeddings=512)  # fmt: skip
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
        proc = subprocess.Popen([sys.executable, "-m", "diffret.flows.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT,
                                env=env, cwd=REPO)  # fmt: skip
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
    return {"stage": name, "seconds": round(seconds, 2), "cpu_seconds": round(cpu_seconds, 2),
            "peak_rss_mb": round(top[1] / 2**20, 1),
            "peak_process": top[0], "processes": len(peaks), "files": files1 - files0,
            "bytes": bytes1 - bytes0}  # fmt: skip


def pipeline(n: int, work: Path, n_queries: int, workers: int, resume: bool = False) -> dict:
    """Every stage at corpus size ``n``. With ``resume``, the stages already measured (``stages.json`` beside the
    store) are kept and the run goes on from the first one missing (each command resumes its own work)."""
    base = work / f"n={n}"
    coll = base / "collection"
    info = write_collection(coll, n, n_queries)
    model = str(write_model(work / "model"))
    root = base / "store"
    progress = base / "diffret.stages.json"
    done = json.loads(progress.read_text()) if resume and progress.exists() else []
    if root.exists() and not resume:
        shutil.rmtree(root)
    log = base / "log.txt"
    if not resume:
        log.write_text("")
    r = ["--root", str(root)]
    enc = ["--model", model, "--max-length", "96"]
    grid = ["--kq", "1,16", "--kp", "1,16"]
    stages = [
        ("download", ["download", "c", "--source", str(coll), *r]),
        ("tokenize", ["tokenize", "-d", "c", "--model", model, "--max-length", "96", "--shard-size", "50000", *r]),
        ("encode", ["encode", "-d", "c", *enc, "--k", "1,16", "--shard-size", "50000", "--batch-size", "64",
                    "--workers", str(workers), *r]),
        ("bm25", ["bm25", "-d", "c", *r]),
        ("score", ["score", "-d", "c", "--model", model, *grid, *r]),
        ("evaluate", ["evaluate", *r]),
        ("index", ["index", "-d", "c", "--model", model, "--kq", "1", "--kp", "1", *r]),
        ("report", ["report", "--out", str(base / "report"), *r]),
        ("compress", ["compress", "-d", "c", "--model", model, "--store", "int8", *r]),
        ("score_int8", ["score", "-d", "c", "--model", model, "--store", "int8", "--kq", "16", "--kp", "16",
                        "--mode", "multi_dense", *r]),
        ("late", ["late", "-d", "c", "--model", model, "--first-stage", "bm25", "--kq", "16", "--kp", "16",
                  "--mode", "multi_dense", "--depth", "100", *r]),
    ]  # fmt: skip
    out = {"n": n, "collection": info, "stages": []}
    measured = {s["stage"]: s for s in done}
    for name, args in stages:
        if name in measured:
            out["stages"].append(measured[name])
            continue
        res = run_stage(name, args, root, log)
        print(f"N={n:>9,} {name:<10} {res['seconds']:9.1f} s  cpu {res['cpu_seconds']:9.1f} s  "
              f"peak {res['peak_rss_mb']:8.1f} MB  +{res['files']:6d} files  +{res['bytes'] / 2**20:9.1f} MB",
              flush=True)  # fmt: skip
        out["stages"].append(res)
        progress.write_text(json.dumps(out["stages"], indent=1))
    out["store_bytes"] = store_size(root)[1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, action="append", help="corpus sizes (repeat)")
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", default="/tmp/diffret-scale")
    ap.add_argument("--resume", action="store_true", help="keep the stages already measured at each N, go on")
    ap.add_argument("--write-docs", action="store_true", help="render docs/scale.md from the results file")
    ap.add_argument("--eval-rows-per-s", type=float, help="evaluate's measured rate (benchmarks/evaluate.py)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    stored = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for n in args.n or []:
        stored[str(n)] = pipeline(n, work, args.queries, args.workers, args.resume)
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
