"""The rerank stage (``diffret rerank``): a diffusion-LM reranker (DiffuRank) over any stored first-stage run.

    runs/system=<reranker slug>/dataset=<d>/split=<s>/kq=0/kp=0/mode=rerank/run.parquet

The reranker is a registered system (kind ``reranker``) whose slug hashes the backbone, the method and its
settings, the prompt's content, the depth and the first-stage run it reorders, so the same model over BM25 and
over a DiffRetriever run are two systems; its runs are evaluated and listed like any other (mode ``rerank``,
kq = kp = 0). Documents below the depth are dropped (a run of the depth's length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pydantic import Field, model_validator

from retrieval.devices import resolve_device
from retrieval.fields import cli, like
from retrieval.models.backbones import BackboneConfig, load_backbone
from retrieval.rerank.rerankers import Reranker, RerankerName, load_rerank_prompt, make_reranker
from retrieval.rerank.training import RerankTrainSettings
from storage import ArtifactStore, StoreError, config_hash
from storage.layout import FUSION_MODE, IMPORTED_MODE, RUN_SCHEMA, run_dir

from .base import Context, Plan, Stage
from .readers import dataset_manifest, side_texts, split_queries
from .runs import Cell, QueriesConfig, read_run, write_run
from .systems import SystemRecord, SystemRef, backbone_settings, find_system, register, slug_base
from .tokenize import default_backbone

RERANK_MODE = "rerank"


class RerankConfig(QueriesConfig):
    """Parameters of the rerank flow."""

    dataset: str = like(QueriesConfig, "dataset", default="scifact")

    splits: list[str] = Field(default=["test"], description="Query splits to rerank.",
                              json_schema_extra=cli(flag="--split"))  # fmt: skip
    first_stage: str = Field(default="bm25", description="The run to rerank: a system slug (or unique prefix), or "
                             "bm25 for the store's BM25 system.")  # fmt: skip
    first_kq: int = Field(default=0, ge=0, description="The first-stage run's K_q (0 for BM25).",
                          json_schema_extra=cli(deprecated=["--kq"]))  # fmt: skip
    first_kp: int = Field(default=0, ge=0, description="The first-stage run's K_p (0 for BM25).",
                          json_schema_extra=cli(deprecated=["--kp"]))  # fmt: skip
    first_mode: str | None = Field(default=None, description="The first-stage run's mode (default: bm25 for BM25, "
                                   "imported for an imported run, fusion for a fusion; an encoder's must be named).",
                                   json_schema_extra=cli(deprecated=["--mode"]))  # fmt: skip
    depth: int = Field(default=100, ge=1, description="Candidates reranked per query (the first stage's top).")
    method: RerankerName = Field(default="logits_listwise", description="DiffuRank's method.")
    backbone: BackboneConfig = Field(default_factory=default_backbone,
                                     description="The diffusion LM that reranks, and how it is loaded.")  # fmt: skip
    prompt: str | None = Field(default=None, description="A built-in rerank prompt or a YAML file (default: the "
                               "method's).")  # fmt: skip
    doc_tokens: int = like(RerankTrainSettings, "doc_tokens")
    window: int = Field(default=20, ge=1, description="Documents per listwise window.")
    step: int = Field(default=10, ge=1, description="Window step (RankGPT's sliding window).")
    steps: int = Field(default=4, ge=1, description="Denoising steps of permutation_sampling.")
    batch_size: int = Field(default=8, ge=1, description="Prompts per forward pass (pairs or windows).")

    @model_validator(mode="after")
    def _windows_overlap(self) -> RerankConfig:
        if self.step > self.window:  # RankGPT's windows would leave the documents between them where they were
            raise ValueError(f"--step {self.step} is larger than --window {self.window}: the documents between two "
                             "windows would never be reranked; give a step no larger than the window (the default: "
                             "window 20, step 10)")  # fmt: skip
        return self

    def settings(self) -> dict[str, Any]:
        """What the reranker system's slug hashes (everything that changes its numbers)."""
        prompt = load_rerank_prompt(self.prompt or _default_prompt(self.method))
        return {
            "backbone": backbone_settings(self.backbone), "method": self.method,
            "prompt": config_hash(prompt.__dict__)[:16], "doc_tokens": self.doc_tokens,
            "window": self.window, "step": self.step, "depth": self.depth,
            **({"steps": self.steps} if self.method == "permutation_sampling" else {}),
        }  # fmt: skip


def _default_prompt(method: str) -> str:
    return "permutation" if method.startswith("permutation") else method


def reranker_slug(model: str, method: str, settings: dict[str, Any], first: dict[str, Any]) -> str:
    """``<model>-<method>-<hash of its settings and the first-stage run>``.

    >>> reranker_slug("org/tiny-llada", "pointwise", {"a": 1}, {"system": "bm25-x"})
    'tiny-llada-pointwise-0252903d12'
    """
    return f"{slug_base(model)}-{method}-{config_hash({'settings': settings, 'first_stage': first})[:10]}"


def first_stage_run(store: ArtifactStore, dataset: str, split: str, system: str, kq: int, kp: int,
                    mode: str | None) -> tuple[str, str]:  # fmt: skip
    """(system, run folder) of a stored first-stage run (see :func:`first_stage_system`; ``mode`` None: the
    system's own, :func:`first_stage_mode`); a missing run is a clear error naming what to run."""
    slug = first_stage_system(store, system)
    mode = first_stage_mode(store, system, mode)
    src = run_dir(slug, dataset, split, kq, kp, mode)
    if store.read_manifest(src) is None:
        raise StoreError(f"no first-stage run {slug} kq={kq} kp={kp} mode={mode} on {dataset}/{split} in "
                         f"{store.root}; run it first (`diffret run`, `diffret bm25` or `diffret score`)")  # fmt: skip
    return slug, src


# the one mode of a system kind whose runs have no grid (kq = kp = 0)
KIND_MODES = {"bm25": "bm25", "run": IMPORTED_MODE, "fusion": FUSION_MODE}


def first_stage_mode(store: ArtifactStore, system: str, mode: str | None) -> str:
    """``mode``, or when None the first-stage system's one mode (BM25, an imported run, a fusion); an encoder's
    runs have a grid, so its mode must be named."""
    if mode is not None:
        return mode
    kind = "bm25" if system == "bm25" else find_system(store, SystemRef(system=system)).kind
    if kind not in KIND_MODES:
        raise ValueError(f"the first stage {system!r} is an {kind} system with a grid of runs: name its run with "
                         "--mode (and --kq, --kp)")  # fmt: skip
    return KIND_MODES[kind]


def first_stage_system(store: ArtifactStore, system: str) -> str:
    """The slug of a first-stage system: ``bm25`` names the store's BM25 system, anything else a system slug or
    unique prefix (an encoder's, an imported run's, a fusion's); a reranker is refused."""
    kind = "bm25" if system == "bm25" else None
    first = find_system(store, SystemRef(system=None if kind else system), kind=kind or "encoder")
    if first.kind == "reranker":
        raise StoreError(f"{first.system} is a reranker; rerank a first-stage run (BM25 or an encoder's)")
    return first.system


@dataclass
class RerankUnit:
    cells: list[Cell]
    first_stages: dict[str, str]  # split -> the first-stage run folder
    config: dict[str, Any]  # RerankConfig as a dict
    record: dict[str, Any]  # the reranker's SystemRecord, registered once the model and its prompts are checked


class Rerank(Stage, name="rerank", config=RerankConfig, noun="run(s)", verb="reranked", reports_progress=True):
    """Rerank a stored run's top candidates with a diffusion LM (DiffuRank's four methods)."""

    deployment = (  # the Prefect deployment's description (flows/deployments.py)
        "Rerank a stored run's top candidates (BM25 by default) with a diffusion LM, DiffuRank's four methods: "
        "pointwise, logits_listwise, permutation_sampling, permutation_assignment. Writes a run like any other "
        "system's."
    )
    example = {
        "dataset": "scifact",
        "splits": ["test"],
        "first_stage": "bm25",
        "depth": 100,
        "method": "logits_listwise",
        "backbone": {"model": "GSAI-ML/LLaDA-8B-Instruct"},
    }  # the deployment's parameters, besides root

    next_step = "evaluate the reranked runs: `diffret evaluate -d {dataset}` (the evaluate deployment)."

    def plan(self, config: RerankConfig, ctx: Context) -> Plan:
        resolve_device(config.backbone.device)  # a device this machine lacks: refused before any work
        store = ctx.store
        settings = config.settings()
        first = first_stage_system(store, config.first_stage)
        first_ref = {"system": first, "kq": config.first_kq, "kp": config.first_kp,
                     "mode": first_stage_mode(store, config.first_stage, config.first_mode)}  # fmt: skip
        slug = reranker_slug(config.backbone.model, config.method, settings, first_ref)
        corpus = config.corpus_name()
        inputs = {"queries": dataset_manifest(store, config.dataset).config_hash,
                  "corpus": dataset_manifest(store, corpus).config_hash}  # fmt: skip
        plan = Plan(system=slug, work_unit="queries")
        todo, firsts = [], {}
        for split in config.splits:
            _, src = first_stage_run(store, config.dataset, split, config.first_stage, config.first_kq,
                                     config.first_kp, config.first_mode)  # fmt: skip
            m = store.require_manifest(src)
            cfg = {"system": slug, "dataset": config.dataset, "corpus": corpus, "split": split, "kq": 0, "kp": 0,
                   "mode": RERANK_MODE, "topk": config.depth, "first_stage": {**first_ref, "run": m.config_hash},
                   "settings": settings, "inputs": inputs}  # fmt: skip
            stage = run_dir(slug, config.dataset, split, 0, 0, RERANK_MODE)
            if plan.needs(ctx, stage, cfg, config.force):
                todo.append(Cell(split, 0, 0, RERANK_MODE, stage, cfg))
                firsts[split] = src
        record = SystemRecord(system=slug, kind="reranker", model=config.backbone.model, readout=config.method,
                              settings={**settings, "first_stage": first_ref})  # fmt: skip
        if todo:
            plan.units.append(RerankUnit(todo, firsts, config.model_dump(), record.model_dump()))
            plan.work = sum(len(split_queries(store, config.dataset, c.split)) for c in todo)
        plan.count = len(todo)
        return plan

    def run(self, unit: RerankUnit, ctx: Context) -> int:
        cfg = RerankConfig.model_validate(unit.config)
        store = ctx.store
        doc_ids, doc_texts, _ = side_texts(store, cfg.corpus_name(), "passage")
        text_of = dict(zip(doc_ids, doc_texts, strict=True))
        q_ids, q_texts, _ = side_texts(store, cfg.dataset, "query")
        query_text = dict(zip(q_ids, q_texts, strict=True))
        reranker = make_reranker(
            cfg.method, load_backbone(cfg.backbone), prompt=cfg.prompt, doc_tokens=cfg.doc_tokens, window=cfg.window,
            step=cfg.step, batch_size=cfg.batch_size, steps=cfg.steps,
        )  # fmt: skip  (single-token answers and the context are checked here: a refusal writes nothing)
        register(store, SystemRecord.model_validate(unit.record))
        for cell in unit.cells:
            table, stats = rerank_run(reranker, read_run(store, unit.first_stages[cell.split]), query_text, text_of,
                                      cfg.depth, ctx.advance)  # fmt: skip
            ctx.log(f"reranked {cfg.dataset}/{cell.split}: {stats['queries']:,} queries, {stats['forward_passes']:,} "
                    f"forward passes")  # fmt: skip
            write_run(store, cell, table, stats)
        return len(unit.cells)


def rerank_run(reranker: Reranker, first: pa.Table, query_text: dict[str, str], doc_text: dict[str, str],
               depth: int, advance: Any = None) -> tuple[pa.Table, dict[str, Any]]:  # fmt: skip
    """The reranked run (RUN_SCHEMA) of ``first``'s top ``depth`` per query, and what it took."""
    by_query: dict[str, list[tuple[int, str]]] = {}
    for q, d, r in zip(first.column("query_id").to_pylist(), first.column("doc_id").to_pylist(),
                       first.column("rank").to_pylist(), strict=True):  # fmt: skip
        by_query.setdefault(q, []).append((r, d))
    qids = list(by_query)
    items = []
    for q in qids:
        ranked = [d for _, d in sorted(by_query[q])[:depth]]
        items.append((query_text[q], [(d, doc_text[d]) for d in ranked]))
    before = reranker.stats.forward_passes
    out = reranker.rerank(items, progress=advance)
    cols: dict[str, list] = {"query_id": [], "doc_id": [], "rank": [], "score": []}
    for q, ranked in zip(qids, out, strict=True):
        for rank, (d, s) in enumerate(ranked, start=1):
            cols["query_id"].append(q)
            cols["doc_id"].append(d)
            cols["rank"].append(rank)
            cols["score"].append(s)
    table = pa.Table.from_pydict(cols, schema=RUN_SCHEMA)
    stats = {"queries": len(qids), "rows": table.num_rows,
             "forward_passes": reranker.stats.forward_passes - before,
             "invalid_without_constraint": reranker.stats.invalid_without_constraint}  # fmt: skip
    return table, stats


stage = Rerank()
