"""The bot stage: SIDR's binary bag-of-tokens index of a dataset's passages, from stored token ids (no model).

    bot/tokenizer=<slug>/dataset=<d>/bot.parquet        id, token_ids (distinct, sorted, special ids dropped)

It reads the passage side's ``tokens/`` shard by shard (the same ids every readout of that tokenizer reads), so
memory is one shard's, and records in its manifest what it cost: build seconds, bytes, passages, nnz and density
(the ``bot_indexes`` view). Beta search (SIDR_beta) scores a query encoder's sparse vectors against it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from diffret.retrieval.data.sources import corpus_of
from diffret.retrieval.fields import like
from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.models.sparse import excluded_ids
from diffret.retrieval.search.bot import bag_of_tokens
from diffret.storage import IncompleteArtifactError, Manifest
from diffret.storage.layout import BOT_FILE, BOT_SCHEMA, bot_dir, tokens_dir

from .base import Context, Folder, Plan, Stage, StageConfig, StageResult
from .presentation import Presentation
from .readers import tokens_manifest
from .systems import tokenizer_of, tokens_slug, vocab_hash
from .tokenize import TokenizeConfig


class BotConfig(StageConfig):
    """Parameters of the bot flow: whose tokenizer, which passages."""

    dataset: str = like(TokenizeConfig, "dataset")
    backbone: BackboneConfig = like(TokenizeConfig, "backbone")
    max_length: int = like(TokenizeConfig, "max_length")
    title_sep: str = like(TokenizeConfig, "title_sep")
    shard_size: int = like(TokenizeConfig, "shard_size")

    def tokenize_config(self) -> TokenizeConfig:
        """The tokenize stage's settings for the passages this index reads (the bot flow tokenizes them first, as the
        encode flow does)."""
        return TokenizeConfig(
            root=self.root,
            force=self.force,
            dataset=corpus_of(self.dataset),
            sides=["passage"],
            backbone=self.backbone,
            max_length=self.max_length,
            title_sep=self.title_sep,
            shard_size=self.shard_size,
        )


@dataclass
class BotPlan(Plan):
    """A bot run's plan: the index folder it builds (or found current)."""

    folder: str = ""


class Bot(Stage, name="bot", config=BotConfig, noun="index(es)", verb="built"):
    """SIDR's binary bag-of-tokens index of a corpus (its passages tokenized first where they are not yet): a pass
    over its stored token ids, no model."""

    def prerequisites(self, config: BotConfig) -> list[tuple[str, StageConfig]]:
        """The passages' tokens, where they are missing."""
        return [("tokenize", config.tokenize_config())]

    def plan(self, config: BotConfig, ctx: Context) -> Plan:
        corpus = corpus_of(config.dataset)
        slug = tokens_slug(config.backbone, config.max_length, config.title_sep)
        t_folder = tokens_dir(slug, corpus, "passage")
        t_man = tokens_manifest(
            ctx.store,
            t_folder,
            f"run `diffret tokenize -d {corpus} --side passage --model "
            f"{config.backbone.model}` (or `diffret encode`) first",
        )
        tokenizer = tokenizer_of(config.backbone)
        cfg = {
            "tokenizer": slug,
            "dataset": corpus,
            "excluded_ids": sorted(excluded_ids(tokenizer)),
            "vocab_size": len(tokenizer),
            "vocab_hash": vocab_hash(tokenizer),
            "inputs": {"tokens": t_man.config_hash, "rows": t_man.total_rows()},
        }
        folder = bot_dir(slug, corpus)
        plan = BotPlan(system=slug, folder=folder)
        if plan.needs(ctx, folder, cfg, config.force):
            plan.units.append(Folder(folder, cfg))
        return plan

    def run(self, unit: Folder, ctx: Context) -> dict[str, Any]:
        store, c = ctx.store, unit.config
        t_folder = tokens_dir(c["tokenizer"], c["dataset"], "passage")
        t_man = store.require_manifest(t_folder)
        if t_man.config_hash != c["inputs"]["tokens"]:
            raise IncompleteArtifactError(f"{store.abspath(t_folder)}: changed since the bot stage planned; run again")
        start = time.perf_counter()
        counts = {"passages": 0, "nnz": 0}

        def batches() -> Iterator[pa.Table]:
            for name in sorted(t_man.files):  # shard by shard: memory is one shard's
                t = store.read_table(t_folder, name, columns=["id", "token_ids"])
                bags = bag_of_tokens(t.column("token_ids"), c["excluded_ids"])
                counts["passages"] += len(bags)
                counts["nnz"] += len(bags.values)
                yield pa.table({"id": t.column("id"), "token_ids": bags}, schema=BOT_SCHEMA)

        m = Manifest.new("bot", {"tokenizer": c["tokenizer"], "dataset": c["dataset"]}, c)
        with store.folder_writer(unit.stage, m) as w:
            entry = w.write_parquet(BOT_FILE, BOT_SCHEMA, batches())
            vocab = int(c["vocab_size"])
            seconds = time.perf_counter() - start
            m.stats = {
                "passages": counts["passages"],
                "nnz": counts["nnz"],
                "bytes": entry.bytes,
                "build_seconds": round(seconds, 3),
                "vocab_size": vocab,
                "mean_tokens": counts["nnz"] / max(counts["passages"], 1),
                "density": counts["nnz"] / max(counts["passages"] * vocab, 1),
            }
        ctx.log(
            f"bag of tokens {c['dataset']}: {counts['passages']:,} passages, {counts['nnz']:,} distinct tokens, "
            f"{entry.bytes:,} bytes in {seconds:.1f}s"
        )
        return m.stats

    def finish(self, config: BotConfig, plan: Plan, results: list[Any], ctx: Context) -> dict[str, Any]:
        assert isinstance(plan, BotPlan)
        stats = results[0] if results else ctx.store.require_manifest(plan.folder).stats
        return {"stage": plan.folder, "stats": stats}


def _printed(result: StageResult) -> list[str]:
    s = result.details.get("stats") or {}
    return [
        f"bag of tokens: {s.get('passages', 0):,} passages, {s.get('mean_tokens', 0):.1f} distinct tokens "
        f"each, {s.get('bytes', 0):,} bytes, built in {s.get('build_seconds', 0):.2f}s"
    ]


presentation = Presentation(
    deployment=(
        "SIDR's binary bag-of-tokens index of a dataset's passages: their distinct token ids (special ids "
        "dropped), built from the stored token ids with no model (tokenized first where they are not yet). Its "
        "manifest records the build seconds, bytes and density (the bot_indexes view)."
    ),
    example={
        "dataset": "scifact",
        "backbone": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
    },
    next_step="search it with a SIDR system: `diffret beta -d {dataset}` (the beta deployment).",
    printed=_printed,
)


stage = Bot()
