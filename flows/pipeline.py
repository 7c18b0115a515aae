"""The pipeline flow (`diffret run`): download -> tokenize/encode the grid -> (index) -> score -> BM25 ->
evaluate -> leaderboard, heatmaps and summary in the store.

Every stage is idempotent over the store (a stage finds its finished artifacts by config hash and
skips them), so re-running the pipeline, or `prefect deployment run` after a failure, resumes where
the last run stopped and a finished run does no model work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from retrieval.backbones import BackboneConfig
from retrieval.bm25 import BM25Settings
from retrieval.encoding import GRID_K, KList
from retrieval.readouts import ReadoutConfig
from storage.layout import MODES

from .download import DownloadConfig
from .encode import EncodeConfig
from .evaluate import EvaluateConfig
from .index import IndexConfig
from .score import DEFAULT_MODEL, BM25Config, ModeList, ScoreConfig

# A CPU-only laptop: a 3 x 3 grid and shorter texts (pass --model for a small checkpoint too).
LAPTOP_PRESET: dict[str, Any] = {"kq": [1, 4, 16], "kp": [1, 4, 16], "max_length": 256, "batch_size": 16}


class PipelineConfig(BaseModel):
    """Parameters of the whole zero-shot experiment on one dataset (the Prefect UI renders them as a form)."""

    root: str = Field(default="./diffret-store", description="Artifact store root.")
    dataset: str = Field(default="scifact", description="Collection (see `diffret download --help`).")
    source: str | None = Field(default=None, description="Mirror of the dataset (folder, archive or URL).")
    corpus_source: str | None = Field(
        default=None, description="Mirror of the judged corpus when it is another collection (TREC DL)."
    )
    cache_dir: str = Field(default="~/.cache/diffret/downloads")
    splits: list[str] = Field(default=["test"], description="Query splits to score and evaluate.")
    backbone: BackboneConfig = Field(default_factory=lambda: BackboneConfig(model=DEFAULT_MODEL))
    readout: ReadoutConfig = Field(default_factory=ReadoutConfig)
    max_length: int = Field(default=512, ge=1)
    kq: KList = Field(default=list(GRID_K), description="Query budgets K_q.")
    kp: KList = Field(default=list(GRID_K), description="Passage budgets K_p.")
    modes: ModeList = Field(default=list(MODES))
    bm25: bool = Field(default=True, description="Add the BM25 baseline.")
    index: Literal["skip", "none", "IVF_PQ", "IVF_HNSW_SQ"] = Field(
        default="skip",
        description="LanceDB index per K_p, checked against exact search (none: flat table; skip: no index).",
    )
    topk: int = Field(default=1000, ge=1)
    batch_size: int = Field(default=32, ge=1)
    shard_size: int = Field(default=1000, ge=1)
    workers: int = Field(default=0, ge=0, description="Local Dask workers for encoding (0: in-process).")
    dask_address: str | None = None
    device: str = Field(default="auto", description="Scoring device: auto | cpu | cuda | cuda:N.")

    # ------------------------------------------------------------------------- stage configs
    def corpus(self) -> str:
        from retrieval.scoring import corpus_of

        return corpus_of(self.dataset)

    def downloads(self) -> list[DownloadConfig]:
        out = [DownloadConfig(name=self.dataset, source=self.source, root=self.root, cache_dir=self.cache_dir)]
        if self.corpus() != self.dataset:
            out.insert(
                0,
                DownloadConfig(name=self.corpus(), source=self.corpus_source, root=self.root, cache_dir=self.cache_dir),
            )
        return out

    def encodes(self) -> list[EncodeConfig]:
        common = dict(
            root=self.root, backbone=self.backbone, readout=self.readout, max_length=self.max_length,
            batch_size=self.batch_size, shard_size=self.shard_size, workers=self.workers,
            dask_address=self.dask_address,
        )  # fmt: skip
        if self.corpus() == self.dataset:
            ks = sorted(set(self.kq) | set(self.kp))
            return [EncodeConfig(dataset=self.dataset, sides=["query", "passage"], k=ks, **common)]
        return [
            EncodeConfig(dataset=self.dataset, sides=["query"], k=self.kq, **common),
            EncodeConfig(dataset=self.corpus(), sides=["passage"], k=self.kp, **common),
        ]

    def score(self) -> ScoreConfig:
        return ScoreConfig(
            root=self.root, dataset=self.dataset, corpus=self.corpus(), splits=self.splits, kq=self.kq, kp=self.kp,
            modes=self.modes, backbone=self.backbone, readout=self.readout, max_length=self.max_length,
            topk=self.topk, device=self.device,
        )  # fmt: skip

    def bm25_config(self) -> BM25Config:
        return BM25Config(
            root=self.root, dataset=self.dataset, corpus=self.corpus(), splits=self.splits, topk=self.topk,
            bm25=BM25Settings(),
        )  # fmt: skip

    def index_config(self) -> IndexConfig:
        return IndexConfig(
            root=self.root, dataset=self.dataset, corpus=self.corpus(), split=self.splits[0], kq=self.kq, kp=self.kp,
            backbone=self.backbone, readout=self.readout, max_length=self.max_length, index_type=self.index,
        )  # fmt: skip


@dataclass
class PipelineResult:
    system: str
    bm25: str | None
    summaries: dict[str, Any]  # split -> retrieval.summary.Summary
    folders: dict[str, str]  # split -> summary folder
    steps: list[str]


def _summaries(config: PipelineConfig, system: str, bm25: str | None) -> tuple[dict, dict]:
    from retrieval.summary import build_summary, write_summary
    from storage import ArtifactStore
    from storage.sql import StoreSQL

    store = ArtifactStore(config.root)
    sums, folders = {}, {}
    with StoreSQL(store) as db:
        for split in config.splits:
            s = build_summary(db, system, config.dataset, split, bm25)
            sums[split] = s
            cfg = {
                "system": system,
                "bm25": bm25,
                "split": split,
                "score": config.score().model_dump(mode="json", exclude={"root"}),
            }
            folders[split] = write_summary(store, s, cfg)
    return sums, folders


def run_pipeline(
    config: PipelineConfig,
    log: Callable[[str], None] = print,
    encode_progress: Callable | None = None,
) -> PipelineResult:
    """The whole experiment in this process (the CLI's default)."""
    from .download import run_download
    from .encode import run_encode
    from .evaluate import run_evaluate
    from .index import run_index
    from .score import run_bm25, run_score

    steps = []
    for d in config.downloads():
        res = run_download(d)
        steps.append(f"download {d.name}: {res.status}")
        log(steps[-1])
    for e in config.encodes():
        plan = run_encode(e, progress=encode_progress, log=log)
        steps.append(f"encode {e.dataset} {'+'.join(e.sides)}: {len(plan.jobs)} shard(s) encoded, {plan.skipped} done")
        log(steps[-1])
    if config.index != "skip":
        res = run_index(config.index_config(), log)
        steps.append(f"index: {res['built']} built, {res['skipped']} already built")
        log(steps[-1])
    sc = run_score(config.score(), log)
    steps.append(f"score: {sc['scored']} cell(s) scored, {sc['skipped']} already done")
    log(steps[-1])
    bm25 = None
    if config.bm25:
        b = run_bm25(config.bm25_config(), log)
        bm25 = b["system"]
        steps.append(f"bm25: {b['scored']} run(s), {b['skipped']} already done")
        log(steps[-1])
    models = [sc["system"]] + ([bm25] if bm25 else [])
    ev = run_evaluate(
        EvaluateConfig(root=config.root, models=models, datasets=[config.dataset], splits=config.splits), log
    )
    steps.append(f"evaluate: {ev['evaluated']} run(s) evaluated, {ev['up_to_date']} up to date")
    log(steps[-1])
    sums, folders = _summaries(config, sc["system"], bm25)
    return PipelineResult(sc["system"], bm25, sums, folders, steps)


@flow(name="pipeline", description="Zero-shot DiffRetriever grid on one dataset, end to end, with BM25.")
def pipeline_flow(config: PipelineConfig) -> dict:
    """The same stages as sub-flow runs (each visible in the UI; each skips what the store already has)."""
    from .download import download_flow
    from .encode import encode_flow
    from .evaluate import evaluate_flow
    from .index import index_flow
    from .score import bm25_flow, score_flow

    logger = get_run_logger()
    for d in config.downloads():
        download_flow(d)
    for e in config.encodes():
        encode_flow(e)
    if config.index != "skip":
        index_flow(config.index_config())
    sc = score_flow(config.score())
    bm25 = bm25_flow(config.bm25_config())["system"] if config.bm25 else None
    models = [sc["system"]] + ([bm25] if bm25 else [])
    evaluate_flow(EvaluateConfig(root=config.root, models=models, datasets=[config.dataset], splits=config.splits))
    sums, folders = _summaries(config, sc["system"], bm25)
    for split, s in sums.items():
        create_markdown_artifact(
            s.markdown({m: f"{folders[split]}/heatmap_{m}.png" for m in s.grids}),
            key=f"leaderboard-{split}",
            description=f"{config.dataset} {split} leaderboard",
        )
    logger.info(f"summaries: {', '.join(folders.values())}")
    return {"system": sc["system"], "bm25": bm25, "summaries": folders}
