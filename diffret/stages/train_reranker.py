"""The train-reranker stage (``diffret train-reranker``): DiffuRank's rerankers fine-tuned on ranked lists.

    models/model=<base>-rr-<hash>/       the peft adapter (or merged weights with --merge / --full), tokenizer,
                                         train_log.parquet, loss.png: `diffret rerank --model <folder>` takes it
    checkpoints/model=<name>/last.pt     the resumable state while training runs (removed at the end)

Lists come from a RankZephyr-format file (``--source``: the published jsonl / jsonl.gz, or plain
``{"query", "candidates", "ranking"?, "labels"?}`` lines) or from the store (``--dataset``): each judged query
of the split, its relevant documents first (by grade, then the first stage's order) then the first-stage
run's other documents, ``list_size`` in all, the grades as labels. The model's name hashes the lists' inputs
(the file's sha256, or the dataset's and the run's config hashes), the backbone and every training setting.
Optimisation, resume and DDP are the contrastive train stage's (:func:`stages.train.fit_and_save`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from diffret.retrieval.data.collections import DatasetError, iter_lines
from diffret.retrieval.devices import resolve_device
from diffret.retrieval.fields import cli, like
from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
from diffret.retrieval.rerank.training import (
    RankedList,
    RerankTrainer,
    RerankTrainSettings,
    qrels_lists,
    read_ranked_lists,
    run_lists,
)
from diffret.retrieval.training.loop import world
from diffret.storage import StoreError
from diffret.storage.store import sha256_file

from .base import Context, Plan, StageConfig, StageResult
from .presentation import Presentation
from .readers import dataset_manifest, qrels_table, side_texts, split_queries
from .rerank import RerankConfig, first_stage_run
from .runs import read_run
from .train import ModelStage, TrainConfig, TrainUnit, fit_and_save


class TrainRerankerConfig(StageConfig):
    """Parameters of the train-reranker flow (one of ``source`` or ``dataset``)."""

    source: str | None = Field(
        default=None,
        description="A RankZephyr-format jsonl / jsonl.gz file of ranked lists.",
        json_schema_extra=cli(short="-s"),
    )
    dataset: str | None = Field(
        default=None,
        description="Teacher lists from this stored dataset: its qrels over a first-stage run.",
        json_schema_extra=cli(short="-d"),
    )
    split: str = Field(default="train", description="The split whose queries become lists.")
    teacher: Literal["qrels", "run"] = Field(
        default="qrels",
        description="qrels: the judged queries, relevant "
        "documents first, then the run's; run: the run's own order (distill a "
        "stronger first stage), every query it ranks.",
    )
    first_stage: str = Field(default="bm25", description="The run giving the candidates: bm25 or a system slug.")
    first_kq: int = like(RerankConfig, "first_kq")
    first_kp: int = like(RerankConfig, "first_kp")
    first_mode: str | None = like(RerankConfig, "first_mode")
    backbone: BackboneConfig = like(TrainConfig, "backbone")
    settings: RerankTrainSettings = like(TrainConfig, "settings", default_factory=RerankTrainSettings)
    name: str | None = Field(default=None, description="The model's name (default: {base}-rr-{hash}).")
    checkpoint_every: int = like(TrainConfig, "checkpoint_every")
    merge: bool = Field(default=False, description="LoRA: save the merged weights instead of the adapter alone.")

    @model_validator(mode="after")
    def _one_origin(self) -> TrainRerankerConfig:
        if (self.source is None) == (self.dataset is None):
            raise ValueError(
                "give exactly one of source (a RankZephyr-format file) and dataset (qrels lists from the store)"
            )
        return self


class TrainReranker(
    ModelStage,
    name="train-reranker",
    config=TrainRerankerConfig,
    noun="model(s)",
    verb="trained",
    reports_progress=True,
    task_tags=("gpu",),
):
    """Fine-tune a backbone as a DiffuRank reranker (listwise CE / RankNet, or MDLM SFT) on ranked lists."""

    def plan(self, config: TrainRerankerConfig, ctx: Context) -> Plan:
        resolve_device(config.backbone.device)  # a device this machine lacks: refused before any work
        store = ctx.store
        cfg: dict[str, Any] = {
            "task": "reranker",
            "backbone": config.backbone.model_dump(exclude={"device"}),
            "settings": config.settings.model_dump(),
            "world_size": world()[1],
            "merge": config.merge,
        }
        if config.source is not None:
            path = Path(config.source).expanduser()
            if not path.is_file():
                raise DatasetError(f"ranked lists {config.source!r}: no such file")
            cfg |= {"source": str(path.resolve()), "inputs": {"source": sha256_file(str(path))[0]}}
            n_lists = sum(1 for _ in iter_lines(path))  # non-blank lines; bad UTF-8 is refused here already
        else:
            dataset = str(config.dataset)
            _, run = first_stage_run(
                store, dataset, config.split, config.first_stage, config.first_kq, config.first_kp, config.first_mode
            )
            qrels = qrels_table(store, dataset, config.split)
            if qrels.num_rows == 0 and config.teacher == "qrels":
                raise StoreError(
                    f"{dataset}/{config.split} has no judgments to build teacher lists from; give "
                    "--teacher run to learn the run's order"
                )
            cfg |= {
                "dataset": dataset,
                "split": config.split,
                "first_stage": run,
                "teacher": config.teacher,
                "inputs": {
                    "dataset": dataset_manifest(store, dataset).config_hash,
                    "run": store.require_manifest(run).config_hash,
                },
            }
            n_lists = (
                len(set(qrels.column("query_id").to_pylist()))
                if config.teacher == "qrels"
                else len(split_queries(store, dataset, config.split))
            )
        return self.model_plan(ctx, config, cfg, "rr", n_lists)

    def run(self, unit: TrainUnit, ctx: Context) -> dict[str, Any]:
        cfg = unit.config
        lists, stats = self.lists(cfg, ctx)
        if not lists:
            raise DatasetError(f"no ranked list to train on ({stats})")
        ctx.log(
            f"{len(lists):,} ranked lists" + "".join(f", {k} {v:,}" for k, v in stats.items() if k != "lists" and v)
        )
        bb = load_backbone(BackboneConfig.model_validate(cfg["backbone"]))
        trainer = RerankTrainer(bb, lists, RerankTrainSettings.model_validate(cfg["settings"]))
        loss = cfg["settings"]["loss"]
        return fit_and_save(trainer, unit, cfg, bb.tokenizer, ctx, {"lists": len(lists)}, ylabel=loss)

    @staticmethod
    def lists(cfg: dict[str, Any], ctx: Context) -> tuple[list[RankedList], dict[str, int]]:
        if "source" in cfg:
            out = list(read_ranked_lists(cfg["source"]))
            return out, {"lists": len(out)}
        store, dataset = ctx.store, cfg["dataset"]
        run = read_run(store, cfg["first_stage"], columns=["query_id", "doc_id", "rank"]).sort_by(
            [("query_id", "ascending"), ("rank", "ascending")]
        )
        ranked: dict[str, list[str]] = {}
        for q, d in zip(run.column("query_id").to_pylist(), run.column("doc_id").to_pylist(), strict=True):
            ranked.setdefault(q, []).append(d)
        q_ids, q_texts, _ = side_texts(store, dataset, "query")
        doc_ids, doc_texts, _ = side_texts(
            store, store.require_manifest(cfg["first_stage"]).config["corpus"], "passage"
        )
        queries = {q: t for q, t in zip(q_ids, q_texts, strict=True)}
        text_of, size = dict(zip(doc_ids, doc_texts, strict=True)), cfg["settings"]["list_size"]
        if cfg.get("teacher", "qrels") == "run":
            split = set(split_queries(store, dataset, cfg["split"]))
            out = run_lists({q: t for q, t in queries.items() if q in split}, ranked, text_of, size)
            return out, {"lists": len(out)}
        qrels = qrels_table(store, dataset, cfg["split"])
        judged: dict[str, dict[str, int]] = {}
        for q, d, g in zip(*(qrels.column(c).to_pylist() for c in ("query_id", "doc_id", "relevance")), strict=True):
            judged.setdefault(q, {})[d] = int(g)
        return qrels_lists(queries, judged, ranked, text_of, size)


def _printed(result: StageResult) -> list[str]:
    return [
        f"model: {result.details.get('model_dir')} (rerank with it: diffret rerank --model <it> --method <the same>)"
    ]


presentation = Presentation(
    deployment=(
        "Fine-tune a DiffuRank reranker on ranked lists: RankZephyr-format data (source) or qrels-ordered lists "
        "over a stored BM25 run (dataset). listwise_ce / ranknet for pointwise and logits_listwise, MDLM SFT "
        "(DocID masking) for the permutation methods; LoRA r 16, alpha 32, constant lr 1e-4, 3 epochs, 64 lists a "
        "step. Resumable."
    ),
    example={
        "dataset": "scifact",
        "split": "train",
        "first_stage": "bm25",
        "backbone": {"model": "GSAI-ML/LLaDA-8B-Instruct"},
        "settings": {"method": "logits_listwise"},
    },
    next_step="rerank with it: `diffret rerank -d DATASET --model MODEL_FOLDER` (the rerank deployment).",
    printed=_printed,
)


stage = TrainReranker()
