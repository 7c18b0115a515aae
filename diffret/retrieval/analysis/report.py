"""The paper's analyses as one report: markdown sections, PNG figures and CSV tables.

Every number is read from a view of ``queries/`` (named in the report next to each table), so
``diffret sql`` over the same store gives the same numbers. The report stage (stages/report.py) writes it
into the store under ``reports/report=<name>/``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diffret.schemas import MEASURES

from ..evaluation.compare import Correction, Test, compare_runs
from ..search.modes import MODE_NAMES
from .correlation import feature_correlations
from .costs import QUERY_LENGTH, cost_points, section_compression, section_footprint, section_latency
from .figures import correlation_png, heatmap_png, oracle_png
from .markdown import Report, csv_bytes, dicts_csv, fmt, md_table, safe_name
from .tables import paper_table
from .views import Views, per_query, rows

__all__ = [
    "QUERY_LENGTH",
    "Report",
    "build_report",
    "cost_points",
    "section_adaptive",
    "section_comparisons",
    "section_compression",
    "section_correlation",
    "section_footprint",
    "section_landscapes",
    "section_late",
    "section_latency",
    "section_oracle",
    "section_reranking",
    "section_selection",
    "section_tables",
]

KIND_MODES = ("bm25", "imported", "fusion", "rerank")  # modes named by their system alone (a single run)
COMPARE_ROWS = 30  # at most this many runs per dataset in the report's comparison (the best by NDCG@10)
CORRELATION_COLUMNS = [
    "system",
    "dataset",
    "split",
    "mode",
    "feature",
    "n",
    "off_mode",
    "spearman",
    "spearman_lo",
    "spearman_hi",
    "kendall",
    "kendall_lo",
    "kendall_hi",
]


# ---------------------------------------------------------------------------------------- sections
def section_selection(db: Views, rep: Report) -> None:
    sel = rows(db, "select * from budget_selection order by system")
    test = rows(
        db,
        "select system, dataset, split, kq, kp, mode, ndcg_10 from selected_cells "
        "where mode in ('multi_dense', 'sparse_max', 'fusion_multi_sparse_max') order by system, dataset, mode",
    )
    rep.files["budget_selection.csv"] = dicts_csv(sel)
    rep.files["selected_cells.csv"] = dicts_csv(test)
    if not sel:
        body = (
            "No system has train-split metrics, so no budget is selected. Score a train split too, e.g. "
            "`diffret run --split train --split test` (SciFact has train 809 / test 300 queries).\n"
        )
    else:
        body = (
            "(K_q*, K_p*) per system: the best mean H (fusion_multi_sparse_max) NDCG@10 over its train split(s), "
            "applied unchanged to every test split (views `budget_selection`, `selected_cells`).\n\n"
            + md_table(sel)
            + "\nAt the selected budget on the other splits:\n\n"
            + md_table(test)
        )
    rep.sections.append(("Budget selection", body))


def section_landscapes(db: Views, rep: Report) -> None:
    cells = rows(
        db,
        "select system, dataset, kq, kp, mode, ndcg_10 from cells where split = 'test' "
        "and mode not in ('bm25', 'rerank')",
    )
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
        name = f"landscape_{safe_name(system)}_{safe_name(dataset)}_{mode}.png"
        rep.files[name] = heatmap_png(kqs, kps, arr, f"{dataset} test: {mode} NDCG@10\n{system}", marks)
        lines.append(f"- {system} / {dataset} / {mode}: best ({best[0]}, {best[1]}) = {fmt(grid[best])} — ![]({name})")
    if not by:
        lines.append("_(no grid metrics on a test split)_")
    rep.sections.append(("Landscapes", "\n".join(lines) + "\n"))


def section_oracle(db: Views, rep: Report, finetuned: dict[str, str]) -> None:
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
    rep.files["oracle.csv"] = dicts_csv(data, [*getattr(data, "columns", []), "finetuned"])
    body = (
        "Mean NDCG@10 per query at the selected budget (fixed) and with a per-query oracle over K_q "
        "(K_p = K_p*), over K_p (K_q = K_q*) and over both (joint) (view `oracle`); `finetuned`: the "
        "fine-tuned model at the same budget when given with --finetuned BASE=FT.\n\n"
        + md_table(
            data,
            ["system", "dataset", "split", "mode", "fixed", "kq_oracle", "kp_oracle", "joint", "finetuned", "queries"],
        )
    )
    if data:
        rep.files["oracle.png"] = oracle_png(data)
        body += "\n![oracle](oracle.png)\n"
    rep.sections.append(("Per-query oracle", body))


def section_correlation(db: Views, rep: Report, n_boot: int) -> None:
    corr = feature_correlations(db, n_boot)
    rep.files["feature_correlation.csv"] = dicts_csv(corr, CORRELATION_COLUMNS)
    peaks = rows(db, "select * from query_peaks order by system, dataset, split, mode, query_id")
    rep.files["query_peaks.csv"] = dicts_csv(peaks)
    for r in corr:
        r["rho [95% CI]"] = f"{fmt(r['spearman'], 3)} [{fmt(r['spearman_lo'], 3)}, {fmt(r['spearman_hi'], 3)}]"
        r["tau [95% CI]"] = f"{fmt(r['kendall'], 3)} [{fmt(r['kendall_lo'], 3)}, {fmt(r['kendall_hi'], 3)}]"
    body = (
        "Per query, the peak K_q (argmax of NDCG@10 over K_q at K_p = K_p*; ties: the smallest) against the "
        "query's length in model-tokenizer subwords and the Shannon entropy (bits) of its token distribution "
        f"(view `query_peaks`); Spearman rho and Kendall tau-b with 95% percentile-bootstrap CIs ({n_boot} "
        "resamples of queries). D = multi_dense, S = sparse_max. off_mode: queries whose peak is not the most "
        "common one; with few of them the interval only reflects resamples that contain them. nan: a constant "
        "variable (e.g. every query peaks at the same K_q).\n\n"
        + md_table(
            corr, ["system", "dataset", "split", "mode", "feature", "n", "off_mode", "rho [95% CI]", "tau [95% CI]"]
        )
    )
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for p in peaks:
        groups.setdefault((p["system"], p["dataset"], p["split"]), []).append(p)
    for (system, dataset, split), ps in sorted(groups.items()):
        name = f"correlation_{safe_name(system)}_{safe_name(dataset)}_{split}.png"
        rep.files[name] = correlation_png(ps, f"{dataset} {split}: peak K_q vs query features\n{system}")
        body += f"\n![{system} {dataset}]({name})\n"
    rep.sections.append(("Feature correlation", body))


def section_tables(
    db: Views,
    rep: Report,
    refs: list[str],
    finetuned: dict[str, str],
    test: Test = "t",
    correction: Correction = "holm",
) -> None:
    resolved = [_resolve_system(db, r) for r in refs]
    t = paper_table(db, resolved, finetuned=finetuned, test=test, correction=correction)
    rep.files["paper_table.csv"] = csv_bytes(t.csv_rows())
    rep.sections.append(("Paper tables (D / S / H)", t.markdown()))


def section_comparisons(
    db: Views, rep: Report, refs: list[str], test: Test = "t", correction: Correction = "holm"
) -> None:
    """Per test dataset: each system's best cell per mode (view ``best_cells``: an imported run, a fusion, a
    reranker's run too) against the first reference's, on NDCG@10 and MRR@10, the p-values corrected across the
    table (``diffret compare`` for any other choice of runs); CSV and LaTeX beside it."""
    if not refs:
        return
    ref = _resolve_system(db, refs[0])
    measures = [m.pytrec for m in MEASURES[:2]]
    body = []
    for (dataset,) in db.execute("select distinct dataset from best_cells where split = 'test' order by 1").fetchall():
        cells = rows(
            db,
            "select system, mode, kq, kp from best_cells where split = 'test' and dataset = ? "
            "order by system = ? desc, ndcg_10 desc, system, mode, kq, kp",
            [dataset, ref],
        )
        if not cells or cells[0]["system"] != ref:
            continue
        scores: dict[str, dict[str, dict[str, float]]] = {}
        for c in cells[: 1 + COMPARE_ROWS]:
            label = (
                c["system"]
                + (f":{c['mode']}" if c["mode"] not in KIND_MODES else "")
                + (f":{c['kq']}:{c['kp']}" if (c["kq"], c["kp"]) != (0, 0) else "")
            )
            scores[label] = {
                m: per_query(db, c["system"], dataset, "test", c["mode"], c["kq"], c["kp"], m) for m in measures
            }
        base = next(iter(scores))
        try:
            comp = compare_runs(scores, base, measures, test, correction, where=f"{dataset}/test")
        except ValueError as exc:  # a run evaluated on other queries or measures: said, not hidden
            body.append(f"### {dataset}\n\nnot compared: {exc}\n")
            continue
        rep.files[f"comparison_{safe_name(dataset)}.csv"] = comp.csv().encode()
        rep.files[f"comparison_{safe_name(dataset)}.tex"] = comp.latex(f"tab:{safe_name(dataset)}").encode()
        body.append(f"### {dataset}\n\n{comp.markdown()}")
    if body:
        rep.sections.append((f"Runs against {ref}", "\n".join(body)))


def _resolve_system(db: Views, name: str) -> str:
    """A system slug, or `bm25` for the store's one BM25 system."""
    systems = [r["system"] for r in rows(db, "select distinct system from cells order by 1")]
    if name in systems:
        return name
    hits = [s for s in systems if s.startswith(name)]
    if len(hits) == 1:
        return hits[0]
    raise ValueError(f"unknown reference system {name!r}; systems with metrics: {systems}")


def section_reranking(db: Views, rep: Report) -> None:
    """DiffuRank rerankers against the first-stage runs they reordered (view ``rerank_gains``)."""
    gains = rows(
        db,
        "select system, method, dataset, split, depth, first_stage, first_mode, ndcg_10, first_ndcg_10, "
        "ndcg_10_gain, queries from rerank_gains order by dataset, split, ndcg_10 desc",
    )
    if not gains:
        return
    rep.files["rerank_gains.csv"] = dicts_csv(gains)
    body = (
        "NDCG@10 of each reranker (`diffret rerank`) and of the run it reordered, on the same queries "
        "(view `rerank_gains`).\n\n" + md_table(gains)
    )
    rep.sections.append(("Reranking", body))


def section_late(db: Views, rep: Report) -> None:
    """Late-parametric re-scoring (SIDR's full / beta / beta(m) against BM25; view ``late_gains``) and what each
    pipeline costs: bag-of-tokens builds (view ``bot_indexes``) and passages encoded (view ``late_runs``)."""
    gains = rows(
        db,
        "select system, dataset, split, rescore, m, first_system, first_mode, first_ndcg_10, ndcg_10, "
        "full_ndcg_10, bm25_ndcg_10, passages_needed, corpus from late_gains "
        "order by dataset, split, system, rescore, m",
    )
    if not gains:
        return
    rep.files["late_gains.csv"] = dicts_csv(gains)
    bots = rows(
        db,
        "select index, name, dataset, bytes, round(build_seconds, 3) build_seconds from index_costs "
        "order by dataset, index, name",
    )
    body = (
        "NDCG@10 of each first stage's top m re-scored (`diffret late`), beside the first stage (`beta`: SIDR_beta"
        " over the bag of tokens), the full-corpus run of the same mode (SIDR_full for a sidr system) and BM25; "
        "passages_needed: the passages encoded for it, of corpus (view `late_gains`).\n\n" + md_table(gains)
    )
    if bots:
        rep.files["index_costs.csv"] = dicts_csv(bots)
        body += (
            "\nIndexes: the bag of tokens (`diffret bot`: no model), BM25's and SIDR systems' passage encodings "
            "(view `index_costs`).\n\n" + md_table(bots)
        )
    costs = rows(
        db,
        "select system, dataset, split, rescore, m, first_mode, round(first_ms_per_query, 3) first_ms, "
        "round(rescore_ms_per_query, 3) rescore_ms, round(encode_ms_per_passage, 3) encode_ms, "
        "round(on_the_fly_ms_per_query, 2) on_the_fly_ms, round(full_ms_per_query, 3) full_ms, "
        "round(full_index_encode_seconds, 1) full_index_encode_s, passages_needed, corpus "
        "from late_costs "
        "order by dataset, split, system, rescore, m",
    )
    if costs:
        rep.files["late_costs.csv"] = dicts_csv(costs)
        body += (
            "\nCost per query, measured on this store's runs (ms per query of a batched pass, query encoding "
            "excluded; view `late_costs`): the first stage's search, the re-scoring of its top m, encode_ms: "
            "one passage's encoding; on_the_fly: SIDR's way, the m passages encoded for each query; full: the "
            "full-corpus search, after encoding the corpus once (full_index_encode_s).\n\n" + md_table(costs)
        )
    rep.sections.append(("Late-parametric re-scoring (SIDR)", body))


def section_adaptive(db: Views, rep: Report) -> None:
    """Adaptive budgets (``diffret budget``; view ``adaptive_runs``): per system, dataset, split, base mode, axis
    and feature set, each selector's NDCG@10 against the fixed train-selected budget and the per-query oracle over
    the same cells, the share of the gap it closes, a paired t-test against fixed, the cells chosen and the
    features that mattered."""
    import json

    from .budgets import Grid, gap_closed

    runs = rows(
        db, "select * from adaptive_runs order by system, dataset, split, base_mode, over_axis, features, selector"
    )
    if not runs:
        return
    table, missing = [], []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(
            (
                r["system"],
                r["dataset"],
                r["split"],
                r["base_mode"],
                r["over_axis"],
                r["features"],
                r["measure"],
                r["cross_fit"],
            ),
            [],
        ).append(r)

    def per_query(system: str, dataset: str, split: str, mode: str, measure: str) -> dict[str, float]:
        return {
            r["query_id"]: r["value"]
            for r in rows(
                db,
                "select query_id, value from metrics where system = ? and dataset = ? and split = ? and mode = ? "
                "and measure = ?",
                [system, dataset, split, mode, measure],
            )
        }

    for (system, dataset, split, base, over, features, measure, cross_fit), sels in groups.items():
        cells = rows(
            db,
            "select query_id, kq, kp, value from metrics where system = ? and dataset = ? and "
            "split = ? and mode = ? and measure = ? and kq > 0",
            [system, dataset, split, base, measure],
        )
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
            table.append(
                {
                    "system": system,
                    "dataset": dataset,
                    "split": split,
                    "mode": base,
                    "over": over,
                    "features": features + (" (cross-fitted)" if cross_fit else ""),
                    "selector": s["selector"],
                    "fixed": fixed_name,
                    "fixed_ndcg_10": round(summary["fixed"], 4),
                    "ndcg_10": round(summary["selected"], 4),
                    "oracle": round(summary["oracle"], 4),
                    "gap_closed": round(summary["gap_closed"], 3),
                    "p_value": round(summary["p_value"], 4),
                    "chosen": " ".join(f"{c}:{n}" for c, n in hist.items() if n),
                    "top_features": ", ".join(f"{k} {v:.2f}" for k, v in top if v > 0),
                    "index_copies": s["passage_indexes"],
                    "query_passes": s["query_passes"],
                }
            )
    body = (
        "Adaptive budgets (`diffret budget`; view `adaptive_runs`): a (K_q, K_p) per query chosen from features "
        "known before search, learned on the train split and applied here (cross-fitted: learned on the other "
        "folds of this split). fixed: the train-selected cell of the cells the choice may take (over kq: K_p "
        "fixed; kp: K_q fixed; joint); oracle: each query's best of them; gap_closed: (selector - fixed) / "
        "(oracle - fixed); p_value: paired t-test of the selector against fixed; chosen: queries per cell; "
        "top_features: importances; index_copies / query_passes: what the choice costs at query time.\n\n"
    )
    body += md_table(table) if table else ""
    if missing:
        body += (
            f"\n{len(missing)} adaptive run(s) without metrics (e.g. {missing[0]}): run `diffret evaluate` "
            "(and `diffret budget --selector fixed` for a cross-fitted baseline).\n"
        )
    rep.files["adaptive_budgets.csv"] = dicts_csv(table)
    rep.sections.append(("Adaptive budgets", body))


def build_report(
    db: Views,
    *,
    name: str = "default",
    refs: list[str] | None = None,
    finetuned: dict[str, str] | None = None,
    n_boot: int = 1000,
    hidden: int = 3584,
    backbones: int = 4,
    settings: int = 2,
    test: Test = "t",
    correction: Correction = "holm",
    random_weights: dict[str, str] | None = None,
) -> Report:
    """Every section of the report from the views of ``db`` (markdown bodies, PNG and CSV files); ``test`` and
    ``correction``: how the tables test against the references (retrieval/evaluation/compare.py);
    ``random_weights``: system -> the registry's note, for systems built with random weights (said under the title,
    so that none of their numbers is read as a result)."""
    rep = Report(name, warnings=[f"{s} has {note}" for s, note in sorted((random_weights or {}).items())])
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
