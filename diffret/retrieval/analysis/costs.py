"""The report's cost sections: the store's footprint and its MS MARCO projection, compressed systems against
their float16 systems, and latency (the paper's Figures 1 and 3), from the views of ``queries/``
(:func:`retrieval.analysis.report.build_report` puts them in the report)."""

from __future__ import annotations

from typing import Any

from .figures import compression_png, cost_effect_png, encode_latency_png, search_latency_png
from .footprint import footprint_projection, human_bytes
from .markdown import Report, dicts_csv, md_table
from .views import Views, rows


def section_footprint(db: Views, rep: Report, hidden: int, backbones: int, settings: int) -> None:
    # the artifacts, not the reports (a report's own earlier copy would make rebuilding it change it)
    fp = rows(
        db,
        "select stage, count(distinct folder) folders, count(*) files, sum(bytes)::BIGINT bytes "
        "from artifact_files where stage <> 'reports' group by stage order by bytes desc, stage",
    )
    detail = rows(
        db, "select * from footprint where stage <> 'reports' order by bytes desc, stage, system, dataset, side, k"
    )  # ties in a fixed order
    for r in detail:
        r["bytes"] = int(r["bytes"] or 0)
        r["rows"] = None if r["rows"] is None else int(r["rows"])
    rep.files["footprint.csv"] = dicts_csv(detail)
    proj = footprint_projection(hidden=hidden, backbones=backbones, settings=settings)
    fp32 = footprint_projection(hidden=hidden, backbones=backbones, settings=settings, bytes_per_value=4)
    a = proj["assumptions"]
    for r in fp:
        r["size"] = human_bytes(r["bytes"])
    body = (
        "This store, per stage (view `footprint`, from the manifests):\n\n"
        + md_table(fp, ["stage", "folders", "files", "bytes", "size"])
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
    rep.files["footprint_projection.csv"] = dicts_csv(
        [
            {
                "bytes_per_value": p["assumptions"]["bytes_per_value"],
                "total_bytes": p["total_bytes"],
                "total_tb": p["total_tb"],
                **{k: v for k, v in p["assumptions"].items() if k != "bytes_per_value"},
            }
            for p in (proj, fp32)
        ]
    )
    rep.sections.append(("Footprint", body))


def section_compression(db: Views, rep: Report, hidden: int, backbones: int, settings: int) -> None:
    """Compressed systems against their float16 systems (views ``vector_bytes``, ``compression_effect``): bytes
    per vector and per passage measured on disk, the MS MARCO projection per storage choice, and the NDCG@10 /
    MRR@10 change per mode over the grid (a table and a figure)."""
    from diffret.retrieval.search.codecs import code_bytes

    systems = rows(db, "select system, store, float16_system from compressed_systems order by float16_system, system")
    if not systems:
        return
    sizes = rows(
        db,
        "select s.system, s.store, s.float16_system, v.dataset, "
        "sum(v.vector_bytes) / sum(v.vectors) bytes_per_vector, "
        "sum(f.vector_bytes) / sum(f.vectors) float16_bytes_per_vector, "
        "sum(v.all_bytes) / max(v.passages) bytes_per_passage, "
        "sum(f.all_bytes) / max(f.passages) float16_bytes_per_passage, list(v.kp order by v.kp) kp, "
        "sum(v.codebook_bytes) codebook_bytes "
        "from compressed_systems s join vector_bytes v on v.system = s.system "
        "join vector_bytes f on f.system = s.float16_system and f.dataset = v.dataset and f.kp = v.kp "
        "group by all order by s.float16_system, v.dataset, bytes_per_vector",
    )
    width = {
        r["float16_system"]: rows(
            db,
            "select len(dense[1]) h from encodings where system = ? and side = 'passage' and dense is not null limit 1",
            [r["float16_system"]],
        )
        for r in sizes
    }
    base = footprint_projection(hidden=hidden, backbones=backbones, settings=settings)
    for r in sizes:
        r["smaller"] = r["float16_bytes_per_vector"] / r["bytes_per_vector"]
        h = width[r["float16_system"]][0]["h"] if width[r["float16_system"]] else None
        # the measured bytes per vector scaled to the projection's width by the code's own width
        scaled = r["bytes_per_vector"] * code_bytes(r["store"], hidden) / code_bytes(r["store"], h) if h else None
        proj = (
            footprint_projection(hidden=hidden, backbones=backbones, settings=settings, passage_bytes_per_vector=scaled)
            if scaled
            else None
        )
        r["msmarco_projection"] = human_bytes(proj["total_bytes"]) if proj else "–"
        r["msmarco_bytes"] = proj["total_bytes"] if proj else None
    rep.files["compression.csv"] = dicts_csv(sizes)
    effect = rows(db, "select * from compression_effect order by float16_system, store, dataset, split, mode, kq, kp")
    rep.files["compression_effect.csv"] = dicts_csv(effect)
    means = rows(
        db,
        "select e.store, e.system, e.dataset, e.split, e.mode, count(*) cells, "
        "avg(ndcg_10_change) ndcg_10_change, min(ndcg_10_change) worst_ndcg_10_change, "
        "avg(mrr_10_change) mrr_10_change, avg(float16_ndcg_10) float16_ndcg_10 "
        "from compression_effect e group by all order by e.dataset, e.split, e.mode, e.store",
    )
    body = (
        "Compressed systems (`diffret compress`, `diffret encode --store`; codecs.py) against the float16 "
        "system they were made from. Bytes are measured on disk from the Parquet metadata (view `vector_bytes`): "
        "per vector the vectors' column, per passage every column over the K_p compressed (the sparse side "
        "included); codebook_bytes: its codebooks over those K_p, paid once whatever the corpus size (one with as "
        "many centroids as vectors stores the vectors themselves). The MS MARCO projection scales each choice's "
        "measured bytes per vector to H = "
        f"{hidden} by its code width, keeps the queries in float16 and the rest as the Footprint section's "
        f"(float16: {human_bytes(base['total_bytes'])}).\n\n"
        + md_table(
            sizes,
            [
                "store",
                "dataset",
                "kp",
                "bytes_per_vector",
                "float16_bytes_per_vector",
                "smaller",
                "bytes_per_passage",
                "float16_bytes_per_passage",
                "codebook_bytes",
                "msmarco_projection",
            ],
        )
        + "\nThe change in mean NDCG@10 and MRR@10 against float16, over the cells scored with both (view "
        "`compression_effect`; per cell in `compression_effect.csv`):\n\n"
        + md_table(
            means,
            [
                "store",
                "dataset",
                "split",
                "mode",
                "cells",
                "float16_ndcg_10",
                "ndcg_10_change",
                "worst_ndcg_10_change",
                "mrr_10_change",
            ],
        )
    )
    test = [m for m in means if m["split"] == "test" and m["mode"] != "sparse_max"] or means  # sparse: unchanged
    passage = {(r["system"], r["dataset"]): r["bytes_per_passage"] for r in sizes}
    points = [
        {
            "store": m["store"],
            "mode": m["mode"],
            "ndcg_10_change": m["ndcg_10_change"],
            "bytes_per_passage": passage[m["system"], m["dataset"]],
        }
        for m in test
        if (m["system"], m["dataset"]) in passage
    ]
    for r in sizes:  # float16 itself, at no change
        for mode in sorted({m["mode"] for m in test}):
            points.append(
                {
                    "store": "float16",
                    "mode": mode,
                    "ndcg_10_change": 0.0,
                    "bytes_per_passage": r["float16_bytes_per_passage"],
                }
            )
    if points:
        rep.files["compression.png"] = compression_png(points, "storage choices: size against NDCG@10 change")
        body += "\n![compression](compression.png)\n"
    rep.sections.append(("Compression", body))


QUERY_LENGTH = 32  # the synthetic length Figure 1 reads a query's encoding latency at (the nearest measured)


def section_latency(db: Views, rep: Report) -> None:
    """The paper's cost figures from the stored latency rows (views ``encode_latency_latest``,
    ``search_latency_latest``): Figure 3's two rows, the autoregressive / one-pass ratio of one checkpoint read both
    ways, and Figure 1."""
    enc = rows(
        db,
        "with e as (select * from encode_latency_latest qualify dense_rank() over (order by side = 'query' "
        "desc, side, batch_size) = 1) select * from e order by system, k, length",
    )
    srch = rows(db, "select * from search_latency_latest order by system, kq, kp, docs")
    if not enc and not srch:
        return
    body = ""
    if enc:
        rep.files["encode_latency.csv"] = dicts_csv(enc)
        title = f"{enc[0]['side']} side, batch size {enc[0]['batch_size']}, {enc[0]['device_name']}"
        rep.files["fig3_encode_latency.png"] = encode_latency_png(enc, title)
        body += (
            "Encoding latency against input length (`diffret latency`; synthetic inputs; open: K = 1, filled: "
            "K > 1; view `encode_latency`):\n\n![encoding latency](fig3_encode_latency.png)\n"
        )
        ratios = rows(
            db,
            "select string_split(a.model, '/')[-1] ar_model, string_split(b.model, '/')[-1] "
            "one_pass_model, a.side, a.batch_size, a.length, a.k, round(a.median_ms, 3) ar_ms, "
            "a.slots ar_slots, round(b.median_ms, 3) one_pass_ms, "
            "round(a.median_ms / b.median_ms, 2) ar_over_one_pass, a.device_name "
            "from encode_latency_latest a join encode_latency_latest b "
            "using (side, length, k, batch_size, device_name, hidden) "
            "where a.readout = 'promptreps' and b.readout = 'diffretriever' "
            "order by a.model != b.model, ar_model, one_pass_model, a.side, a.batch_size, a.k, "
            "a.length",
        )
        if ratios:
            rep.files["ar_over_one_pass.csv"] = dicts_csv(ratios)
            body += (
                "\nAutoregressive against one pass at matched K: PromptReps (causal, decoding up to N = k slots "
                "with a KV cache; ar_slots: decoded) over the mask readout (bidirectional, one pass, K = k) on "
                "the same machine and width (Qwen2.5-7B and Dream-7B, LLaMA3-8B and LLaDA-8B); rows with one "
                "model for both are one checkpoint read both ways (`--both-ways`), the ratio of decoding "
                "alone:\n\n" + md_table(ratios)
            )
    if srch:
        rep.files["search_latency.csv"] = dicts_csv(srch)
        title = f"search, {srch[0]['device_name']}"
        rep.files["fig3_search_latency.png"] = search_latency_png(srch, title)
        body += (
            "\nSearch latency against index size (synthetic unit vectors; open: one vector per text, filled: "
            "K_q x K_p; solid: exact search, dashed: LanceDB; view `search_latency`):\n\n"
            "![search latency](fig3_search_latency.png)\n"
        )
    points = cost_points(db)
    if points:
        rep.files["fig1_cost_effect.csv"] = dicts_csv(points)
        rep.files["fig1_cost_effect.png"] = cost_effect_png(points, "NDCG@10 against per-query latency")
        body += (
            f"\nEffectiveness against cost (Figure 1): mean test NDCG@10 of multi_dense over the datasets, "
            f"against a query's encoding (the measured length nearest {QUERY_LENGTH} tokens) plus exact search "
            "of the largest index measured; single: (1, 1) (single_dense where multi_dense is not scored "
            "there), multi: the train-selected budget where its latency was measured, else the largest "
            "measured.\n\n![cost and effect](fig1_cost_effect.png)\n\n" + md_table(points)
        )
    rep.sections.append(("Latency (Figures 1 and 3)", body))


def cost_points(db: Views) -> list[dict[str, Any]]:
    """Figure 1's points: per system with latency rows and test metrics, (1, 1) and its multi budget."""
    out = []
    for sys_row in rows(db, "select distinct system from encode_latency_latest order by system"):
        system = sys_row["system"]
        enc = {
            r["k"]: r["median_ms"]
            for r in rows(
                db,
                "select k, median_ms from encode_latency_latest where system = ? and side = 'query' qualify "
                "row_number() over (partition by k order by batch_size, abs(length - ?), length) = 1",
                [system, QUERY_LENGTH],
            )
        }
        # search depends on the vectors' width and the machine, not the readout: the system's own rows, else those
        # timed with another system of that width on that machine (--both-ways times search once)
        srch = {
            (r["kq"], r["kp"]): r["median_ms"]
            for r in rows(
                db,
                "select s.kq, s.kp, s.median_ms from search_latency_latest s join (select distinct hidden, "
                "device_name from encode_latency_latest where system = ?) e using (hidden, device_name) where "
                "s.engine = 'exact' qualify row_number() over (partition by s.kq, s.kp order by s.system = ? desc, "
                "s.docs desc) = 1",
                [system, system],
            )
        }
        # (1, 1): single_dense where multi_dense is not scored there (the default, as the reference evaluator)
        eff = {
            (r["kq"], r["kp"]): r["ndcg"]
            for r in rows(
                db,
                "select kq, kp, avg(ndcg_10) ndcg from cells where system = ? and split = 'test' and (mode = "
                "'multi_dense' or (mode = 'single_dense' and kq = 1 and kp = 1)) group by kq, kp, mode "
                "order by mode = 'multi_dense'",
                [system],
            )
        }
        usable = [b for b in eff if b[0] in enc and b in srch]
        if not usable:
            continue
        sel = rows(db, "select kq_star, kp_star from budget_selection where system = ?", [system])
        chosen = (sel[0]["kq_star"], sel[0]["kp_star"]) if sel else None
        multi = chosen if chosen in usable else max(usable, key=lambda b: (b[0] * b[1], b))
        for budget in dict.fromkeys([(1, 1), multi]):
            if budget in usable:
                ms = round(enc[budget[0]] + srch[budget], 3)
                out.append(
                    {
                        "system": system,
                        "multi": budget != (1, 1),
                        "kq": budget[0],
                        "kp": budget[1],
                        "ms": ms,
                        "ndcg_10": round(eff[budget], 4),
                    }
                )
    return out
