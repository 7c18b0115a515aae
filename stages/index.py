"""The index stage: a passage encoding -> a LanceDB multivector table (+ optional ANN index), checked against
exact search on every build. One unit per K_p (on the workers with ``workers`` / ``dask_address``).

Memory is bounded by a shard, whatever the corpus: the encodings are streamed into LanceDB shard by shard (one
shard's vectors in memory at once), LanceDB trains its one index build on a sample of them, and the recall check
streams them again through exact search (``--block-mb`` as score's).

Store layout: ``index/system=<slug>/dataset=<corpus>/kp=<K_p>/`` is a LanceDB database folder (table
``docs``) with a ``_manifest.json`` listing every Lance file with its sha256, and in ``stats`` the
recall@10 / @100 of the index against exact MaxSim and its latency, per K_q of the check.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
from pydantic import Field

from diffret.retrieval.fields import cli
from diffret.retrieval.search import lance
from diffret.retrieval.search.encodings import Encodings
from diffret.retrieval.search.exact import SearchSettings, search_pass
from diffret.retrieval.search.rules import ScoreRules
from diffret.storage import ArtifactStore, FileEntry, Manifest
from diffret.storage.layout import encodings_dir, index_dir

from .base import ClusterConfig, Context, Folder, KList, Plan, Stage, StageResult
from .readers import budgets, corpus_size, encoding_manifest, iter_encodings, query_encodings, split_queries
from .runs import QueriesConfig
from .systems import SystemRef, find_system

# LanceDB's MaxSim scale (the mean over query vectors, unclamped): recall is measured against exact search under it
LANCE_RULES = ScoreRules(maxsim_clamp=False, maxsim_reduce="mean")


class IndexConfig(QueriesConfig, ClusterConfig):
    """Parameters of the index flow (the dataset's queries check the index against exact search)."""

    system: SystemRef = Field(default_factory=SystemRef, description="The encoder system whose passages to index.")
    split: str = Field(default="test", description="Query split of the recall check.")
    kq: KList | None = Field(default=None, description="Query budgets of the recall check (default: every K_q whose "
                             "query encodings are stored).")  # fmt: skip
    kp: KList | None = Field(default=None, description="Passage budgets to index, one table each (default: every "
                             "K_p whose passage encodings are stored).")  # fmt: skip
    index_type: Literal["none", "IVF_PQ", "IVF_HNSW_SQ"] = Field(
        default="IVF_PQ", description="The LanceDB index: IVF_PQ, IVF_HNSW_SQ, or none (a flat table).",
        json_schema_extra=cli(flag="--type"),
    )
    overfetch: int | None = Field(
        default=None,
        ge=1,
        le=lance.MAX_CANDIDATES // 100,  # the recall check searches k = 100
        description="Candidates per result = k x overfetch (default lance.DEFAULT_OVERFETCH).",
    )


def _passage_batches(store: ArtifactStore, stage: str, m: Manifest) -> Iterator[tuple[list[str], list[np.ndarray]]]:
    """(ids, per-passage [n_j, H] float32 arrays) shard by shard, in corpus order."""
    for enc in iter_encodings(store, stage, m, "cpu"):
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
        kwargs = {"overfetch": overfetch} if overfetch else {}
        res = lance.search(db_path, qv, k, **kwargs)
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


class Index(Stage, name="index", config=IndexConfig, noun="index(es)", verb="built", distributed=True):
    """LanceDB multivector index per K_p, with recall against exact search."""

    deployment = (  # the Prefect deployment's description (flows/deployments.py)
        "Build a LanceDB multivector table (+ IVF_PQ / IVF_HNSW_SQ index) per K_p from stored passage encodings, "
        "and report recall@10 / @100 against exact MaxSim and the latency in the index manifest. config.system "
        "names the encoder system: `{system: <slug>}`, or `{model: <id or path>, where: {setting: value}}`."
    )
    example = {
        "dataset": "scifact",
        "split": "test",
        "kq": [1, 2, 4, 8, 16],
        "kp": [1, 2, 4, 8, 16],
        "system": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
        "index_type": "IVF_PQ",
    }  # the deployment's parameters, besides root

    next_step = (
        "the recall of each index against exact search is above; score the grid exactly with `diffret score "
        "-d {dataset} --system {system}`."
    )

    def shown(self, result: StageResult) -> str:
        """Each index's recall against exact search and its latency, as a markdown table."""
        return index_checks(result.details["checks"]) + "\n"

    def plan(self, config: IndexConfig, ctx: Context) -> Plan:
        store, corpus = ctx.store, config.corpus_name()
        record = find_system(store, config.system)
        n_passages = corpus_size(store, corpus)
        config = config.model_copy(update={
            "kq": budgets(store, config.kq, record.system, config.dataset, "query", ctx.log),
            "kp": budgets(store, config.kp, record.system, corpus, "passage", ctx.log)})  # fmt: skip
        q_hashes = {
            str(kq): encoding_manifest(store, encodings_dir(record.system, config.dataset, "query", kq)).config_hash
            for kq in config.kq
        }
        plan = Plan(system=record.system, details={"checks": {}})
        for kp in config.kp:
            p_man = encoding_manifest(store, encodings_dir(record.system, corpus, "passage", kp), n_passages)
            cfg = {
                "system": record.system, "corpus": corpus, "kp": kp, "index_type": config.index_type,
                "overfetch": config.overfetch or lance.DEFAULT_OVERFETCH,
                "refine_factor": lance.DEFAULT_REFINE_FACTOR if config.index_type == "IVF_PQ" else None,
                "check": {"dataset": config.dataset, "split": config.split, "kq": list(config.kq)},
                "inputs": {"passage_encodings": p_man.config_hash, "query_encodings": q_hashes},
            }  # fmt: skip
            stage = index_dir(record.system, corpus, kp)
            if plan.needs(ctx, stage, cfg, config.force):
                plan.units.append(Folder(stage, cfg))
            else:
                plan.details["checks"][kp] = store.require_manifest(stage).stats.get("check", {})
        return plan

    def run(self, unit: Folder, ctx: Context) -> tuple[int, dict[str, Any]]:
        store, c = ctx.store, unit.config
        system, corpus, kp, check = c["system"], c["corpus"], c["kp"], c["check"]
        p_stage = encodings_dir(system, corpus, "passage", kp)
        p_man = encoding_manifest(store, p_stage)
        batches = _passage_batches(store, p_stage, p_man)
        first = next(batches, None)
        if first is None:
            raise ValueError(f"{store.abspath(p_stage)}: no passages to index")
        hidden = int(first[1][0].shape[1])
        m = Manifest.new("index", {"system": system, "dataset": corpus, "kp": str(kp)}, c)
        index_type, overfetch = c["index_type"], c["overfetch"]
        ctx.log(f"index K_p={kp}: streaming {p_man.total_rows():,} passages into LanceDB one shard at a time "
                f"({len(p_man.files)} shard(s); memory: one shard), then one {index_type} build")  # fmt: skip
        with store.stage_writer(unit.stage, m) as w:
            rows = lance.build_table(w.work_dir, itertools.chain([first], batches), hidden)
            info = lance.create_index(w.work_dir, index_type) if index_type != "none" else None
            ids = split_queries(store, check["dataset"], check["split"])
            q_stages = {kq: encodings_dir(system, check["dataset"], "query", kq) for kq in check["kq"]}
            queries = {kq: query_encodings(store, st, ids) for kq, st in q_stages.items()}
            result = check_against_exact(w.work_dir, queries, iter_encodings(store, p_stage, p_man), 100, overfetch)
            index = None if info is None else {"params": info.params, "seconds": info.seconds, "vectors": info.vectors}
            m.stats = {"rows": rows, "index": index, "check": result}
            m.files.update(_file_entries(w.work_dir))
        worst = min(r["recall_10"] for r in result.values())
        ctx.log(f"index K_p={kp} ({index_type}): {rows:,} passages; recall@10 vs exact >= {worst:.4f}")
        return kp, result

    def finish(self, config: IndexConfig, plan: Plan, results: list[tuple[int, dict]], ctx: Context) -> dict[str, Any]:
        checks = dict(plan.details["checks"])
        checks.update(dict(results))
        return {"checks": {kp: checks[kp] for kp in sorted(checks)}}


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
