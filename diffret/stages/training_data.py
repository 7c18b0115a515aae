"""The training stage: contrastive training groups in Tevatron's format, stored once and queried by SQL.

    training/set=<name>/groups.parquet      query_id, query, positive_passages, negative_passages

A set comes from a Tevatron file (``--source``: jsonl, jsonl.gz or Parquet, or a hub dataset id when the hub
is reachable), or is mined from a dataset in the store: the judged queries of its train split, their
positives from the qrels, and hard negatives from a run already in the store (BM25 by default, or any
system by name): the top ``depth`` (30) minus the positives, ``n_negatives`` (15) sampled per query. Groups
with fewer candidates keep the ones there are (never a duplicate: training draws a short group's negatives
with replacement, as Tevatron does); queries without a positive in the corpus, without a run or without any
negative get no group. A Tevatron file's repeated negatives are stored once. Every such case is counted in the manifest
(``stats``) and printed. The view ``training_groups`` shows one row per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from pydantic import Field, model_validator

from diffret.retrieval.data.collections import DatasetError
from diffret.retrieval.data.sources import corpus_of
from diffret.retrieval.data.training import Group, drop_repeated_negatives, groups_table, mine_groups, read_tevatron
from diffret.retrieval.fields import SEED_MAX, cli
from diffret.schemas import GROUPS_SCHEMA
from diffret.storage import Manifest, StoreError
from diffret.storage.layout import GROUPS_FILE, dataset_dir, training_dir
from diffret.storage.store import sha256_file

from .base import Context, Plan, Stage, StageConfig
from .presentation import Presentation
from .readers import dataset_manifest, qrels_table, side_texts, split_queries
from .runs import read_run
from .systems import SystemRef, find_system


class TrainingDataConfig(StageConfig):
    """Parameters of the training-data stage (one of ``source`` or ``dataset``)."""

    name: str | None = Field(default=None, description="The set's name (default: the dataset, or the file's stem).")
    source: str | None = Field(
        default=None,
        description="A Tevatron file (jsonl / jsonl.gz / Parquet) or hub id.",
        json_schema_extra=cli(short="-s"),
    )
    dataset: str | None = Field(
        default=None,
        description="Mine groups from this stored dataset's train split.",
        json_schema_extra=cli(short="-d"),
    )
    split: str = Field(default="train", description="The split whose judged queries become groups.")
    negatives: str = Field(default="bm25", description="The stored system whose run gives the hard negatives.")
    kq: int | None = Field(default=None, ge=0, description="The run's K_q (when the system has several runs).")
    kp: int | None = Field(default=None, ge=0, description="The run's K_p (when the system has several runs).")
    mode: str | None = Field(default=None, description="The run's mode (when the system has several runs).")
    depth: int = Field(default=30, ge=1, description="Negatives are drawn from the run's top depth.")
    n_negatives: int = Field(default=15, ge=1, description="Hard negatives per group.")
    seed: int = Field(default=0, ge=0, le=SEED_MAX, description="Seed of the negative sampling.")

    @model_validator(mode="after")
    def _one_origin(self) -> TrainingDataConfig:
        if (self.source is None) == (self.dataset is None):
            raise ValueError("give exactly one of source (a Tevatron file or hub id) and dataset (mine from the store)")
        return self

    def set_name(self) -> str:
        if self.name:
            return self.name
        if self.dataset:
            return self.dataset if self.negatives == "bm25" else f"{self.dataset}-{self.negatives}"
        return Path(self.source or "groups").name.split(".")[0]


def _source_files(source: str) -> list[Path]:
    """A local Tevatron file, or the jsonl / Parquet files of a hub dataset (downloaded when reachable)."""
    path = Path(source).expanduser()
    if path.exists():
        return [path]
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise DatasetError(f"{source}: no such file (and not a hub dataset id 'org/name')")
    try:
        from huggingface_hub import snapshot_download

        folder = Path(
            snapshot_download(source, repo_type="dataset", allow_patterns=["*.jsonl", "*.jsonl.gz", "*.parquet"])
        )
    except Exception as exc:  # noqa: BLE001 - offline, unknown repo: one clear error
        raise DatasetError(
            f"{source}: cannot fetch the hub dataset ({type(exc).__name__}); pass a local file"
        ) from None
    files = sorted(p for p in folder.rglob("*") if p.name.endswith((".jsonl", ".jsonl.gz", ".parquet")))
    if not files:
        raise DatasetError(f"{source}: the hub dataset has no jsonl or Parquet files")
    return files


@dataclass
class TrainingUnit:
    stage: str
    config: dict[str, Any]
    run: str | None  # the run folder negatives come from


class TrainingData(Stage, name="training-data", config=TrainingDataConfig, noun="set(s)", verb="written"):
    """Training groups (query, positives, hard negatives) from a Tevatron file or mined from a stored run."""

    def plan(self, config: TrainingDataConfig, ctx: Context) -> Plan:
        store, name = ctx.store, config.set_name()
        cfg: dict[str, Any] = {"set": name}
        run = None
        if config.source is not None:
            files = _source_files(config.source)
            cfg |= {"source": config.source, "inputs": {str(f.name): sha256_file(str(f))[0] for f in files}}
        else:
            dataset = str(config.dataset)
            run = self._run_folder(config, ctx)
            run_depth = store.require_manifest(run).config.get("topk")
            if run_depth is not None and int(run_depth) < config.depth:
                raise StoreError(
                    f"{run} keeps {run_depth} documents per query, fewer than the negatives' "
                    f"depth {config.depth}; lower --depth or re-score deeper (--train-topk)"
                )
            cfg |= {
                "dataset": dataset,
                "corpus": corpus_of(dataset),
                "split": config.split,
                "negatives": run,
                "depth": config.depth,
                "n_negatives": config.n_negatives,
                "seed": config.seed,
                "inputs": {
                    "dataset": dataset_manifest(store, dataset).config_hash,
                    "run": store.require_manifest(run).config_hash,
                },
            }
        plan = Plan(system=name)
        folder = training_dir(name)
        if plan.needs(ctx, folder, cfg, config.force):
            plan.units.append(TrainingUnit(folder, cfg, run))
        return plan

    def _run_folder(self, config: TrainingDataConfig, ctx: Context) -> str:
        store, dataset = ctx.store, str(config.dataset)
        split_queries(store, dataset, config.split)  # a clear error without the split
        system = find_system(store, SystemRef(system=config.negatives)).system
        parts = [
            f"kq={config.kq}" if config.kq is not None else "kq=*",
            f"kp={config.kp}" if config.kp is not None else "kp=*",
            f"mode={config.mode}" if config.mode else "mode=*",
        ]
        found = store.folders(f"runs/system={system}/dataset={dataset}/split={config.split}/{'/'.join(parts)}")
        if len(found) == 1:
            return found[0]
        if not found:
            raise StoreError(
                f"no run of {system} on {dataset}/{config.split} in {store.root}; score that split first "
                f"(e.g. `diffret bm25 -d {dataset} --split {config.split}`)"
            )
        cells = ", ".join("/".join(f.split("/")[-3:]) for f in found[:8])
        raise StoreError(
            f"{system} has {len(found)} runs on {dataset}/{config.split} ({cells}, ...); "
            "choose one with --kq, --kp and --mode"
        )

    def run(self, unit: TrainingUnit, ctx: Context) -> dict[str, Any]:
        cfg = unit.config
        if unit.run is None:
            groups: list[Group] = [g for f in _source_files(cfg["source"]) for g in read_tevatron(f)]
            stats: dict[str, Any] = {"groups": len(groups), "repeated_negatives": drop_repeated_negatives(groups)}
        else:
            groups, report = self._mine(unit, ctx)
            stats = report.to_dict()
        if not groups:
            raise DatasetError(f"set {cfg['set']!r}: no training group could be built ({stats})")
        stats["negatives_per_group"] = sum(len(g.negatives) for g in groups) / len(groups)
        stats["max_negatives"] = max(len(g.negatives) for g in groups)
        m = Manifest.new("training", {"set": cfg["set"]}, cfg, stats=stats)
        with ctx.store.folder_writer(unit.stage, m) as w:
            w.write_parquet(GROUPS_FILE, GROUPS_SCHEMA, [groups_table(groups)])
        counted = {
            k: v
            for k, v in stats.items()
            if k not in ("examples", "negatives_per_group", "short", "negatives_short", "repeated_negatives") and v
        }
        ctx.log(f"training set {cfg['set']!r}: " + ", ".join(f"{k} {v:,}" for k, v in counted.items()))
        if stats.get("short"):
            held = [len(g.negatives) for g in groups if len(g.negatives) < cfg["n_negatives"]]
            ctx.log(
                f"{stats['short']:,} group(s) have fewer than {cfg['n_negatives']:,} distinct negatives in the "
                f"run's top {cfg['depth']} (positives left out): stored as they are, {min(held)}-{max(held)} each "
                f"({stats['negatives_short']:,} fewer in all), no duplicates; for more, raise --depth"
            )
        if stats.get("repeated_negatives"):
            ctx.log(
                f"{stats['repeated_negatives']:,} repeated negative(s) dropped (a passage is stored once per group)"
            )
        return stats

    def _mine(self, unit: TrainingUnit, ctx: Context) -> tuple[list[Group], Any]:
        store, cfg = ctx.store, unit.config
        assert unit.run is not None  # a unit that mines negatives names its run (run() reads the others' files)
        qrels = qrels_table(store, cfg["dataset"], cfg["split"])
        qrels = qrels.filter(pc.greater(qrels.column("relevance"), 0))
        positives: dict[str, list[str]] = {}
        for q, d in zip(qrels.column("query_id").to_pylist(), qrels.column("doc_id").to_pylist(), strict=True):
            positives.setdefault(q, []).append(d)
        q_ids, q_texts, _ = side_texts(store, cfg["dataset"], "query")
        corpus = store.read_table(dataset_dir(cfg["corpus"]), "corpus.parquet", columns=["doc_id", "title", "text"])
        passage = {
            d: (t or "", x)
            for d, t, x in zip(*(corpus.column(c).to_pylist() for c in ("doc_id", "title", "text")), strict=True)
        }
        run = read_run(store, unit.run, columns=["query_id", "doc_id", "rank"]).sort_by(
            [("query_id", "ascending"), ("rank", "ascending")]
        )
        ranked: dict[str, list[str]] = {}
        for q, d in zip(run.column("query_id").to_pylist(), run.column("doc_id").to_pylist(), strict=True):
            ranked.setdefault(q, []).append(d)
        return mine_groups(
            dict(zip(q_ids, q_texts, strict=True)),
            positives,
            ranked,
            passage,
            cfg["depth"],
            cfg["n_negatives"],
            cfg["seed"],
        )


presentation = Presentation(
    deployment=(
        "Contrastive training groups in Tevatron's format (query, positive and hard-negative passages) as "
        "`training/set=<name>/groups.parquet`: from a Tevatron file (config.source) or mined from a stored run on "
        "a dataset's train split (config.dataset; BM25 by default: top 30 minus the positives, 15 sampled)."
    ),
    example={
        "dataset": "scifact",
        "split": "train",
        "negatives": "bm25",
    },
    next_step="fine-tune on it: `diffret train` (the train deployment).",
)


stage = TrainingData()
