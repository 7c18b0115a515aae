"""The rerank stage (``diffret rerank``): a diffusion-LM reranker (DiffuRank) over any stored first-stage run.

    runs/system=<reranker slug>/dataset=<d>/split=<s>/kq=0/kp=0/mode=rerank/run.parquet

The reranker is a registered system (kind ``reranker``) whose slug hashes the backbone, the method and its
settings, the prompt's content, the depth and the first-stage run it reorders, so the same model over BM25 and
over a DiffRetriever run are two systems; its runs are evaluated and listed like any other (mode ``rerank``,
kq = kp = 0). Documents below the depth are dropped (a run of the depth's length).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, model_validator

from diffret.caching import KeyedCache
from diffret.retrieval.data.collections import passage_text
from diffret.retrieval.fields import cli, like
from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
from diffret.retrieval.rerank.rerankers import Reranker, RerankerName, batch_cuts, load_rerank_prompt, make_reranker
from diffret.retrieval.rerank.training import RerankTrainSettings
from diffret.schemas import RUN_SCHEMA
from diffret.storage import ArtifactStore, FileEntry, StoreError, config_hash
from diffret.storage.layout import FUSION_MODE, IMPORTED_MODE, dataset_dir, run_dir

from .base import ClusterConfig, Context, Shared, check_device, read_shared
from .passes import Block, Pass, PassPlan, PassStage, PassUnit, read_units, write_unit
from .presentation import Presentation
from .readers import dataset_manifest
from .runs import Cell, QueriesConfig, read_run, write_run
from .systems import SystemRecord, SystemRef, backbone_settings, find_system, model_name, register, slug_base
from .tokenize import default_backbone

RERANK_MODE = "rerank"


class RerankConfig(QueriesConfig, ClusterConfig):
    """Parameters of the rerank flow."""

    dataset: str = like(QueriesConfig, "dataset", default="scifact")

    splits: list[str] = Field(
        default=["test"], description="Query splits to rerank.", json_schema_extra=cli(flag="--split")
    )
    first_stage: str = Field(
        default="bm25",
        description="The run to rerank: a system slug (or unique prefix), or bm25 for the store's BM25 system.",
    )
    first_kq: int = Field(default=0, ge=0, description="The first-stage run's K_q (0 for BM25).")
    first_kp: int = Field(default=0, ge=0, description="The first-stage run's K_p (0 for BM25).")
    first_mode: str | None = Field(
        default=None,
        description="The first-stage run's mode (default: bm25 for BM25, "
        "imported for an imported run, fusion for a fusion; an encoder's must be named).",
    )
    depth: int = Field(default=100, ge=1, description="Candidates reranked per query (the first stage's top).")
    method: RerankerName = Field(default="logits_listwise", description="DiffuRank's method.")
    backbone: BackboneConfig = Field(
        default_factory=default_backbone, description="The diffusion LM that reranks, and how it is loaded."
    )
    prompt: str | None = Field(
        default=None, description="A built-in rerank prompt or a YAML file (default: the method's)."
    )
    doc_tokens: int = like(RerankTrainSettings, "doc_tokens")
    window: int = Field(default=20, ge=1, description="Documents per listwise window.")
    step: int = Field(default=10, ge=1, description="Window step (RankGPT's sliding window).")
    steps: int = Field(default=4, ge=1, description="Denoising steps of permutation_sampling.")
    batch_size: int = Field(default=8, ge=1, description="Prompts per forward pass (pairs or windows).")
    unit_queries: int = Field(
        default=4096,
        ge=1,
        description="Queries per unit (at least; a unit ends where the "
        "whole run's batches end, so that its forward passes are the whole run's): the units run "
        "on the workers and a killed run keeps the finished ones.",
    )

    @model_validator(mode="after")
    def _windows_overlap(self) -> RerankConfig:
        if self.step > self.window:  # RankGPT's windows would leave the documents between them where they were
            raise ValueError(
                f"--step {self.step} is larger than --window {self.window}: the documents between two "
                "windows would never be reranked; give a step no larger than the window (the default: "
                "window 20, step 10)"
            )
        return self

    def settings(self) -> dict[str, Any]:
        """What the reranker system's slug hashes (everything that changes its numbers)."""
        prompt = load_rerank_prompt(self.prompt or _default_prompt(self.method))
        return {
            "backbone": backbone_settings(self.backbone),
            "method": self.method,
            "prompt": config_hash(prompt.__dict__)[:16],
            "doc_tokens": self.doc_tokens,
            "window": self.window,
            "step": self.step,
            "depth": self.depth,
            **({"steps": self.steps} if self.method == "permutation_sampling" else {}),
        }


def _default_prompt(method: str) -> str:
    return "permutation" if method.startswith("permutation") else method


def reranker_slug(model: str, method: str, settings: dict[str, Any], first: dict[str, Any]) -> str:
    """``<model>-<method>-<hash of its settings and the first-stage run>``.

    >>> reranker_slug("org/tiny-llada", "pointwise", {"a": 1}, {"system": "bm25-x"})
    'tiny-llada-pointwise-0252903d12'
    """
    return f"{slug_base(model)}-{method}-{config_hash({'settings': settings, 'first_stage': first})[:10]}"


def first_stage_run(
    store: ArtifactStore, dataset: str, split: str, system: str, kq: int, kp: int, mode: str | None
) -> tuple[str, str]:
    """(system, run folder) of a stored first-stage run (see :func:`first_stage_system`; ``mode`` None: the
    system's own, :func:`first_stage_mode`); a missing run is a clear error naming what to run."""
    slug = first_stage_system(store, system)
    mode = first_stage_mode(store, system, mode)
    src = run_dir(slug, dataset, split, kq, kp, mode)
    if store.read_manifest(src) is None:
        raise StoreError(
            f"no first-stage run {slug} kq={kq} kp={kp} mode={mode} on {dataset}/{split} in "
            f"{store.root}; run it first (`diffret run`, `diffret bm25` or `diffret score`)"
        )
    return slug, src


# the one mode of a system kind whose runs have no grid (kq = kp = 0)
KIND_MODES = {"bm25": "bm25", "run": IMPORTED_MODE, "fusion": FUSION_MODE}


def first_stage_mode(
    store: ArtifactStore, system: str, mode: str | None, options: str = "--first-mode (and --first-kq, --first-kp)"
) -> str:
    """``mode``, or when None the first-stage system's one mode (BM25, an imported run, a fusion); an encoder's
    runs have a grid, so its mode must be named (with ``options``, as the command spells them)."""
    if mode is not None:
        return mode
    kind = "bm25" if system == "bm25" else find_system(store, SystemRef(system=system)).kind
    if kind not in KIND_MODES:
        raise ValueError(
            f"the first stage {system!r} is an {kind} system with a grid of runs: name its run with {options}"
        )
    return KIND_MODES[kind]


def first_stage_system(store: ArtifactStore, system: str) -> str:
    """The slug of a first-stage system: ``bm25`` names the store's BM25 system, anything else a system slug or
    unique prefix (an encoder's, an imported run's, a fusion's); a reranker is refused."""
    kind = "bm25" if system == "bm25" else None
    first = find_system(store, SystemRef(system=None if kind else system), kind=kind or "encoder")
    if first.kind == "reranker":
        raise StoreError(f"{first.system} is a reranker; rerank a first-stage run (BM25 or an encoder's)")
    return first.system


class RerankShared(Shared):
    """What every unit of a split's rerank pass shares: the run's settings, the first stage's run folder, and the
    reranker's system record (registered by the first unit that loads it)."""

    config: RerankConfig
    first: str
    record: SystemRecord


@dataclass
class RerankMerge:
    """What writing a split's reranked run needs."""

    cell: Cell


class Rerank(
    PassStage[RerankMerge],
    name="rerank",
    config=RerankConfig,
    noun="run(s)",
    verb="reranked",
    reports_progress=True,
    distributed=True,
    task_tags=("gpu",),
):
    """Rerank a stored run's top candidates with a diffusion LM (DiffuRank's four methods)."""

    def plan(self, config: RerankConfig, ctx: Context) -> PassPlan[RerankMerge]:
        check_device(config.backbone.device, config)  # a device this machine lacks: refused before any work
        store = ctx.store
        settings = config.settings()
        first = first_stage_system(store, config.first_stage)
        first_ref = {
            "system": first,
            "kq": config.first_kq,
            "kp": config.first_kp,
            "mode": first_stage_mode(store, config.first_stage, config.first_mode),
        }
        name = model_name(config.backbone) if config.backbone.random_weights else config.backbone.model
        slug = reranker_slug(name, config.method, settings, first_ref)
        corpus = config.corpus_name()
        inputs = {
            "queries": dataset_manifest(store, config.dataset).config_hash,
            "corpus": dataset_manifest(store, corpus).config_hash,
        }
        plan: PassPlan[RerankMerge] = PassPlan(system=slug, work=0, work_unit="queries")
        record = SystemRecord(
            system=slug,
            kind="reranker",
            model=config.backbone.model,
            readout=config.method,
            settings={**settings, "first_stage": first_ref},
        )
        for split in config.splits:
            self._plan_split(config, ctx, plan, record, split, settings, first_ref, inputs)
        plan.count = len(plan.passes)
        if plan.passes:
            register(store, record, write=False)  # refuses a slug registered with other settings, before any work
        return plan

    def _plan_split(
        self,
        config: RerankConfig,
        ctx: Context,
        plan: PassPlan[RerankMerge],
        record: SystemRecord,
        split: str,
        settings: dict[str, Any],
        first_ref: dict[str, Any],
        inputs: dict[str, str],
    ) -> None:
        """A split's pass over its first-stage run (unless its reranked run is current): slices of its queries cut
        where the method's batches allow."""
        store, slug, corpus = ctx.store, record.system, config.corpus_name()
        _, src = first_stage_run(
            store, config.dataset, split, config.first_stage, config.first_kq, config.first_kp, config.first_mode
        )
        m = store.require_manifest(src)
        cfg = {
            "system": slug,
            "dataset": config.dataset,
            "corpus": corpus,
            "split": split,
            "kq": 0,
            "kp": 0,
            "mode": RERANK_MODE,
            "topk": config.depth,
            "first_stage": {**first_ref, "run": m.config_hash},
            "settings": settings,
            "inputs": inputs,
        }
        folder = run_dir(slug, config.dataset, split, 0, 0, RERANK_MODE)
        if not plan.needs(ctx, folder, cfg, config.force):
            return
        cell = Cell(split, 0, 0, RERANK_MODE, folder, cfg)
        sizes = _candidates(read_run(store, src, columns=["query_id"]), config.depth)
        cuts = set(batch_cuts(config.method, sizes, config.batch_size, config.window, config.step))
        shared = RerankShared(config=config, first=src, record=record)
        blocks = [
            Block(a, b, f"{split} queries {a:,}-{b - 1:,}") for a, b in _slices(len(sizes), config.unit_queries, cuts)
        ]
        self.add_pass(
            ctx,
            plan,
            system=slug,
            dataset=config.dataset,
            kp=0,
            config={**cfg, "unit_queries": config.unit_queries},
            shared=shared,
            blocks=blocks,
            merge=RerankMerge(cell),
        )

    def run(self, unit: PassUnit, ctx: Context) -> FileEntry:
        """A slice of a split's queries reranked (in the first stage's query order): its run rows to the partials."""
        store = ctx.store
        shared = read_shared(ctx, unit.plan, RerankShared)
        cfg = shared.config
        first = read_run(store, shared.first)
        qids = list(dict.fromkeys(first.column("query_id").to_pylist()))[unit.start : unit.end]
        first = first.filter(pc.is_in(first.column("query_id"), value_set=pa.array(qids, pa.string())))
        top = first.filter(pc.less_equal(first.column("rank"), cfg.depth))
        text_of = _texts(store, cfg.corpus_name(), "passage", pc.unique(top.column("doc_id")))
        query_text = _texts(store, cfg.dataset, "query", pa.array(qids, pa.string()))
        reranker = _reranker(cfg)  # (single-token answers and the context are checked here: a refusal writes nothing)
        register(store, shared.record)
        invalid = reranker.stats.invalid_without_constraint
        table, stats = rerank_run(reranker, first, query_text, text_of, cfg.depth, ctx.advance)
        stats["invalid_without_constraint"] -= invalid  # this unit's (the reranker is kept across units)
        meta = {b"stats": json.dumps(stats).encode()}
        return write_unit(store, unit, table.replace_schema_metadata(meta))

    def merge(self, done: Pass[RerankMerge], ctx: Context) -> None:
        """A split's slices in order: its reranked run, with their stats summed."""
        store = ctx.store
        tables, stats = [], {"queries": 0, "rows": 0, "forward_passes": 0, "invalid_without_constraint": 0}
        for _, table in read_units(store, done.folder):
            for k, v in json.loads((table.schema.metadata or {}).get(b"stats", b"{}")).items():
                stats[k] = stats.get(k, 0) + v
            tables.append(table.replace_schema_metadata(None))
        table = pa.concat_tables(tables) if tables else RUN_SCHEMA.empty_table()
        cell = done.merge.cell
        ctx.log(
            f"reranked {cell.config['dataset']}/{cell.split}: {stats['queries']:,} queries, "
            f"{stats['forward_passes']:,} forward passes"
        )
        write_run(store, cell, table, stats)


presentation = Presentation(
    deployment=(
        "Rerank a stored run's top candidates (BM25 by default) with a diffusion LM, DiffuRank's four methods: "
        "pointwise, logits_listwise, permutation_sampling, permutation_assignment. Writes a run like any other "
        "system's."
    ),
    example={
        "dataset": "scifact",
        "splits": ["test"],
        "first_stage": "bm25",
        "depth": 100,
        "method": "logits_listwise",
        "backbone": {"model": "GSAI-ML/LLaDA-8B-Instruct"},
    },
    next_step="evaluate the reranked runs: `diffret evaluate -d {dataset}` (the evaluate deployment).",
)


def _candidates(first: pa.Table, depth: int) -> list[int]:
    """Each query's candidates (at most ``depth``), queries in the order they first appear in the run."""
    counts: dict[str, int] = {}
    for q in first.column("query_id").to_pylist():
        counts[q] = counts.get(q, 0) + 1
    return [min(n, depth) for n in counts.values()]


def _slices(n: int, size: int, cuts: set[int]) -> list[tuple[int, int]]:
    """Consecutive slices of ``n`` queries, each at least ``size`` long, ending at one of ``cuts`` (or the end).

    >>> _slices(10, 3, {2, 4, 6, 9})
    [(0, 4), (4, 9), (9, 10)]
    """
    out, a = [], 0
    for c in sorted(x for x in cuts if 0 < x < n):
        if c - a >= size:
            out.append((a, c))
            a = c
    if a < n:
        out.append((a, n))
    return out


def _texts(store: ArtifactStore, dataset: str, side: str, ids: pa.Array) -> dict[str, str]:
    """The texts of ``ids`` of one side (passages as ``passage_text``), without holding the others."""
    folder = dataset_dir(dataset)
    if side == "passage":
        t = store.read_table(folder, "corpus.parquet", columns=["doc_id", "title", "text"])
        t = t.filter(pc.is_in(t.column("doc_id"), value_set=ids))
        return {
            d: passage_text(ti, tx)
            for d, ti, tx in zip(
                t.column("doc_id").to_pylist(), t.column("title").to_pylist(), t.column("text").to_pylist(), strict=True
            )
        }
    t = store.read_table(folder, "queries.parquet", columns=["query_id", "text"])
    t = t.filter(pc.is_in(t.column("query_id"), value_set=ids))
    out: dict[str, str] = {}
    for q, tx in zip(t.column("query_id").to_pylist(), t.column("text").to_pylist(), strict=True):
        out.setdefault(q, tx)
    return out


_RERANKERS: KeyedCache[str, Reranker] = KeyedCache()  # one loaded model at a time


def _reranker(cfg: RerankConfig) -> Reranker:
    """One loaded reranker per process and settings (a worker keeps it across units)."""
    key = cfg.model_dump_json(
        include={"method", "backbone", "prompt", "doc_tokens", "window", "step", "steps", "batch_size"}
    )
    return _RERANKERS.get(
        key,
        lambda: make_reranker(
            cfg.method,
            load_backbone(cfg.backbone),
            prompt=cfg.prompt,
            doc_tokens=cfg.doc_tokens,
            window=cfg.window,
            step=cfg.step,
            batch_size=cfg.batch_size,
            steps=cfg.steps,
        ),
    )


def rerank_run(
    reranker: Reranker,
    first: pa.Table,
    query_text: dict[str, str],
    doc_text: dict[str, str],
    depth: int,
    advance: Any = None,
) -> tuple[pa.Table, dict[str, Any]]:
    """The reranked run (RUN_SCHEMA) of ``first``'s top ``depth`` per query, and what it took."""
    by_query: dict[str, list[tuple[int, str]]] = {}
    for q, d, r in zip(
        first.column("query_id").to_pylist(),
        first.column("doc_id").to_pylist(),
        first.column("rank").to_pylist(),
        strict=True,
    ):
        by_query.setdefault(q, []).append((r, d))
    qids = list(by_query)
    items = []
    for q in qids:
        ranked = [d for _, d in sorted(by_query[q])[:depth]]
        items.append((query_text[q], [(d, doc_text[d]) for d in ranked]))
    before = reranker.stats.forward_passes
    out = reranker.rerank(items, progress=advance)
    cols: dict[str, list] = {"query_id": [], "doc_id": [], "rank": [], "score": []}
    for q, reranked in zip(qids, out, strict=True):
        for rank, (d, s) in enumerate(reranked, start=1):
            cols["query_id"].append(q)
            cols["doc_id"].append(d)
            cols["rank"].append(rank)
            cols["score"].append(s)
    table = pa.Table.from_pydict(cols, schema=RUN_SCHEMA)
    stats = {
        "queries": len(qids),
        "rows": table.num_rows,
        "forward_passes": reranker.stats.forward_passes - before,
        "invalid_without_constraint": reranker.stats.invalid_without_constraint,
    }
    return table, stats


stage = Rerank()
