"""The index stage: a passage encoding -> its index, checked against exact search on every build. One unit per K_p
(on the workers with ``workers`` / ``dask_address``); by default the K_p of the system's operating point only.

What the index holds (``vectors``), one copy of each vector at most at the store's precision by default:

- a float16 system: a LanceDB multivector table in float16 (+ optional ANN index), re-ranked on its own vectors;
  ``--vectors float32`` is the earlier float32 table (twice the bytes of the encodings it copies);
- a ``residual:B`` system: its codes index, the passages of each of its codebook's centroids' cells
  (``ivf.parquet``: at most 4 bytes a vector, no vector); search over the codes (``diffret score --search codes``,
  ``retrieval/search/codes.py``) reads the candidates' vectors from the stored codes. int8 and pq codes have no
  centroids to search: ``--vectors float16`` / ``float32`` index their decoded vectors in a LanceDB table.

Memory is bounded by a shard, whatever the corpus, for a LanceDB table: the encodings are streamed into LanceDB shard
by shard, LanceDB trains its one index build on a sample of them, and the recall check streams them again through
exact search (``--block-mb`` as score's). A codes index holds the (cell, passage) pairs (8 bytes a vector) while it is
built, and its check the pass's codes.

Store layout: ``index/system=<slug>/dataset=<corpus>/kp=<K_p>/`` is a LanceDB database folder (table ``docs``) or a
codes index (``ivf.parquet``), with a ``_manifest.json`` listing every file with its sha256, and in ``stats`` the
recall@10 / @100 of the index against exact MaxSim and its latency, per K_q of the check.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import Field

from diffret.retrieval.fields import cli, like
from diffret.retrieval.search import lance
from diffret.retrieval.search.codecs import FLOAT16, parse_store
from diffret.retrieval.search.codes import CodesIndex, CodesSearchStats, centroid_ids, search_codes
from diffret.retrieval.search.encodings import Encodings
from diffret.retrieval.search.exact import SearchSettings, search_pass
from diffret.retrieval.search.rules import ScoreRules
from diffret.storage import ArtifactStore, FileEntry, IncompleteArtifactError, Manifest, StoreError
from diffret.storage.layout import CODES_INDEX_FILE, encodings_dir, index_dir, summary_dir

from .base import ClusterConfig, Context, Folder, KList, Plan, Stage, StageResult
from .presentation import Presentation
from .readers import (
    budgets,
    codec_for,
    coded_passages,
    corpus_size,
    encoding_manifest,
    iter_codes,
    iter_encodings,
    query_encodings,
    split_queries,
)
from .runs import QueriesConfig
from .score import ScoreConfig
from .systems import SystemRecord, SystemRef, encoder_record, find_system, float16_settings, settings_of

# LanceDB's MaxSim scale (the mean over query vectors, unclamped): recall is measured against exact search under it
LANCE_RULES = ScoreRules(maxsim_clamp=False, maxsim_reduce="mean")


class IndexConfig(QueriesConfig, ClusterConfig):
    """Parameters of the index flow (the dataset's queries check the index against exact search)."""

    system: SystemRef = Field(default_factory=SystemRef, description="The encoder system whose passages to index.")
    split: str = Field(default="test", description="Query split of the recall check.")
    kq: KList | None = Field(
        default=None,
        description="Query budgets of the recall check (default: every K_q whose query encodings are stored).",
    )
    kp: KList | None = Field(
        default=None,
        description="Passage budgets to index, one index each (default: the K_p of "
        "the system's operating point: the budget selected on a train split, view "
        "budget_selection, else the best hybrid (or multi_dense) cell of a stored summary; "
        "without either, every K_p whose passage encodings are stored).",
    )
    vectors: Literal["store", "float16", "float32"] = Field(
        default="store",
        description="What the index holds. store: no more than the store's precision (a float16 "
        "system: a LanceDB table in float16; a residual:B system: its codes index, the passages of each centroid's "
        "cell, searched over the stored codes); float16 / float32: a LanceDB table of the (decoded) vectors at that "
        "precision (float32: the earlier table, twice a float16 system's bytes).",
    )
    probes: int = like(
        ScoreConfig, "probes", description="A codes index's check: the nearest centroids each query vector probes."
    )
    candidates: int = like(
        ScoreConfig, "candidates", description="A codes index's check: candidates a query re-scored by exact MaxSim."
    )
    index_type: Literal["none", "IVF_PQ", "IVF_HNSW_SQ"] = Field(
        default="IVF_PQ",
        description="The LanceDB index: IVF_PQ, IVF_HNSW_SQ, or none (a flat table).",
        json_schema_extra=cli(flag="--type"),
    )
    overfetch: int | None = Field(
        default=None,
        ge=1,
        le=lance.MAX_CANDIDATES // 100,  # the recall check searches k = 100
        description="Candidates per result = k x overfetch (default lance.DEFAULT_OVERFETCH).",
    )


def _passage_batches(store: ArtifactStore, folder: str, m: Manifest) -> Iterator[tuple[list[str], list[np.ndarray]]]:
    """(ids, per-passage [n_j, H] float32 arrays) shard by shard, in corpus order."""
    for enc in iter_encodings(store, folder, m, "cpu"):
        arrays = [enc.multi[i][enc.mask[i]].numpy() for i in range(len(enc))]
        yield enc.ids, arrays


def _file_entries(folder: str) -> dict[str, FileEntry]:
    out = {}
    for base, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(base, f)
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
            out[os.path.relpath(path, folder)] = FileEntry(sha256=h.hexdigest(), bytes=os.path.getsize(path))
    return out


def check_against_exact(
    db_path: str, queries_by_kq: dict[int, Encodings], passages: Any, k: int = 100, overfetch: int | None = None
) -> dict[str, Any]:
    """recall@10 / @100 and latency of the index against exact MaxSim, per K_q."""
    exact, doc_ids = search_pass(queries_by_kq, passages, ["multi_dense"], SearchSettings(topk=k, rules=LANCE_RULES))
    out: dict[str, Any] = {}
    for kq, q in queries_by_kq.items():
        ex = [[doc_ids[i] for i in row if i >= 0] for row in exact[(kq, "multi_dense")].index]
        qv = [q.multi[i][q.mask[i]].cpu().numpy() for i in range(len(q))]
        res = lance.search(db_path, qv, k, overfetch=overfetch) if overfetch else lance.search(db_path, qv, k)
        approx = [[d for d, _ in hits] for hits in res]
        out[str(kq)] = {
            "recall_10": lance.recall_at(ex, approx, 10),
            "recall_100": lance.recall_at(ex, approx, min(100, k)),
            "latency_ms_mean": res.stats.mean_ms,
            "latency_ms_p95": res.stats.p95_ms,
            "queries": len(q),
            "search": {
                "limit": res.stats.limit,
                "nprobes": res.stats.nprobes,
                "refine_factor": res.stats.refine_factor,
                "ef": res.stats.ef,
            },
        }
    return out


def index_engine(record: SystemRecord, vectors: str) -> tuple[str, str]:
    """(engine, dtype) of an index over ``record``'s passages: ``("lance", "float16" | "float32")`` or
    ``("codes", spec)``; a choice that would hold more than the store's precision by default is refused, naming
    the options.

    >>> rec = SystemRecord(system="s", kind="encoder", settings={"store": "residual:2"})
    >>> index_engine(rec, "store"), index_engine(rec, "float32")
    (('codes', 'residual:2'), ('lance', 'float32'))
    """
    spec = record.flat_settings().get("store", FLOAT16)
    if vectors != "store":
        return "lance", vectors
    if spec == FLOAT16:
        return "lance", FLOAT16
    if parse_store(spec).kind == "residual":
        return "codes", spec
    raise StoreError(
        f"{record.system} stores its passages as {spec}, whose codes have no centroids to search: "
        "`--vectors float16` (or float32) indexes its decoded vectors in a LanceDB table (more bytes "
        "than its codes), or compress the float16 system to residual:B"
    )


def operating_kp(store: ArtifactStore, record: SystemRecord, datasets: list[str]) -> tuple[int, str] | None:
    """The K_p of the system's operating point and where it comes from: the budget the system (or, for a compressed
    system, the float16 system it was made from) selected on its train split(s) (view ``budget_selection``: the
    best mean hybrid NDCG@10), else the best hybrid cell (multi_dense where it has none) of a stored summary of one of
    ``datasets``; None when the store holds neither."""
    from diffret.retrieval.analysis.views import rows
    from diffret.storage.sql import StoreSQL

    systems = [record.system]
    if record.kind == "encoder" and record.flat_settings().get("store", FLOAT16) != FLOAT16:
        systems.append(encoder_record(float16_settings(settings_of(record))).system)
    with StoreSQL(store) as db:
        for system in systems:
            found = rows(
                db, "select kq_star, kp_star, train_ndcg_10, train_on from budget_selection where system = ?", [system]
            )
            if found:
                r = found[0]
                return int(r["kp_star"]), (
                    f"the operating point ({r['kq_star']}, {r['kp_star']}) {system} selected "
                    f"on {r['train_on']} train (hybrid NDCG@10 {r['train_ndcg_10']:.4f}, view "
                    "budget_selection)"
                )
    for system in systems:
        for dataset in dict.fromkeys(datasets):
            for split in store.list_partitions(f"summaries/system={system}/dataset={dataset}", "split"):
                m = store.read_manifest(summary_dir(system, dataset, split))
                board = (m.stats.get("leaderboard") or []) if m is not None else []
                for mode in ("fusion_multi_sparse_max", "multi_dense"):
                    best = [r for r in board if r.get("mode") == mode and r.get("kp")]
                    if best:
                        r = max(best, key=lambda r: r.get("ndcg_10") or 0.0)
                        return int(r["kp"]), (
                            f"the best {mode} cell ({r['kq']}, {r['kp']}) of {system}'s summary of "
                            f"{dataset}/{split} (NDCG@10 {r.get('ndcg_10') or 0:.4f})"
                        )
    return None


def index_budgets(
    store: ArtifactStore,
    given: list[int] | None,
    record: SystemRecord,
    corpus: str,
    datasets: list[str],
    log: Callable[[str], None],
) -> list[int]:
    """``given``; else the operating point's K_p (:func:`operating_kp`, said in one log line), which must be stored;
    else every stored K_p (saying so)."""
    if given is not None:
        return given
    found = operating_kp(store, record, datasets)
    if found is None:
        kps = budgets(store, None, record.system, corpus, "passage", lambda _: None)
        log(
            f"index: no operating point selected for {record.system} (no train-split budget selection, no summary): "
            f"every stored K_p = {', '.join(map(str, kps))}, as without one"
        )
        return kps
    kp, why = found
    if not store.exists(encodings_dir(record.system, corpus, "passage", kp)):
        raise IncompleteArtifactError(
            f"{record.system} has no K_p = {kp} passage encodings of {corpus!r}, the K_p of "
            f"{why}: encode them (`diffret encode -d {corpus} --side passage --k {kp}`) or "
            "give --kp"
        )
    log(f"index: K_p = {kp}, {why} (--kp indexes others)")
    return [kp]


def build_codes_index(store: ArtifactStore, folder: str, m: Manifest) -> CodesIndex:
    """The codes index of a residual:B passage folder: its codes' centroid ids read a shard at a time."""
    codec = codec_for(store, folder, m)
    assert codec is not None and codec.codebook is not None
    cells = int(codec.codebook.arrays["centroids"].shape[0])
    return CodesIndex.build(((centroid_ids(codes), n_reps) for codes, n_reps in iter_codes(store, folder, m)), cells)


def check_codes(
    store: ArtifactStore,
    p_folder: str,
    index: CodesIndex,
    queries_by_kq: dict[int, Encodings],
    k: int = 100,
    probes: int = 2,
    candidates: int = 1024,
) -> dict[str, Any]:
    """recall@10 / @100 and latency of the search over codes against exact MaxSim over the decoded codes (the same
    rules: the reference's), per K_q, and exact search's time a query in the same process (batched, as score)."""
    rules = ScoreRules()
    p_man = encoding_manifest(store, p_folder)
    t0 = time.perf_counter()
    exact, _ = search_pass(
        queries_by_kq,
        iter_encodings(store, p_folder, p_man, "cpu", rules),
        ["multi_dense"],
        SearchSettings(topk=k, rules=rules),
    )
    exact_ms = (time.perf_counter() - t0) * 1000.0 / max(1, sum(len(q) for q in queries_by_kq.values()))
    coded = coded_passages(store, p_folder, p_man)
    out: dict[str, Any] = {}
    for kq, q in queries_by_kq.items():
        st = CodesSearchStats()
        got = search_codes(q, coded, index, k, probes, candidates, rules, st)
        ex = [[i for i in row if i >= 0] for row in exact[(kq, "multi_dense")].index]
        approx = [[i for i in row if i >= 0] for row in got.index]
        out[str(kq)] = {
            "recall_10": lance.recall_at(ex, approx, 10),
            "recall_100": lance.recall_at(ex, approx, min(100, k)),
            "latency_ms_mean": float(np.mean(st.latencies_ms)) if st.latencies_ms else 0.0,
            "latency_ms_p95": float(np.percentile(st.latencies_ms, 95)) if st.latencies_ms else 0.0,
            "exact_ms_per_query": exact_ms,
            "queries": len(q),
            "search": {
                "probes": probes,
                "candidates": candidates,
                "probed_mean": float(np.mean(st.probed or [0])),
                "decoded_mean": float(np.mean(st.decoded or [0])),
            },
        }
    return out


@dataclass
class IndexPlan(Plan):
    """An index run's plan: the recall checks of the indexes already current, by K_p (those built now come back as
    results)."""

    checks: dict[int, dict[str, Any]] = field(default_factory=dict)


class Index(Stage, name="index", config=IndexConfig, noun="index(es)", verb="built", distributed=True):
    """An index per K_p (a LanceDB multivector table, or a residual:B system's codes index), with recall against
    exact search."""

    def plan(self, config: IndexConfig, ctx: Context) -> IndexPlan:
        store, corpus = ctx.store, config.corpus_name()
        record = find_system(store, config.system)
        engine, dtype = index_engine(record, config.vectors)
        n_passages = corpus_size(store, corpus)
        config = config.model_copy(
            update={
                "kq": budgets(store, config.kq, record.system, config.dataset, "query", ctx.log),
                "kp": index_budgets(store, config.kp, record, corpus, [config.dataset, corpus], ctx.log),
            }
        )
        assert config.kq is not None and config.kp is not None  # resolved above
        q_hashes = {
            str(kq): encoding_manifest(store, encodings_dir(record.system, config.dataset, "query", kq)).config_hash
            for kq in config.kq
        }
        plan = IndexPlan(system=record.system)
        for kp in config.kp:
            p_man = encoding_manifest(store, encodings_dir(record.system, corpus, "passage", kp), n_passages)
            check = {"dataset": config.dataset, "split": config.split, "kq": list(config.kq)}
            inputs = {"passage_encodings": p_man.config_hash, "query_encodings": q_hashes}
            if engine == "codes":
                cfg = {
                    "system": record.system,
                    "corpus": corpus,
                    "kp": kp,
                    "engine": "codes",
                    "store": dtype,
                    "probes": config.probes,
                    "candidates": config.candidates,
                    "check": check,
                    "inputs": inputs,
                }
            else:  # a float32 table keeps the earlier config (its folders stay current); other precisions name theirs
                cfg = {
                    "system": record.system,
                    "corpus": corpus,
                    "kp": kp,
                    "index_type": config.index_type,
                    "overfetch": config.overfetch or lance.DEFAULT_OVERFETCH,
                    "refine_factor": lance.DEFAULT_REFINE_FACTOR if config.index_type == "IVF_PQ" else None,
                    **({"vectors": dtype} if dtype != "float32" else {}),
                    "check": check,
                    "inputs": inputs,
                }
            folder = index_dir(record.system, corpus, kp)
            if plan.needs(ctx, folder, cfg, config.force):
                plan.units.append(Folder(folder, cfg))
            else:
                plan.checks[kp] = store.require_manifest(folder).stats.get("check", {})
        return plan

    def run(self, unit: Folder, ctx: Context) -> tuple[int, dict[str, Any]]:
        store, c = ctx.store, unit.config
        system, corpus, kp, check = c["system"], c["corpus"], c["kp"], c["check"]
        p_folder = encodings_dir(system, corpus, "passage", kp)
        p_man = encoding_manifest(store, p_folder)
        m = Manifest.new("index", {"system": system, "dataset": corpus, "kp": str(kp)}, c)
        ids = split_queries(store, check["dataset"], check["split"])
        q_folders = {kq: encodings_dir(system, check["dataset"], "query", kq) for kq in check["kq"]}
        if c.get("engine") == "codes":
            ctx.log(
                f"index K_p={kp}: the codes index of {p_man.total_rows():,} passages ({c['store']}: the cells of "
                "its codebook's centroids; no vector copied), read a shard at a time"
            )
            with store.folder_writer(unit.stage, m) as w:
                start = time.perf_counter()
                index = build_codes_index(store, p_folder, p_man)
                table = index.to_table()
                w.write_parquet(CODES_INDEX_FILE, table.schema, [table])
                seconds = time.perf_counter() - start
                queries = {kq: query_encodings(store, st, ids, "cpu", ScoreRules()) for kq, st in q_folders.items()}
                result = check_codes(store, p_folder, index, queries, 100, c["probes"], c["candidates"])
                m.stats = {
                    "rows": index.n_passages,
                    "index": {
                        "engine": "codes",
                        "cells": index.n_centroids,
                        "entries": int(len(index.passages)),
                        "seconds": seconds,
                    },
                    "check": result,
                }
            worst = min(r["recall_10"] for r in result.values())
            ctx.log(
                f"index K_p={kp} (codes, {c['probes']} probes, {c['candidates']} candidates): "
                f"{index.n_passages:,} passages in {index.n_centroids:,} cells; recall@10 vs exact >= {worst:.4f}"
            )
            return kp, result
        batches = _passage_batches(store, p_folder, p_man)
        first = next(batches, None)
        if first is None:
            raise ValueError(f"{store.abspath(p_folder)}: no passages to index")
        hidden = int(first[1][0].shape[1])
        index_type, overfetch, dtype = c["index_type"], c["overfetch"], c.get("vectors", "float32")
        ctx.log(
            f"index K_p={kp}: streaming {p_man.total_rows():,} passages into LanceDB ({dtype}) one shard at a time "
            f"({len(p_man.files)} shard(s); memory: one shard), then one {index_type} build"
        )
        with store.folder_writer(unit.stage, m) as w:
            rows = lance.build_table(w.work_dir, itertools.chain([first], batches), hidden, dtype=dtype)
            info = lance.create_index(w.work_dir, index_type) if index_type != "none" else None
            queries = {kq: query_encodings(store, st, ids) for kq, st in q_folders.items()}
            result = check_against_exact(w.work_dir, queries, iter_encodings(store, p_folder, p_man), 100, overfetch)
            built = None if info is None else {"params": info.params, "seconds": info.seconds, "vectors": info.vectors}
            m.stats = {"rows": rows, "index": built, "check": result}
            m.files.update(_file_entries(w.work_dir))
        worst = min(r["recall_10"] for r in result.values())
        ctx.log(f"index K_p={kp} ({index_type}, {dtype}): {rows:,} passages; recall@10 vs exact >= {worst:.4f}")
        return kp, result

    def finish(self, config: IndexConfig, plan: Plan, results: list[tuple[int, dict]], ctx: Context) -> dict[str, Any]:
        assert isinstance(plan, IndexPlan)
        checks = dict(plan.checks)
        checks.update(dict(results))
        return {"checks": {kp: checks[kp] for kp in sorted(checks)}}


def _shown(result: StageResult) -> str:
    """Each index's recall against exact search and its latency, as a markdown table."""
    return index_checks(result.details["checks"]) + "\n"


presentation = Presentation(
    deployment=(
        "Build an index per K_p (by default the operating point's) from stored passage encodings: a LanceDB "
        "multivector table in the store's precision (+ IVF_PQ / IVF_HNSW_SQ index) for a float16 system, the codes "
        "index (the passages of each centroid's cell) for a residual:B system; report recall@10 / @100 against "
        "exact MaxSim and the latency in the index manifest. config.system names the encoder system: `{system: "
        "<slug>}`, or `{model: <id or path>, where: {setting: value}}`."
    ),
    example={
        "dataset": "scifact",
        "split": "test",
        "kq": [1, 2, 4, 8, 16],
        "kp": [1, 2, 4, 8, 16],
        "system": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
        "index_type": "IVF_PQ",
    },
    next_step=(
        "the recall of each index against exact search is above; score the grid exactly with `diffret score "
        "-d {dataset} --system {system}`."
    ),
    shown=_shown,
)


def index_checks(checks: dict[Any, dict[Any, dict]]) -> str:
    """Recall of each index against exact search, per K_p and K_q, as a markdown table.

    >>> print(index_checks({16: {4: {"recall_10": 1.0, "recall_100": 0.99, "latency_ms_mean": 2.0,
    ...                              "latency_ms_p95": 3.5}}}).splitlines()[-1])
    | 16 | 4 | 1.0000 | 0.9900 | 2.0 | 3.5 |
    """
    lines = ["| K_p | K_q | recall@10 | recall@100 | mean ms | p95 ms |", "|---:|---:|---:|---:|---:|---:|"]
    for kp, by_kq in sorted(checks.items(), key=lambda x: int(x[0])):
        for kq, c in sorted(by_kq.items(), key=lambda x: int(x[0])):
            lines.append(
                f"| {kp} | {kq} | {c['recall_10']:.4f} | {c['recall_100']:.4f} | "
                f"{c['latency_ms_mean']:.1f} | {c['latency_ms_p95']:.1f} |"
            )
    return "\n".join(lines)


stage = Index()
