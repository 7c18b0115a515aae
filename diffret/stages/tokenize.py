"""The tokenize stage: a dataset side's texts -> token ids, once per (tokenizer, max_length).

    tokens/tokenizer=<slug>/dataset=<d>/side=<s>/shard=NNNNN.parquet      text token ids (no special tokens), raw text

A shard is a contiguous range of the side's texts (corpus order; queries in first-appearance order). Every
K of the grid and every readout of the same tokenizer reads these ids; the prompt, masks and closing
tokens are added at encode time. The raw text travels with the ids: the sparse content-word filter reads it
whole, as the reference does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field

from diffret.retrieval.fields import cli
from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.models.encoding import tokenize_texts
from diffret.retrieval.models.readouts import DEFAULT_MAX_LENGTH
from diffret.retrieval.models.sparse import make_filter, word_pool
from diffret.storage import FileEntry
from diffret.storage.layout import FILTER_SCHEMA, TOKENS_SCHEMA, filters_dir, shard_name, tokens_dir

from .base import Context, ShardedPlan, ShardedStage, StageConfig
from .presentation import Presentation
from .readers import TITLE_SEP, side_size, side_text_ranges
from .systems import tokenizer_of, tokens_slug

DEFAULT_MODEL = "dllm-hub/ModernBERT-base-chat-v0.1"


def default_backbone() -> BackboneConfig:
    """The backbone a stage's command starts from when ``--model`` is not given.

    >>> default_backbone().model
    'dllm-hub/ModernBERT-base-chat-v0.1'
    """
    return BackboneConfig(model=DEFAULT_MODEL)


class TokenizeConfig(StageConfig):
    """Parameters of the tokenize stage (part of the encode flow)."""

    dataset: str = Field(
        description="A dataset already in the store (diffret download).", json_schema_extra=cli(short="-d")
    )
    sides: list[Literal["query", "passage"]] = Field(
        default=["query", "passage"], description="The sides to tokenize.", json_schema_extra=cli(flag="--side")
    )
    backbone: BackboneConfig = Field(default_factory=default_backbone, description="The model whose tokenizer is used.")
    max_length: int = Field(default=DEFAULT_MAX_LENGTH, ge=1, description="Text tokens kept per text.")
    title_sep: str = Field(default=TITLE_SEP, description="Between a passage's title and its text.")
    shard_size: int = Field(default=1000, ge=1, description="Texts per shard (unit of parallelism and resume).")
    verify: bool = Field(
        default=False, description="Check every stored shard's sha256 when planning (default: its size and mtime)."
    )
    content_filter: Literal["none", "nltk", "regex"] = Field(
        default="none",
        description="Also store the sparse content-word filter's ids of every text (filters/), "
        "computed once here and read by every K pass of every system of this tokenizer (the encode flow asks for "
        "its readout's filter).",
    )
    filter_workers: int = Field(
        default=0,
        ge=0,
        description="Processes that split the texts into words for the content filter (0: one per "
        "CPU core where a side has 5,000 texts or more to filter; 1: this process only).",
    )


def filter_config(slug: str, dataset: str, side: str, kind: str, tokens_hash: str, flt: Any) -> dict[str, Any]:
    """A filters/ folder's config: what it is of, and (as inputs, so that a new NLTK makes it stale, not drifted)
    the tokens it read and the filter's version."""
    return {
        "tokenizer": slug,
        "dataset": dataset,
        "side": side,
        "filter": kind,
        "inputs": {"tokens": tokens_hash, "filter": flt.version()},
    }


def shard_ranges(n: int, shard_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of ``shard_size`` texts (one empty range for an empty side).

    >>> shard_ranges(5, 2)
    [(0, 2), (2, 4), (4, 5)]
    """
    return [(s, min(s + shard_size, n)) for s in range(0, n, shard_size)] or [(0, 0)]


def tokens_config(
    slug: str, dataset: str, side: str, max_length: int, title_sep: str, shard_size: int, rows: int, dataset_hash: str
) -> dict[str, Any]:
    return {
        "tokenizer": slug,
        "dataset": dataset,
        "side": side,
        "max_length": max_length,
        "title_sep": title_sep,
        "shard_size": shard_size,
        "inputs": {"dataset": dataset_hash, "rows": rows},
    }


@dataclass
class TokenizeUnit:
    dataset: str
    side: str
    stage: str
    backbone: dict[str, Any]
    max_length: int
    title_sep: str
    rows: int
    shards: list[tuple[str, int, int]]  # (name, start, end) still to do
    config_hash: str  # of the folder's manifest when planned: the shards are recorded against it
    filter_kind: str = "none"  # the content filter whose ids are stored beside (filters/)
    filter_folder: str = ""
    filter_shards: list[tuple[str, int, int]] = field(default_factory=list)  # of the filter folder, still to do
    filter_hash: str = ""
    filter_workers: int = 0  # processes splitting texts into words (word_pool)


class Tokenize(ShardedStage, name="tokenize", config=TokenizeConfig, noun="shard(s)", verb="tokenized"):
    """Tokenize a dataset's queries and passages once per tokenizer."""

    def plan(self, config: TokenizeConfig, ctx: Context) -> ShardedPlan:
        slug = tokens_slug(config.backbone, config.max_length, config.title_sep)
        plan = ShardedPlan(system=slug)
        for side in config.sides:
            n, ds_hash = side_size(ctx.store, config.dataset, side)
            folder = tokens_dir(slug, config.dataset, side)
            cfg = tokens_config(
                slug, config.dataset, side, config.max_length, config.title_sep, config.shard_size, n, ds_hash
            )
            part = {"tokenizer": slug, "dataset": config.dataset, "side": side}
            ctx.hold(folder)  # another tokenize of this folder running now is refused, not raced
            m, done = ctx.store.open_sharded(folder, "tokens", part, cfg, force=config.force, verify=config.verify)
            plan.folders[side] = folder
            shards = [(shard_name(i), s, e) for i, (s, e) in enumerate(shard_ranges(n, config.shard_size))]
            todo = [sh for sh in shards if sh[0] not in done]
            plan.skipped += len(shards) - len(todo)
            unit = TokenizeUnit(
                config.dataset,
                side,
                folder,
                config.backbone.model_dump(),
                config.max_length,
                config.title_sep,
                n,
                todo,
                m.config_hash,
            )
            if config.content_filter != "none":
                f_folder = filters_dir(slug, config.dataset, side, config.content_filter)
                f_cfg = filter_config(
                    slug,
                    config.dataset,
                    side,
                    config.content_filter,
                    m.config_hash,
                    make_filter(tokenizer_of(config.backbone), config.content_filter),
                )
                ctx.hold(f_folder)
                fm, f_done = ctx.store.open_sharded(
                    f_folder,
                    "filters",
                    {**part, "filter": config.content_filter},
                    f_cfg,
                    force=config.force,
                    verify=config.verify,
                )
                plan.folders[f"{side}/filter={config.content_filter}"] = f_folder
                unit.filter_kind, unit.filter_folder, unit.filter_hash = config.content_filter, f_folder, fm.config_hash
                unit.filter_workers = config.filter_workers
                unit.filter_shards = [sh for sh in shards if sh[0] not in f_done]
                plan.skipped += len(shards) - len(unit.filter_shards)
            if unit.shards or unit.filter_shards:
                plan.units.append(unit)
        plan.count = sum(self.work_of(u) for u in plan.units)
        return plan

    def work_of(self, unit: TokenizeUnit) -> int:
        return len(unit.shards) + len(unit.filter_shards)

    def run(self, unit: TokenizeUnit, ctx: Context) -> list[tuple[str, FileEntry]]:
        """Tokenize the side's missing shards (its texts are read once, only when a shard is missing)."""
        tokenizer = tokenizer_of(BackboneConfig.model_validate(unit.backbone))
        size, _ = side_size(ctx.store, unit.dataset, unit.side)
        if size != unit.rows:
            raise ValueError(f"{unit.dataset}/{unit.side}: {size} texts, the plan counted {unit.rows}")
        out = []
        tokens = {(s, e): name for name, s, e in unit.shards}
        filters = {(s, e): name for name, s, e in unit.filter_shards}
        flt = make_filter(tokenizer, unit.filter_kind) if filters else None
        todo = sum(e - s for s, e in filters)
        with word_pool(unit.filter_workers, todo) if filters else contextlib.nullcontext() as pool:
            # the side's texts a shard at a time (memory: a shard, not the corpus)
            for s, e, ids, texts in side_text_ranges(
                ctx.store, unit.dataset, unit.side, sorted({*tokens, *filters}), unit.title_sep
            ):
                if (s, e) in tokens:
                    name = tokens[(s, e)]
                    t = tokenize_texts(tokenizer, texts, unit.max_length)
                    t = t.add_column(0, "id", pa.array(ids, pa.string()))
                    t = t.append_column("text", pa.array(texts, pa.string())).cast(TOKENS_SCHEMA)
                    entry = ctx.store.write_shard(unit.stage, name, t)
                    # recorded as each shard is written (an appended record, safe from any process): a run killed
                    # half-way through a side keeps the shards it finished
                    ctx.store.record_shard(unit.stage, name, entry, unit.config_hash)
                    out.append((name, entry))
                if (s, e) in filters:
                    assert flt is not None
                    name = filters[(s, e)]
                    allowed = pa.array(flt.allowed_many(texts, pool), pa.list_(pa.int32()))
                    t = pa.table({"id": pa.array(ids, pa.string()), "allowed_ids": allowed}, schema=FILTER_SCHEMA)
                    entry = ctx.store.write_shard(unit.filter_folder, name, t)
                    ctx.store.record_shard(unit.filter_folder, name, entry, unit.filter_hash)
                    out.append((name, entry))
        if unit.shards:
            ctx.log(f"tokenized {unit.dataset}/{unit.side}: {len(unit.shards)} shard(s), {unit.rows:,} texts")
        if unit.filter_shards:
            ctx.log(f"filtered {unit.dataset}/{unit.side} ({unit.filter_kind}): {len(unit.filter_shards)} shard(s)")
        return out


presentation = Presentation(
    deployment=(
        "Tokenize a stored dataset's queries and passages once per (tokenizer, max_length); the encode flow runs "
        "it first, so this deployment is for tokenizing ahead of encoding."
    ),
    example={
        "dataset": "scifact",
        "backbone": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
    },
    next_step=(
        "encode the tokens: `diffret encode -d {dataset}` (the encode deployment); SIDR's bag of tokens: "
        "`diffret bot -d {dataset}`."
    ),
)


stage = Tokenize()
