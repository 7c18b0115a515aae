"""The pipeline: the stages composed into the whole zero-shot experiment on one dataset (`diffret run`: download ->
tokenize/encode the grid -> (index) -> score -> BM25 -> evaluate -> summary: leaderboard, heatmaps, summary page in
the store). Not a stage: one config (:class:`PipelineConfig`) that builds each stage's, and :func:`run_pipeline`, which
runs them in order through the runner it is given (flows/runner.py's ``run_stage``: in this process, or each as its
flow run under Prefect; flows/pipeline.py holds the pipeline's own flow).

Every stage is idempotent over the store (a stage finds its finished artifacts by config hash and
skips them), so re-running the pipeline, or `prefect deployment run` after a failure, resumes where
the last run stopped and a finished run does no model work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, model_validator

from diffret.retrieval.data.sources import corpus_of, stored_name
from diffret.retrieval.fields import cli, like
from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.models.readouts import ReadoutConfig
from diffret.retrieval.models.released import read_released
from diffret.retrieval.search.bm25 import BM25Settings
from diffret.retrieval.search.rules import ScoreRules

from . import bm25, download, evaluate, index, score, summary
from . import encode as encode_stage
from .base import GRID_K, KList, ModeList, Stage, StageConfig, StageResult
from .bm25 import BM25Config
from .codebooks import SampleSize
from .download import DownloadConfig
from .encode import EncodeConfig, check_head_stats, check_k_within
from .evaluate import EvaluateConfig
from .index import IndexConfig
from .score import ScoreConfig
from .summary import SummaryConfig
from .systems import SystemRef

# runs one stage with its config and returns its result (flows.runner.run_stage, bound to how the pipeline runs)
StageRunner = Callable[[Stage, StageConfig], StageResult]

# the pipeline's Prefect deployment (flows/deployments.py): its description and default parameters
DEPLOYMENT = {
    "description": (
        "The whole zero-shot experiment on one dataset: download, encode the (K_q, K_p) grid, (LanceDB index), "
        "exact scoring of every cell in the five modes, BM25, pytrec_eval metrics, leaderboard + heatmaps + "
        "summary under summaries/ in the store. Every stage skips what the store already holds, so "
        "`prefect deployment run 'pipeline/pipeline'` after a failure resumes where it stopped."
    ),
    "example": {
        "dataset": "scifact",
        "source": None,
        "splits": ["test"],
        "kq": [1, 2, 4, 8, 16],
        "kp": [1, 2, 4, 8, 16],
        "backbone": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
        "bm25": True,
        "index": "skip",
    },
}

# `diffret run --preset`: the paper's 5 x 5 grid, or for a CPU-only laptop a 3 x 3 grid and shorter texts
# (pass --model for a small checkpoint too).
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {"kq": list(GRID_K), "kp": list(GRID_K), "batch_size": 32},
    "laptop": {"kq": [1, 4, 16], "kp": [1, 4, 16], "batch_size": 16},
}


class PipelineConfig(StageConfig):
    """The whole zero-shot experiment on one dataset: download, encode the grid, score, BM25, evaluate, summary.

    Each setting means what it means for the stage it goes to, with the same default.
    """

    # each field is declared by the stage it goes to (retrieval.fields.like): the same default and help

    preset: Literal["paper", "laptop"] = Field(
        default="paper",
        description="paper: the 5 x 5 grid, batch 32; laptop (CPU only): {1, 4, 16}^2, batch 16. "
        "kq, kp and batch_size given explicitly win.",
    )
    dataset: str = like(DownloadConfig, "name", default="scifact", json_schema_extra=cli(short="-d"))
    source: str | None = like(DownloadConfig, "source")
    corpus_source: str | None = Field(
        default=None, description="Mirror of the judged corpus when it is another collection (TREC DL)."
    )
    cache_dir: str = like(DownloadConfig, "cache_dir")
    unknown_judgments: Literal["error", "drop", "keep"] = like(DownloadConfig, "unknown_judgments")
    splits: list[str] = like(ScoreConfig, "splits")
    backbone: BackboneConfig = like(EncodeConfig, "backbone")
    readout: ReadoutConfig = like(EncodeConfig, "readout")
    max_length: int = like(EncodeConfig, "max_length")
    title_sep: str = like(EncodeConfig, "title_sep")
    kq: KList | None = like(
        ScoreConfig,
        "kq",
        default=None,
        description="Query budgets K_q (default: the preset's; a released checkpoint's trained K_q).",
    )
    kp: KList | None = like(
        ScoreConfig,
        "kp",
        default=None,
        description="Passage budgets K_p (default: the preset's; a released checkpoint's trained K_p).",
    )
    modes: ModeList = like(ScoreConfig, "modes")
    q1p1_multi: Literal["skip", "keep"] = like(ScoreConfig, "q1p1_multi")
    bm25: bool = Field(default=True, description="Add the BM25 baseline.")
    index: Literal["skip", "none", "IVF_PQ", "IVF_HNSW_SQ"] = Field(
        default="skip",
        description="LanceDB index per K_p, checked against exact search (none: flat table; skip: no index).",
    )
    topk: int = like(ScoreConfig, "topk")
    train_topk: int = like(ScoreConfig, "train_topk")
    batch_size: int | None = like(
        EncodeConfig, "batch_size", default=None, description="Texts per forward pass (default: the preset's)."
    )
    shard_size: int = like(EncodeConfig, "shard_size")
    workers: int = like(
        EncodeConfig,
        "workers",
        description="Local Dask workers of the distributed stages: 0 none, N (a GPU each on a GPU), -1 one per GPU.",
    )
    workers_per_gpu: int = like(EncodeConfig, "workers_per_gpu", description="Local workers a GPU may hold.")
    workers_per_core: int = like(EncodeConfig, "workers_per_core", description="Local CPU workers a core may hold.")
    dask_address: str | None = like(EncodeConfig, "dask_address", description="Join a Dask cluster instead.")
    verify: bool = like(EncodeConfig, "verify")
    head_stats: bool = like(EncodeConfig, "head_stats")
    store: str = like(EncodeConfig, "store")
    store_seed: int = like(EncodeConfig, "store_seed")
    codebook_sample: SampleSize = like(EncodeConfig, "codebook_sample")
    rules: ScoreRules = like(ScoreConfig, "rules")
    self_hits: Literal["keep", "drop"] = like(ScoreConfig, "self_hits")
    ties: Literal["trec", "rank"] = like(EvaluateConfig, "ties")

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        """The preset's grid and batch, where not given explicitly; a released checkpoint's trained (K_q, K_p) in
        place of the preset's grid."""
        if isinstance(data, dict):
            preset = dict(PRESETS.get(data.get("preset") or "paper", {}))
            backbone = data.get("backbone")
            bb = backbone if isinstance(backbone, dict) else vars(backbone) if backbone is not None else {}
            model = bb.get("adapter") or bb.get("model")  # a released checkpoint given as --adapter too
            if isinstance(model, str) and (ckpt := read_released(model)) is not None:
                preset.update(kq=[ckpt.kq], kp=[ckpt.kp])
            data = {
                **{k: v for k, v in preset.items() if data.get(k) is None},
                **{k: v for k, v in data.items() if v is not None},
            }
        return data

    @model_validator(mode="after")
    def _k_within_max_length(self) -> PipelineConfig:
        assert self.kq is not None and self.kp is not None  # the preset's when not given (mode="before")
        check_k_within([*self.kq, *self.kp], self.max_length)
        check_head_stats(self.head_stats, self.readout)
        return self

    # ------------------------------------------------------------------------- stage configs
    def _common(self) -> dict[str, Any]:
        return {"root": self.root, "force": self.force}

    def _cluster(self) -> dict[str, Any]:
        """Where the distributed stages' units run (the same for each of them)."""
        return {
            "workers": self.workers,
            "workers_per_gpu": self.workers_per_gpu,
            "workers_per_core": self.workers_per_core,
            "dask_address": self.dask_address,
        }

    def name(self) -> str:
        """The stored name of ``dataset`` (an ir_datasets id is stored under the catalog's name, or with / as -).

        >>> PipelineConfig(dataset="beir/scifact/test", backbone={"model": "org/m"}).name()
        'scifact'
        """
        return stored_name(self.dataset)

    def corpus(self) -> str:
        return corpus_of(self.name())

    def downloads(self) -> list[DownloadConfig]:
        def dl(name: str, source: str | None) -> DownloadConfig:
            return DownloadConfig(
                name=name,
                source=source,
                cache_dir=self.cache_dir,
                unknown_judgments=self.unknown_judgments,
                **self._common(),
            )

        out = [dl(self.dataset, self.source)]
        if self.corpus() != self.name():
            out.insert(0, dl(self.corpus(), self.corpus_source))
        return out

    def encodes(self) -> list[EncodeConfig]:
        common = dict(
            backbone=self.backbone,
            readout=self.readout,
            max_length=self.max_length,
            title_sep=self.title_sep,
            batch_size=self.batch_size,
            shard_size=self.shard_size,
            verify=self.verify,
            head_stats=self.head_stats,
            store=self.store,
            store_seed=self.store_seed,
            codebook_sample=self.codebook_sample,
            **self._cluster(),
            **self._common(),
        )
        assert self.kq is not None and self.kp is not None
        if self.corpus() == self.name():  # one pass per K_q on the queries, one per K_p on the passages
            ks = sorted(set(self.kq) | set(self.kp))
            return [
                EncodeConfig(dataset=self.name(), sides=["query", "passage"], k=ks, kq=self.kq, kp=self.kp, **common)
            ]
        return [  # the queries' dataset and the corpus's, each side at its own budgets
            EncodeConfig(dataset=self.name(), sides=["query"], k=self.kq, **common),
            EncodeConfig(dataset=self.corpus(), sides=["passage"], k=self.kp, **common),
        ]

    def score(self, system: str) -> ScoreConfig:
        return ScoreConfig(
            dataset=self.name(),
            corpus=self.corpus(),
            system=SystemRef(system=system),
            splits=self.splits,
            kq=self.kq,
            kp=self.kp,
            modes=self.modes,
            q1p1_multi=self.q1p1_multi,
            topk=self.topk,
            train_topk=self.train_topk,
            device=self.backbone.device,
            rules=self.rules,
            self_hits=self.self_hits,
            **self._cluster(),
            **self._common(),
        )

    def bm25_config(self) -> BM25Config:
        return BM25Config(
            dataset=self.name(),
            corpus=self.corpus(),
            splits=self.splits,
            topk=self.topk,
            train_topk=self.train_topk,
            self_hits=self.self_hits,
            bm25=BM25Settings(),
            **self._cluster(),
            **self._common(),
        )

    def index_config(self, system: str) -> IndexConfig:
        if self.index == "skip":
            raise ValueError("--index skip: the pipeline builds no index")
        return IndexConfig(
            dataset=self.name(),
            corpus=self.corpus(),
            system=SystemRef(system=system),
            split=self.splits[0],
            kq=self.kq,
            kp=self.kp,
            index_type=self.index,
            **self._cluster(),
            **self._common(),
        )

    def evaluate(self, systems: list[str]) -> EvaluateConfig:
        return EvaluateConfig(
            systems=systems,
            datasets=[self.name()],
            splits=self.splits,
            ties=self.ties,
            **self._cluster(),
            **self._common(),
        )

    def summary(self, system: str, bm25: str | None) -> SummaryConfig:
        return SummaryConfig(system=system, bm25=bm25, dataset=self.name(), splits=self.splits, **self._common())


def pipeline_plan(config: PipelineConfig) -> list[tuple[str, str]]:
    """The stages ``run_pipeline`` makes for ``config``, in order, each with the settings that differ from the
    stage's defaults (every stage config built and validated; nothing read, loaded or written). The encoder's
    system is named ``<encoder>`` until it exists."""
    import json

    def brief(cfg: Any) -> str:
        drop = set(config._common()) | {"cluster", "workers", "scheduler"}
        data = {k: v for k, v in cfg.model_dump(mode="json", exclude_defaults=True).items() if k not in drop}
        return json.dumps(data, sort_keys=True, separators=(", ", ": "))

    plan = [(f"download {d.name}", brief(d)) for d in config.downloads()]
    plan += [(f"encode {e.dataset} {'+'.join(e.sides)}", brief(e)) for e in config.encodes()]
    system = "<encoder>"
    if config.index != "skip":
        plan.append(("index", brief(config.index_config(system))))
    plan.append(("score", brief(config.score(system))))
    if config.bm25:
        plan.append(("bm25", brief(config.bm25_config())))
    plan.append(("evaluate", brief(config.evaluate([system] + (["<bm25>"] if config.bm25 else [])))))
    plan.append(("summary", brief(config.summary(system, "<bm25>" if config.bm25 else None))))
    return plan


def run_pipeline(
    config: PipelineConfig,
    run: StageRunner,
    log: Callable[[str], None] = print,
    check: Callable[[Stage, StageConfig], None] | None = None,
) -> dict[str, Any]:
    """Every stage in order, each through ``run`` (``flows.runner.run_stage``: sub-flow runs under Prefect); the
    result lines, the system, and the leaderboard and summary folder of each split. ``check`` refuses, before
    anything is downloaded, a placement of the distributed stages' units this machine cannot hold
    (``flows.cluster.check_placement``)."""
    steps: list[str] = []

    def step(name: str, line: str) -> None:
        steps.append(f"{name}: {line}")
        log(steps[-1])

    if check is not None:  # the local workers asked for, checked before anything is downloaded
        for e in config.encodes():
            check(encode_stage.stage, e)
        check(score.stage, config.score("<encoder>"))
    for d in config.downloads():
        res = run(download.stage, d)
        step(f"download {d.name}", res.details.get("status", "done"))
    system = ""
    for e in config.encodes():
        res = run(encode_stage.stage, e)
        system = res.system or system
        step(f"encode {e.dataset} {'+'.join(e.sides)}", res.line())
    if config.index != "skip":
        step("index", run(index.stage, config.index_config(system)).line())
    step("score", run(score.stage, config.score(system)).line())
    bm25_system = None
    if config.bm25:
        res = run(bm25.stage, config.bm25_config())
        bm25_system = res.system
        step("bm25", res.line())
    systems = [system] + ([bm25_system] if bm25_system else [])
    ev = run(evaluate.stage, config.evaluate(systems))
    step("evaluate", ev.line())
    sm = run(summary.stage, config.summary(system, bm25_system))
    step("summary", sm.line())
    return {"system": system, "bm25": bm25_system, "steps": steps, **sm.details}
