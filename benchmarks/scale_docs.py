"""docs/scale.md from benchmarks/results/scale_e2e.json (benchmarks/scale_e2e.py --write-docs): the measured table
per corpus size, each stage's growth exponents, the figure, and the MS MARCO projection with its assumptions."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "scale.md"
FIGURE = REPO / "docs" / "img" / "scale.png"

# The projection's assumptions, each named in the page.
MSMARCO_PASSAGES = 8_841_823
MSMARCO_QUERIES = 6_980  # dev (small)
H_7B = 3584  # Dream-7B's hidden size
H_HERE = 64  # the harness's model
GPU_PASSAGES_PER_S = 150.0  # a 7B encoder on one H100 in bfloat16 at ~110 tokens a passage (stated, not measured)
GRID_K = (1, 2, 4, 8, 16)
GPU_TFLOPS = 400.0  # bfloat16 matrix products one H100 sustains in exact scoring (about 40% of its peak; stated)
READ_GB_S = 2.0  # the encodings read from local NVMe per node (stated)
CELLS, MODES, DEPTH = 25, 5, 1000  # the MS MARCO grid: 5 x 5 cells, five modes, runs of 1,000


def projection(results: list[dict], eval_rows_per_s: float | None) -> list[str]:
    """The MS MARCO projection per stage, from the largest measured N, each assumption named."""
    big = results[-1]
    n = big["n"]
    st = {s["stage"]: s for s in big["stages"]}
    scale = MSMARCO_PASSAGES / n
    per_vec_here = st["encode"]["bytes"] / (n * (1 + 16))  # the harness encodes passages at K 1 and 16
    grid_vectors = MSMARCO_PASSAGES * sum(GRID_K)
    enc_1 = MSMARCO_PASSAGES * len(GRID_K) / GPU_PASSAGES_PER_S
    op_1 = MSMARCO_PASSAGES / GPU_PASSAGES_PER_S
    flops = 2 * MSMARCO_QUERIES * sum(GRID_K) * MSMARCO_PASSAGES * sum(GRID_K) * H_7B
    score_1 = flops / (GPU_TFLOPS * 1e12) + grid_vectors * 2 * H_7B / (READ_GB_S * 1e9)
    rows = MSMARCO_QUERIES * DEPTH * CELLS * MODES
    row_b = st["score"]["bytes"] / (big["collection"]["queries"] * DEPTH * 4 * MODES)  # 4 cells scored here
    lines = [
        "## MS MARCO projection",
        "",
        f"From the largest run measured (N = {n:,}) to MS MARCO's {MSMARCO_PASSAGES:,} passages and "
        f"{MSMARCO_QUERIES:,} dev queries, the grid K in {{1, 2, 4, 8, 16}} on both sides (25 cells, 5 modes), "
        f"H = {H_7B} (Dream-7B). Assumptions, each stated, none measured here (no GPU in this session): a 7B "
        f"encoder reads {GPU_PASSAGES_PER_S:.0f} passages/s on one H100 in bfloat16 (~110 tokens a passage with the "
        f"prompt and K masks); exact scoring sustains {GPU_TFLOPS:.0f} TFLOP/s on one H100 and reads the "
        f"encodings at {READ_GB_S:.0f} GB/s; CPU stages scale linearly from the measured N (their fitted exponents "
        "above) on the same 2 cores; 8 GPUs divide the GPU stages by 8 (units are independent shards).",
        "",
        "**Awaiting the GPU run**: the two GPU rates above (marked *assumed* in the table) are to be replaced by "
        "the device check's measurements on a lent H100 or H200 (`benchmarks/device_check.py`, docs/operations.md, "
        "\"The device check\"): diffret's docs/s at Dream-7B shape on 115-token rows (MS MARCO's length) for encode, "
        "and `search_pass`'s time at H = 3,584, K_q = K_p = 16 for score. No figure here was measured on a GPU.",
        "",
        "| stage | where | 1 GPU (or this CPU) | 8 GPUs | how |",
        "|---|---|---|---|---|",
    ]
    for name in ("download", "tokenize", "bm25"):
        t = st[name]["seconds"] * scale
        lines.append(f"| {name} | CPU | {_fmt_s(t)} | {_fmt_s(t)} | measured s/passage x {MSMARCO_PASSAGES:,} |")
    lines.append(
        f"| encode, whole grid (5 passage passes) | GPU | {_fmt_s(enc_1)} | {_fmt_s(enc_1 / 8)} | "
        f"{MSMARCO_PASSAGES:,} x 5 / {GPU_PASSAGES_PER_S:.0f} per s (*assumed*) |"
    )
    lines.append(
        f"| encode, one operating point (`--kq 4 --kp 16`: one passage pass) | GPU | {_fmt_s(op_1)} | "
        f"{_fmt_s(op_1 / 8)} | per-side budgets: the K = 4 passage pass is not made |"
    )
    lines.append(
        f"| score, whole grid | GPU | {_fmt_s(score_1)} | {_fmt_s(score_1 / 8)} | {flops:.2e} FLOPs "
        f"(2 x queries x sum K_q x passages x sum K_p x H) at {GPU_TFLOPS:.0f} TFLOP/s (*assumed*) + the "
        "encodings read once per K_p pass |"
    )
    if eval_rows_per_s:
        t = rows / eval_rows_per_s
        lines.append(
            f"| evaluate, whole grid | CPU | {_fmt_s(t)} | {_fmt_s(t / 8)} (8 workers) | {rows:.2e} rows "
            f"at {eval_rows_per_s:,.0f} rows/s (benchmarks/evaluate.py) |"
        )
    lines += [
        "",
        f"Bytes: the dense part of a passage vector is {2 * H_7B:,} B of float16 at H = {H_7B}: "
        f"{_fmt_b(MSMARCO_PASSAGES * 2 * H_7B)} per K of the corpus, {_fmt_b(grid_vectors * 2 * H_7B)} for the "
        "grid's five passage passes (int8: about half, `diffret compress`), plus the sparse terms a real model's "
        f"vectors hold (the harness's random model stores {per_vec_here:.0f} B a vector at H = {H_HERE} after "
        "compression, which says nothing of a trained model's sparsity). The runs: "
        f"{rows:.2e} rows, about {_fmt_b(rows * row_b)} as compact run files ({row_b:.1f} B a row measured here).",
        "",
    ]
    return lines


def _fmt_s(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def _fmt_b(b: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(b) < 1000:
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1000
    return f"{b:.1f} PB"


def figure(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ns = [r["n"] for r in results]
    for name in [s["stage"] for s in results[0]["stages"]]:
        secs = [_stage(r, name)["seconds"] for r in results]
        mem = [_stage(r, name)["peak_rss_mb"] for r in results]
        ax1.plot(ns, secs, marker="o", label=name)
        ax2.plot(ns, mem, marker="o", label=name)
    for ax, what in ((ax1, "wall time (s)"), (ax2, "peak RSS of a process (MB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("passages")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=110)


MEMORY_BOUND_MB = 4096  # the bound every process's peak stays under, whatever N
GROWS_BYTES = 64  # a peak growing more than this a passage is not bounded (64 B: 0.5 GB at MS MARCO)
PER_QUERY = ("evaluate", "report", "late")  # their work follows the queries (fixed) and the depth, not N


def exponents(results: list[dict], key: str, base: dict | None = None) -> dict[str, float]:
    """Per stage: the least-squares slope of log(key) against log(N) over ``results``. With ``base`` (the smallest
    N's result: a command's start-up, Python, imports, the model, a Dask cluster, which does not grow with N), the
    slope of log(key - base's key), over the sizes where key exceeds 1.5x base's (no work above start-up to fit
    otherwise)."""
    import math

    import numpy as np

    out = {}
    for name in [s["stage"] for s in results[0]["stages"]]:
        v0 = _stage(base, name)[key] if base is not None else 0.0
        pts = [
            (math.log(r["n"]), math.log(v - v0))
            for r in results
            if (v := _stage(r, name)[key]) > (1.5 * v0 if base is not None else 0.0)
        ]
        if len(pts) >= 2:
            out[name] = float(np.polyfit(*zip(*pts, strict=True), 1)[0])
    return out


def marginal_exponents(results: list[dict]) -> dict[str, float]:
    """Per stage: the time exponent above start-up, ``results[0]`` (the smallest N) standing for the start-up."""
    return exponents(results[1:], "seconds", base=results[0])


def _stage(result: dict, name: str) -> dict:
    return next(s for s in result["stages"] if s["stage"] == name)


def write_docs(
    results: list[dict],
    t_exp: dict[str, float],
    m_exp: dict[str, float],
    eval_rows_per_s: float | None = None,
    notes: str = "",
) -> None:
    """docs/scale.md and docs/img/scale.png from the results, smallest N first. The smallest N (1,000) stands for
    each command's fixed cost; the exponents are fitted over the larger sizes."""
    figure(results)
    big = results[-1]
    names = [s["stage"] for s in big["stages"]]
    sizes = " ".join(f"--n {r['n']}" for r in results)
    lines = [
        "# Scale: every stage's cost against the corpus size",
        "",
        "Measured by `benchmarks/scale_e2e.py` on this machine (2 cores, 24 GB, no GPU): a synthetic MS "
        "MARCO-shaped collection (passages of MS MARCO's length from a real English word distribution, "
        f"{big['collection']['queries']} queries with one relevant passage each) through the CLI, stage by "
        "stage, with a random-weight BERT masked LM of hidden size 64 (2 layers) and two local Dask workers for "
        "encoding. "
        f"Reproduce: `python benchmarks/scale_e2e.py {sizes} --write-docs`.",
        "",
        "## Time",
        "",
        "| stage | "
        + " | ".join(f"N = {r['n']:,}" for r in results)
        + " | exponent (wall) | exponent above start-up |",
        "|---|" + "---|" * (len(results) + 2),
    ]
    marginal = marginal_exponents(results)
    for name in names:
        cells = []
        for r in results:
            s = _stage(r, name)
            cpu = f" ({_fmt_s(s['cpu_seconds'])} CPU)" if "cpu_seconds" in s else ""
            cells.append(_fmt_s(s["seconds"]) + cpu)
        kind = " (per query)" if name in PER_QUERY else ""
        lines.append(
            f"| {name}{kind} | "
            + " | ".join(cells)
            + f" | {t_exp.get(name, float('nan')):.2f} | "
            + (f"{marginal[name]:.2f}" if name in marginal else "-")
            + " |"
        )
    lines += [
        "",
        "Wall time of each command, and the CPU seconds of the command and every process it started (Dask "
        f"workers included). The smallest size, N = {results[0]['n']:,}, measures each command's fixed cost "
        "(start-up: Python and its imports, the model, a Dask cluster for encode); the exponents are fitted "
        f"over N >= {results[1]['n']:,} (least-squares slope on log-log): of the wall time, and of the wall "
        "time above that fixed cost (the work that grows; '-' where a stage takes no longer than 1.5x its "
        f"fixed cost). Per query: stages whose work follows the queries ({big['collection']['queries']} at "
        "every N) and the depth, not the corpus.",
        "",
        "## Memory and files",
        "",
        "| stage | "
        + " | ".join(f"N = {r['n']:,}" for r in results)
        + " | memory exponent | growth a passage | at MS MARCO |",
        "|---|" + "---|" * (len(results) + 3),
    ]
    prev = results[-2]
    grows = []
    for name in names:
        cells = []
        for r in results:
            s = _stage(r, name)
            cells.append(f"{s['peak_rss_mb']:,.0f} MB, {s['files']} files, {_fmt_b(s['bytes'])}")
        a, b = _stage(prev, name)["peak_rss_mb"], _stage(big, name)["peak_rss_mb"]
        per = max(0.0, (b - a) * 2**20 / (big["n"] - prev["n"]))  # bytes a passage, between the two largest N
        at = b * 2**20 + per * (MSMARCO_PASSAGES - big["n"])
        if per >= GROWS_BYTES or at > MEMORY_BOUND_MB * 2**20:
            grows.append((name, per, at))
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {m_exp.get(name, float('nan')):.2f} | "
            f"{per:,.0f} B | {_fmt_b(at)} |"
        )
    peak = max((s["peak_rss_mb"], s["stage"]) for s in big["stages"])
    lines += [
        "",
        "Each cell: the peak RSS of the largest process of the command (Dask workers included, sampled "
        "every 0.1 s), then the files and bytes it added to the store. Growth a passage: the peak's increase "
        f"from N = {prev['n']:,} to N = {big['n']:,} per passage added; at MS MARCO: the peak at "
        f"N = {big['n']:,} plus that growth for {MSMARCO_PASSAGES:,} passages.",
        "",
    ]
    flat = [n for n in names if n not in {g[0] for g in grows}]
    within = [g for g in grows if g[2] <= MEMORY_BOUND_MB * 2**20]
    beyond = [g for g in grows if g[2] > MEMORY_BOUND_MB * 2**20]

    def said(gs: list[tuple[str, float, float]]) -> str:
        return ", ".join(f"{n} ({per:,.0f} B a passage: {_fmt_b(at)} at MS MARCO)" for n, per, at in gs)

    lines.append(
        f"**Memory bound: {MEMORY_BOUND_MB / 1024:.0f} GB a process.** At N = {big['n']:,} the largest "
        f"peak is {peak[0]:,.0f} MB ({peak[1]}): every process is within the bound"
        + ("." if peak[0] <= MEMORY_BOUND_MB else " but one.")
        + f" It holds at any N for {', '.join(flat)}: their peaks grow less than {GROWS_BYTES} B a passage. "
        "By design tokenize and encode hold one shard (`--shard-size`, 50,000 texts here), bm25 one shard's "
        "index (`bm25 --shard-size`, 50,000 here), score one shard of encodings, index and compress stream "
        "the encodings a shard at a time, late the candidates (queries x depth) and one shard of encodings, "
        "and download keeps 8 B hashes of the ids."
        + (
            f" Still growing from N = {prev['n']:,} to {big['n']:,}, though within the bound when projected "
            f"to MS MARCO: {said(within)}."
            if within
            else ""
        )
        + (f" **Beyond the bound at MS MARCO: {said(beyond)}.**" if beyond else "")
        + (" What each holds is under Known limits below." if grows else "")
    )
    lines += ["", "![stage costs against the corpus size](img/scale.png)", ""]
    lines += projection(results, eval_rows_per_s)
    if notes:
        lines += [notes.strip(), ""]
    DOC.write_text("\n".join(lines))
