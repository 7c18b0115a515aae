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
        secs = [next(s for s in r["stages"] if s["stage"] == name)["seconds"] for r in results]
        mem = [next(s for s in r["stages"] if s["stage"] == name)["peak_rss_mb"] for r in results]
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


def write_docs(results: list[dict], t_exp: dict[str, float], m_exp: dict[str, float]) -> None:
    figure(results)
    big = results[-1]
    names = [s["stage"] for s in big["stages"]]
    lines = ["# Scale: every stage's cost against the corpus size", "",
             "Measured by `benchmarks/scale_e2e.py` on this machine (2 cores, 24 GB, no GPU): a synthetic MS "
             "MARCO-shaped collection (passages of MS MARCO's length from a real English word distribution, "
             f"{big['collection']['queries']} queries with one relevant passage each) through the CLI, stage by "
             "stage, with a random-weight BERT masked LM of hidden size 64 (2 layers) and two local Dask workers for "
             "encoding. "
             "Reproduce: `python benchmarks/scale_e2e.py --n 10000 --n 100000 --n 1000000 --write-docs`.", "",
             "## Measured", "",
             "| stage | " + " | ".join(f"N = {r['n']:,}" for r in results) + " | time exponent | memory exponent |",
             "|---|" + "---|" * (len(results) + 2)]  # fmt: skip
    for name in names:
        cells = []
        for r in results:
            s = next(s for s in r["stages"] if s["stage"] == name)
            cells.append(f"{_fmt_s(s['seconds'])}, {s['peak_rss_mb']:,.0f} MB, {s['files']} files, "
                         f"{_fmt_b(s['bytes'])}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {t_exp.get(name, float('nan')):.2f} | "
                     f"{m_exp.get(name, float('nan')):.2f} |")  # fmt: skip
    lines += ["", "Each cell: wall time, the peak RSS of the largest process of the command (Dask workers included), "
              "files and bytes it added to the store. Exponents: least-squares slope of log(time) and log(peak RSS) "
              "against log(N).", "", "![stage costs against the corpus size](img/scale.png)", ""]  # fmt: skip
    DOC.write_text("\n".join(lines))
