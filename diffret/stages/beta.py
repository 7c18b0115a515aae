"""The beta stage: SIDR_beta search, any stored system's sparse query vectors against a bag-of-tokens index.

    runs/system=<slug>/dataset=<d>/split=<s>/kq=<K_q>/kp=0/mode=beta/run.parquet

A query's score for a passage is the sum of its sparse weights over the tokens the passage contains (the bot
stage's index of the query encoder's own tokenizer): no passage is encoded. SIDR's sparse vectors, DiffRetriever's
K-mask sparse vectors and PromptReps' all search it the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import Field

from diffret.caching import KeyedCache
from diffret.retrieval.fields import like
from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.search.bot import beta_search, bot_blocks
from diffret.retrieval.search.encodings import SparseFlat
from diffret.retrieval.search.rules import ScoreRules
from diffret.retrieval.search.runs import topk_table
from diffret.retrieval.search.scoring import TopK
from diffret.storage import FileEntry, IncompleteArtifactError, StoreError, config_hash
from diffret.storage.layout import bot_dir, encodings_dir, run_dir

from .base import ClusterConfig, Context, KList, shared_settings
from .passes import Pass, PassPlan, PassStage, PassUnit, even_blocks, merged_blocks, pass_queries, write_unit
from .readers import bot_index, budgets, encoding_manifest, split_queries
from .runs import Cell, RetrievalConfig, cell_config, search_depth, write_runs
from .score import ScoreConfig
from .systems import SystemRecord, SystemRef, find_system, tokenizer_of, vocab_hash


class BetaConfig(RetrievalConfig, ClusterConfig):
    """Parameters of the beta flow."""

    system: SystemRef = Field(
        default_factory=SystemRef, description="The query encoder: a stored system with sparse query vectors."
    )
    kq: KList | None = Field(
        default=None, description="Query budgets K_q (default: every K_q whose query encodings are stored)."
    )
    bot: str | None = Field(
        default=None,
        description="The bag-of-tokens index's tokenizer slug (`diffret sql "
        "'from bot_indexes'`); default: the one the system's queries were tokenized with.",
    )
    unit_passages: int = like(ScoreConfig, "unit_passages")


@dataclass
class BetaMerge:
    """What merging a beta pass's blocks into its runs needs."""

    cells: list[Cell]
    depth: int
    ignore: bool
    query_ids: list[str]
    split_rows: dict[str, list[int]]
    passages: int
    bot_folder: str


class Beta(PassStage, name="beta", config=BetaConfig, noun="run(s)", verb="written", distributed=True):
    """SIDR_beta: sparse query vectors against the passages' binary bag of tokens (no passage encoded)."""

    deployment = (  # the Prefect deployment's description (flows/deployments.py)
        "SIDR_beta search: a stored system's sparse query vectors against the bag-of-tokens index of its "
        "tokenizer (the bot deployment builds it); no passage is encoded. One run folder per (split, K_q) with "
        "mode beta, kp 0."
    )
    example = {
        "dataset": "scifact",
        "system": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
        "kq": [1],
    }  # the deployment's parameters, besides root

    next_step = (
        "evaluate the runs: `diffret evaluate -d {dataset}` (the evaluate deployment); re-score the top m: "
        "`diffret late -d {dataset}`."
    )

    def plan(self, config: BetaConfig, ctx: Context) -> PassPlan:
        store, corpus = ctx.store, config.corpus_name()
        record = find_system(store, config.system)
        if not record.has_sparse:
            raise ValueError(
                f"{record.system}: the {record.readout} readout has no sparse vectors; beta search needs "
                "a sparse query side (sidr, diffretriever, promptreps)"
            )
        config = config.model_copy(
            update={"kq": budgets(store, config.kq, record.system, config.dataset, "query", ctx.log)}
        )
        q_folders = {kq: encodings_dir(record.system, config.dataset, "query", kq) for kq in config.kq}
        q_hashes = {}
        tokens = None
        for kq, st in q_folders.items():
            m = encoding_manifest(store, st)
            q_hashes[str(kq)] = m.config_hash
            tokens = m.config.get("tokens", tokens)
        slug = config.bot or tokens
        b_folder = bot_dir(str(slug), corpus)
        b_man = store.read_manifest(b_folder)
        if b_man is None:
            raise IncompleteArtifactError(
                f"{store.abspath(b_folder)}: no bag-of-tokens index; run `diffret bot -d {corpus} --model "
                f"{record.model}` first"
            )
        _check_tokenizer(record, b_man.config)
        inputs = {"queries": q_hashes, "bot": b_man.config_hash}
        split_ids = {s: split_queries(store, config.dataset, s) for s in config.splits}
        plan = PassPlan(system=record.system, work=0, work_unit="passages")
        cells = []
        for split in config.splits:
            for kq in config.kq:
                cfg = cell_config(
                    record.system,
                    config.dataset,
                    corpus,
                    split,
                    kq,
                    0,
                    "beta",
                    config.depth(split),
                    0,
                    config.ignore_ids(),
                    {"queries": q_hashes[str(kq)], "bot": b_man.config_hash},
                )
                cfg["bot"] = b_man.partition
                folder = run_dir(record.system, config.dataset, split, kq, 0, "beta")
                if plan.needs(ctx, folder, cfg, config.force):
                    cells.append(Cell(split, kq, 0, "beta", folder, cfg))
        plan.count = len(cells)
        plan.details["inputs"] = inputs
        if not cells:
            return plan
        query_ids = list(dict.fromkeys(q for c in cells for q in split_ids[c.split]))
        row = {q: i for i, q in enumerate(query_ids)}
        split_rows = {s: [row[q] for q in split_ids[s]] for s in {c.split for c in cells}}
        factor = ScoreRules().factor_for(record.readout, record.settings.get("readout"))
        ignore = config.ignore_ids()
        depth = search_depth(cells)
        shared = {
            "query_stages": {str(kq): q_folders[kq] for kq in sorted({c.kq for c in cells})},
            "query_ids": query_ids,
            "bot_stage": b_folder,
            "topk": depth + (1 if ignore else 0),
            "sparse_factor": factor,
        }
        pass_cfg = {
            **{k: v for k, v in shared.items() if k != "query_ids"},
            "query_ids": config_hash({"ids": query_ids}),
            "unit_passages": config.unit_passages,
            "inputs": inputs,
        }
        n_passages = b_man.total_rows()
        blocks = even_blocks(n_passages, config.unit_passages, "passages")
        merge = BetaMerge(cells, depth, ignore, query_ids, split_rows, n_passages, b_folder)
        done = self.add_pass(
            ctx,
            plan,
            system=record.system,
            dataset=config.dataset,
            kp=0,
            config=pass_cfg,
            shared=shared,
            blocks=blocks,
            merge=merge,
        )
        ctx.log(
            f"beta: {len(cells)} run(s), {len(query_ids):,} queries over {n_passages:,} passages' bags of tokens "
            f"({b_man.partition.get('tokenizer')}) in {len(blocks)} unit(s), {done} already done"
        )
        return plan

    def run(self, unit: PassUnit, ctx: Context) -> FileEntry:
        """Every K_q's queries against a block of the bags: its top-k (corpus positions) to the pass's partials."""
        store = ctx.store
        shared = shared_settings(ctx, unit.plan)
        bags = _bags(ctx, shared["bot_stage"]).rows(unit.start, unit.end)
        tops, seconds = {}, 0.0
        for kq, enc in pass_queries(ctx, unit.plan, shared, "cpu").items():
            q = SparseFlat.from_lists(enc.sparse_ids, enc.sparse_weights)
            start = time.perf_counter()
            top = beta_search(q, bot_blocks(bags), int(shared["topk"]))
            seconds += time.perf_counter() - start
            top.index[top.index >= 0] += unit.start
            tops[(kq, "beta")] = top
        return write_unit(store, unit, topk_table(tops), seconds)

    def merge(self, done: Pass, ctx: Context) -> None:
        """The pass's blocks merged (the top k of their top k), self hits dropped where asked, the runs written."""
        info: BetaMerge = done.merge
        store = ctx.store
        tops, seconds = merged_blocks(store, done.folder, info.depth + (1 if info.ignore else 0), info.passages)
        doc_ids, _ = bot_index(store, info.bot_folder)
        for (kq, mode), top in tops.items():
            if info.ignore:
                top = drop_self_hits(top, info.query_ids, doc_ids, info.depth)
            cells = [c for c in info.cells if c.kq == kq]
            write_runs(store, cells, {(kq, mode): top}, info.query_ids, doc_ids, info.split_rows, seconds)


_BAGS: KeyedCache[tuple[str, str], SparseFlat] = KeyedCache()


def _bags(ctx: Context, folder: str) -> SparseFlat:
    """A bag-of-tokens index, read once per process (the units of a pass each take a block of it)."""
    return _BAGS.get((ctx.store.root, folder), lambda: bot_index(ctx.store, folder)[1])


def _check_tokenizer(record: SystemRecord, bot_config: dict[str, Any]) -> None:
    """Refuse a bag-of-tokens index built with another vocabulary than the query encoder's, naming both."""
    backbone = BackboneConfig(model=record.model or "", gguf_file=record.settings.get("gguf_file"))
    mine = vocab_hash(tokenizer_of(backbone))
    theirs = bot_config.get("vocab_hash")
    if theirs is not None and theirs != mine:
        raise StoreError(
            f"the bag-of-tokens index {bot_config.get('tokenizer')!r} was built with another tokenizer "
            f"than the query encoder {record.system!r} ({record.model}): their token ids do not "
            "mean the same words; build one with `diffret bot --model <the encoder's model>`"
        )


def drop_self_hits(top: TopK, query_ids: list[str], doc_ids: list[str], depth: int) -> TopK:
    """The top ``depth`` without the document whose id is the query's (BEIR's evaluation of ArguAna / Quora).

    >>> t = TopK(np.array([[3.0, 2.0, 1.0]], np.float32), np.array([[1, 0, 2]]))
    >>> drop_self_hits(t, ["b"], ["a", "b", "c"], 2).index.tolist()
    [[0, 2]]
    """
    scores = np.full((len(query_ids), depth), -np.inf, np.float32)
    index = np.full((len(query_ids), depth), -1, np.int64)
    for i, q in enumerate(query_ids):
        keep = [j for j, d in enumerate(top.index[i]) if d < 0 or doc_ids[d] != q][:depth]
        scores[i, : len(keep)], index[i, : len(keep)] = top.scores[i, keep], top.index[i, keep]
    return TopK(scores, index)


stage = Beta()
