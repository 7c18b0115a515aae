"""Every artifact's bytes a passage at Dream-7B's width (H = 3,584), projected to MS MARCO's grid for one 7B model.

    python benchmarks/width.py --n 20000                       # the measurement (K_p 1 and 16, every choice)
    python benchmarks/width.py --n 1000 --work /tmp/w1k        # a quick one
    python benchmarks/width.py --docs                          # docs/scale.md's section from the stored results

A synthetic store (tests/synthetic_store.py: N passages whose K_p vectors, and the queries', come from a low-rank
plus noise model, singular values s_i = c i^-0.5 over rank 256 carrying 80% of a vector's energy; 128 sparse terms a
passage) at K_p in {1, 16}, queries at K_q 8; then the encode-less stages, each through its stage API in this process:
compress under each storage choice; index (the float16 system's LanceDB table in float16, the default, and in float32,
the earlier default; each residual system's codes index); score (exact over the float16 system and each compressed
one; over the codes for each residual one); late (the float16 vectors re-scoring the top 20 of residual:2's search
over its codes). Per artifact and choice: bytes on disk (from the manifests), bytes a passage, the stage's seconds and
the peak resident memory it added. Results: ``benchmarks/results/width.json`` (merged over invocations).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the synthetic store and the tiny tokenizer's model

RESULTS = REPO / "benchmarks" / "results" / "width.json"
QUALITY = REPO / "benchmarks" / "results" / "codes_search.json"
DOCS = REPO / "docs" / "scale.md"
MSMARCO = 8_841_823
GRID = (1, 2, 4, 8, 16)  # the grid's passage passes: sum K_p = 31
BEGIN, END = "<!-- width: begin (benchmarks/width.py --docs) -->", "<!-- width: end -->"


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """The largest resident set while the block runs (sampled every 10 ms), above the one before it."""

    def __enter__(self) -> Peak:
        gc.collect()
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        self.t0 = time.perf_counter()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())

    @property
    def added_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def folder_bytes(store: Any, pattern: str) -> tuple[int, int]:
    """(bytes, files) that the manifests of the folders matching ``pattern`` list."""
    total, files = 0, 0
    for folder in store.folders(pattern):
        m = store.read_manifest(folder)
        total += sum(int(e.bytes or 0) for e in m.files.values())
        files += len(m.files)
    return total, files


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import synthetic_store
    import torch

    from diffret.retrieval.search.codecs import parse_store
    from diffret.stages import execute, stages
    from diffret.stages.compress import CompressConfig
    from diffret.stages.index import IndexConfig
    from diffret.stages.late import LateConfig
    from diffret.stages.score import ScoreConfig
    from diffret.stages.systems import SystemRef
    from diffret.storage import ArtifactStore
    from diffret.storage.layout import index_dir

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    if work.exists() and not args.resume:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "n": args.n,
        "hidden": args.hidden,
        "kp": args.kp,
        "kq": args.kq,
        "queries": args.queries,
        "threads": args.threads,
        "rows": [],
    }
    rows = out["rows"]

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def step(what: str, choice: str, stage: str, fn: Any, patterns: list[str], per: str = "passage") -> Any:
        with Peak() as p:
            res = fn()
        store = ArtifactStore(root)
        sizes = [folder_bytes(store, pat) for pat in patterns]
        total, files = sum(b for b, _ in sizes), sum(f for _, f in sizes)
        n = args.n if per == "passage" else args.queries
        rows.append(
            {
                "artifact": what,
                "choice": choice,
                "stage": stage,
                "bytes": total,
                "files": files,
                "per": per,
                "bytes_per": total / n,
                "seconds": round(p.seconds, 2),
                "peak_added_mb": round(p.added_mb, 1),
            }
        )
        log(
            f"{what} [{choice}]: {total / n:,.0f} B a {per} ({total / 2**20:,.1f} MiB, {files} files), "
            f"{p.seconds:.1f} s, +{p.added_mb:,.0f} MB"
        )
        _merge(out)  # after every step: a long run keeps what it measured
        return res

    log(f"building the synthetic store: {args.n:,} passages x K_p {args.kp}, H {args.hidden}")
    with Peak() as p:
        syn = synthetic_store.build(
            work / "base",
            args.n,
            args.hidden,
            args.kp,
            [args.kq],
            n_queries=args.queries,
            shard_size=args.shard_size,
            dev=args.check_queries,
            log=lambda m: None,
        )
    out["build_seconds"] = round(p.seconds, 1)
    out["spectrum"] = {
        "rank": syn.spectrum.rank,
        "alpha": syn.spectrum.alpha,
        "signal": syn.spectrum.signal,
        "topic": syn.spectrum.topic,
        "s_1": syn.stats["singular_values"][0],
        "s_r": syn.stats["singular_values"][-1],
    }
    root, f16 = syn.root, syn.system
    store = ArtifactStore(root)
    for kp in args.kp:
        b, f = folder_bytes(store, f"encodings/system={f16}/dataset=synth/side=passage/k={kp}")
        rows.append(
            {
                "artifact": f"encodings K_p={kp}",
                "choice": "float16",
                "stage": "encode",
                "bytes": b,
                "files": f,
                "per": "passage",
                "bytes_per": b / args.n,
                "seconds": None,
                "peak_added_mb": None,
            }
        )
        log(f"encodings K_p={kp} [float16]: {b / args.n:,.0f} B a passage")
    systems = {"float16": f16}
    ref = SystemRef(system=f16)
    for spec in args.stores:
        if args.centroids and parse_store(spec).kind == "residual":
            spec = f"{spec}:{args.centroids}"
        res = step(
            "compress",
            spec,
            "compress",
            lambda spec=spec: execute(
                stages()["compress"],
                CompressConfig(
                    root=root, dataset="synth", system=ref, store=spec, codebook_sample=args.codebook_sample
                ),
                log=log,
            ),
            [],
        )
        systems[spec] = res.system
        for kp in args.kp:
            b, f = folder_bytes(store, f"encodings/system={res.system}/dataset=synth/side=passage/k={kp}")
            rows.append(
                {
                    "artifact": f"encodings K_p={kp}",
                    "choice": spec,
                    "stage": "compress",
                    "bytes": b,
                    "files": f,
                    "per": "passage",
                    "bytes_per": b / args.n,
                    "seconds": None,
                    "peak_added_mb": None,
                }
            )
            c, f = folder_bytes(store, f"codebooks/system={res.system}/dataset=synth/k={kp}")
            if c:
                rows.append(
                    {
                        "artifact": f"codebook K_p={kp}",
                        "choice": spec,
                        "stage": "compress",
                        "bytes": c,
                        "files": f,
                        "per": "corpus",
                        "bytes_per": c,
                        "seconds": None,
                        "peak_added_mb": None,
                    }
                )
            log(f"encodings K_p={kp} [{spec}]: {b / args.n:,.0f} B a passage; codebook {c / 2**20:,.1f} MiB")
    # index: the float16 system's table in float16 (the default) and float32 (the earlier default), flat, and at the
    # smallest K_p also with an IVF_PQ index (its bytes a vector); each residual system's codes index. The check
    # reads the dev split's queries.
    lo = min(args.kp)
    for kp in args.kp:
        ivf = args.ivf == "all" or (args.ivf == "smallest" and kp == lo)
        variants = [("store", "none"), ("float32", "none")] + ([("store", "IVF_PQ")] if ivf else [])
        for vectors, itype in variants:
            step(
                f"index K_p={kp} ({itype})",
                f"float16 system, --vectors {vectors}",
                "index",
                lambda kp=kp, vectors=vectors, itype=itype: execute(
                    stages()["index"],
                    IndexConfig(
                        root=root,
                        dataset="synth",
                        split="dev",
                        system=ref,
                        kp=[kp],
                        vectors=vectors,
                        index_type=itype,
                        force=True,
                    ),
                    log=log,
                ),
                [index_dir(f16, "synth", kp)],
            )
        for spec, system in systems.items():
            if spec != "float16" and parse_store(spec).kind == "residual":
                step(
                    f"index K_p={kp} (codes)",
                    spec,
                    "index",
                    lambda kp=kp, system=system: execute(
                        stages()["index"],
                        IndexConfig(
                            root=root,
                            dataset="synth",
                            split="dev",
                            system=SystemRef(system=system),
                            kp=[kp],
                            probes=args.probes,
                            candidates=args.candidates,
                        ),
                        log=log,
                    ),
                    [index_dir(system, "synth", kp)],
                )
    # score: exact over each choice, then over the codes (multi_dense); runs are per query, not per passage
    top = max(args.kp)
    for spec, system in systems.items():
        step(
            f"runs K_p={top} (exact, 5 modes)",
            spec,
            "score",
            lambda system=system: execute(
                stages()["score"],
                ScoreConfig(root=root, dataset="synth", system=SystemRef(system=system), kq=[args.kq], kp=[top]),
                log=log,
            ),
            [f"runs/system={system}/dataset=synth/split=test/kq={args.kq}/kp={top}/*"],
            per="query",
        )
    for spec, system in systems.items():
        if spec != "float16" and parse_store(spec).kind == "residual":
            step(
                f"runs K_p={top} (codes search, multi_dense)",
                spec,
                "score",
                lambda system=system: execute(
                    stages()["score"],
                    ScoreConfig(
                        root=root,
                        dataset="synth",
                        system=SystemRef(system=system),
                        kq=[args.kq],
                        kp=[top],
                        search="codes",
                        probes=args.probes,
                        candidates=args.candidates,
                        force=True,
                    ),
                    log=log,
                ),
                [f"runs/system={system}/dataset=synth/split=test/kq={args.kq}/kp={top}/mode=multi_dense"],
                per="query",
            )
    r2 = next((s for s in systems if s.startswith("residual:2")), None)
    if r2 is not None:
        step(
            f"late runs (float16 re-scoring {r2}'s top 20)",
            "float16",
            "late",
            lambda: execute(
                stages()["late"],
                LateConfig(
                    root=root,
                    dataset="synth",
                    system=ref,
                    kq=args.kq,
                    kp=top,
                    depths=[20],
                    first_stage=systems[r2],
                    first_kq=args.kq,
                    first_kp=top,
                    first_mode="multi_dense",
                ),
                log=log,
            ),
            [
                f"runs/system={f16}/dataset=synth/split=test/kq={args.kq}/kp={top}/mode=late_*",
                f"partial/system={f16}/dataset=synth/*",
            ],
            per="query",
        )
    # search latency per query of each choice, from the runs' manifests (the pass's seconds over its queries)
    out["search"] = []
    for stage in store.folders(f"runs/system=*/dataset=synth/split=test/kq={args.kq}/kp={top}/*"):
        m = store.read_manifest(stage)
        spec = next((s for s, v in systems.items() if v == m.config["system"]), "?")
        out["search"].append(
            {
                "choice": spec,
                "mode": m.config["mode"],
                "search": m.config.get("search", {}).get(
                    "engine", "late" if m.config["mode"].startswith("late") else "exact"
                ),
                "ms_per_query": m.stats.get("search_ms_per_query"),
                "seconds": m.stats.get("search_seconds"),
            }
        )
    return out


def _merge(result: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[str(result["n"])] = result
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


# ------------------------------------------------------------------------------------------ docs/scale.md
def colbert_centroids(n: int) -> int:
    return 2 ** int(math.floor(math.log2(16 * math.sqrt(max(n, 1)))))


def _tb(b: float) -> str:
    return f"{b / 1e12:.2f} TB" if b >= 1e11 else f"{b / 1e9:.1f} GB"


def projection(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per encodings choice, bytes a passage at K_p = k as a + b k (fitted on K_p 1 and 16), and at MS MARCO over the
    grid's five passage passes (5 a + 31 b per passage) and at K_p = 16 alone."""
    lo, hi = min(result["kp"]), max(result["kp"])
    per = {}
    for r in result["rows"]:
        if r["artifact"].startswith("encodings K_p="):
            per.setdefault(r["choice"], {})[int(r["artifact"].split("=")[1])] = r["bytes_per"]
    out = {}
    for choice, by in per.items():
        b = (by[hi] - by[lo]) / (hi - lo)
        a = by[lo] - b * lo
        out[choice] = {
            "a": a,
            "b": b,
            "k1": by[lo],
            "k16": by[hi],
            "grid": MSMARCO * (len(GRID) * a + sum(GRID) * b),
            "op": MSMARCO * (a + hi * b),
        }
    return out


def _index_bytes(result: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Measured index bytes a passage: {"float16 table" | "float32 table" | "IVF_PQ over the table" | "codes
    (<spec>)": {K_p: bytes}}."""
    out: dict[str, dict[int, float]] = {}
    for r in result["rows"]:
        if not r["artifact"].startswith("index K_p="):
            continue
        kp = int(r["artifact"].split("=")[1].split()[0])
        kind = r["artifact"].split("(", 1)[1].rstrip(")")
        if kind == "codes":
            out.setdefault(f"codes index ({r['choice']})", {})[kp] = r["bytes_per"]
        else:
            dtype = "float32" if "float32" in r["choice"] else "float16"
            out.setdefault(f"{dtype} table" + (f" + {kind}" if kind != "none" else ""), {})[kp] = r["bytes_per"]
    return out


def plans(result: dict[str, Any], plan_store: str) -> dict[str, list[tuple[str, float]]]:
    """Each plan's terms (name, bytes at MS MARCO) for one 7B model over the grid: HEAD's, the defaults', and the
    recommended one (encodings under ``plan_store`` + the codes index at the operating point)."""
    proj = projection(result)
    idx = _index_bytes(result)
    h, hi, lo = result["hidden"], max(result["kp"]), min(result["kp"])
    # an IVF_PQ index's own bytes a vector, from the smallest K_p (table with and without it), when measured
    with_ivf = "float16 table + IVF_PQ" in idx
    ivf = (idx["float16 table + IVF_PQ"][lo] - idx["float16 table"][lo]) / lo if with_ivf else 0.0
    ann = ", with IVF_PQ" if with_ivf else " (flat: the IVF_PQ index's own bytes not measured)"
    vec16 = idx["float16 table"][hi] / hi
    vec32 = idx["float32 table"][hi] / hi
    queries = 6_980 * sum(GRID) * 2 * h  # the dev queries' float16 vectors, every K_q pass (never compressed)
    runs = 8.72e8 * 3.4  # the grid's runs (docs/scale.md, MS MARCO projection)
    codebooks = sum(colbert_centroids(MSMARCO * k) * h * 4 for k in GRID)
    head = [
        ("encodings, float16, 5 passage passes", proj["float16"]["grid"]),
        (f"index: float32 LanceDB tables at every K_p{ann}", MSMARCO * sum(GRID) * (vec32 + ivf)),
        ("query encodings (6,980 dev queries, 5 passes)", queries),
        ("runs of the grid", runs),
    ]
    default = [
        ("encodings, float16, 5 passage passes", proj["float16"]["grid"]),
        (
            f"index: a float16 LanceDB table at the operating point (K_p = {hi}){ann}",
            MSMARCO * hi * (vec16 + ivf),
        ),
        ("query encodings (6,980 dev queries, 5 passes)", queries),
        ("runs of the grid", runs),
    ]
    spec = next(c for c in proj if c.startswith(plan_store))
    codes = next((v for k, v in idx.items() if k == f"codes index ({spec})"), None)
    rec = [
        (f"encodings, {spec} (`diffret compress --store {plan_store}`), 5 passage passes", proj[spec]["grid"]),
        ("codebooks, one a K_p (ColBERTv2's centroid count at MS MARCO, float32)", codebooks),
        (
            f"index: the codes index at the operating point (K_p = {hi}; `diffret index`; at most 4 B a vector, "
            f"{codes[hi] / hi if codes else 0:.1f} measured)",
            MSMARCO * hi * 4,
        ),
        ("query encodings (6,980 dev queries, 5 passes)", queries),
        ("runs of the grid", runs),
    ]
    return {"head": head, "default": default, "recommended": rec}


def quality_table(quality: dict[str, Any], hidden: int) -> list[str]:
    """codes_search.json's rows as a table: each choice's NDCG@10 against exact float16 and its search's speed."""
    out = []
    for label, q in quality.items():
        out += [
            f"Quality and search latency of every lossy choice on the fine-tuned proxy ({label}: "
            f"`benchmarks/codes_search.py`; {q['passages']:,} passages x K_p {q['kp']}, H {q['hidden']}, "
            f"{q['queries']} {q['split']} queries; one process, {q['threads']} thread(s), best of {q['repeats']}; "
            "ms a query: exact search, the pass's time (reading and decoding the shards included) over its "
            "queries; over the codes, each query's own search, the codes and the index loaded once; speed: exact "
            "float16 multi_dense's ms a query over this row's, measured in the same run):",
            "",
            "| K_q | store | search | B a vector (H = 3,584) | multi_dense NDCG@10 | change | hybrid NDCG@10 | "
            "change | recall@10 vs float16 | ms a query | speed vs exact float16 |",
            "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in q["rows"]:
            from diffret.retrieval.search.codecs import code_bytes

            try:
                wide = f"{code_bytes(r['store'], hidden):,}"
            except ValueError:  # a pq:M whose M does not divide H
                wide = "-"
            out.append(
                f"| {r['kq']} | {r['store']} | {r['search']} | {wide} | {r['ndcg_multi']:.4f} | "
                f"{r['delta_multi']:+.4f} | {r['ndcg_fused']:.4f} | {r['delta_fused']:+.4f} | "
                f"{r['recall_10']:.3f} | {r['ms_per_query']:.2f} | {r['speedup']:.2f}x |"
            )
        out.append("")
    return out


def render(result: dict[str, Any], quality: dict[str, Any] | None, plan_store: str = "residual:4") -> str:
    """The footprint section of docs/scale.md from a width.json entry (and codes_search.json's table)."""
    proj = projection(result)
    hi = max(result["kp"])
    h = result["hidden"]
    sp = result["spectrum"]
    lines = [
        f"## Footprint at H = {h:,} (Dream-7B), and the plan that fits MS MARCO in 1 TB",
        "",
        f"Measured by `benchmarks/width.py --n {result['n']:,}` on this machine: a synthetic store of "
        f"{result['n']:,} passages (tests/synthetic_store.py: vectors from a low-rank plus noise model, singular "
        f"values s_i = c i^-{sp['alpha']} over rank {sp['rank']} (s_1 = {sp['s_1']:.3f}, s_r = {sp['s_r']:.4f}) "
        f"carrying {sp['signal']:.0%} of a vector's expected squared norm, the rest isotropic noise; a passage's "
        f"vectors share its topic at weight {sp['topic']}; 128 sparse terms a passage) at K_p 1 and {hi}, "
        f"{result['queries']} queries at K_q {result['kq']}, through the encode-less stages (compress, index, "
        f"score, late). Bytes are the files the manifests list; a passage = bytes / {result['n']:,}. Projection: "
        "a choice's bytes a passage at K_p = k are a + b k (a: the id, the sparse terms and the other columns; b: "
        "a vector), fitted on the two K_p measured; MS MARCO's grid for one model is "
        f"{MSMARCO:,} passages x its five passage passes (K_p 1, 2, 4, 8, 16: 5 a + 31 b a passage); the "
        f"operating point is one pass at K_p = {hi}.",
        "",
    ]
    lines += [
        "| artifact | storage choice | B a passage, K_p = 1 | B a passage, K_p = 16 | MS MARCO, the grid "
        "(5 passes) | MS MARCO, K_p = 16 only |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for choice, p in proj.items():
        lines.append(
            f"| encodings (passages) | {choice} | {p['k1']:,.0f} | {p['k16']:,.0f} | {_tb(p['grid'])} | "
            f"{_tb(p['op'])} |"
        )
    for kind, by in _index_bytes(result).items():
        k1, k16 = by.get(1), by.get(hi)
        grid = MSMARCO * (k1 * 5 + (k16 - k1) / (hi - 1) * (sum(GRID) - 5)) if k1 is not None and k16 else None
        lines.append(
            f"| index | {kind} | {k1 or 0:,.0f} | {'-' if k16 is None else f'{k16:,.0f}'} | "
            f"{_tb(grid) if grid else '-'} | {_tb(MSMARCO * k16) if k16 else '-'} |"
        )
    for r in result["rows"]:
        if r["artifact"].startswith("codebook K_p="):
            kp = int(r["artifact"].split("=")[1])
            ms = colbert_centroids(MSMARCO * kp) * h * 4
            lines.append(
                f"| codebook, K_p = {kp} | {r['choice']} | {r['bytes'] / 2**20:,.1f} MiB in all | | | "
                f"{_tb(ms)} ({colbert_centroids(MSMARCO * kp):,} centroids) |"
            )
    for r in result["rows"]:
        if r["per"] == "query":
            lines.append(f"| {r['artifact']} | {r['choice']} | | {r['bytes_per']:,.0f} B a query | | |")
    lines.append("")
    if quality is not None:
        lines += quality_table(quality, h)
    for name, terms in plans(result, plan_store).items():
        total = sum(b for _, b in terms)
        lines.append(f"- **{name}**: " + " + ".join(f"{t} {_tb(b)}" for t, b in terms) + f" = **{_tb(total)}**")
    lines.append("")
    return "\n".join(lines)


def write_docs() -> None:
    data = json.loads(RESULTS.read_text())
    result = data[max(data, key=int)]
    quality = json.loads(QUALITY.read_text()) if QUALITY.exists() else None
    text = DOCS.read_text()
    section = f"{BEGIN}\n{render(result, quality)}\n{END}"
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.replace("## MS MARCO projection", section + "\n\n## MS MARCO projection", 1)
    DOCS.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--kp", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--kq", type=int, default=8)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--stores", nargs="+", default=["int8", "residual:1", "residual:2", "residual:4", "pq:256"])
    ap.add_argument("--codebook-sample", type=int, default=65536)
    ap.add_argument(
        "--centroids",
        type=int,
        default=0,
        help="residual:B:C with C centroids (0: ColBERTv2's count "
        "for the corpus); a vector's bytes do not depend on it, the codebook's time does",
    )
    ap.add_argument("--check-queries", type=int, default=10, help="queries of the index's recall check (dev split)")
    ap.add_argument("--probes", type=int, default=2)
    ap.add_argument("--candidates", type=int, default=1024)
    ap.add_argument(
        "--ivf",
        choices=["smallest", "all", "none"],
        default="smallest",
        help="where an IVF_PQ index is built over the float16 table: the smallest K_p (its bytes a vector), every K_p, "
        "or none (its training dominates the run's time at H = 3,584 on a small CPU)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/width")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--docs", action="store_true", help="only render docs/scale.md's section from the results")
    args = ap.parse_args()
    if args.docs:
        write_docs()
        return
    result = measure(args)
    _merge(result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
