"""The encode flow: a dataset's sides x the K grid -> dense + sparse encodings in the store.

Tokenize each side once (cached in the store), then one task per (side, K, shard); each K is one
encoding pass per side, so 5 query passes and 5 passage passes serve all 25 (K_q, K_p) cells.
Shards already done with the same config are skipped, so a re-run resumes a killed one. Runs
in-process, on a local Dask cluster (``workers``), or on an existing one (``dask_address``; one
worker per GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from pydantic import BaseModel, Field

from retrieval.backbones import BackboneConfig, load_tokenizer
from retrieval.encoding import (
    GRID_K,
    EncodeSettings,
    KList,
    check_k,
    done_shards,
    encodings_config,
    model_slug,
    open_stage,
    plan_tokens,
    record_shard,
    tokenize_side,
)
from retrieval.readouts import ReadoutConfig
from storage import ArtifactStore, FileEntry
from storage.layout import encodings_dir


class EncodeConfig(BaseModel):
    """Parameters of the encode flow (the Prefect UI renders them as a form)."""

    root: str = Field(default="./diffret-store", description="Artifact store root.")
    dataset: str = Field(description="A dataset already in the store (diffret download).")
    sides: list[Literal["query", "passage"]] = Field(default=["query", "passage"])
    k: KList = Field(default=list(GRID_K), description="Budgets K to encode (one pass per K and side).")
    backbone: BackboneConfig = Field(default_factory=lambda: BackboneConfig(model="dllm-hub/ModernBERT-base-chat-v0.1"))
    readout: ReadoutConfig = Field(default_factory=ReadoutConfig)
    max_length: int = Field(default=512, ge=1, description="Text tokens kept per text (512 zero-shot).")
    batch_size: int = Field(default=32, ge=1)
    shard_size: int = Field(default=1000, ge=1, description="Texts per shard (unit of parallelism and resume).")
    workers: int = Field(default=0, ge=0, description="Local Dask workers (0: run shards in this process).")
    dask_address: str | None = Field(default=None, description="Join an existing Dask cluster (tcp://host:8786).")

    def settings(self) -> EncodeSettings:
        return EncodeSettings(backbone=self.backbone, readout=self.readout, max_length=self.max_length)


@dataclass
class Job:
    side: str
    k: int
    shard: str
    rows: int
    tokens_stage: str
    out_stage: str


@dataclass
class EncodePlan:
    slug: str
    jobs: list[Job] = field(default_factory=list)
    skipped: int = 0
    total_shards: int = 0
    stages: dict[tuple[str, int], str] = field(default_factory=dict)


def plan_encode(config: EncodeConfig, log: Callable[[str], None] = print) -> EncodePlan:
    """Tokenize what is missing and list the (side, K, shard) jobs that are not done yet."""
    check_k(config.readout, config.k)
    store = ArtifactStore(config.root)
    settings = config.settings()
    tokenizer = load_tokenizer(config.backbone)
    plan = EncodePlan(slug=model_slug(settings))
    for side in config.sides:
        tplan = plan_tokens(store, tokenizer, settings, config.dataset, side, config.shard_size)
        n = tokenize_side(store, tokenizer, tplan)
        if n:
            log(f"tokenized {config.dataset}/{side}: {n} shard(s), {tplan.config['rows']:,} texts")
        rows = {name: e - s for name, s, e in tplan.shards}
        for k in config.k:
            stage = encodings_dir(plan.slug, config.dataset, side, k)
            cfg = encodings_config(settings, tplan, k)
            part = {"model": plan.slug, "dataset": config.dataset, "side": side, "k": str(k)}
            m = open_stage(store, stage, "encodings", part, cfg)
            done = done_shards(store, stage, m)
            plan.stages[(side, k)] = stage
            for name, _, _ in tplan.shards:
                plan.total_shards += 1
                if name in done:
                    plan.skipped += 1
                else:
                    plan.jobs.append(Job(side, k, name, rows[name], tplan.stage, stage))
    return plan


def summary_markdown(config: EncodeConfig, plan: EncodePlan, written: int) -> str:
    rows = "\n".join(f"| {side} | {k} | `{stage}` |" for (side, k), stage in sorted(plan.stages.items()))
    return (
        f"# encode {config.dataset} with `{plan.slug}`\n\n"
        f"{written} shard(s) encoded, {plan.skipped} already done, {plan.total_shards} in all.\n\n"
        f"| side | K | folder |\n|---|---:|---|\n{rows}\n"
    )


def run_encode(
    config: EncodeConfig,
    progress: Callable[[EncodePlan], Callable[[int], None] | None] | None = None,
    log: Callable[[str], None] = print,
) -> EncodePlan:
    """The flow's work without Prefect, shard by shard in this process (the CLI's default).

    ``progress(plan)`` may return a callback that receives the number of texts of each finished batch.
    """
    from tasks.encode import encode_job

    plan = plan_encode(config, log)
    on_rows = progress(plan) if progress else None
    store = ArtifactStore(config.root)
    for job in plan.jobs:
        entry = encode_job(
            config.root,
            config.settings().model_dump(),
            job.tokens_stage,
            job.shard,
            job.out_stage,
            job.side,
            job.k,
            config.batch_size,
            on_rows,
        )
        record_shard(store, job.out_stage, job.shard, entry)
    return plan


@flow(name="encode", description="Encode a dataset's queries and passages for every K of the grid.")
def encode_flow(config: EncodeConfig) -> dict:
    logger = get_run_logger()
    plan = plan_encode(config, logger.info)
    logger.info(f"{plan.slug}: {len(plan.jobs)} shard(s) to encode, {plan.skipped} already done")
    written = 0
    if plan.jobs:
        if config.dask_address or config.workers:
            from prefect_dask import DaskTaskRunner

            _expose_packages_to_workers()

            runner = (
                DaskTaskRunner(address=config.dask_address)
                if config.dask_address
                else DaskTaskRunner(cluster_kwargs={"n_workers": config.workers, "threads_per_worker": 1})
            )
            written = _encode_jobs.with_options(task_runner=runner)(config, plan.jobs)
        else:
            # in-process: one shard at a time (threads would only contend for the same model and device)
            from prefect.task_runners import ThreadPoolTaskRunner

            written = _encode_jobs.with_options(task_runner=ThreadPoolTaskRunner(max_workers=1))(config, plan.jobs)
    create_markdown_artifact(summary_markdown(config, plan, written), key="encode-summary", description="encode")
    return {"model": plan.slug, "encoded": written, "skipped": plan.skipped, "total": plan.total_shards}


def _expose_packages_to_workers() -> None:
    """Put this checkout on PYTHONPATH for the Dask worker processes we start.

    A Dask worker puts its scratch folder, which holds a ``storage/`` spill folder, first on
    ``sys.path``; with an editable install (a meta-path finder, consulted after the path) that
    folder would shadow our ``storage`` package as an empty namespace. A path entry for the checkout
    wins over that (a regular package found anywhere on the path beats a namespace portion).
    """
    import os
    import sys
    from pathlib import Path

    import storage

    top = str(Path(storage.__file__).resolve().parents[1])
    if top not in sys.path:
        sys.path.append(top)  # spawned worker processes start from a copy of this sys.path
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if top not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([top, *parts])


@flow(name="encode-shards")
def _encode_jobs(config: EncodeConfig, jobs: list[Job]) -> int:
    """Submit one task per shard; record each in its stage manifest as it completes (one writer)."""
    from prefect.futures import as_completed

    from tasks.encode import encode_shard_task

    store = ArtifactStore(config.root)
    settings = config.settings().model_dump()
    progress = create_progress_artifact(0.0, key="encode-progress", description="shards encoded")
    futures = {
        encode_shard_task.submit(
            config.root, settings, j.tokens_stage, j.shard, j.out_stage, j.side, j.k, config.batch_size
        ): j
        for j in jobs
    }
    done = 0
    for fut in as_completed(list(futures)):
        job = futures[fut]
        entry: FileEntry = fut.result()
        record_shard(store, job.out_stage, job.shard, entry)
        done += 1
        update_progress_artifact(progress, 100.0 * done / len(jobs))
    return done
