"""Search over residual:4 codes as the collection grows, against fast-plaid (PLAID) and LanceDB on the same vectors.

    python benchmarks/codes_scale.py --n 10000 100000 --work /tmp/codes_scale      # the measurement
    python benchmarks/codes_scale.py --n 2000 --queries 20 --work /tmp/cs_small     # a quick one
    python benchmarks/codes_scale.py --n 1000000 --kmeans-iterations 4 --fastplaid-codes diffret \
        --fastplaid-python /path/to/fastplaid-env/bin/python --repeats 1 --setting 32x8192 32x32768 128x65536

Per size N: N passages x K_p 16 and ``--queries`` queries x K_q 8 at H = 128 from the width benchmark's low-rank plus
noise model (tests/synthetic_store.py, imported: query i is about passage i N / queries), unit vectors stored as
float16 (a memory map). The reference is diffret's exact search (``search_pass``, multi_dense) over those vectors:
its top-10 and top-100 of each query. Then, in one process per size, with the engines alternating setting by setting:

- **diffret**: the codebook trained as `diffret compress` trains it (residual:4, ColBERTv2's count of centroids,
  2^floor(log2(16 sqrt(vectors))), on ``--sample`` vectors: by default ColBERTv2's sample, as fast-plaid draws it and
  ``--codebook-sample colbert`` does; a number gives a fixed sample), every vector coded, the codes
  index built as `diffret index` builds it; then `search_codes` (what `score --search codes` runs) at each
  ``PROBESxCANDIDATES``. Its 4-bit ceiling: exact search over the decoded codes.
- **fast-plaid** (``--fastplaid-python``: a separate environment with fast-plaid and the torch its wheel pins; a
  benchmark-only dependency): ``FastPlaid.create(nbits=4)`` (its own k-means, the same count of centroids) and
  ``search(n_ivf_probe=PROBES, n_full_scores=CANDIDATES)``, run as a subprocess that reads the same .npy files.
  ``--fastplaid-codes diffret``: instead of its own build, it searches diffret's codebook and codes written in its
  index layout (:func:`fastplaid_from_codes`; rows of engine ``fast-plaid/diffret-codes``), where its own build would
  take hours (1M on 2 cores).
- **LanceDB** (sizes up to ``--lance-max``): the float16 multivector table and IVF_PQ index `diffret index` builds,
  searched with exact MaxSim re-ranking (retrieval/search/lance.py) at a few probe counts.

Per row: recall@10 and recall@100 of the exact top-10 / top-100, ms a query (the whole query batch's wall time over
the queries, one thread, best of ``--repeats``), bytes a passage (codes and index in memory for diffret, the index
folder for fast-plaid and LanceDB), build seconds (on ``--build-threads``, recorded with them). Results:
``benchmarks/results/codes_scale.json``
(merged by size: a long run keeps every size it finished). The work folder keeps each size's vectors, their exact
top-100, diffret's build (reused for the same sample and k-means iterations) and fast-plaid's, so a rerun searches
again without building.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "codes_scale.json"
KP, KQ, HIDDEN, BITS = 16, 8, 128, 4
CHUNK = 5000  # passages generated (and streamed to exact search) at a time
FASTPLAID, FASTPLAID_ON_DIFFRET = "fast-plaid", "fast-plaid/diffret-codes"  # its own build; diffret's codes


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ------------------------------------------------------------------------------------------ fast-plaid worker
def fastplaid_worker(work: Path, mode: str, folder: str = "fastplaid") -> None:
    """Runs in fast-plaid's environment (no diffret import), on the index in ``work / folder``. ``build``: create
    the index, print its seconds and bytes. ``search``: read ``{"probes", "candidates"}`` lines on stdin, write
    ``top100_PxC.npy`` (top-100 ids) into the index folder, print the batch's ms a query."""
    import torch
    from fast_plaid.search import FastPlaid

    index = work / folder
    if mode == "build":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        x = torch.from_numpy(np.load(work / "passages.npy"))  # [N, K_p, H] float16
        t0 = time.perf_counter()
        fp = FastPlaid(index=str(index), device="cpu")
        fp.create(list(torch.unbind(x)), nbits=BITS, seed=0)
        print(json.dumps({"build_s": time.perf_counter() - t0, "bytes": folder_bytes(index)}), flush=True)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    q = torch.from_numpy(np.load(work / "queries.npy"))
    fp = FastPlaid(index=str(index), device="cpu")
    fp.search(q[:2], top_k=10, show_progress=False)  # loads the index
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        t0 = time.perf_counter()
        res = fp.search(q, top_k=100, n_ivf_probe=cmd["probes"], n_full_scores=cmd["candidates"], show_progress=False)
        ms = (time.perf_counter() - t0) * 1000 / len(q)
        ids = np.full((len(q), 100), -1, np.int64)
        for i, r in enumerate(res):
            ids[i, : len(r)] = [d for d, _ in r]
        np.save(index / f"top100_{cmd['probes']}x{cmd['candidates']}.npy", ids)
        print(json.dumps({"ms": ms}), flush=True)


def fastplaid_from_codes(folder: Path, codes: np.ndarray, cb: Any, index: Any, n: int) -> None:
    """Write diffret's residual:4 codebook, codes and codes index as a fast-plaid index folder (its 1.7 layout), so
    fast-plaid searches the very codes diffret searches. fast-plaid packs a byte as diffret does (the even dimension
    in the high nibble) but each 4-bit bucket index with its bits reversed; its centroids are float16. Checked
    against a fast-plaid build: its ``get_embeddings`` of a written folder equals diffret's ``decode`` to float16
    rounding (2.7e-4 at 10k; docs/scale.md)."""
    from diffret.retrieval.search.codecs import ID_BYTES, byte_table
    from diffret.retrieval.search.codes import centroid_ids

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rev = np.array([int(f"{v:04b}"[::-1], 2) for v in range(16)], np.uint8)
    lut = (rev[np.arange(256) >> 4] << 4 | rev[np.arange(256) & 15]).astype(np.uint8)
    cents = cb.arrays["centroids"]
    # one chunk: fast-plaid merges it into its own files at the first load
    np.save(folder / "0.codes.npy", centroid_ids(codes))
    np.save(folder / "0.residuals.npy", lut[codes[:, ID_BYTES:]])
    np.save(folder / "centroids.npy", cents.astype(np.float16))
    np.save(folder / "bucket_cutoffs.npy", cb.arrays["cutoffs"].astype(np.float32))
    np.save(folder / "bucket_weights.npy", cb.arrays["values"].astype(np.float32))
    # not read by search (update's): the mean absolute residual of each dimension, and a cell radius
    sample = codes[:: max(1, len(codes) // 100_000)]
    resid = byte_table(cb.arrays["values"], BITS)[sample[:, ID_BYTES:]].reshape(len(sample), -1)
    np.save(folder / "avg_residual.npy", np.abs(resid).mean(0).astype(np.float32))
    np.save(
        folder / "cluster_threshold.npy",
        np.array([float(np.quantile(np.linalg.norm(resid, axis=1), 0.75))], np.float32),
    )
    np.save(folder / "ivf.npy", index.passages.astype(np.int64))
    np.save(folder / "ivf_lengths.npy", np.diff(index.offsets).astype(np.int32))
    (folder / "doclens.0.json").write_text(json.dumps([KP] * n))
    (folder / "0.metadata.json").write_text(
        json.dumps({"embedding_offset": 0, "num_documents": n, "num_embeddings": len(codes)}, indent=2)
    )
    (folder / "plan.json").write_text(json.dumps({"nbits": BITS, "num_chunks": 1}, indent=2))
    meta = {
        "avg_doclen": float(KP),
        "compress_only": False,
        "nbits": BITS,
        "num_chunks": 1,
        "num_documents": n,
        "num_embeddings": len(codes),
        "num_partitions": len(cents),
        "frozen": True,
        "mutable": True,
    }
    (folder / "metadata.json").write_text(json.dumps(meta, indent=2))


# ------------------------------------------------------------------------------------------ the measurement
def recall(got: np.ndarray, ref: np.ndarray, k: int) -> float:
    return float(np.mean([len(set(g[:k].tolist()) & set(r[:k].tolist())) / k for g, r in zip(got, ref, strict=True)]))


def make_vectors(work: Path, n: int, n_queries: int, seed: int) -> None:
    """passages.npy [N, K_p, H] float16 and queries.npy [queries, K_q, H] float32, unit vectors."""
    sys.path.insert(0, str(REPO / "tests"))
    from synthetic_store import Spectrum, _Vectors

    sp = Spectrum()
    gen = _Vectors(HIDDEN, sp, n, seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    p = np.lib.format.open_memmap(work / "passages.tmp.npy", "w+", np.float16, (n, KP, HIDDEN))
    for i, a in enumerate(range(0, n, CHUNK)):
        b = min(a + CHUNK, n)
        p[a:b] = unit(gen.vectors(np.arange(a, b), KP, i))
    p.flush()
    del p
    targets = np.arange(n_queries) * n // n_queries
    np.save(work / "queries.npy", unit(gen.vectors(targets, KQ, 10_000, sp.query_noise)).astype(np.float32))
    os.replace(work / "passages.tmp.npy", work / "passages.npy")


def run_size(args: argparse.Namespace, n: int) -> dict[str, Any]:
    import faiss
    import torch

    from diffret.retrieval.search.codecs import Codebook, Codec, colbert_centroids, decode, encode, train_codebook
    from diffret.retrieval.search.codes import CodedPassages, CodesIndex, CodesSearchStats, search_codes
    from diffret.retrieval.search.encodings import Encodings
    from diffret.retrieval.search.exact import SearchSettings, search_pass
    from diffret.retrieval.search.rules import ScoreRules
    from diffret.stages.codebooks import DEFAULT_SAMPLE, codebook_sample, sample_vectors

    spec = f"residual:{BITS}"
    work = Path(args.work) / f"n{n}"
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"n": n, "kp": KP, "kq": KQ, "hidden": HIDDEN, "queries": args.queries, "rows": []}
    rows = out["rows"]
    # an earlier run's rows that this one does not measure again: LanceDB's (when not measured), and the others at
    # another thread count or setting
    before = json.loads(RESULTS.read_text()).get(str(n), {}) if RESULTS.exists() else {}
    again = {(args.threads, *(int(v) for v in setting.split("x"))) for setting in args.setting}
    measured = {"diffret"} | (
        {FASTPLAID_ON_DIFFRET if args.fastplaid_codes == "diffret" else FASTPLAID} if args.fastplaid_python else set()
    )
    kept = [
        r
        for r in before.get("rows", [])
        if (r["engine"] == "lancedb" and n > args.lance_max)
        or (
            r["engine"] != "lancedb"
            and (r["engine"] not in measured or (r.get("threads", 1), r["probes"], r["candidates"]) not in again)
        )
    ]
    rows += kept
    if "fastplaid_build_s" in before:  # an earlier run's fast-plaid build, when this one does not measure it
        out["fastplaid_build_s"] = before["fastplaid_build_s"]
    t0 = time.perf_counter()
    if not (work / "passages.npy").exists():
        make_vectors(work, n, args.queries, args.seed)
    log(f"N {n:,}: vectors in {time.perf_counter() - t0:.0f} s")
    x = np.load(work / "passages.npy", mmap_mode="r")
    qn = np.load(work / "queries.npy")
    rules = ScoreRules()

    def enc(ids: list[str], multi: torch.Tensor) -> Encodings:
        return Encodings(ids, multi, torch.ones(multi.shape[:2], dtype=torch.bool), multi.mean(1), [], [])

    queries = enc([f"q{i}" for i in range(len(qn))], torch.from_numpy(qn))

    def exact(block: Any) -> np.ndarray:
        stream = (
            enc([str(i) for i in range(a, min(a + CHUNK, n))], torch.from_numpy(block(a, min(a + CHUNK, n))))
            for a in range(0, n, CHUNK)
        )
        tops, _ = search_pass({KQ: queries}, stream, ["multi_dense"], SearchSettings(topk=100, rules=rules))
        return tops[(KQ, "multi_dense")].index

    torch.set_num_threads(args.build_threads)
    faiss.omp_set_num_threads(args.build_threads)
    t0 = time.perf_counter()
    if (work / "exact_top100.npy").exists():  # the vectors' exact top-100 (the vectors are never rewritten)
        ref = np.load(work / "exact_top100.npy")
        out["exact_s"] = before.get("exact_s")  # the run that searched them
    else:
        ref = exact(lambda a, b: np.asarray(x[a:b], np.float32))
        np.save(work / "exact_top100.npy", ref)
        out["exact_s"] = round(time.perf_counter() - t0, 1)
    log(f"exact top-100 in {out['exact_s']} s")

    # diffret: codebook as `compress` trains it, codes, the codes index as `index` builds it (the codebook and
    # codes are kept in the work folder with their sample and build seconds: a rerun with the same sample searches
    # them again; another sample builds them anew)
    built = work / "diffret_build.json"
    out["sample"] = min(sample_vectors(args.sample, n, KP), n * KP)
    out["kmeans_iterations"] = args.kmeans_iterations
    b = json.loads(built.read_text()) if built.exists() else {}
    # a build without its sample recorded: the old default's; without its iterations: 20
    if (b.get("sample", DEFAULT_SAMPLE), b.get("kmeans_iterations", 20)) == (out["sample"], args.kmeans_iterations):
        cb, codes = (
            Codebook.from_bytes((work / "diffret_codebook.bin").read_bytes()),
            np.load(work / "diffret_codes.npy"),
        )
    else:
        t0 = time.perf_counter()
        chunks = [str(a) for a in range(0, n, CHUNK)]
        sample = codebook_sample(
            chunks,
            lambda s: np.asarray(x[int(s) : int(s) + CHUNK], np.float32).reshape(-1, HIDDEN),
            out["sample"],
            0,
        )
        cb = train_codebook(sample, spec, 0, n * KP, iterations=args.kmeans_iterations)
        t_codebook = time.perf_counter() - t0
        codes = np.concatenate(
            [encode(np.asarray(x[a : a + CHUNK], np.float32).reshape(-1, HIDDEN), spec, cb) for a in range(0, n, CHUNK)]
        )
        t_codes = time.perf_counter() - t0 - t_codebook
        (work / "diffret_codebook.bin").write_bytes(cb.to_bytes())
        np.save(work / "diffret_codes.npy", codes)
        b = {
            "codebook_s": t_codebook,
            "codes_s": t_codes,
            "sample": len(sample),
            "kmeans_iterations": args.kmeans_iterations,
            "build_threads": args.build_threads,
        }
        (work / "ceiling_top100.npy").unlink(missing_ok=True)
        built.write_text(json.dumps(b))
    t_codebook, t_codes, b_threads = b["codebook_s"], b["codes_s"], b.get("build_threads", args.build_threads)
    t0 = time.perf_counter()
    codec = Codec(spec, HIDDEN, cb)
    coded = CodedPassages.from_blocks([(codes, np.full(n, KP))], codec)
    index = CodesIndex.build([(coded.cells, np.full(n, KP))], len(cb.arrays["centroids"]))
    build_s = time.perf_counter() - t0 + t_codebook + t_codes
    d_bytes = (codes.nbytes + index.passages.nbytes + index.offsets.nbytes) / n
    out["centroids"] = colbert_centroids(n * KP)
    log(
        f"diffret: {index.n_centroids:,} centroids, codebook {t_codebook:.0f} s, built in {build_s:.0f} s, "
        f"{d_bytes:,.0f} B a passage"
    )
    if (work / "ceiling_top100.npy").exists():  # of this build (removed when it is rebuilt)
        ceiling = np.load(work / "ceiling_top100.npy")
    else:
        ceiling = exact(lambda a, b: decode(codes[a * KP : b * KP], spec, cb, HIDDEN).reshape(b - a, KP, HIDDEN))
        np.save(work / "ceiling_top100.npy", ceiling)
    out["ceiling"] = {"recall_10": recall(ceiling, ref, 10), "recall_100": recall(ceiling, ref, 100)}
    log(f"4-bit ceiling (exact over diffret's decoded codes): {out['ceiling']}")

    fp_search, fp_engine, fp_folder = None, FASTPLAID, "fastplaid"
    if args.fastplaid_python and args.fastplaid_codes == "diffret":
        # fast-plaid searches diffret's codes (written in its layout): no fast-plaid build to measure
        fp_engine, fp_folder = FASTPLAID_ON_DIFFRET, "fastplaid_diffret_codes"
        t0 = time.perf_counter()
        fastplaid_from_codes(work / fp_folder, codes, cb, index, n)
        fp_build = {"build_s": None, "bytes": 0, "build_threads": None}  # its bytes: once fast-plaid has loaded it
        log(f"fast-plaid's folder written from diffret's codes in {time.perf_counter() - t0:.0f} s")
    if args.fastplaid_python:
        env = dict(os.environ)
        threads = {k: str(args.build_threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS")}
        fp_built = work / "fastplaid_build.json"
        if fp_engine == FASTPLAID and not fp_built.exists():
            res = subprocess.run(
                [args.fastplaid_python, __file__, "--fastplaid-worker", "build", "--work", str(work)],
                capture_output=True,
                text=True,
                env={**env, **threads},
            )
            if res.returncode:
                raise RuntimeError(f"fast-plaid build failed: {res.stderr[-2000:]}")
            fp_built.write_text(
                json.dumps({**json.loads(res.stdout.strip().splitlines()[-1]), "build_threads": args.build_threads})
            )
        if fp_engine == FASTPLAID:
            fp_build = json.loads(fp_built.read_text())
            fp_build["build_s"] = round(fp_build["build_s"], 1)
            log(f"fast-plaid: built in {fp_build['build_s']:.0f} s, {fp_build['bytes'] / n:,.0f} B a passage")
        one = {k: str(args.threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS")}
        fp_search = subprocess.Popen(
            [
                args.fastplaid_python,
                __file__,
                "--fastplaid-worker",
                "search",
                "--work",
                str(work),
                "--fastplaid-folder",
                fp_folder,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**env, **one},
        )
        json.loads(fp_search.stdout.readline())
        if fp_build["build_s"] is not None:
            out["fastplaid_build_s"] = fp_build["build_s"]
        if fp_engine == FASTPLAID_ON_DIFFRET:  # after the search loaded it: fast-plaid's own merged files counted
            fp_build["bytes"] = folder_bytes(work / fp_folder)

    torch.set_num_threads(args.threads)
    search_codes(queries.rows(0, 2), coded, index, 10, 1, 64, rules)  # warm

    def d_run(p: int, c: int) -> tuple[float, np.ndarray, CodesSearchStats]:
        st = CodesSearchStats()
        t0 = time.perf_counter()
        got = search_codes(queries, coded, index, 100, p, c, rules, st)
        return (time.perf_counter() - t0) * 1000 / len(qn), got.index, st

    def f_run(p: int, c: int) -> tuple[float, np.ndarray]:
        fp_search.stdin.write(json.dumps({"probes": p, "candidates": c}) + "\n")
        fp_search.stdin.flush()
        ms = json.loads(fp_search.stdout.readline())["ms"]
        return ms, np.load(work / fp_folder / f"top100_{p}x{c}.npy")

    for setting in args.setting:
        p, c = (int(v) for v in setting.split("x"))
        best = {"diffret": float("inf"), fp_engine: float("inf")}
        got: dict[str, np.ndarray] = {}
        st = None
        for _ in range(args.repeats):  # engines alternating
            ms, got["diffret"], st = d_run(p, c)
            best["diffret"] = min(best["diffret"], ms)
            if fp_search is not None:
                ms, got[fp_engine] = f_run(p, c)
                best[fp_engine] = min(best[fp_engine], ms)
        for engine, ids in got.items():
            row = {
                "engine": engine,
                "n": n,
                "probes": p,
                "candidates": c,
                "threads": args.threads,
                "recall_10": recall(ids, ref, 10),
                "recall_100": recall(ids, ref, 100),
                "ms_per_query": best[engine],
                "bytes_per_passage": d_bytes if engine == "diffret" else fp_build["bytes"] / n,
                "build_s": round(build_s, 1) if engine == "diffret" else fp_build["build_s"],
                "build_threads": (b_threads if engine == "diffret" else fp_build.get("build_threads", 1)),
            }
            if engine == "diffret":
                row["probed_mean"] = float(np.mean(st.probed))
            rows.append(row)
            log(
                f"{engine:10s} {p:>4}x{c:<5} R@10 {row['recall_10']:.3f} R@100 {row['recall_100']:.3f} "
                f"{row['ms_per_query']:8.2f} ms"
            )
        _merge(out)
    if fp_search is not None:
        fp_search.stdin.close()
        fp_search.wait(timeout=60)

    if n <= args.lance_max:
        from diffret.retrieval.search import lance

        db = str(work / "lance")
        shutil.rmtree(db, ignore_errors=True)  # an earlier run's table versions would count in its bytes
        t0 = time.perf_counter()
        lance.build_table(
            db,
            ((list(map(str, range(a, min(a + CHUNK, n)))), np.asarray(x[a : a + CHUNK])) for a in range(0, n, CHUNK)),
            HIDDEN,
            dtype="float16",
        )
        info = lance.create_index(db, "IVF_PQ")
        l_build = time.perf_counter() - t0
        l_bytes = folder_bytes(Path(db)) / n
        parts = info.params["num_partitions"]
        log(f"LanceDB: IVF_PQ {parts} partitions, built in {l_build:.0f} s, {l_bytes:,.0f} B a passage")
        qs = [q for q in qn]
        lance.search(db, qs[:2], 10)  # warm
        for nprobes in args.lance_nprobes:
            best, hits = float("inf"), None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                hits = lance.search(db, qs, 100, nprobes=min(nprobes, parts))
                best = min(best, (time.perf_counter() - t0) * 1000 / len(qs))
            ids = np.array([[int(d) for d, _ in h] + [-1] * (100 - len(h)) for h in hits])
            row = {
                "engine": "lancedb",
                "n": n,
                "probes": min(nprobes, parts),
                "candidates": hits.stats.limit,
                "recall_10": recall(ids, ref, 10),
                "recall_100": recall(ids, ref, 100),
                "ms_per_query": best,
                "bytes_per_passage": l_bytes,
                "build_s": round(l_build, 1),
            }
            rows.append(row)
            log(f"lancedb    {nprobes:>4}x{row['candidates']:<5} R@10 {row['recall_10']:.3f} {best:8.2f} ms")
        _merge(out)
    return out


def _merge(out: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[str(out["n"])] = out
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


# ------------------------------------------------------------------------------------------ docs/scale.md
DOCS = REPO / "docs" / "scale.md"
BEGIN, END = "<!-- codes-scale: begin (benchmarks/codes_scale.py --docs) -->", "<!-- codes-scale: end -->"
MSMARCO = 8_841_823


def cheapest(rows: list[dict[str, Any]], engine: str, target: float) -> dict[str, Any] | None:
    """The fastest row of ``engine`` whose recall@10 reaches ``target`` (None: none does)."""
    ok = [r for r in rows if r["engine"] == engine and r["recall_10"] >= target - 1e-9]
    return min(ok, key=lambda r: r["ms_per_query"]) if ok else None


def smallest(rows: list[dict[str, Any]], engine: str, target: float) -> dict[str, Any] | None:
    """The row of ``engine`` with the fewest candidates, then probes, whose recall@10 reaches ``target``."""
    ok = [r for r in rows if r["engine"] == engine and r["recall_10"] >= target - 1e-9]
    return min(ok, key=lambda r: (r["candidates"], r["probes"])) if ok else None


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def fp_of(d: dict[str, Any]) -> str:
    """The fast-plaid rows a size compares diffret with: its own build's, else those on diffret's codes."""
    return FASTPLAID if any(r["engine"] == FASTPLAID for r in d["rows"]) else FASTPLAID_ON_DIFFRET


def render(data: dict[str, Any]) -> str:
    sizes = sorted(data.values(), key=lambda d: d["n"])
    many = [r for d in sizes for r in d["rows"] if r.get("threads", 1) != 1]
    sizes = [{**d, "rows": [r for r in d["rows"] if r.get("threads", 1) == 1]} for d in sizes]
    out = [BEGIN, "", "Each engine's index, per size:", ""]
    out.append(
        "| N | vectors | centroids | engine | B a passage | build s (threads) | 4-bit ceiling recall@10 / @100 |"
    )
    out.append("|---:|---:|---:|---|---:|---:|---|")
    for d in sizes:
        for e in ("diffret", FASTPLAID, FASTPLAID_ON_DIFFRET, "lancedb"):
            mine = [r for r in d["rows"] if r["engine"] == e]
            if not mine:
                continue
            ceiling = (
                f"{d['ceiling']['recall_10']:.3f} / {d['ceiling']['recall_100']:.3f} (exact over its codes)"
                if e == "diffret"
                else ""
            )
            built = (
                "diffret's codes"
                if mine[0]["build_s"] is None
                else f"{mine[0]['build_s']:,.0f} ({mine[0].get('build_threads', 1)})"
            )
            iters = (
                f", k-means {d['kmeans_iterations']} iterations" if e == "diffret" and "kmeans_iterations" in d else ""
            )
            out.append(
                f"| {d['n']:,} | {d['n'] * d['kp']:,} | {d['centroids']:,} | {e} | "
                f"{mine[0]['bytes_per_passage']:,.0f} | {built}{iters} | {ceiling} |"
            )
    out += ["", "Recall of the exact top-10 / top-100 and ms a query (one thread), per setting:", ""]
    out.append("| N | probes x candidates | diffret R@10 | R@100 | ms | fast-plaid R@10 | R@100 | ms |")
    out.append("|---:|---|---:|---:|---:|---:|---:|---:|")
    for d in sizes:
        by = {(r["engine"], r["probes"], r["candidates"]): r for r in d["rows"]}
        mark = "" if fp_of(d) == FASTPLAID else " *"
        for p, c in sorted(
            {(r["probes"], r["candidates"]) for r in d["rows"] if r["engine"] in ("diffret", fp_of(d))},
            key=lambda k: (k[1], k[0]),
        ):
            cells = []
            for e in ("diffret", fp_of(d)):
                r = by.get((e, p, c))
                cells += (
                    [f"{r['recall_10']:.3f}", f"{r['recall_100']:.3f}", f"{r['ms_per_query']:.1f}"]
                    if r
                    else ["", "", ""]
                )
            out.append(f"| {d['n']:,}{mark} | {p} x {c:,} | " + " | ".join(cells) + " |")
    if any(fp_of(d) == FASTPLAID_ON_DIFFRET for d in sizes):
        out += [
            "",
            "\\* fast-plaid searching diffret's codebook and codes, written in its index layout (no build of its own).",
        ]
    both = [d for d in sizes if {FASTPLAID, FASTPLAID_ON_DIFFRET} <= {r["engine"] for r in d["rows"]}]
    for d in both:
        by = {(r["engine"], r["probes"], r["candidates"]): r for r in d["rows"]}
        keys = sorted({(p, c) for e, p, c in by if e == FASTPLAID_ON_DIFFRET}, key=lambda k: (k[1], k[0]))
        out += [
            "",
            f"fast-plaid at N = {d['n']:,} on its own build and on diffret's codes (same settings, same run):",
            "",
            "| probes x candidates | own R@10 | ms | on diffret's codes R@10 | ms | diffret R@10 | ms |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for p, c in keys:
            cells = []
            for e in (FASTPLAID, FASTPLAID_ON_DIFFRET, "diffret"):
                r = by.get((e, p, c))
                cells += [f"{r['recall_10']:.3f}", f"{r['ms_per_query']:.1f}"] if r else ["", ""]
            out.append(f"| {p} x {c:,} | " + " | ".join(cells) + " |")
    lance = [r for d in sizes for r in d["rows"] if r["engine"] == "lancedb"]
    if lance:
        out += ["", "LanceDB (IVF_PQ, nprobes x the candidates it fetches, re-ranked exactly):", ""]
        out.append("| N | nprobes x candidates | R@10 | R@100 | ms |")
        out.append("|---:|---|---:|---:|---:|")
        for r in lance:
            out.append(
                f"| {r['n']:,} | {r['probes']} x {r['candidates']:,} | {r['recall_10']:.3f} | {r['recall_100']:.3f} | "
                f"{r['ms_per_query']:.1f} |"
            )
    out += [
        "",
        "The smallest setting (fewest candidates, then probes) within 0.01 of each engine's ceiling: for diffret, "
        "exact search over its decoded codes; for fast-plaid, the best recall@10 any of its settings reached:",
        "",
    ]
    out.append("| N | centroids | engine | ceiling recall@10 | smallest setting | recall@10 | ms a query |")
    out.append("|---:|---:|---|---:|---|---:|---:|")
    law: dict[str, list[tuple[int, float, int, int]]] = {}
    for d in sizes:
        for e in ("diffret", fp_of(d)):
            mine = [r["recall_10"] for r in d["rows"] if r["engine"] == e]
            if not mine:
                continue
            ceiling = d["ceiling"]["recall_10"] if e == "diffret" else max(mine)
            r = smallest(d["rows"], e, ceiling - 0.01)
            if r is None:
                out.append(f"| {d['n']:,} | {d['centroids']:,} | {e} | {ceiling:.3f} | none reaches it | | |")
                continue
            law.setdefault(e if e == "diffret" else FASTPLAID, []).append(
                (d["n"], r["ms_per_query"], r["probes"], r["candidates"])
            )
            out.append(
                f"| {d['n']:,} | {d['centroids']:,} | {e} | {ceiling:.3f} | {r['probes']} x {r['candidates']:,} | "
                f"{r['recall_10']:.3f} | {r['ms_per_query']:.1f} |"
            )
    out.append("")
    reach = [
        t
        for t in (0.6, 0.65, 0.7, 0.75, 0.8)
        if all(cheapest(d["rows"], e, t) for d in sizes for e in ("diffret", fp_of(d)))
    ]
    for t in reach[-1:]:
        for e in ("diffret", FASTPLAID):
            pts = [(d["n"], cheapest(d["rows"], e if e == "diffret" else fp_of(d), t)) for d in sizes]
            b = slope([p[0] for p in pts], [p[1]["ms_per_query"] for p in pts])
            steps = ", ".join(f"{p[1]['ms_per_query']:.1f} ms ({p[1]['probes']} x {p[1]['candidates']:,})" for p in pts)
            out.append(
                f"- **{e}** at recall@10 >= {t:.2f} (the highest reached by both at every size): {steps}; N^{b:.2f}."
            )
    for e, pts in law.items():
        if len(pts) >= 2:
            ns = [p[0] for p in pts]
            b, bc = slope(ns, [p[1] for p in pts]), slope(ns, [p[3] for p in pts])
            big = 10 * ns[-1]
            at = {m: (pts[-1][1] * (m / ns[-1]) ** b, pts[-1][3] * (m / ns[-1]) ** bc) for m in (big, MSMARCO)}
            out.append(
                f"- **{e}** within 0.01 of its ceiling (least squares over N = {', '.join(f'{n:,}' for n in ns)}): "
                f"ms a query grows as N^{b:.2f}, the candidates it needs as N^{bc:.2f}. *Extrapolated*, not "
                f"measured: at {big:,} passages (one decade on) {at[big][0]:,.0f} ms and {at[big][1]:,.0f} "
                f"candidates; at MS MARCO's {MSMARCO:,}, {at[MSMARCO][0]:,.0f} ms and {at[MSMARCO][1]:,.0f} "
                "candidates a query on one thread."
            )
    top = sizes[-1]
    fp_best = max((r["recall_10"] for r in top["rows"] if r["engine"] == fp_of(top)), default=0.0)
    for target in sorted({0.6, 0.7, 0.8, round(fp_best, 3)}):
        a, b = cheapest(top["rows"], "diffret", target), cheapest(top["rows"], fp_of(top), target)
        if a and b:
            out.append(
                f"- At N = {top['n']:,}, recall@10 >= {target:.3f}: diffret {a['ms_per_query']:.1f} ms "
                f"({a['probes']} x {a['candidates']:,}), fast-plaid {b['ms_per_query']:.1f} ms ({b['probes']} x "
                f"{b['candidates']:,}): diffret's time is {a['ms_per_query'] / b['ms_per_query']:.2f}x fast-plaid's."
            )
    if many:
        out += ["", "The same searches on every thread of this machine:", ""]
        out.append("| N | engine | threads | probes x candidates | recall@10 | ms a query |")
        out.append("|---:|---|---:|---|---:|---:|")
        for r in sorted(many, key=lambda r: (r["n"], r["engine"], r["candidates"], r["probes"])):
            out.append(
                f"| {r['n']:,} | {r['engine']} | {r['threads']} | {r['probes']} x {r['candidates']:,} | "
                f"{r['recall_10']:.3f} | {r['ms_per_query']:.1f} |"
            )
    out += ["", END]
    return "\n".join(out)


def write_docs() -> None:
    data = json.loads(RESULTS.read_text())
    text = DOCS.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOCS}: add the markers {BEGIN} and {END} where the table goes")
    head, rest = text.split(BEGIN, 1)
    DOCS.write_text(head + render(data) + rest.split(END, 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--work", default="/tmp/codes_scale")
    ap.add_argument(
        "--setting",
        nargs="+",
        default=[f"{p}x{c}" for c in (256, 1024, 4096) for p in (1, 2, 4, 8, 16, 32, 64, 128)],
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--sample",
        type=lambda v: v if v == "colbert" else int(v),
        default="colbert",
        help="diffret's codebook sample: 'colbert' (ColBERTv2's, as fast-plaid's) or a number of vectors",
    )
    ap.add_argument(
        "--kmeans-iterations",
        type=int,
        default=20,
        help="diffret's k-means iterations (20, compress's; ColBERTv2 and fast-plaid run 4)",
    )
    ap.add_argument("--threads", type=int, default=1, help="threads a search runs on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--build-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--fastplaid-python", default="", help="python of the environment holding fast-plaid")
    ap.add_argument("--lance-max", type=int, default=10_000, help="the largest N LanceDB is measured at")
    ap.add_argument("--lance-nprobes", type=int, nargs="+", default=[20, 80, 320])
    ap.add_argument(
        "--fastplaid-codes",
        choices=["own", "diffret"],
        default="own",
        help="fast-plaid searches its own build ('own') or diffret's codebook and codes written in its layout",
    )
    ap.add_argument("--fastplaid-worker", choices=["build", "search"], help=argparse.SUPPRESS)
    ap.add_argument("--fastplaid-folder", default="fastplaid", help=argparse.SUPPRESS)
    ap.add_argument("--docs", action="store_true", help="render docs/scale.md's table from the stored results")
    ap.add_argument("--results", default=str(RESULTS), help="the results file (merged by size)")
    args = ap.parse_args()
    globals()["RESULTS"] = Path(args.results)
    if args.docs:
        write_docs()
        return
    if args.fastplaid_worker:
        fastplaid_worker(Path(args.work), args.fastplaid_worker, args.fastplaid_folder)
        return
    for n in args.n:
        run_size(args, n)


if __name__ == "__main__":
    main()
