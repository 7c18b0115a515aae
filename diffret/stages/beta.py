"""The beta stage: SIDR_beta search, any stored system's sparse query vectors against a bag-of-tokens index.

    runs/system=<slug>/dataset=<d>/split=<s>/kq=<K_q>/kp=0/mode=beta/run.parquet

A query's score for a passage is the sum of its sparse weights over the tokens the passage contains (the bot
stage's index of the query encoder's own tokenizer): no passage is encoded. SIDR's sparse vectors, DiffRetriever's
K-mask sparse vectors and PromptReps' all search it the same way.
"""

from __future__ import annotations

import itertools
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
from diffret.storage import FileEntry, IncompleteArtifactError, Manifest, StoreError
from diffret.storage.layout import bot_dir, encodings_dir, run_dir

from .base import ClusterConfig, Context, KList, read_shared
from .passes import (
    Pass,
    PassPlan,
    PassShared,
    PassStage,
    PassUnit,
    even_blocks,
    merged_blocks,
    pass_queries,
    write_unit,
)
from .presentation import Presentation
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


class BetaShared(PassShared):
    """What every unit of a beta pass shares: the queries (:class:`PassShared`), the bags' folder, the depth."""

    bot_folder: str
    topk: int


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


class Beta(PassStage[BetaMerge], name="beta", config=BetaConfig, noun="run(s)", verb="written", distributed=True):
    """SIDR_beta: sparse query vectors against the passages' binary bag of tokens (no passage encoded)."""

    def plan(self, config: BetaConfig, ctx: Context) -> PassPlan[BetaMerge]:
        store, corpus = ctx.store, config.corpus_name()
        record = find_system(store, config.system)
        if not record.has_sparse:
            raise ValueError(
                f"{record.system}: the {record.readout} readout has no sparse vectors; beta search needs "
                "a sparse query side (sidr, diffretriever, promptreps)"
            )
        kqs = budgets(store, config.kq, record.system, config.dataset, "query", ctx.log)
        q_folders = {kq: encodings_dir(record.system, config.dataset, "query", kq) for kq in kqs}
        q_mans = {kq: encoding_manifest(store, f) for kq, f in q_folders.items()}
        tokens = next((m.config["tokens"] for m in reversed(q_mans.values()) if "tokens" in m.config), None)
        b_folder = bot_dir(str(config.bot or tokens), corpus)
        b_man = store.read_manifest(b_folder)
        if b_man is None:
            raise IncompleteArtifactError(
                f"{store.abspath(b_folder)}: no bag-of-tokens index; run `diffret bot -d {corpus} --model "
                f"{record.model}` first"
            )
        _check_tokenizer(record, b_man.config)
        plan: PassPlan[BetaMerge] = PassPlan(system=record.system, work=0, work_unit="passages")
        cells = []
        for split, kq in itertools.product(config.splits, kqs):
            cfg = cell_config(
                system=record.system,
                dataset=config.dataset,
                corpus=corpus,
                split=split,
                kq=kq,
                kp=0,
                mode="beta",
                topk=config.depth(split),
                fusion_depth=0,
                ignore=config.ignore_ids(),
                inputs={"queries": q_mans[kq].config_hash, "bot": b_man.config_hash},
            )
            cfg["bot"] = b_man.partition
            folder = run_dir(record.system, config.dataset, split, kq, 0, "beta")
            if plan.needs(ctx, folder, cfg, config.force):
                cells.append(Cell(split, kq, 0, "beta", folder, cfg))
        plan.count = len(cells)
        if cells:
            inputs = {"queries": {str(kq): m.config_hash for kq, m in q_mans.items()}, "bot": b_man.config_hash}
            self._plan_pass(
                config,
                ctx,
                plan=plan,
                record=record,
                cells=cells,
                q_folders=q_folders,
                b_folder=b_folder,
                b_man=b_man,
                inputs=inputs,
            )
        return plan

    def _plan_pass(
        self,
        config: BetaConfig,
        ctx: Context,
        *,
        plan: PassPlan[BetaMerge],
        record: SystemRecord,
        cells: list[Cell],
        q_folders: dict[int, str],
        b_folder: str,
        b_man: Manifest,
        inputs: dict[str, Any],
    ) -> None:
        """The one pass over the bags for ``cells``: its shared record, its blocks of passages and its merge."""
        split_ids = {s: split_queries(ctx.store, config.dataset, s) for s in config.splits}
        query_ids = list(dict.fromkeys(q for c in cells for q in split_ids[c.split]))
        row = {q: i for i, q in enumerate(query_ids)}
        split_rows = {s: [row[q] for q in split_ids[s]] for s in {c.split for c in cells}}
        ignore, depth = config.ignore_ids(), search_depth(cells)
        shared = BetaShared(
            query_folders={kq: q_folders[kq] for kq in sorted({c.kq for c in cells})},
            query_ids=query_ids,
            sparse_factor=ScoreRules().factor_for(record.readout, record.settings.get("readout")),
            bot_folder=b_folder,
            topk=depth + (1 if ignore else 0),
        )
        n_passages = b_man.total_rows()
        blocks = even_blocks(n_passages, config.unit_passages, "passages")
        merge = BetaMerge(cells, depth, ignore, query_ids, split_rows, n_passages, b_folder)
        done = self.add_pass(
            ctx,
            plan,
            system=record.system,
            dataset=config.dataset,
            kp=0,
            config=shared.pass_config(unit_passages=config.unit_passages, inputs=inputs),
            shared=shared,
            blocks=blocks,
            merge=merge,
        )
        ctx.log(
            f"beta: {len(cells)} run(s), {len(query_ids):,} queries over {n_passages:,} passages' bags of tokens "
            f"({b_man.partition.get('tokenizer')}) in {len(blocks)} unit(s), {done} already done"
        )

    def run(self, unit: PassUnit, ctx: Context) -> FileEntry:
        """Every K_q's queries against a block of the bags: its top-k (corpus positions) to the pass's partials."""
        store = ctx.store
        shared = read_shared(ctx, unit.plan, BetaShared)
        bags = _bags(ctx, shared.bot_folder).rows(unit.start, unit.end)
        tops, seconds = {}, 0.0
        for kq, enc in pass_queries(ctx, unit.plan, shared, "cpu").items():
            q = SparseFlat.from_lists(enc.sparse_ids, enc.sparse_weights)
            start = time.perf_counter()
            top = beta_search(q, bot_blocks(bags), shared.topk)
            seconds += time.perf_counter() - start
            top.index[top.index >= 0] += unit.start
            tops[(kq, "beta")] = top
        return write_unit(store, unit, topk_table(tops), seconds)

    def merge(self, done: Pass[BetaMerge], ctx: Context) -> None:
        """The pass's blocks merged (the top k of their top k), self hits dropped where asked, the runs written."""
        info = done.merge
        store = ctx.store
        tops, seconds = merged_blocks(store, done.folder, info.depth + (1 if info.ignore else 0), info.passages)
        doc_ids, _ = bot_index(store, info.bot_folder)
        for (kq, mode), top in tops.items():
            if info.ignore:
                top = drop_self_hits(top, info.query_ids, doc_ids, info.depth)
            cells = [c for c in info.cells if c.kq == kq]
            write_runs(store, cells, {(kq, mode): top}, info.query_ids, doc_ids, info.split_rows, seconds)


presentation = Presentation(
    deployment=(
        "SIDR_beta search: a stored system's sparse query vectors against the bag-of-tokens index of its "
        "tokenizer (the bot deployment builds it); no passage is encoded. One run folder per (split, K_q) with "
        "mode beta, kp 0."
    ),
    example={
        "dataset": "scifact",
        "system": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
        "kq": [1],
    },
    next_step=(
        "evaluate the runs: `diffret evaluate -d {dataset}` (the evaluate deployment); re-score the top m: "
        "`diffret late -d {dataset}`."
    ),
)


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
