"""The encode stage: stored token ids -> dense + sparse encodings, one folder per (side, K).

    encodings/system=<slug>/dataset=<d>/side=<s>/k=<K>/shard=NNNNN.parquet

K changes the input sequence, so each K is one encoding pass per side: 5 query passes and 5 passage passes
serve all 25 (K_q, K_p) cells. A shard (the tokens stage's shards) is the unit of parallelism and of
resume: it is done when its manifest entry exists and its file still has the recorded size and mtime (its
sha256 with ``verify``). Shard files are written atomically by the units; the planning process records each
as it completes (one line appended to the folder's ``_shards.jsonl``, compacted into the manifest when the
stage finishes or when the next run plans), so a killed run loses at most the shards in flight. The system's full
settings go to the registry (stages/systems.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, model_validator

from diffret.caching import KeyedCache
from diffret.retrieval.fields import cli, like
from diffret.retrieval.models.backbones import (
    BackboneConfig,
    check_random_memory,
    check_weights,
    load_backbone,
    mask_token_id,
    resolve_family,
)
from diffret.retrieval.models.encoding import encode_rows
from diffret.retrieval.models.readouts import DEFAULT_MAX_LENGTH, Readout, ReadoutConfig, make_reader, readout_class
from diffret.retrieval.models.released import read_released
from diffret.retrieval.search.codecs import FLOAT16, Codec, compress_table, parse_store, vectors_of
from diffret.storage import ArtifactStore, FileEntry, Manifest, StoreError, config_hash
from diffret.storage.layout import codebook_dir, encodings_dir, filters_dir, manifest_path, system_dir, tokens_dir

from .base import (
    GRID_K,
    ClusterConfig,
    Context,
    KList,
    Plan,
    ShardedPlan,
    ShardedStage,
    Shared,
    StageConfig,
    check_device,
    put_shared,
    read_shared,
)
from .codebooks import (
    DEFAULT_SAMPLE,
    SampleSize,
    codebook_config,
    compressed_config,
    ensure_codebook,
    make_codec,
    sample_vectors,
)
from .presentation import Presentation
from .readers import read_codebook, tokens_manifest
from .systems import (
    EncodeSettings,
    SystemRecord,
    encoder_record,
    encoder_slug,
    float16_settings,
    numeric_settings,
    register,
    tokenizer_of,
    tokens_slug,
    weights_of,
)
from .tokenize import TokenizeConfig, default_backbone

DEFAULT_BATCH_SIZE = 32  # texts per forward pass; a folder encoded at another records it


class EncodeConfig(StageConfig, ClusterConfig):
    """Parameters of the encode flow."""

    dataset: str = like(TokenizeConfig, "dataset")
    sides: list[Literal["query", "passage"]] = Field(
        default=["query", "passage"], description="The sides to encode.", json_schema_extra=cli(flag="--side")
    )
    k: KList | None = Field(
        default=None,
        description="Budgets K to encode (one pass per K and side), on each side "
        "that --kq / --kp does not name its own (default: a released checkpoint's trained K_q for "
        "queries and K_p for passages, else 1,2,4,8,16).",
    )
    kq: KList | None = Field(default=None, description="Query budgets K_q: the query side's passes (default: k).")
    kp: KList | None = Field(
        default=None,
        description="Passage budgets K_p: the passage side's passes (default: k). "
        "`diffret run --kq 4 --kp 16` encodes the queries at 4 and the passages at 16 only.",
    )
    backbone: BackboneConfig = Field(default_factory=default_backbone, description="The model and how it is loaded.")
    readout: ReadoutConfig = Field(default_factory=ReadoutConfig, description="How a text becomes vectors.")
    max_length: int = Field(
        default=DEFAULT_MAX_LENGTH,
        ge=1,
        description="Tokens per input, prompt included (run_encode.sh's 256; encode.py's 512).",
    )
    title_sep: str = like(TokenizeConfig, "title_sep")
    batch_size: int = Field(
        default=DEFAULT_BATCH_SIZE,
        ge=1,
        description="Texts per forward pass. It changes the vectors' last bits, so it is recorded in the folders' "
        "config: a folder encoded at another batch size is not resumed at this one (--force replaces it).",
    )
    shard_size: int = like(TokenizeConfig, "shard_size")
    verify: bool = like(TokenizeConfig, "verify")
    head_stats: bool = Field(
        default=False,
        description="Also store the LM head's entropy and max probability at "
        "each query slot (the adaptive budgets' features; mask readout; passages unchanged).",
    )
    store: str = like(EncodeSettings, "store")
    store_seed: int = like(EncodeSettings, "store_seed")
    codebook_sample: SampleSize = Field(
        default=DEFAULT_SAMPLE,
        description="Vectors a compressed store's codebook is trained on (a seeded sample, shard by shard), or "
        "'colbert': ColBERTv2's, every vector of min(1 + 16 sqrt(120 N), N) passages (for large collections).",
    )

    @model_validator(mode="after")
    def _k_within_max_length(self) -> EncodeConfig:
        check_k_within([k for side in self.sides for k in self.budgets(side)], self.max_length)
        check_head_stats(self.head_stats, self.readout)
        return self

    def budgets(self, side: str) -> list[int]:
        """The K values encoded on ``side``: its own (``kq`` / ``kp``) when given, else ``k``, else a released
        checkpoint's trained budget of that side, else the paper's grid.

        >>> EncodeConfig(dataset="d", backbone={"model": "org/base"}).budgets("query")
        [1, 2, 4, 8, 16]
        >>> EncodeConfig(dataset="d", kq=[4], kp=[16]).budgets("query")
        [4]
        >>> EncodeConfig(dataset="d", k=[1, 4]).budgets("passage")
        [1, 4]
        """
        own = self.kq if side == "query" else self.kp
        if own is not None:
            return list(own)
        if self.k is not None:
            return list(self.k)
        ckpt = read_released(self.backbone.adapter or self.backbone.model)
        return [ckpt.budget(side)] if ckpt is not None else list(GRID_K)

    def settings(self) -> EncodeSettings:
        return EncodeSettings(
            backbone=self.backbone,
            readout=self.readout,
            max_length=self.max_length,
            title_sep=self.title_sep,
            store=self.store,
            store_seed=self.store_seed,
        )

    def tokenize_config(self) -> TokenizeConfig:
        return TokenizeConfig(
            root=self.root,
            force=self.force,
            dataset=self.dataset,
            sides=self.sides,
            backbone=self.backbone,
            max_length=self.max_length,
            title_sep=self.title_sep,
            shard_size=self.shard_size,
            verify=self.verify,
            content_filter=readout_class(self.readout.readout).filter_kind(self.readout),
        )


def check_k_within(ks: list[int], max_length: int) -> None:
    """Refuse a budget beyond the tokens asked for (before any work): the K slots come on top of the prompt and
    text that ``max_length`` counts.

    >>> try:
    ...     check_k_within([1, 64], 32)
    ... except ValueError as exc:
    ...     print(str(exc)[:36])
    K = 64 is beyond --max-length 32: th
    """
    if ks and max(ks) > max_length:
        raise ValueError(
            f"K = {max(ks)} is beyond --max-length {max_length}: the K slots come on top of the prompt "
            "and text it counts, so every input would be far longer than asked; raise --max-length or "
            "lower K"
        )


def check_head_stats(head_stats: bool, readout: ReadoutConfig) -> None:
    """Refuse head stats for a readout without mask slots (before any work).

    >>> try:
    ...     check_head_stats(True, ReadoutConfig(readout="diffembed"))
    ... except ValueError as exc:
    ...     print(str(exc)[:48])
    --head-stats reads the LM head at the mask slots
    """
    if head_stats and readout.readout != "diffretriever":
        raise ValueError(
            f"--head-stats reads the LM head at the mask slots: the {readout.readout} readout has "
            "none (use --readout diffretriever)"
        )


def stored_filter(
    store: ArtifactStore, tokens: str, dataset: str, side: str, kind: str, tokens_hash: str
) -> tuple[str | None, set[str]]:
    """The filters/ folder of a tokens folder and the shards it holds, when it is of these tokens (else none: the
    texts are filtered while encoding, as without it)."""
    if kind == "none":
        return None, set()
    folder = filters_dir(tokens, dataset, side, kind)
    try:
        m = store.read_manifest(folder)
    except StoreError:
        return None, set()
    if m is None or (m.config.get("inputs") or {}).get("tokens") != tokens_hash:
        return None, set()
    return folder, set(m.files)


def encodings_config(
    settings: EncodeSettings,
    tokens: str,
    tokens_hash: str,
    k: int,
    head_stats: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> dict[str, Any]:
    """An encodings folder's config. The batch size (a batch pads to its longest text) and an attention kernel asked
    for change the vectors' last bits, so they are recorded and a shard encoded otherwise is never mixed into the
    folder; they and ``head_stats`` are there only when not the default, so a folder without them keeps its hash.

    >>> s = EncodeSettings(backbone=BackboneConfig(model="org/m"))
    >>> "batch_size" in encodings_config(s, "t", "h", 1), encodings_config(s, "t", "h", 1, batch_size=16)["batch_size"]
    (False, 16)
    """
    extra: dict[str, Any] = {"head_stats": True} if head_stats else {}
    if batch_size != DEFAULT_BATCH_SIZE:
        extra["batch_size"] = batch_size
    if settings.backbone.attn_implementation is not None:
        extra["attn_implementation"] = settings.backbone.attn_implementation
    return {**numeric_settings(settings), "k": k, "tokens": tokens, **extra, "inputs": {"tokens": tokens_hash}}


class EncodeShared(Shared):
    """What every shard of an encode run shares: the settings, the batch size, the weights' fingerprint, and the
    folders the run holds (so the key belongs to that run, which removes it when it ends)."""

    settings: EncodeSettings
    batch_size: int
    weights: dict[str, str]
    folders: list[str]


@dataclass
class EncodePlan(ShardedPlan):
    """An encode run's plan: its folders by ``side/k=K``, the system's record and weights (registered with the first
    finished shard), the key of its shared record."""

    record: tuple[SystemRecord, dict[str, str]] | None = None
    shared: str | None = None


@dataclass
class SideTokens:
    """One side's stored tokens as an encode run reads them: the tokenizer's slug, the tokens folder and its
    manifest, and the content filter's folder with the shards it holds."""

    side: str
    tokens: str
    t_folder: str
    t_man: Manifest
    f_folder: str | None
    filtered: set[str]


@dataclass
class EncodeUnit:
    """One shard at one (side, K). What every shard of the run shares (the settings, the batch size, the weights'
    fingerprint) is stored once (:meth:`storage.ArtifactStore.put_plan`) and named by ``plan``: a unit sent to a
    Dask worker, or recorded as a Prefect task's parameters, costs the same few bytes whatever the settings."""

    plan: str  # key of the run's shared record (:class:`EncodeShared`)
    tokens_folder: str
    shard: str
    out_folder: str
    side: str
    k: int
    rows: int
    config_hash: str  # of the folder's manifest when planned: the shard is recorded against it
    filter_folder: str | None = None  # the content filter's ids of the shard's texts, stored at tokenize time
    head_stats: bool = False  # also the LM head's entropy and max probability at each slot
    store: str = FLOAT16  # passages: the storage choice their vectors are coded with (retrieval/search/codecs.py)
    codebook: str | None = None  # its codebook folder, when the choice is trained


_READERS: KeyedCache[str, Readout] = KeyedCache()  # one loaded model at a time
_LOAD_LOCK = threading.Lock()


def reader_for(settings: EncodeSettings) -> Readout:
    """One loaded model per process and settings (a Dask worker keeps it across shards).

    Loading is serialised: transformers builds a model under process-global state (the meta device
    context), so two threads loading at once can hand each other meta tensors.
    """
    settings = float16_settings(settings)  # how the vectors are stored does not change the model
    key = settings.model_dump_json()
    with _LOAD_LOCK:  # the previous model is let go before the next one loads
        return _READERS.get(
            key, lambda: make_reader(load_backbone(settings.backbone), settings.readout, settings.max_length)
        )


def encode_shard(
    ctx: Context,
    *,
    settings: EncodeSettings,
    batch_size: int,
    tokens_folder: str,
    shard: str,
    filter_folder: str | None,
    side: str,
    k: int,
    head_stats: bool = False,
    advance: Callable[[int], None] | None = None,
) -> pa.Table:
    """One tokens shard encoded at K (float16 vectors, the encodings schema)."""
    reader = reader_for(settings)
    t = ctx.store.read_table(tokens_folder, shard)
    ids, filtered = t.column("id").to_pylist(), None
    if filter_folder:  # the filter's ids, stored at tokenize time: the texts are not filtered again
        f = ctx.store.read_table(filter_folder, shard)
        if f.column("id").to_pylist() != ids:
            raise StoreError(
                f"{ctx.store.abspath(filter_folder)}/{shard}: its ids are not the tokens shard's; run "
                "`diffret encode --verify`"
            )
        filtered = f.column("allowed_ids").to_pylist()
    return encode_rows(
        reader,
        ids,
        t.column("token_ids").to_pylist(),
        None if filtered else t.column("text").to_pylist(),
        side=side,
        k=k,
        batch_size=batch_size,
        on_batch=advance or (lambda _n: None),
        filtered=filtered,
        head_stats=head_stats,
    )


_CODECS: KeyedCache[str, Codec] = KeyedCache()


def _codec(ctx: Context, unit: EncodeUnit) -> Codec:
    """The codec a passage unit codes with (its codebook read once per process)."""

    def make() -> Codec:
        codebook, digest = read_codebook(ctx.store, unit.codebook) if unit.codebook else (None, None)
        return make_codec(unit.store, codebook, digest)

    return _CODECS.get(f"{unit.store}|{unit.codebook}", make)


class Encode(
    ShardedStage,
    name="encode",
    config=EncodeConfig,
    noun="shard(s)",
    verb="encoded",
    distributed=True,
    reports_progress=True,
    task_tags=("gpu",),
):
    """Tokenize what is missing, then encode a dataset's queries and passages for every K of the grid: dense
    multi-vectors + sparse weights."""

    def prerequisites(self, config: EncodeConfig) -> list[tuple[str, StageConfig]]:
        """The texts' tokens, where they are missing. Random weights that this machine's device cannot hold are
        refused here, in one line, before anything is tokenized (a joined cluster's workers check their own)."""
        if not config.dask_address:
            check_random_memory(config.backbone)
        return [("tokenize", config.tokenize_config())]

    def plan(self, config: EncodeConfig, ctx: Context) -> EncodePlan:
        check_device(config.backbone.device, config)  # a device this machine lacks: refused before any work
        cls = readout_class(config.readout.readout)
        for side in config.sides:
            cls.check_k(config.budgets(side))
        if cls.name == "diffretriever":  # a masked readout needs a mask token: refused before any work
            mask_token_id(
                tokenizer_of(config.backbone),
                resolve_family(config.backbone),
                config.backbone.mask_token,
                config.backbone.model,
            )
        settings = config.settings()
        record = encoder_record(settings)
        tokens = tokens_slug(config.backbone, config.max_length, config.title_sep)
        plan = EncodePlan(system=record.system, work=0, work_unit="docs")
        weights = weights_of(config.backbone)
        for side in config.sides:
            t_folder = tokens_dir(tokens, config.dataset, side)
            t_man = tokens_manifest(
                ctx.store, t_folder, "run `diffret encode` (which tokenizes first) or the tokenize stage"
            )
            f_folder, filtered = stored_filter(
                ctx.store, tokens, config.dataset, side, cls.filter_kind(config.readout), t_man.config_hash
            )
            texts = SideTokens(side, tokens, t_folder, t_man, f_folder, filtered)
            for k in config.budgets(side):
                self._plan_folder(config, ctx, plan, settings, texts, k)
        register(ctx.store, record, weights, write=False)  # refuses a folder retrained in place
        plan.record = (record, weights)  # registered with the first finished shard (commit, finish)
        if plan.units:  # model work to do: no weights, a truncated or corrupt file fail here, before any
            check_weights(config.backbone)
            # the settings every shard shares, stored once; with the folders in it, the key belongs to the run
            # that holds their locks, which removes it when it ends
            shared = EncodeShared(
                settings=settings, batch_size=config.batch_size, weights=weights, folders=list(plan.folders.values())
            )
            plan.shared = put_shared(ctx, shared)
            for unit in plan.units:
                unit.plan = plan.shared
        return plan

    def _plan_folder(
        self, config: EncodeConfig, ctx: Context, plan: EncodePlan, settings: EncodeSettings, texts: SideTokens, k: int
    ) -> None:
        """One (side, K) encodings folder: opened (a shard an earlier run finished is kept), its codebook first when
        its storage choice is trained, a unit per shard not yet done."""
        side, system = texts.side, plan.system or ""
        folder = encodings_dir(system, config.dataset, side, k)
        stats = config.head_stats and side == "query"
        cfg = encodings_config(settings, texts.tokens, texts.t_man.config_hash, k, stats, config.batch_size)
        codebook = None
        if side == "passage" and parse_store(config.store).trained:
            codebook = codebook_dir(system, config.dataset, k)
            cfg = compressed_config(cfg, self._codebook(config, ctx, settings, texts, k))
        part = {"system": system, "dataset": config.dataset, "side": side, "k": str(k)}
        ctx.hold(folder)  # another encode of this folder running now is refused, not raced
        m, done = ctx.store.open_sharded(folder, "encodings", part, cfg, force=config.force, verify=config.verify)
        plan.folders[f"{side}/k={k}"] = folder
        for shard in sorted(texts.t_man.files):
            if shard in done:
                plan.skipped += 1
                continue
            rows = int(texts.t_man.files[shard].rows or 0)
            unit = EncodeUnit(
                "",
                texts.t_folder,
                shard,
                folder,
                side,
                k,
                rows,
                m.config_hash,
                texts.f_folder if shard in texts.filtered else None,
                stats,
                config.store if side == "passage" else FLOAT16,
                codebook,
            )
            plan.units.append(unit)
            plan.work = (plan.work or 0) + rows

    def _codebook(self, config: EncodeConfig, ctx: Context, settings: EncodeSettings, texts: SideTokens, k: int) -> str:
        """The K_p codebook of a trained storage choice (trained now unless current): its sample is the float16
        vectors of the shards ``diffret compress`` would read, in its seeded order, taken from the float16 system
        when it holds them, else encoded here (the model's work before the units: the sample only)."""
        f16 = float16_settings(settings)
        source_cfg = encodings_config(f16, texts.tokens, texts.t_man.config_hash, k, batch_size=config.batch_size)
        source = encodings_dir(encoder_slug(f16), config.dataset, "passage", k)
        try:
            have = ctx.store.read_manifest(source)
        except StoreError:
            have = None
        stored = set(have.files) if have is not None and have.config_hash == config_hash(source_cfg) else set()

        def vectors(shard: str) -> np.ndarray:
            if shard in stored:
                return vectors_of(ctx.store.read_table(source, shard))
            check_weights(config.backbone)
            table = encode_shard(
                ctx,
                settings=f16,
                batch_size=config.batch_size,
                tokens_folder=texts.t_folder,
                shard=shard,
                filter_folder=texts.f_folder if shard in texts.filtered else None,
                side="passage",
                k=k,
            )
            return vectors_of(table)

        cb_cfg = codebook_config(
            config.store,
            config.store_seed,
            sample_vectors(config.codebook_sample, texts.t_man.total_rows(), k),
            config.dataset,
            k,
            config_hash(source_cfg),
            texts.t_man.total_rows() * k,
        )
        return ensure_codebook(
            ctx.store,
            system=encoder_slug(settings),
            dataset=config.dataset,
            k=k,
            config=cb_cfg,
            force=config.force,
            shards=sorted(texts.t_man.files),
            vectors=vectors,
            log=ctx.log,
        )

    def work_of(self, unit: EncodeUnit) -> int:
        return unit.rows

    def unit_name(self, unit: EncodeUnit) -> str:
        return f"{unit.side} K={unit.k} {unit.shard.removesuffix('.parquet')}"

    def run(self, unit: EncodeUnit, ctx: Context) -> FileEntry:
        shared = read_shared(ctx, unit.plan, EncodeShared)
        table = encode_shard(
            ctx,
            settings=shared.settings,
            batch_size=shared.batch_size,
            tokens_folder=unit.tokens_folder,
            shard=unit.shard,
            filter_folder=unit.filter_folder,
            side=unit.side,
            k=unit.k,
            head_stats=unit.head_stats,
            advance=ctx.advance,
        )
        if unit.store != FLOAT16:
            table = compress_table(table, _codec(ctx, unit))
        return ctx.store.write_shard(unit.out_folder, unit.shard, table)

    def commit(self, unit: EncodeUnit, result: FileEntry, ctx: Context) -> None:
        ctx.store.record_shard(unit.out_folder, unit.shard, result, unit.config_hash)
        record, weights = self._record(unit, ctx)
        if not ctx.store.exists(manifest_path(system_dir(record.system))):  # registered once it has artifacts
            register(ctx.store, record, weights)

    @staticmethod
    def _record(unit: EncodeUnit, ctx: Context) -> tuple[SystemRecord, dict[str, str]]:
        shared = read_shared(ctx, unit.plan, EncodeShared)
        return encoder_record(shared.settings), shared.weights

    def finish(self, config: EncodeConfig, plan: Plan, results: list[Any], ctx: Context) -> dict[str, Any]:
        """Compact each folder's shard records into its manifest (one write per folder); register the system."""
        details = super().finish(config, plan, results, ctx)
        assert isinstance(plan, EncodePlan) and plan.record is not None
        register(ctx.store, *plan.record)
        if plan.shared is not None:
            ctx.store.remove_plan(plan.shared)
        return details

    def abort(self, config: EncodeConfig, plan: Plan, ctx: Context) -> None:
        """A failed run: the shards it finished are kept (recorded); the folders it opened that hold none are
        removed, so no empty encoding folder (or system without encodings) is left behind."""
        super().abort(config, plan, ctx)
        assert isinstance(plan, EncodePlan)
        if plan.shared is not None:
            ctx.store.remove_plan(plan.shared)


presentation = Presentation(
    deployment=(
        "Encode a stored dataset's queries and passages for every K of the budget grid (dense multi-vectors + "
        "sparse vocabulary weights) with a DiffRetriever mask readout or a baseline (promptreps, diffembed, "
        "repllama). Sharded and resumable: re-running skips shards whose manifest entry verifies. Set workers (a "
        "local Dask cluster, a worker per GPU; -1: one per visible GPU) or dask_address (an existing cluster, one "
        "worker per GPU started with --resources GPU=1) to scale out."
    ),
    example={
        "dataset": "scifact",
        "sides": ["query", "passage"],
        "k": [1, 2, 4, 8, 16],
        "backbone": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
        "readout": {"readout": "diffretriever"},
    },
    next_step=(
        "score the grid: `diffret score -d {dataset} --system {system}` (the score deployment), then `diffret "
        "evaluate`."
    ),
)


stage = Encode()
