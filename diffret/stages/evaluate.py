"""The evaluate stage: each run folder -> per-query metrics (pytrec_eval) in the store.

    metrics/system=<slug>/dataset=<d>/split=<s>/kq=<K_q>/kp=<K_p>/mode=<m>/per_query.parquet

A metrics folder mirrors its run folder's partitions. Its config holds the measures and the relevance level
(settings: changing them is drift, refused unless forced) and, as inputs, the run (config hash and file
sha256) and the qrels file's sha256: when the run or the qrels change, the metrics are recomputed.

Measures are of what the run retrieved: a train run kept at depth 100 (``train_topk``) has a recall_1000
equal to its recall_100 (the train split selects budgets by NDCG@10, which it does not change).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import pyarrow as pa
from pydantic import AfterValidator, Field

from diffret.caching import KeyedCache
from diffret.retrieval.evaluation import DEFAULT_MEASURES
from diffret.retrieval.evaluation.arrays import evaluate_tables
from diffret.retrieval.evaluation.measures import check_measures
from diffret.retrieval.fields import cli
from diffret.schemas import METRICS_SCHEMA
from diffret.storage import ArtifactStore, Manifest, StoreError, layout
from diffret.storage.layout import METRICS_FILE, RUN_FILE, metrics_dir

from .base import ClusterConfig, Context, Folder, Plan, Stage, StageConfig
from .presentation import Presentation
from .readers import dataset_manifest, qrels_table
from .runs import read_run

# TREC DL judges on a 0-3 scale; its binary measures (recall, MRR) count grade >= 2 as relevant
GRADED_DATASETS = ("trec-dl-",)


def default_relevance_level(dataset: str) -> int:
    return 2 if dataset.startswith(GRADED_DATASETS) else 1


class EvaluateConfig(StageConfig, ClusterConfig):
    """Parameters of the evaluate flow."""

    systems: list[str] | None = Field(
        default=None, description="Systems to evaluate (default: every run).", json_schema_extra=cli(flag="--system")
    )
    datasets: list[str] | None = Field(
        default=None,
        description="Datasets to evaluate (default: all).",
        json_schema_extra=cli(flag="--dataset", short="-d"),
    )
    splits: list[str] | None = Field(
        default=None, description="Splits to evaluate (default: all).", json_schema_extra=cli(flag="--split")
    )
    measures: Annotated[list[str], AfterValidator(check_measures)] = Field(
        default=list(DEFAULT_MEASURES),
        description="pytrec_eval measures; mrr_10 is recip_rank on the run cut at 10.",
        json_schema_extra=cli(flag="--measure"),
    )
    relevance_level: int | None = Field(
        default=None, ge=1, description="Grade counted relevant by binary measures (default: 2 for TREC DL, else 1)."
    )
    # the reference's choice: docs/ARCHITECTURE.md, parity table
    ties: Literal["trec", "rank"] = Field(
        default="trec",
        description="trec: a measure of depth d reads the run's first d documents, ordered among "
        "themselves as pytrec_eval orders them (ties by doc_id descending; the reference's choice); rank: the "
        "stored rank order.",
    )


@dataclass
class RunFolder:
    """A run's folder and its partition (system, dataset, split, ...), as selectors match it."""

    stage: str
    partition: dict[str, str]


@dataclass
class RunRef(RunFolder):
    """A stored run, with its manifest."""

    manifest: Manifest


RunT = TypeVar("RunT", bound=RunFolder)


def list_runs(
    store: ArtifactStore,
    systems: list[str] | None = None,
    datasets: list[str] | None = None,
    splits: list[str] | None = None,
    damaged: dict[str, str] | None = None,
) -> list[RunRef]:
    """Complete run folders in the store, optionally filtered. A damaged one (its manifest unreadable or edited by
    hand, its run file missing or changed: the cheap checks of :meth:`ArtifactStore.check_file`) is left out and
    named in ``damaged`` (folder -> the line with its repair) when given, else its error is raised."""
    out = []
    for folder in store.folders("runs/*/*/*/*/*/*"):
        p = dict(part.split("=", 1) for part in folder.split("/")[1:])  # the folder's partition, as it was written
        if systems and p.get("system") not in systems:
            continue
        if datasets and p.get("dataset") not in datasets:
            continue
        if splits and p.get("split") not in splits:
            continue
        try:
            m = store.read_manifest(folder)
            if m is None or RUN_FILE not in m.files:
                continue
            written = store.file_stat(layout.manifest_path(folder))  # its files are written before it
            store.check_file(folder, RUN_FILE, m.files[RUN_FILE], written[1] if written else None)
        except StoreError as exc:
            if damaged is None:
                raise
            damaged[folder] = str(exc)
            continue
        out.append(RunRef(folder, m.partition, m))
    return out


def select_runs(
    runs: list[RunT],
    systems: list[str] | None = None,
    datasets: list[str] | None = None,
    splits: list[str] | None = None,
) -> list[RunT]:
    """The runs of the given systems, datasets and splits (None: any)."""
    wanted = (("system", systems), ("dataset", datasets), ("split", splits))
    return [r for r in runs if all(not values or r.partition.get(key) in values for key, values in wanted)]


def check_selectors(
    runs: Sequence[RunFolder], systems: list[str] | None, datasets: list[str] | None, splits: list[str] | None
) -> None:
    """Refuse a selector value (``--system``, ``-d``, ``--split``) that none of the stored ``runs`` has: a typo
    would otherwise evaluate nothing and succeed. The error names what the store holds.

    >>> run = RunFolder("runs/x", {"system": "bm25-1", "dataset": "scifact", "split": "test"})
    >>> check_selectors([run], None, ["scifact"], ["test"])
    >>> check_selectors([run], None, ["nosuch"], None)
    Traceback (most recent call last):
    ...
    ValueError: no stored run has dataset 'nosuch' (-d); the stored runs' datasets: scifact (`diffret sql "select \
distinct dataset from runs"` lists them)
    """
    for key, flag, given in (
        ("system", "--system", systems),
        ("dataset", "-d", datasets),
        ("split", "--split", splits),
    ):
        stored = {r.partition.get(key, "") for r in runs}
        missing = [v for v in given or [] if v not in stored]
        if not missing:
            continue
        if not runs:
            raise ValueError(
                f"no stored run has {key} {missing[0]!r} ({flag}): the store holds no run yet (`diffret "
                "score`, `diffret bm25` or `diffret import-run` make them)"
            )
        raise ValueError(
            f"no stored run has {key} {missing[0]!r} ({flag}); the stored runs' {key}s: "
            f'{", ".join(sorted(stored))} (`diffret sql "select distinct {key} from runs"` lists '
            "them)"
        )


def metrics_config(
    run: RunRef, qrels_sha256: str, measures: list[str], relevance_level: int, ties: str = "trec"
) -> dict[str, Any]:
    return {
        "run": run.stage,
        "split": run.partition["split"],
        "measures": list(measures),
        "relevance_level": relevance_level,
        "ties": ties,
        "mrr_cutoff": 10,
        "missing_queries": "score 0",
        "inputs": {
            "run_config_hash": run.manifest.config_hash,
            "run_sha256": run.manifest.files[RUN_FILE].sha256,
            "qrels_sha256": qrels_sha256,
        },
    }


# (root, dataset, split, qrels sha256) -> the split's qrels: more splits than one evaluation reads
_QRELS: KeyedCache[tuple[str, str, str, str], pa.Table] = KeyedCache(size=256)


def _qrels(store: ArtifactStore, dataset: str, split: str, sha: str) -> pa.Table:
    return _QRELS.get((store.root, dataset, split, sha), lambda: qrels_table(store, dataset, split))


class Evaluate(Stage, name="evaluate", config=EvaluateConfig, noun="run(s)", verb="evaluated", distributed=True):
    """Per-query metrics (pytrec_eval) for the runs in the store."""

    def plan(self, config: EvaluateConfig, ctx: Context) -> Plan:
        store = ctx.store
        plan = Plan(work_unit="runs")
        qrels_sha: dict[str, str] = {}
        damaged: dict[str, str] = {}
        runs = list_runs(store, damaged=damaged)
        partitions = [RunFolder(st, dict(part.split("=", 1) for part in st.split("/")[1:])) for st in damaged]
        check_selectors([*runs, *partitions], config.systems, config.datasets, config.splits)
        damaged = {
            r.stage: damaged[r.stage] for r in select_runs(partitions, config.systems, config.datasets, config.splits)
        }
        if damaged and config.systems:  # a system asked for by name: its damaged run is refused, not skipped
            more = f" (and {len(damaged) - 1} more damaged run folder(s))" if len(damaged) > 1 else ""
            raise StoreError(next(iter(damaged.values())) + more)
        for why in damaged.values():  # every run: the others are evaluated, the damaged ones named with their repair
            ctx.log(f"warning: a damaged run folder is left out: {why}")
        for run in select_runs(runs, config.systems, config.datasets, config.splits):
            p = run.partition
            ds = p["dataset"]
            level = config.relevance_level if config.relevance_level is not None else default_relevance_level(ds)
            if ds not in qrels_sha:  # one manifest read per dataset, not per run
                qrels_sha[ds] = dataset_manifest(store, ds).files["qrels.parquet"].sha256
            cfg = metrics_config(run, qrels_sha[ds], config.measures, level, config.ties)
            folder = metrics_dir(p["system"], ds, p["split"], int(p["kq"]), int(p["kp"]), p["mode"])
            plan.add_folder(ctx, folder, cfg, config.force)
        return plan

    def run(self, unit: Folder, ctx: Context) -> None:
        store = ctx.store
        p = store.require_manifest(unit.config["run"]).partition
        qrels = _qrels(store, p["dataset"], p["split"], unit.config["inputs"]["qrels_sha256"])
        if qrels.num_rows == 0:
            raise ValueError(f"dataset {p['dataset']!r} has no qrels for split {p['split']!r}")
        measures = unit.config["measures"]
        stored = read_run(store, unit.config["run"])
        # vectorised over queries (retrieval/evaluation/arrays.py): pytrec_eval's values, bit for bit
        table = evaluate_tables(
            qrels, stored, measures, unit.config["relevance_level"], ties=unit.config.get("ties", "rank")
        )
        means: dict[str, float | None] = dict.fromkeys(measures)
        n_queries = table.num_rows // len(measures)
        if n_queries:
            values = table.column("value").to_numpy().reshape(n_queries, len(measures))
            for j, name in enumerate(measures):  # the mean as Python sums it, query by query
                means[name] = sum(values[:, j].tolist()) / n_queries
        m = Manifest.new("metrics", dict(p), unit.config, stats={"queries": n_queries, "means": means})
        with store.folder_writer(unit.stage, m) as w:
            w.write_parquet(METRICS_FILE, METRICS_SCHEMA, [table])


presentation = Presentation(
    deployment=(
        "Per-query pytrec_eval metrics (NDCG@10, MRR@10 on the run cut at 10, Recall@100/1000; TREC DL binary "
        "measures at grade >= 2) for every run in the store without up-to-date metrics."
    ),
    example={},
    next_step=(
        "the leaderboard and heatmaps: `diffret summary -d {dataset} --system SYSTEM` (the summary "
        "deployment); any table: `diffret sql`."
    ),
)


stage = Evaluate()
