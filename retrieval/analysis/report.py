"""The paper's analyses as one report: markdown sections, PNG figures and CSV tables.

Every number is read from a view of ``queries/`` (named in the report next to each table), so
``diffret sql`` over the same store gives the same numbers. The report stage (stages/report.py) writes it
into the store under ``reports/report=<name>/``.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from storage.layout import MEASURES
from storage.sql import StoreSQL

from ..evaluation.compare import Correction, Test, compare_runs
from ..search.modes import MODE_NAMES
from .correlation import feature_correlations
from .figures import (
    compression_png,
    correlation_png,
    cost_effect_png,
    encode_latency_png,
    heatmap_png,
    oracle_png,
    search_latency_png,
)
from .footprint import footprint_projection, human_bytes
from .tables import paper_table
from .views import per_query, rows

KIND_MODES = ("bm25", "imported", "fusion", "rerank")  # modes named by their system alone (a single run)
COMPARE_ROWS = 30  # at most this many runs per dataset in the report's comparison (the best by NDCG@10)


@dataclass
class Report:
    name: str
    sections: list[tuple[str, str]] = field(default_factory=list)  # (title, markdown body)
    files: dict[str, bytes] = field(default_factory=dict)  # name -> bytes (PNG, CSV)

    def markdown(self) -> str:
        out = [f"# diffret report `{self.name}`", ""]
        out += [f"- [{t}](#{_anchor(t)})" for t, _ in self.sections]
        for title, body in self.sections:
            out += ["", f"## {title}", "", body.rstrip()]
        return "\n".join(out) + "\n"


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def _csv(data: list[list[Any]]) -> bytes:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(data)
    return buf.getvalue().encode()


def _dicts_csv(data: list[dict[str, Any]], columns: list[str] | None = None) -> bytes:
    """Rows as CSV with a header line, also without rows (``columns``, or a :class:`views.Rows`' own)."""
    cols = list(data[0]) if data else list(columns or getattr(data, "columns", []))
    return _csv([cols] + [[r.get(c) for c in cols] for r in data])


CORRELATION_COLUMNS = ["system", "dataset", "split", "mode", "feature", "n", "off_mode", "spearman", "spearman_lo",
                       "spearman_hi", "kendall", "kendall_lo", "kendall_hi"]  # fmt: skip


def _fmt(v: Any, nd: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return "nan" if np.isnan(v) else f"{v:.{nd}f}"
    return str(v)


def _md_table(data: list[dict[str, Any]], cols: list[str] | None = None) -> str:
    if not data:
        return "_(no rows)_\n"
    cols = cols or list(data[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in data]
    return "\n".join(lines) + "\n"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", name)


# ---------------------------------------------------------------------------------------- sections
def section_selection(db: StoreSQL, rep: Report) -> None:
    sel = rows(db, "select * from budget_selection order by system")
    test = rows(
        db,
        "select system, dataset, split, kq, kp, mode, ndcg_10 from selected_cells "
        "where mode in ('multi_dense', 'sparse_max', 'fusion_multi_sparse_max') order by system, dataset, mode",
    )
    rep.files["budget_selection.csv"] = _dicts_csv(sel)
    rep.files["selected_cells.csv"] = _dicts_csv(test)
    if not sel:
        body = (
            "No system has train-split metrics, so no budget is selected. Score a train split too, e.g. "
            "`diffret run --split train --split test` (SciFact has train 809 / test 300 queries).\n"
        )
    else:
        body = (
            "(K_q*, K_p*) per system: the best mean H (fusion_multi_sparse_max) NDCG@10 over its train split(s), "
            "applied unchanged to every test split (views `budget_selection`, `selected_cells`).\n\n"
            + _md_table(sel)
            + "\nAt the selected budget on the other splits:\n\n"
            + _md_table(test)
        )
    rep.sections.append(("Budget selection", body))


def section_landscapes(db: StoreSQL, rep: Report) -> None:
    cells = rows(db, "select system, dataset, kq, kp, mode, ndcg_10 from cells where split = 'test' "
                 "and mode not in ('bm25', 'rerank')")  # fmt: skip
    sel = {r["system"]: (r["kq_star"], r["kp_star"]) for r in rows(db, "select * from budget_selection")}
    by: dict[tuple[str, str, str], dict[tuple[int, int], float]] = {}
    for c in cells:
        by.setdefault((c["system"], c["dataset"], c["mode"]), {})[(c["kq"], c["kp"])] = c["ndcg_10"]
    # the average over datasets, on the cells every dataset has
    systems = sorted({m for m, _, _ in by})
    for system in systems:
        dsets = sorted({d for m, d, _ in by if m == system})
        if len(dsets) > 1:
            for mode in MODE_NAMES:
                grids = [by.get((system, d, mode), {}) for d in dsets]
                common = set.intersection(*(set(g) for g in grids)) if all(grids) else set()
                if common:
                    by[(system, "avg", mode)] = {k: float(np.mean([g[k] for g in grids])) for k in common}
    lines = [
        "NDCG@10 over (K_q, K_p) on test, per system, dataset (and the average over datasets) and mode "
        "(view `cells`). Red box: the best cell on test; cyan dashed box: the train-selected cell.",
        "",
    ]
    for (system, dataset, mode), grid in sorted(by.items()):
        kqs = sorted({k for k, _ in grid})
        kps = sorted({p for _, p in grid})
        arr = np.full((len(kqs), len(kps)), np.nan)
        for (kq, kp), v in grid.items():
            arr[kqs.index(kq), kps.index(kp)] = np.nan if v is None else v
        best = max(grid, key=lambda k: (grid[k] if grid[k] is not None else -1, -(k[0] + k[1])))
        marks = {"best on test": best}
        if system in sel:
            marks["train-selected"] = sel[system]
        name = f"landscape_{_safe(system)}_{_safe(dataset)}_{mode}.png"
        rep.files[name] = heatmap_png(kqs, kps, arr, f"{dataset} test: {mode} NDCG@10\n{system}", marks)
        lines.append(f"- {system} / {dataset} / {mode}: best ({best[0]}, {best[1]}) = {_fmt(grid[best])} — ![]({name})")
    if not by:
        lines.append("_(no grid metrics on a test split)_")
    rep.sections.append(("Landscapes", "\n".join(lines) + "\n"))


def section_oracle(db: StoreSQL, rep: Report, finetuned: dict[str, str]) -> None:
    data = rows(db, "select * from oracle order by system, dataset, split, mode")
    sel = {r["system"]: (r["kq_star"], r["kp_star"]) for r in rows(db, "select * from budget_selection")}
    for r in data:
        r["finetuned"] = None
        ft = finetuned.get(r["system"])
        if ft and r["system"] in sel:
            kq, kp = sel[r["system"]]
            v = rows(
                db,
                "select ndcg_10 from cells where system = ? and dataset = ? and split = ? and mode = ? and kq = ? "
                "and kp = ?",
                [ft, r["dataset"], r["split"], r["mode"], kq, kp],
            )
            r["finetuned"] = v[0]["ndcg_10"] if v else None
    rep.files["oracle.csv"] = _dicts_csv(data, [*getattr(data, "columns", []), "finetuned"])
    body = (
        "Mean NDCG@10 per query at the selected budget (fixed) and with a per-query oracle over K_q "
        "(K_p = K_p*), over K_p (K_q = K_q*) and over both (joint) (view `oracle`); `finetuned`: the "
        "fine-tuned model at the same budget when given with --finetuned BASE=FT.\n\n"
        + _md_table(
            data,
            ["system", "dataset", "split", "mode", "fixed", "kq_oracle", "kp_oracle", "joint", "finetuned", "queries"],
        )  # fmt: skip
    )
    if data:
        rep.files["oracle.png"] = oracle_png(data)
        body += "\n![oracle](oracle.png)\n"
    rep.sections.append(("Per-query oracle", body))


def section_correlation(db: StoreSQL, rep: Report, n_boot: int) -> None:
    corr = feature_correlations(db, n_boot)
    rep.files["feature_correlation.csv"] = _dicts_csv(corr, CORRELATION_COLUMNS)
    peaks = rows(db, "select * from query_peaks order by system, dataset, split, mode, query_id")
    rep.files["query_peaks.csv"] = _dicts_csv(peaks)
    for r in corr:
        r["rho [95% CI]"] = f"{_fmt(r['spearman'], 3)} [{_fmt(r['spearman_lo'], 3)}, {_fmt(r['spearman_hi'], 3)}]"
        r["tau [95% CI]"] = f"{_fmt(r['kendall'], 3)} [{_fmt(r['kendall_lo'], 3)}, {_fmt(r['kendall_hi'], 3)}]"
    body = (
        "Per query, the peak K_q (argmax of NDCG@10 over K_q at K_p = K_p*; ties: the smallest) against the "
        "query's length in model-tokenizer subwords and the Shannon entropy (bits) of its token distribution "
        f"(view `query_peaks`); Spearman rho and Kendall tau-b with 95% percentile-bootstrap CIs ({n_boot} "
        "resamples of queries). D = multi_dense, S = sparse_max. off_mode: queries whose peak is not the most "
        "common one; with few of them the interval only reflects resamples that contain them. nan: a constant "
        "variable (e.g. every query peaks at the same K_q).\n\n"
        + _md_table(
            corr, ["system", "dataset", "split", "mode", "feature", "n", "off_mode", "rho [95% CI]", "tau [95% CI]"]
        )
    )
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for p in peaks:
        groups.setdefault((p["system"], p["dataset"], p["split"]), []).append(p)
    for (system, dataset, split), ps in sorted(groups.items()):
        name = f"correlation_{_safe(system)}_{_safe(dataset)}_{split}.png"
        rep.files[name] = correlation_png(ps, f"{dataset} {split}: peak K_q vs query features\n{system}")
        body += f"\n![{system} {dataset}]({name})\n"
    rep.sections.append(("Feature correlation", body))


def section_tables(db: StoreSQL, rep: Report, refs: list[str], finetuned: dict[str, str], test: Test = "t",
                   correction: Correction = "holm") -> None:  # fmt: skip
    resolved = [_resolve_system(db, r) for r in refs]
    t = paper_table(db, resolved, finetuned=finetuned, test=test, correction=correction)
    rep.files["paper_table.csv"] = _csv(t.csv_rows())
    rep.sections.append(("Paper tables (D / S / H)", t.markdown()))


def section_comparisons(db: StoreSQL, rep: Report, refs: list[str], test: Test = "t",
                        correction: Correction = "holm") -> None:  # fmt: skip
    """Per test dataset: each system's best cell per mode (view ``best_cells``: an imported run, a fusion, a
    reranker's run too) against the first reference's, on NDCG@10 and MRR@10, the p-values corrected across the
    table (``diffret compare`` for any other choice of runs); CSV and LaTeX beside it."""
    if not refs:
        return
    ref = _resolve_system(db, refs[0])
    measures = [m.pytrec for m in MEASURES[:2]]
    body = []
    for (dataset,) in db.con.execute("select distinct dataset from best_cells where split = 'test' "
                                     "order by 1").fetchall():  # fmt: skip
        cells = rows(db, "select system, mode, kq, kp from best_cells where split = 'test' and dataset = ? "
                         "order by system = ? desc, ndcg_10 desc, system, mode, kq, kp", [dataset, ref])  # fmt: skip
        if not cells or cells[0]["system"] != ref:
            continue
        scores: dict[str, dict[str, dict[str, float]]] = {}
        for c in cells[: 1 + COMPARE_ROWS]:
            label = c["system"] + (f":{c['mode']}" if c["mode"] not in KIND_MODES else "") + (
                f":{c['kq']}:{c['kp']}" if (c["kq"], c["kp"]) != (0, 0) else "")  # fmt: skip
            scores[label] = {m: per_query(db, c["system"], dataset, "test", c["mode"], c["kq"], c["kp"], m)
                             for m in measures}  # fmt: skip
        base = next(iter(scores))
        try:
            comp = compare_runs(scores, base, measures, test, correction, where=f"{dataset}/test")
        except ValueError as exc:  # a run evaluated on other queries or measures: said, not hidden
            body.append(f"### {dataset}\n\nnot compared: {exc}\n")
            continue
        rep.files[f"comparison_{_safe(dataset)}.csv"] = comp.csv().encode()
        rep.files[f"comparison_{_safe(dataset)}.tex"] = comp.latex(f"tab:{_safe(dataset)}").encode()
        body.append(f"### {dataset}\n\n{comp.markdown()}")
    if body:
        rep.sections.append((f"Runs against {ref}", "\n".join(body)))


def _resolve_system(db: StoreSQL, name: str) -> str:
    """A system slug, or `bm25` for the store's one BM25 system."""
    systems = [r["system"] for r in rows(db, "select distinct system from cells order by 1")]
    if name in systems:
        return name
    hits = [s for s in systems if s.startswith(name)]
    if len(hits) == 1:
        return hits[0]
    raise ValueError(f"unknown reference system {name!r}; systems with metrics: {systems}")


def section_footprint(db: StoreSQL, rep: Report, hidden: int, backbones: int, settings: int) -> None:
    # the artifacts, not the reports (a report's own earlier copy would make rebuilding it change it)
    fp = rows(
        db,
        "select stage, count(distinct folder) folders, count(*) files, sum(bytes)::BIGINT bytes "
        "from artifact_files where stage <> 'reports' group by stage order by bytes desc, stage",
    )
    detail = rows(db, "select * from footprint where stage <> 'reports' "
                  "order by bytes desc, stage, system, dataset, side, k")  # ties in a fixed order
    for r in detail:
        r["bytes"] = int(r["bytes"] or 0)
        r["rows"] = None if r["rows"] is None else int(r["rows"])
    rep.files["footprint.csv"] = _dicts_csv(detail)
    proj = footprint_projection(hidden=hidden, backbones=backbones, settings=settings)
    fp32 = footprint_projection(hidden=hidden, backbones=backbones, settings=settings, bytes_per_value=4)
    a = proj["assumptions"]
    for r in fp:
        r["size"] = human_bytes(r["bytes"])
    body = (
        "This store, per stage (view `footprint`, from the manifests):\n\n"
        + _md_table(fp, ["stage", "folders", "files", "bytes", "size"])
        + "\nProjection of the encodings to MS MARCO scale. Assumptions: "
        f"{a['passages']:,} passages + {a['queries']:,} queries (dev + DL19 + DL20); hidden size {a['hidden']}; "
        f"one pass per K in {a['grid']} per side, so {a['vectors_per_text']} dense vectors per text; float16 "
        f"({a['bytes_per_value']:g} bytes/value, Parquet zstd barely compresses activations); sparse top-"
        f"{a['sparse_topk']} (int32 id + float32 weight) per pass; {a['backbones']} backbones x {a['settings']} "
        "settings (e.g. zero-shot and fine-tuned); no index or runs.\n\n"
        f"- dense per backbone and setting: {human_bytes(proj['dense_bytes_per_setting'])}\n"
        f"- sparse per backbone and setting: {human_bytes(proj['sparse_bytes_per_setting'])}\n"
        f"- **total: {human_bytes(proj['total_bytes'])}** (float32 vectors: {human_bytes(fp32['total_bytes'])}); "
        "the paper reports ~20 TB of intermediate artifacts.\n"
    )
    rep.files["footprint_projection.csv"] = _dicts_csv(
        [{"bytes_per_value": p["assumptions"]["bytes_per_value"], "total_bytes": p["total_bytes"],
          "total_tb": p["total_tb"], **{k: v for k, v in p["assumptions"].items() if k != "bytes_per_value"}}
         for p in (proj, fp32)]
    )  # fmt: skip
    rep.sections.append(("Footprint", body))


def section_compression(db: StoreSQL, rep: Report, hidden: int, backbones: int, settings: int) -> None:
    """Compressed systems against their float16 systems (views ``vector_bytes``, ``compression_effect``): bytes
    per vector and per passage measured on disk, the MS MARCO projection per storage choice, and the NDCG@10 /
    MRR@10 change per mode over the grid (a table and a figure)."""
    from storage.codecs import code_bytes

    systems = rows(db, "select system, store, float16_system from compressed_systems order by float16_system, system")
    if not systems:
        return
    sizes = rows(db, "select s.system, s.store, s.float16_system, v.dataset, "
                     "sum(v.vector_bytes) / sum(v.vectors) bytes_per_vector, "
                     "sum(f.vector_bytes) / sum(f.vectors) float16_bytes_per_vector, "
                     "sum(v.all_bytes) / max(v.passages) bytes_per_passage, "
                     "sum(f.all_bytes) / max(f.passages) float16_bytes_per_passage, list(v.kp order by v.kp) kp, "
                     "sum(v.codebook_bytes) codebook_bytes "
                     "from compressed_systems s join vector_bytes v on v.system = s.system "
                     "join vector_bytes f on f.system = s.float16_system and f.dataset = v.dataset and f.kp = v.kp "
                     "group by all order by s.float16_system, v.dataset, bytes_per_vector")  # fmt: skip
    width = {r["float16_system"]: rows(db, "select len(dense[1]) h from encodings where system = ? and side = "
                                           "'passage' and dense is not null limit 1", [r["float16_system"]])
             for r in sizes}  # fmt: skip
    base = footprint_projection(hidden=hidden, backbones=backbones, settings=settings)
    for r in sizes:
        r["smaller"] = r["float16_bytes_per_vector"] / r["bytes_per_vector"]
        h = width[r["float16_system"]][0]["h"] if width[r["float16_system"]] else None
        # the measured bytes per vector scaled to the projection's width by the code's own width
        scaled = r["bytes_per_vector"] * code_bytes(r["store"], hidden) / code_bytes(r["store"], h) if h else None
        proj = footprint_projection(hidden=hidden, backbones=backbones, settings=settings,
                                    passage_bytes_per_vector=scaled) if scaled else None  # fmt: skip
        r["msmarco_projection"] = human_bytes(proj["total_bytes"]) if proj else "–"
        r["msmarco_bytes"] = proj["total_bytes"] if proj else None
    rep.files["compression.csv"] = _dicts_csv(sizes)
    effect = rows(db, "select * from compression_effect order by float16_system, store, dataset, split, mode, kq, kp")
    rep.files["compression_effect.csv"] = _dicts_csv(effect)
    means = rows(db, "select e.store, e.system, e.dataset, e.split, e.mode, count(*) cells, "
                     "avg(ndcg_10_change) ndcg_10_change, min(ndcg_10_change) worst_ndcg_10_change, "
                     "avg(mrr_10_change) mrr_10_change, avg(float16_ndcg_10) float16_ndcg_10 "
                     "from compression_effect e group by all order by e.dataset, e.split, e.mode, e.store")  # fmt: skip
    body = ("Compressed systems (`diffret compress`, `diffret encode --store`; storage/codecs.py) against the float16 "
            "system they were made from. Bytes are measured on disk from the Parquet metadata (view `vector_bytes`): "
            "per vector the vectors' column, per passage every column over the K_p compressed (the sparse side "
            "included); codebook_bytes: its codebooks over those K_p, paid once whatever the corpus size (one with as "
            "many centroids as vectors stores the vectors themselves). The MS MARCO projection scales each choice's "
            "measured bytes per vector to H = "
            f"{hidden} by its code width, keeps the queries in float16 and the rest as the Footprint section's "
            f"(float16: {human_bytes(base['total_bytes'])}).\n\n"
            + _md_table(sizes, ["store", "dataset", "kp", "bytes_per_vector", "float16_bytes_per_vector", "smaller",
                                "bytes_per_passage", "float16_bytes_per_passage", "codebook_bytes",
                                "msmarco_projection"])  # fmt: skip
            + "\nThe change in mean NDCG@10 and MRR@10 against float16, over the cells scored with both (view "
            "`compression_effect`; per cell in `compression_effect.csv`):\n\n"
            + _md_table(means, ["store", "dataset", "split", "mode", "cells", "float16_ndcg_10", "ndcg_10_change",
                                "worst_ndcg_10_change", "mrr_10_change"]))  # fmt: skip
    test = [m for m in means if m["split"] == "test" and m["mode"] != "sparse_max"] or means  # sparse: unchanged
    passage = {(r["system"], r["dataset"]): r["bytes_per_passage"] for r in sizes}
    points = [{"store": m["store"], "mode": m["mode"], "ndcg_10_change": m["ndcg_10_change"],
               "bytes_per_passage": passage[m["system"], m["dataset"]]}
              for m in test if (m["system"], m["dataset"]) in passage]  # fmt: skip
    for r in sizes:  # float16 itself, at no change
        for mode in sorted({m["mode"] for m in test}):
            points.append({"store": "float16", "mode": mode, "ndcg_10_change": 0.0,
                           "bytes_per_passage": r["float16_bytes_per_passage"]})  # fmt: skip
    if points:
        rep.files["compression.png"] = compression_png(points, "storage choices: size against NDCG@10 change")
        body += "\n![compression](compression.png)\n"
    rep.sections.append(("Compression", body))


def section_reranking(db: StoreSQL, rep: Report) -> None:
    """DiffuRank rerankers against the first-stage runs they reordered (view ``rerank_gains``)."""
    gains = rows(db, "select system, method, dataset, split, depth, first_stage, first_mode, ndcg_10, first_ndcg_10, "
                     "ndcg_10_gain, queries from rerank_gains order by dataset, split, ndcg_10 desc")  # fmt: skip
    if not gains:
        return
    rep.files["rerank_gains.csv"] = _dicts_csv(gains)
    body = ("NDCG@10 of each reranker (`diffret rerank`) and of the run it reordered, on the same queries "
            "(view `rerank_gains`).\n\n" + _md_table(gains))  # fmt: skip
    rep.sections.append(("Reranking", body))


def section_late(db: StoreSQL, rep: Report) -> None:
    """Late-parametric re-scoring (SIDR's full / beta / beta(m) against BM25; view ``late_gains``) and what each
    pipeline costs: bag-of-tokens builds (view ``bot_indexes``) and passages encoded (view ``late_runs``)."""
    gains = rows(db, "select system, dataset, split, rescore, m, first_system, first_mode, first_ndcg_10, ndcg_10, "
                     "full_ndcg_10, bm25_ndcg_10, passages_needed, corpus from late_gains "
                     "order by dataset, split, system, rescore, m")  # fmt: skip
    if not gains:
        return
    rep.files["late_gains.csv"] = _dicts_csv(gains)
    bots = rows(db, "select index, name, dataset, bytes, round(build_seconds, 3) build_seconds from index_costs "
                    "order by dataset, index, name")  # fmt: skip
    body = ("NDCG@10 of each first stage's top m re-scored (`diffret late`), beside the first stage (`beta`: SIDR_beta"
            " over the bag of tokens), the full-corpus run of the same mode (SIDR_full for a sidr system) and BM25; "
            "passages_needed: the passages encoded for it, of corpus (view `late_gains`).\n\n" + _md_table(gains))
    if bots:
        rep.files["index_costs.csv"] = _dicts_csv(bots)
        body += ("\nIndexes: the bag of tokens (`diffret bot`: no model), BM25's and SIDR systems' passage encodings "
                 "(view `index_costs`).\n\n" + _md_table(bots))
    costs = rows(db, "select system, dataset, split, rescore, m, first_mode, round(first_ms_per_query, 3) first_ms, "
                     "round(rescore_ms_per_query, 3) rescore_ms, round(encode_ms_per_passage, 3) encode_ms, "
                     "round(on_the_fly_ms_per_query, 2) on_the_fly_ms, round(full_ms_per_query, 3) full_ms, "
                     "round(full_index_encode_seconds, 1) full_index_encode_s, passages_needed, corpus "
                     "from late_costs "
                     "order by dataset, split, system, rescore, m")  # fmt: skip
    if costs:
        rep.files["late_costs.csv"] = _dicts_csv(costs)
        body += ("\nCost per query, measured on this store's runs (ms per query of a batched pass, query encoding "
                 "excluded; view `late_costs`): the first stage's search, the re-scoring of its top m, encode_ms: "
                 "one passage's encoding; on_the_fly: SIDR's way, the m passages encoded for each query; full: the "
                 "full-corpus search, after encoding the corpus once (full_index_encode_s).\n\n" + _md_table(costs))
    rep.sections.append(("Late-parametric re-scoring (SIDR)", body))


def section_adaptive(db: StoreSQL, rep: Report) -> None:
    """Adaptive budgets (``diffret budget``; view ``adaptive_runs``): per system, dataset, split, base mode, axis
    and feature set, each selector's NDCG@10 against the fixed train-selected budget and the per-query oracle over
    the same cells, the share of the gap it closes, a paired t-test against fixed, the cells chosen and the
    features that mattered."""
    import json

    from .budgets import Grid, gap_closed

    runs = rows(db, "select * from adaptive_runs order by system, dataset, split, base_mode, over_axis, features, "
                    "selector")  # fmt: skip
    if not runs:
        return
    table, missing = [], []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["system"], r["dataset"], r["split"], r["base_mode"], r["over_axis"], r["features"],
                           r["measure"], r["cross_fit"]), []).append(r)  # fmt: skip

    def per_query(system: str, dataset: str, split: str, mode: str, measure: str) -> dict[str, float]:
        return {r["query_id"]: r["value"] for r in rows(
            db, "select query_id, value from metrics where system = ? and dataset = ? and split = ? and mode = ? "
                "and measure = ?", [system, dataset, split, mode, measure])}  # fmt: skip

    for (system, dataset, split, base, over, features, measure, cross_fit), sels in groups.items():
        cells = rows(db, "select query_id, kq, kp, value from metrics where system = ? and dataset = ? and "
                         "split = ? and mode = ? and measure = ? and kq > 0",
                     [system, dataset, split, base, measure])  # fmt: skip
        allowed = [tuple(c) for c in json.loads(sels[0]["cells"])]  # the grid it chose from, nothing more
        grid = Grid.from_rows([(c["query_id"], c["kq"], c["kp"], c["value"]) for c in cells], allowed)
        if cross_fit:  # each fold has its own fixed cell: the baseline is the cross-fitted fixed selector's run
            base_run = next((s["mode"] for s in sels if s["selector"] == "fixed"), None)
            got_fixed = per_query(system, dataset, split, base_run, measure) if base_run else {}
            if not got_fixed:
                missing.append(f"the fixed selector's run beside {sels[0]['mode']} (the cross-fitted baseline)")
                continue
            fixed_v, fixed_name = np.array([got_fixed.get(q, 0.0) for q in grid.queries]), "per fold"
        else:
            fixed = (sels[0]["fixed_kq"], sels[0]["fixed_kp"])
            grid = grid.restrict(over, fixed)
            fixed_v, fixed_name = grid.scores[:, grid.cells.index(fixed)], f"{fixed[0]}x{fixed[1]}"
        for s in sels:
            got = per_query(system, dataset, split, s["mode"], measure)
            if not got:
                missing.append(s["mode"])
                continue
            summary = gap_closed(fixed_v, np.array([got.get(q, 0.0) for q in grid.queries]), grid.oracle())
            hist = json.loads(s["histogram"]) if s["histogram"] else {}
            imp = json.loads(s["importances"]) if s["importances"] else {}
            top = sorted(imp.items(), key=lambda kv: -kv[1])[:3]
            table.append({
                "system": system, "dataset": dataset, "split": split, "mode": base, "over": over,
                "features": features + (" (cross-fitted)" if cross_fit else ""), "selector": s["selector"],
                "fixed": fixed_name,
                "fixed_ndcg_10": round(summary["fixed"], 4), "ndcg_10": round(summary["selected"], 4),
                "oracle": round(summary["oracle"], 4), "gap_closed": round(summary["gap_closed"], 3),
                "p_value": round(summary["p_value"], 4), "chosen": " ".join(f"{c}:{n}" for c, n in hist.items() if n),
                "top_features": ", ".join(f"{k} {v:.2f}" for k, v in top if v > 0),
                "index_copies": s["passage_indexes"], "query_passes": s["query_passes"],
            })  # fmt: skip
    body = ("Adaptive budgets (`diffret budget`; view `adaptive_runs`): a (K_q, K_p) per query chosen from features "
            "known before search, learned on the train split and applied here (cross-fitted: learned on the other "
            "folds of this split). fixed: the train-selected cell of the cells the choice may take (over kq: K_p "
            "fixed; kp: K_q fixed; joint); oracle: each query's best of them; gap_closed: (selector - fixed) / "
            "(oracle - fixed); p_value: paired t-test of the selector against fixed; chosen: queries per cell; "
            "top_features: importances; index_copies / query_passes: what the choice costs at query time.\n\n")
    body += _md_table(table) if table else ""
    if missing:
        body += (f"\n{len(missing)} adaptive run(s) without metrics (e.g. {missing[0]}): run `diffret evaluate` "
                 "(and `diffret budget --selector fixed` for a cross-fitted baseline).\n")
    rep.files["adaptive_budgets.csv"] = _dicts_csv(table)
    rep.sections.append(("Adaptive budgets", body))


QUERY_LENGTH = 32  # the synthetic length Figure 1 reads a query's encoding latency at (the nearest measured)


def section_latency(db: StoreSQL, rep: Report) -> None:
    """The paper's cost figures from the stored latency rows (views ``encode_latency_latest``,
    ``search_latency_latest``): Figure 3's two rows, the autoregressive / one-pass ratio of one checkpoint read both
    ways, and Figure 1."""
    enc = rows(db, "with e as (select * from encode_latency_latest qualify dense_rank() over (order by side = 'query' "
                   "desc, side, batch_size) = 1) select * from e order by system, k, length")  # fmt: skip
    srch = rows(db, "select * from search_latency_latest order by system, kq, kp, docs")
    if not enc and not srch:
        return
    body = ""
    if enc:
        rep.files["encode_latency.csv"] = _dicts_csv(enc)
        title = f"{enc[0]['side']} side, batch size {enc[0]['batch_size']}, {enc[0]['device_name']}"
        rep.files["fig3_encode_latency.png"] = encode_latency_png(enc, title)
        body += ("Encoding latency against input length (`diffret latency`; synthetic inputs; open: K = 1, filled: "
                 "K > 1; view `encode_latency`):\n\n![encoding latency](fig3_encode_latency.png)\n")
        ratios = rows(db, "select string_split(a.model, '/')[-1] ar_model, string_split(b.model, '/')[-1] "
                          "one_pass_model, a.side, a.batch_size, a.length, a.k, round(a.median_ms, 3) ar_ms, "
                          "a.slots ar_slots, round(b.median_ms, 3) one_pass_ms, "
                          "round(a.median_ms / b.median_ms, 2) ar_over_one_pass, a.device_name "
                          "from encode_latency_latest a join encode_latency_latest b "
                          "using (side, length, k, batch_size, device_name, hidden) "
                          "where a.readout = 'promptreps' and b.readout = 'diffretriever' "
                          "order by a.model != b.model, ar_model, one_pass_model, a.side, a.batch_size, a.k, "
                          "a.length")  # fmt: skip
        if ratios:
            rep.files["ar_over_one_pass.csv"] = _dicts_csv(ratios)
            body += ("\nAutoregressive against one pass at matched K: PromptReps (causal, decoding up to N = k slots "
                     "with a KV cache; ar_slots: decoded) over the mask readout (bidirectional, one pass, K = k) on "
                     "the same machine and width (Qwen2.5-7B and Dream-7B, LLaMA3-8B and LLaDA-8B); rows with one "
                     "model for both are one checkpoint read both ways (`--both-ways`), the ratio of decoding "
                     "alone:\n\n" + _md_table(ratios))  # fmt: skip
    if srch:
        rep.files["search_latency.csv"] = _dicts_csv(srch)
        title = f"search, {srch[0]['device_name']}"
        rep.files["fig3_search_latency.png"] = search_latency_png(srch, title)
        body += ("\nSearch latency against index size (synthetic unit vectors; open: one vector per text, filled: "
                 "K_q x K_p; solid: exact search, dashed: LanceDB; view `search_latency`):\n\n"
                 "![search latency](fig3_search_latency.png)\n")
    points = cost_points(db)
    if points:
        rep.files["fig1_cost_effect.csv"] = _dicts_csv(points)
        rep.files["fig1_cost_effect.png"] = cost_effect_png(points, "NDCG@10 against per-query latency")
        body += (f"\nEffectiveness against cost (Figure 1): mean test NDCG@10 of multi_dense over the datasets, "
                 f"against a query's encoding (the measured length nearest {QUERY_LENGTH} tokens) plus exact search "
                 "of the largest index measured; single: (1, 1) (single_dense where multi_dense is not scored "
                 "there), multi: the train-selected budget where its latency was measured, else the largest "
                 "measured.\n\n![cost and effect](fig1_cost_effect.png)\n\n"
                 + _md_table(points))
    rep.sections.append(("Latency (Figures 1 and 3)", body))


def cost_points(db: StoreSQL) -> list[dict[str, Any]]:
    """Figure 1's points: per system with latency rows and test metrics, (1, 1) and its multi budget."""
    out = []
    for sys_row in rows(db, "select distinct system from encode_latency_latest order by system"):
        system = sys_row["system"]
        enc = {r["k"]: r["median_ms"] for r in rows(
            db, "select k, median_ms from encode_latency_latest where system = ? and side = 'query' qualify "
                "row_number() over (partition by k order by batch_size, abs(length - ?), length) = 1",
            [system, QUERY_LENGTH])}  # fmt: skip
        # search depends on the vectors' width and the machine, not the readout: the system's own rows, else those
        # timed with another system of that width on that machine (--both-ways times search once)
        srch = {(r["kq"], r["kp"]): r["median_ms"] for r in rows(
            db, "select s.kq, s.kp, s.median_ms from search_latency_latest s join (select distinct hidden, "
                "device_name from encode_latency_latest where system = ?) e using (hidden, device_name) where "
                "s.engine = 'exact' qualify row_number() over (partition by s.kq, s.kp order by s.system = ? desc, "
                "s.docs desc) = 1",
            [system, system])}  # fmt: skip
        # (1, 1): single_dense where multi_dense is not scored there (the default, as the reference evaluator)
        eff = {(r["kq"], r["kp"]): r["ndcg"] for r in rows(
            db, "select kq, kp, avg(ndcg_10) ndcg from cells where system = ? and split = 'test' and (mode = "
                "'multi_dense' or (mode = 'single_dense' and kq = 1 and kp = 1)) group by kq, kp, mode "
                "order by mode = 'multi_dense'", [system])}  # fmt: skip
        usable = [b for b in eff if b[0] in enc and b in srch]
        if not usable:
            continue
        sel = rows(db, "select kq_star, kp_star from budget_selection where system = ?", [system])
        chosen = (sel[0]["kq_star"], sel[0]["kp_star"]) if sel else None
        multi = chosen if chosen in usable else max(usable, key=lambda b: (b[0] * b[1], b))
        for budget in dict.fromkeys([(1, 1), multi]):
            if budget in usable:
                ms = round(enc[budget[0]] + srch[budget], 3)
                out.append({"system": system, "multi": budget != (1, 1), "kq": budget[0], "kp": budget[1], "ms": ms,
                            "ndcg_10": round(eff[budget], 4)})  # fmt: skip
    return out


def build_report(
    db: StoreSQL,
    name: str = "default",
    refs: list[str] | None = None,
    finetuned: dict[str, str] | None = None,
    n_boot: int = 1000,
    hidden: int = 3584,
    backbones: int = 4,
    settings: int = 2,
    test: Test = "t",
    correction: Correction = "holm",
) -> Report:
    """Every section of the report from the views of ``db`` (markdown bodies, PNG and CSV files); ``test`` and
    ``correction``: how the tables test against the references (retrieval/evaluation/compare.py)."""
    rep = Report(name)
    has_bm25 = rows(db, "select count(*) n from cells where mode = 'bm25' and split = 'test'")[0]["n"] > 0
    refs = list(refs) if refs is not None else (["bm25"] if has_bm25 else [])
    section_selection(db, rep)
    section_landscapes(db, rep)
    section_oracle(db, rep, finetuned or {})
    section_correlation(db, rep, n_boot)
    section_tables(db, rep, refs, finetuned or {}, test, correction)
    section_comparisons(db, rep, refs, test, correction)
    section_footprint(db, rep, hidden, backbones, settings)
    section_compression(db, rep, hidden, backbones, settings)
    section_reranking(db, rep)
    section_late(db, rep)
    section_adaptive(db, rep)
    section_latency(db, rep)
    return rep
