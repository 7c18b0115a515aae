"""docs/scale.md from benchmarks/results/scale_e2e.json (benchmarks/scale_e2e.py --write-docs): the measured table
per corpus size, each stage's growth exponents, the figure, and the MS MARCO projection with its assumptions; the GPU
section and the projection (between their markers) also alone, from the device check's JSON:

    python benchmarks/scale_docs.py --device-check OUT/device_check.json   # after a GPU call
    python benchmarks/scale_docs.py --device-check none                    # no GPU figures: "awaiting the GPU run"
"""

from __future__ import annotations

import json
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


def projection(results: list[dict], eval_rows_per_s: float | None, gpu: dict | None = None) -> list[str]:
    """The MS MARCO projection per stage, from the largest measured N, each assumption named; the GPU rates from the
    device check's figures (:func:`gpu_figures`) where it measured them, else assumed."""
    gpu = gpu or {}
    docs_s = gpu.get("docs_s", GPU_PASSAGES_PER_S)
    tflops = gpu.get("tflops", GPU_TFLOPS)
    big = results[-1]
    n = big["n"]
    st = {s["stage"]: s for s in big["stages"]}
    scale = MSMARCO_PASSAGES / n
    per_vec_here = st["encode"]["bytes"] / (n * (1 + 16))  # the harness encodes passages at K 1 and 16
    grid_vectors = MSMARCO_PASSAGES * sum(GRID_K)
    enc_1 = MSMARCO_PASSAGES * len(GRID_K) / docs_s
    op_1 = MSMARCO_PASSAGES / docs_s
    flops = 2 * MSMARCO_QUERIES * sum(GRID_K) * MSMARCO_PASSAGES * sum(GRID_K) * H_7B
    score_1 = flops / (tflops * 1e12) + grid_vectors * 2 * H_7B / (READ_GB_S * 1e9)
    rows = MSMARCO_QUERIES * DEPTH * CELLS * MODES
    row_b = st["score"]["bytes"] / (big["collection"]["queries"] * DEPTH * 4 * MODES)  # 4 cells scored here
    on = f"{gpu.get('device')}, {gpu.get('date')}"
    if "docs_s" in gpu:
        enc_how = f"*measured*: Dream-7B shape, 115-token rows, batch {gpu['docs_batch']}, {on}"
        enc_said = (
            f"a 7B encoder reads {docs_s:,.0f} passages/s on one GPU in bfloat16 (measured by the device check: "
            f"Dream-7B shape, 115-token rows with the prompt and K = 16 masks, {on})"
        )
    else:
        enc_how = "*assumed*"
        enc_said = (
            f"a 7B encoder reads {GPU_PASSAGES_PER_S:.0f} passages/s on one H100 in bfloat16 (~110 tokens a passage "
            "with the prompt and K masks)"
        )
    if "tflops" in gpu:
        score_how = f"*measured*: search_pass at H = {gpu['hidden']:,}, K_q = K_p = 16, {on}"
        score_said = (
            f"exact scoring sustains {tflops:,.1f} TFLOP/s on one GPU (measured by the device check: `search_pass` "
            f"over {gpu['passages']:,} passages, {on}) and reads the encodings at {READ_GB_S:.0f} GB/s"
        )
    else:
        score_how = "*assumed*"
        score_said = (
            f"exact scoring sustains {GPU_TFLOPS:.0f} TFLOP/s on one H100 and reads the "
            f"encodings at {READ_GB_S:.0f} GB/s"
        )
    measured = [w for w, k in (("encode", "docs_s"), ("score", "tflops")) if k in gpu]
    if not measured:
        intro = "Assumptions, each stated, none measured here (no GPU in this session): "
        status = (
            "**Awaiting the GPU run**: the two GPU rates above (marked *assumed* in the table) are to be replaced by "
            "the device check's measurements on a lent H100 or H200 (`benchmarks/device_check.py`, docs/operations.md, "
            "\"The device check\"): diffret's docs/s at Dream-7B shape on 115-token rows (MS MARCO's length) for "
            "encode, and `search_pass`'s time at H = 3,584, K_q = K_p = 16 for score. No figure here was measured on "
            "a GPU."
        )
    else:
        intro = "Assumptions, each stated (the GPU rates measured where the device check measured them): "
        left = [w for w in ("encode", "score") if w not in measured]
        status = f"**Measured on a GPU**: the {' and '.join(measured)} rate{'s' if len(measured) > 1 else ''} " + (
            f"(marked *measured* in the table; the device check's figures above). The {left[0]} rate is still "
            "assumed: the device check did not measure it."
            if left
            else "(marked *measured* in the table; the device check's figures above)."
        )
    lines = [
        "## MS MARCO projection",
        "",
        f"From the largest run measured (N = {n:,}) to MS MARCO's {MSMARCO_PASSAGES:,} passages and "
        f"{MSMARCO_QUERIES:,} dev queries, the grid K in {{1, 2, 4, 8, 16}} on both sides (25 cells, 5 modes), "
        f"H = {H_7B} (Dream-7B). {intro}{enc_said}; {score_said}; CPU stages scale linearly from the measured N "
        "(their fitted exponents above) on the same 2 cores; 8 GPUs divide the GPU stages by 8 (units are "
        "independent shards).",
        "",
        status,
        "",
        "| stage | where | 1 GPU (or this CPU) | 8 GPUs | how |",
        "|---|---|---|---|---|",
    ]
    for name in ("download", "tokenize", "bm25"):
        t = st[name]["seconds"] * scale
        lines.append(f"| {name} | CPU | {_fmt_s(t)} | {_fmt_s(t)} | measured s/passage x {MSMARCO_PASSAGES:,} |")
    lines.append(
        f"| encode, whole grid (5 passage passes) | GPU | {_fmt_s(enc_1)} | {_fmt_s(enc_1 / 8)} | "
        f"{MSMARCO_PASSAGES:,} x 5 / {docs_s:,.0f} per s ({enc_how}) |"
    )
    lines.append(
        f"| encode, one operating point (`--kq 4 --kp 16`: one passage pass) | GPU | {_fmt_s(op_1)} | "
        f"{_fmt_s(op_1 / 8)} | per-side budgets: the K = 4 passage pass is not made |"
    )
    lines.append(
        f"| score, whole grid | GPU | {_fmt_s(score_1)} | {_fmt_s(score_1 / 8)} | {flops:.2e} FLOPs "
        f"(2 x queries x sum K_q x passages x sum K_p x H) at {tflops:,.0f} TFLOP/s ({score_how}) + the "
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
    check = json.loads(DEVICE_CHECK.read_text()) if DEVICE_CHECK.exists() else None
    lines += [render_section(check, results, eval_rows_per_s), ""]
    if notes:
        lines += [notes.strip(), ""]
    DOC.write_text("\n".join(lines))


# ------------------------------------------------------------------------------------------ the device check
# docs/scale.md's GPU section and the MS MARCO projection, rendered between these markers from the device check's
# JSON (benchmarks/device_check.py) and benchmarks/results/scale_e2e.json: `python benchmarks/scale_docs.py
# --device-check OUT/device_check.json` after a GPU call, and nothing edited by hand.
BEGIN = "<!-- device-check: begin (rendered by benchmarks/scale_docs.py from the device check's JSON) -->"
END = "<!-- device-check: end -->"
SCALE_E2E = REPO / "benchmarks" / "results" / "scale_e2e.json"
DEVICE_CHECK = REPO / "benchmarks" / "results" / "device_check.json"  # the last GPU call's JSON, as it came back
EVAL_ROWS_PER_S = 7_000_000 / 0.49  # benchmarks/evaluate.py: 7M rows in 0.49 s ("Found and fixed" below)


def on_gpu(check: dict | None) -> bool:
    """Whether ``check`` (a device check's JSON) ran on a GPU: a CPU run's figures are no GPU figures."""
    return bool(check) and check["environment"].get("device", "cpu") != "cpu"


def gpu_figures(check: dict | None) -> dict:
    """The rates the projection takes from a device check that ran on a GPU: diffret's best docs/s at Dream-7B shape
    on 115-token rows (``docs_s``, ``docs_batch``) and ``search_pass``'s float32 TFLOP/s at the most passages scored
    (``tflops``); each only where measured ({} for a CPU run or none).

    >>> gpu_figures(None), gpu_figures({"environment": {"device": "cpu"}, "parts": {}})
    ({}, {})
    """
    if not on_gpu(check):
        return {}
    env, parts = check["environment"], check.get("parts", {})
    out: dict = {"device": env["device"], "date": env["date"]}
    enc = [r for r in parts.get("encode_dream", {}).get("rows", []) if r.get("tokens") == 115 and "diffret_docs_s" in r]
    if enc:
        best = max(enc, key=lambda r: r["diffret_docs_s"])
        out |= {"docs_s": best["diffret_docs_s"], "docs_batch": best["batch"]}
    score = [r for r in parts.get("score", {}).get("rows", []) if "search_pass_s" in r]
    if score:
        r = max(score, key=lambda r: r["passages"])
        flops = 2 * r["queries"] * r["kq"] * r["passages"] * r["kp"] * r["hidden"]
        out |= {"tflops": flops / r["search_pass_s"] / 1e12, "passages": r["passages"], "hidden": r["hidden"]}
    return out


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v).replace("|", "/")


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
    return [
        "| " + " | ".join(title for _, title in cols) + " |",
        "|" + "---|" * len(cols),
        *("| " + " | ".join(_cell(r.get(k)) for k, _ in cols) + " |" for r in rows),
    ]


def gpu_section(check: dict | None) -> list[str]:
    """The device check's figures on a GPU (every part: its status, time, budget and peak memory; the stages, the
    encode benchmark, the score benchmark, the GPU tests), or what awaits it."""
    lines = ["## On a GPU: the device check", ""]
    if not on_gpu(check):
        return lines + [
            "**Awaiting the GPU run.** No GPU has been lent since the device check was written, so no figure in this "
            "page was measured on one. `benchmarks/device_check.py` measures them in one call of a lent H100 or H200 "
            '(docs/operations.md, "The device check": every stage at Dream-7B shape, the encode benchmark at '
            "Dream-7B and LLaDA-8B shapes, the score benchmark, the GPU tests, each part with its time and peak GPU "
            "memory); `python benchmarks/scale_docs.py --device-check OUT/device_check.json` then renders them "
            "here and puts the measured rates into the projection below.",
            "",
        ]
    env, parts = check["environment"], check.get("parts", {})
    lines += [
        f"Measured by `benchmarks/device_check.py` on {env['device']} ({env['date']}; torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}) in {check['seconds']:,.0f} s, with random weights "
        "(`--load-format random`): speeds and memory, never retrieval results. Each part ran in a process of its "
        "own under its budget; GPU peak: the memory its process allocated (`torch.cuda.max_memory_allocated`), "
        "in use: the device's peak while it ran (NVML, its subprocesses included). JSON: "
        "`benchmarks/results/device_check.json`.",
        "",
        *_table(
            [{"part": n, **p, "error": (p.get("error") or "")[:160]} for n, p in parts.items()],
            [
                ("part", "part"),
                ("status", "status"),
                ("seconds", "seconds"),
                ("budget_s", "budget (s)"),
                ("gpu_peak_gib", "GPU peak (GiB)"),
                ("gpu_used_peak_gib", "in use (GiB)"),
                ("error", "error"),
            ],
        ),
        "",
    ]
    if parts.get("stages", {}).get("rows"):
        lines += ["Every stage through the CLI at Dream-7B shape (bfloat16, the SciFact subset):", ""]
        lines += _table(
            parts["stages"]["rows"],
            [("stage", "stage"), ("seconds", "seconds"), ("gpu_used_peak_gib", "GPU in use (GiB)"), ("line", "said")],
        )
        lines.append("")
    enc = [r for n in ("encode_dream", "encode_llada") for r in parts.get(n, {}).get("rows", [])]
    if enc:
        lines += [
            "The encode benchmark: `encode_rows` against a bare trunk loop over the same rows (docs/s at K = 16; "
            "bare / diffret: time over time, above 1 means diffret is faster), and the code before at the first batch:",
            "",
        ]
        lines += _table(
            enc,
            [
                ("model", "model"),
                ("tokens", "tokens"),
                ("batch", "batch"),
                ("diffret_docs_s", "diffret docs/s"),
                ("bare_docs_s", "bare docs/s"),
                ("ratio", "bare / diffret"),
                ("k16_over_k1", "K16 / K1 time"),
                ("before_docs_s", "before docs/s"),
                ("same_bytes_as_before", "same bytes"),
                ("gpu_peak_gib", "GPU peak (GiB)"),
                ("skipped", "skipped"),
            ],
        )
        lines.append("")
    if parts.get("score", {}).get("rows"):
        lines += [
            f"Exact scoring, multi_dense at K_q = K_p = 16 ({parts['score'].get('encodings', '')}): `search_pass` "
            "against a bare batched matmul + max + sum + top-k over the same tensors:",
            "",
        ]
        lines += _table(
            parts["score"]["rows"],
            [
                ("queries", "queries"),
                ("passages", "passages"),
                ("hidden", "H"),
                ("search_pass_s", "search_pass (s)"),
                ("bare_s", "bare (s)"),
                ("ratio", "bare / search_pass"),
                ("top10_agreement", "top-10 agreement"),
                ("gpu_peak_gib", "GPU peak (GiB)"),
                ("skipped", "skipped"),
            ],
        )
        lines.append("")
    for r in parts.get("tests", {}).get("rows", []):
        lines += [f"The GPU unit tests ({r['tests']}): {r['summary']} (exit {r['returncode']}).", ""]
    return lines


def render_section(check: dict | None, results: list[dict], eval_rows_per_s: float | None = EVAL_ROWS_PER_S) -> str:
    """What goes between the markers: the GPU section and the MS MARCO projection."""
    lines = [BEGIN, *gpu_section(check), *projection(results, eval_rows_per_s, gpu_figures(check)), END]
    return "\n".join(lines)


def replace_section(text: str, section: str) -> str:
    """``text`` with what lies between the markers (both included) replaced by ``section``; nothing else changes."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{DOC}: expected one {BEGIN!r} ... {END!r} pair of markers")
    return text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]


def scale_results(path: Path = SCALE_E2E) -> list[dict]:
    stored = json.loads(path.read_text())
    return [stored[k] for k in sorted(stored, key=int)]


def main(argv: list[str] | None = None) -> None:
    import argparse
    import shutil

    ap = argparse.ArgumentParser(
        description="Render docs/scale.md's GPU section and MS MARCO projection (between their markers) from a device "
        "check's JSON and benchmarks/results/scale_e2e.json; the rest of the page is left as it is."
    )
    ap.add_argument(
        "--device-check",
        default=str(DEVICE_CHECK),
        help="the device check's JSON (copied to benchmarks/results/device_check.json when it ran on a GPU); "
        "'none': no GPU figures",
    )
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--keep", default=str(DEVICE_CHECK), help="where a GPU run's JSON is copied, beside the results")
    args = ap.parse_args(argv)
    check = None
    if args.device_check != "none" and Path(args.device_check).exists():
        check = json.loads(Path(args.device_check).read_text())
        keep = Path(args.keep)
        if on_gpu(check) and Path(args.device_check).resolve() != keep.resolve():
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(args.device_check, keep)  # the figures' source, beside the other results
    doc = Path(args.doc)
    doc.write_text(replace_section(doc.read_text(), render_section(check, scale_results())))
    print(
        f"{doc}: rendered from {args.device_check if check else 'no device check'}"
        f" ({'GPU figures' if on_gpu(check) else 'awaiting the GPU run'})"
    )


if __name__ == "__main__":
    main()
