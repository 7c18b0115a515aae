"""The compress stage: a stored float16 system -> the same system under a compressed storage choice, without
re-encoding.

    codebooks/system=<compressed>/dataset=<d>/k=<K_p>/codebook.npz          (residual:B, pq:M)
    encodings/system=<compressed>/dataset=<d>/side=passage/k=<K_p>/shard=NNNNN.parquet   (a ``codes`` column)
    encodings/system=<compressed>/dataset=<d>/side=query/k=<K_q>/...        (float16, as stored)

The compressed system is the float16 one's settings plus ``store`` and ``store_seed`` (a system of its own, never
mixed with the float16 one). Per K_p a codebook is trained from a seeded sample of the float16 vectors
(stages/codebooks.py: the same sample and codebook as ``diffret encode --store`` with that seed), then every
passage shard is coded with it, shard by shard (resumable as encode is); query folders are copied. The folders'
configs are the ones ``encode --store`` writes, so the two ways give the same folders and the same runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from diffret.retrieval.fields import cli, like
from diffret.retrieval.search.codecs import FLOAT16, compress_table, parse_store, vectors_of
from diffret.storage import FileEntry, IncompleteArtifactError, StoreError
from diffret.storage.layout import codebook_dir, encodings_dir

from .base import ClusterConfig, Context, KList, Plan, ShardedPlan, ShardedStage, StageConfig
from .codebooks import SampleSize, codebook_config, compressed_config, ensure_codebook, make_codec, sample_vectors
from .encode import EncodeConfig
from .presentation import Presentation
from .readers import dataset_manifest, encoding_manifest, read_codebook, side_size, stored_budgets
from .systems import (
    EncodeSettings,
    SystemRecord,
    SystemRef,
    encoder_record,
    find_system,
    numeric_settings,
    register,
    settings_of,
)


class CompressConfig(StageConfig, ClusterConfig):
    """Parameters of the compress flow."""

    system: SystemRef = Field(
        default_factory=SystemRef,
        description="The float16 encoder system to compress.",
        json_schema_extra=cli(filters_except=["store", "store_seed"]),
    )
    dataset: str = like(EncodeConfig, "dataset")
    # encode's names for the same settings
    store: str = Field(
        description="The storage choice: int8, residual:B (B = 1, 2, 4; e.g. residual:2:16384 for "
        "16,384 centroids) or pq:M (search/codecs.py)."
    )
    store_seed: int = like(EncodeConfig, "store_seed")
    verify: bool = like(EncodeConfig, "verify")
    k: KList | None = Field(
        default=None,
        description="Budgets K to compress (default: every K stored for the "
        "dataset; its queries are copied as they are).",
    )
    codebook_sample: SampleSize = like(EncodeConfig, "codebook_sample")


@dataclass
class CompressUnit:
    """One float16 shard written under the compressed system: passages coded, queries as they are."""

    source: str
    shard: str
    out_folder: str
    side: str
    k: int
    rows: int
    config_hash: str
    store: str  # the storage choice (float16 for a query shard)
    codebook: str | None = None  # its codebook folder, when trained


@dataclass
class CompressPlan(ShardedPlan):
    """A compress run's plan: its folders (:class:`ShardedPlan`), the float16 system it reads, the compressed system's
    record (registered when the run finishes)."""

    source: str = ""
    record: SystemRecord | None = None


class Compress(
    ShardedStage, name="compress", config=CompressConfig, noun="shard(s)", verb="compressed", distributed=True
):
    """Turn a stored float16 system into a compressed one (int8, residual:B, pq:M) without re-encoding."""

    def plan(self, config: CompressConfig, ctx: Context) -> CompressPlan:
        spec = parse_store(config.store)
        if spec.kind == FLOAT16:
            raise ValueError("--store float16 is the system as stored: give int8, residual:B or pq:M")
        store = ctx.store
        ref = config.system  # by model: its float16 system (a slug names the system itself: checked below)
        if ref.system is None:
            ref = ref.model_copy(update={"where": {**ref.where, "store": FLOAT16}})
        record = find_system(store, ref)
        if record.kind != "encoder" or record.flat_settings().get("store") != FLOAT16:
            raise StoreError(
                f"{record.system} is not a float16 encoder system; compress the float16 system it was made from"
            )
        source = settings_of(record)
        target = source.model_copy(update={"store": config.store, "store_seed": config.store_seed})
        out = encoder_record(target)
        plan = CompressPlan(system=out.system, work_unit="docs", work=0, source=record.system, record=out)
        sides = self._sides(config, ctx, record.system)
        for side, ks in sides.items():
            expected = side_size(store, config.dataset, side)[0]
            for k in ks:
                self._plan_folder(config, ctx, plan, record.system, target, side, k, expected)
        register(store, out, write=False)
        return plan

    def _plan_folder(
        self,
        config: CompressConfig,
        ctx: Context,
        plan: CompressPlan,
        source: str,
        target: EncodeSettings,
        side: str,
        k: int,
        expected: int,
    ) -> None:
        """One (side, K) folder of the compressed system: its codebook (trained now unless current, passages of a
        trained storage choice), the folder opened, a unit per shard not yet done."""
        store, out = ctx.store, plan.record
        assert out is not None
        src = encodings_dir(source, config.dataset, side, k)
        m = encoding_manifest(store, src, expected)  # a killed encode's folder is refused: finish it first
        base = {**m.config, **numeric_settings(target)}  # the float16 folder's config, as this system's
        codebook = None
        if side == "passage" and parse_store(config.store).trained:
            codebook = codebook_dir(out.system, config.dataset, k)
            cb_cfg = codebook_config(
                config.store,
                config.store_seed,
                sample_vectors(config.codebook_sample, m.total_rows(), k),
                config.dataset,
                k,
                m.config_hash,
                m.total_rows() * k,
            )
            digest = ensure_codebook(
                store,
                system=out.system,
                dataset=config.dataset,
                k=k,
                config=cb_cfg,
                force=config.force,
                shards=sorted(m.files),
                vectors=lambda s: vectors_of(store.read_table(src, s)),
                log=ctx.log,
            )
            base = compressed_config(base, digest)
        folder = encodings_dir(out.system, config.dataset, side, k)
        ctx.hold(folder)
        part = {"system": out.system, "dataset": config.dataset, "side": side, "k": str(k)}
        m_out, done = store.open_sharded(folder, "encodings", part, base, force=config.force, verify=config.verify)
        plan.folders[f"{side}/k={k}"] = folder
        for shard in sorted(m.files):
            if shard in done:
                plan.skipped += 1
                continue
            rows = int(m.files[shard].rows or 0)
            plan.units.append(
                CompressUnit(
                    src,
                    shard,
                    folder,
                    side,
                    k,
                    rows,
                    m_out.config_hash,
                    config.store if side == "passage" else FLOAT16,
                    codebook,
                )
            )
            plan.work = (plan.work or 0) + rows

    @staticmethod
    def _sides(config: CompressConfig, ctx: Context, system: str) -> dict[str, list[int]]:
        """The K of each side to write (``k``, default every K stored): the passages' when the dataset has a corpus,
        the queries' when it has stored query encodings (a queries-only dataset such as TREC DL: queries only)."""
        has_corpus = "corpus.parquet" in dataset_manifest(ctx.store, config.dataset).files
        passage = (config.k or stored_budgets(ctx.store, system, config.dataset, "passage")) if has_corpus else []
        query = [k for k in stored_budgets(ctx.store, system, config.dataset, "query") if not config.k or k in config.k]
        if not passage and not query:
            raise IncompleteArtifactError(
                f"{system} has no encodings of {config.dataset!r} to compress; run `diffret encode` first"
            )
        return {side: ks for side, ks in (("query", query), ("passage", passage)) if ks}

    def work_of(self, unit: CompressUnit) -> int:
        return unit.rows

    def unit_name(self, unit: CompressUnit) -> str:
        return f"{unit.side} K={unit.k} {unit.shard.removesuffix('.parquet')}"

    def run(self, unit: CompressUnit, ctx: Context) -> FileEntry:
        table = ctx.store.read_table(unit.source, unit.shard)
        if unit.store != FLOAT16:
            codebook, digest = read_codebook(ctx.store, unit.codebook) if unit.codebook else (None, None)
            table = compress_table(table, make_codec(unit.store, codebook, digest))
        return ctx.store.write_shard(unit.out_folder, unit.shard, table)

    def commit(self, unit: CompressUnit, result: FileEntry, ctx: Context) -> None:
        ctx.store.record_shard(unit.out_folder, unit.shard, result, unit.config_hash)

    def finish(self, config: CompressConfig, plan: Plan, results: list[Any], ctx: Context) -> dict[str, Any]:
        """Compact each folder's shard records into its manifest; register the compressed system."""
        details = super().finish(config, plan, results, ctx)
        assert isinstance(plan, CompressPlan) and plan.record is not None
        register(ctx.store, plan.record)
        return {**details, "source": plan.source}


presentation = Presentation(
    deployment=(
        "Compress a stored float16 encoder system without re-encoding: per K_p a codebook trained from a seeded "
        "sample of its own vectors (residual:B, pq:M; int8 needs none), every passage shard coded with it, the "
        "queries kept in float16. The result is a system of its own (its slug names the choice) that score, index "
        "and late read as any other; the report's Compression section compares it with the float16 one."
    ),
    example={"dataset": "scifact", "store": "residual:2"},
    next_step="score it: `diffret score -d {dataset} --system {system}`, then `diffret evaluate`.",
)


stage = Compress()
