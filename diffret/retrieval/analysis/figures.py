"""Figures (PNG bytes, matplotlib's Agg backend): (K_q, K_p) heatmaps, oracle bars, peak-K_q scatter plots."""

from __future__ import annotations

import io
from typing import Any

import numpy as np


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heatmap_png(
    kqs: list[int],
    kps: list[int],
    grid: np.ndarray,
    title: str,
    marks: dict[str, tuple] | None = None,
    reference: float | None = None,
) -> bytes:
    """A (K_q rows, K_p columns) heatmap with the values written in; ``marks``: label -> (kq, kp) boxed.
    ``reference`` (BM25's value): the colour scale runs from 0 to just above the larger of it and the grid's maximum
    and it is drawn on the colour bar, so that a grid far below it is not stretched into a pattern."""
    from matplotlib.patches import Rectangle

    fig, ax = _pyplot().subplots(figsize=(1.1 * len(kps) + 2.2, 0.9 * len(kqs) + 1.6), dpi=110)
    finite = grid[np.isfinite(grid)]
    scale = {}
    if reference is not None:
        scale = {"vmin": 0.0, "vmax": 1.05 * max([reference, *finite.tolist(), 1e-9])}  # its line below the top
    im = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto", **scale)
    ax.set_xticks(range(len(kps)), [str(k) for k in kps])
    ax.set_yticks(range(len(kqs)), [str(k) for k in kqs])
    ax.set_xlabel("K_p (passage budget)")
    ax.set_ylabel("K_q (query budget)")
    ax.set_title(title, fontsize=10)
    mid = float(finite.mean()) if finite.size else 0.0
    if reference is not None:  # the text colour follows the fixed scale's midpoint
        mid = scale["vmax"] / 2
    fmt = "{:.3f}" if finite.size and float(np.abs(finite).max()) >= 0.05 else "{:.4f}"
    for i in range(len(kqs)):
        for j in range(len(kps)):
            v = grid[i, j]
            if np.isfinite(v):
                ax.text(
                    j, i, fmt.format(v), ha="center", va="center", fontsize=8, color="black" if v > mid else "white"
                )
    styles = [("red", "-"), ("cyan", "--")]
    for (label, (kq, kp)), (color, ls) in zip((marks or {}).items(), styles, strict=False):
        if kq in kqs and kp in kps:
            ax.add_patch(
                Rectangle(
                    (kps.index(kp) - 0.5, kqs.index(kq) - 0.5), 1, 1, fill=False, ec=color, lw=2.2, ls=ls, label=label
                )
            )
    if marks:
        ax.legend(loc="upper left", bbox_to_anchor=(1.25, 1.0), fontsize=7, frameon=False)
    bar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if reference is not None:
        bar.ax.axhline(reference, color="red", lw=2)
        bar.set_label(f"red line: BM25 {reference:.3f}", fontsize=7)
    return _png(fig)


def oracle_png(data: list[dict[str, Any]]) -> bytes:
    """Bars per (dataset, mode): fixed budget, K_q / K_p / joint oracles and the fine-tuned system (Figure 8)."""
    keys = ["fixed", "kq_oracle", "kp_oracle", "joint", "finetuned"]
    labels = [f"{r['dataset']}\n{r['mode'].replace('fusion_', 'f_')}" for r in data]
    x = np.arange(len(data))
    w = 0.16
    fig, ax = _pyplot().subplots(figsize=(max(6, 0.9 * len(data) + 2), 3.8), dpi=110)
    for i, k in enumerate(keys):
        vals = [np.nan if r.get(k) is None else r[k] for r in data]
        if all(np.isnan(v) for v in vals):
            continue
        ax.bar(x + (i - 2) * w, vals, w, label=k)
    ax.set_xticks(x, labels, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("NDCG@10")
    ax.legend(fontsize=7, ncol=5, loc="upper left", bbox_to_anchor=(0, 1.15), frameon=False)
    return _png(fig)


def correlation_png(peaks: list[dict[str, Any]], title: str) -> bytes:
    """Peak K_q per query against its length and entropy, for D and S (paper section 6.4)."""
    fig, axes = _pyplot().subplots(2, 2, figsize=(8, 6), dpi=110, squeeze=False)
    rng = np.random.default_rng(0)
    for i, (mode, label) in enumerate((("multi_dense", "dense (D)"), ("sparse_max", "sparse (S)"))):
        ps = [p for p in peaks if p["mode"] == mode]
        for j, feature in enumerate(("length", "entropy")):
            ax = axes[i][j]
            if ps:
                y = np.log2([p["peak_kq"] for p in ps]) + rng.uniform(-0.15, 0.15, len(ps))
                ax.scatter([p[feature] for p in ps], y, s=6, alpha=0.5)
                ks = sorted({p["peak_kq"] for p in ps})
                ax.set_yticks(np.log2(ks), [str(k) for k in ks])
            ax.set_xlabel("length (subwords)" if feature == "length" else "entropy (bits)")
            ax.set_ylabel(f"peak K_q, {label}")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _png(fig)


def _marker(multi: bool) -> dict[str, Any]:
    """The paper's markers: open for one slot / vector, filled for several."""
    return {"marker": "o", "markerfacecolor": None if multi else "white"}


def _model(system: str) -> str:
    """A system slug's model part, short: ``model-readout-hash`` -> the first 18 characters of ``model``."""
    base = system.rsplit("-", 2)[0] if system.count("-") >= 2 else system
    return base[:18]


def _log_x(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str) -> bytes:
    """A one-panel figure's log x axis, labels, legend (beside the axes) and title, as PNG bytes."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=6, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return _png(fig)


def encode_latency_png(data: list[dict[str, Any]], title: str) -> bytes:
    """Encoding latency against input length, one panel per family, a line per (system, K); open markers at K = 1,
    filled at K > 1, PromptReps dashed with the slots it decoded beside each point (Figure 3, top row). ``data``:
    rows of the ``encode_latency`` view."""
    families = sorted({r["family"] for r in data})
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, max(1, len(families)), figsize=(4.6 * max(1, len(families)), 4.8), dpi=110, squeeze=False
    )
    for ax, family in zip(axes[0], families, strict=False):
        series: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
        for r in data:
            if r["family"] == family:
                series.setdefault((r["readout"], r["system"], r["k"]), []).append(r)
        for (readout, system, k), pts in sorted(series.items()):
            pts = sorted(pts, key=lambda p: p["length"])
            name = "N" if readout == "promptreps" else "K"
            ax.plot(
                [p["length"] for p in pts],
                [p["median_ms"] for p in pts],
                **_marker(k > 1),
                linestyle="--" if readout == "promptreps" else "-",
                label=f"{readout} {name}={k} ({_model(system)})",
            )
            if readout == "promptreps" and k > 1:  # the slots it decoded before its stop rule, at each point
                for p in pts:
                    ax.annotate(
                        f"{p['slots']:g}",
                        (p["length"], p["median_ms"]),
                        fontsize=5,
                        textcoords="offset points",
                        xytext=(3, 3),
                    )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("input length (tokens)")
        ax.set_ylabel("encoding latency (ms per text, median)")
        ax.set_title(family, fontsize=9)
        ax.legend(fontsize=6, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)  # below
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _png(fig)


def search_latency_png(data: list[dict[str, Any]], title: str) -> bytes:
    """Search latency against index size (log-log), a line per (system, engine, K_q, K_p), solid for exact search,
    dashed for LanceDB; open markers for one vector per text, filled for several (Figure 3, bottom row). ``data``:
    rows of the ``search_latency`` view."""
    fig, ax = _pyplot().subplots(figsize=(8.0, 3.6), dpi=110)
    series: dict[tuple[str, int, str, int, int], list[dict[str, Any]]] = {}
    for r in data:
        engine = f"{r['engine']} {r['index_type']}" if r.get("index_type") else r["engine"]
        series.setdefault((r["system"], r["hidden"], engine, r["kq"], r["kp"]), []).append(r)
    for (system, hidden, engine, kq, kp), pts in sorted(series.items()):
        pts = sorted(pts, key=lambda p: p["docs"])
        ax.plot(
            [p["docs"] for p in pts],
            [p["median_ms"] for p in pts],
            **_marker(kq * kp > 1),
            linestyle="--" if engine.startswith("lance") else "-",
            label=f"{engine} (K_q, K_p) = ({kq}, {kp}), H = {hidden} ({_model(system)})",
        )
    ax.set_yscale("log")
    return _log_x(fig, ax, "index size (documents)", "search latency (ms per query, median)", title)


def cost_effect_png(points: list[dict[str, Any]], title: str) -> bytes:
    """Effectiveness against per-query latency (Figure 1): a point per (system, single / multi), open for single,
    filled for multi, a dashed line joining a system's two. ``points``: system, multi, ms, ndcg_10."""
    fig, ax = _pyplot().subplots(figsize=(8.0, 3.8), dpi=110)
    by_system: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        by_system.setdefault(p["system"], []).append(p)
    for i, (system, pts) in enumerate(sorted(by_system.items())):
        color = f"C{i % 10}"
        pts = sorted(pts, key=lambda p: p["multi"])
        if len(pts) > 1:
            ax.plot([p["ms"] for p in pts], [p["ndcg_10"] for p in pts], "--", color=color, linewidth=0.8)
        for p in pts:
            ax.plot(
                [p["ms"]],
                [p["ndcg_10"]],
                color=color,
                linestyle="none",
                **_marker(p["multi"]),
                label=f"{system.rsplit('-', 1)[0]} ({'multi' if p['multi'] else 'single'})",
            )
    return _log_x(fig, ax, "query encoding + search latency (ms per query)", "NDCG@10 (mean over datasets)", title)


def compression_png(points: list[dict[str, Any]], title: str) -> bytes:
    """Bytes per passage (log x) against the mean NDCG@10 change from float16, one point per storage choice and
    mode (``store``, ``mode``, ``bytes_per_passage``, ``ndcg_10_change``); float16 itself at 0."""
    fig, ax = _pyplot().subplots(figsize=(6.4, 4), dpi=110)
    modes = sorted({p["mode"] for p in points})
    for mode in modes:
        pts = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["bytes_per_passage"])
        ax.plot([p["bytes_per_passage"] for p in pts], [p["ndcg_10_change"] for p in pts], "o-", label=mode, ms=5)
    low: dict[str, dict[str, Any]] = {}  # each choice named once, at its lowest point
    for p in points:
        if p["store"] not in low or p["ndcg_10_change"] < low[p["store"]]["ndcg_10_change"]:
            low[p["store"]] = p
    for p in low.values():
        ax.annotate(
            p["store"],
            (p["bytes_per_passage"], p["ndcg_10_change"]),
            fontsize=7,
            rotation=-30,
            xytext=(2, -4),
            textcoords="offset points",
        )
    ax.axhline(0, color="grey", lw=0.8)
    ax.legend(fontsize=7, frameon=False)
    return _log_x(fig, ax, "bytes per passage (all K_p, measured)", "mean NDCG@10 change vs float16", title)
