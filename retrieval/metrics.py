"""The evaluate stage without Prefect: each run folder -> per-query metrics (pytrec_eval) in the store.

A metrics folder mirrors its run folder's partitions. Its config names the run (config hash and file
sha256), the qrels file's sha256, the measures and the relevance level; when the run or the qrels
change, the metrics are recomputed, otherwise they are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from storage import ArtifactStore, Manifest, config_hash
from storage.layout import METRICS_FILE, METRICS_SCHEMA, RUN_FILE, dataset_dir, metrics_dir

from .evaluation import DEFAULT_MEASURES, evaluate, qrels_from_table, run_from_table
from .scoring import qrels_table

# TREC DL judges on a 0-3 scale; its binary measures (recall, MRR) count grade >= 2 as relevant
GRADED_DATASETS = ("trec-dl-",)


def default_relevance_level(dataset: str) -> int:
    return 2 if dataset.startswith(GRADED_DATASETS) else 1


@dataclass
class RunRef:
    stage: str
    partition: dict[str, str]
    manifest: Manifest


def list_runs(
    store: ArtifactStore,
    models: list[str] | None = None,
    datasets: list[str] | None = None,
    splits: list[str] | None = None,
) -> list[RunRef]:
    """Complete run folders in the store, optionally filtered."""
    out = []
    for path in sorted(store.fs.glob(store.abspath("runs/*/*/*/*/*/*/_manifest.json"))):
        stage = path[len(store.abspath("")) :].lstrip("/").rsplit("/", 1)[0]
        m = store.read_manifest(stage)
        if m is None or RUN_FILE not in m.files:
            continue
        p = m.partition
        if models and p.get("model") not in models:
            continue
        if datasets and p.get("dataset") not in datasets:
            continue
        if splits and p.get("split") not in splits:
            continue
        out.append(RunRef(stage, p, m))
    return out


def metrics_config(run: RunRef, qrels_sha256: str, measures: list[str], relevance_level: int) -> dict[str, Any]:
    return {
        "run": run.stage,
        "run_config_hash": run.manifest.config_hash,
        "run_sha256": run.manifest.files[RUN_FILE].sha256,
        "qrels_sha256": qrels_sha256,
        "split": run.partition["split"],
        "measures": list(measures),
        "relevance_level": relevance_level,
        "mrr_cutoff": 10,
        "missing_queries": "score 0",
    }


def evaluate_runs(
    store: ArtifactStore,
    runs: list[RunRef],
    measures: list[str] | None = None,
    relevance_level: int | None = None,
    log: Callable[[str], None] = print,
) -> tuple[int, int]:
    """Write metrics for every run whose metrics are missing or stale; returns (evaluated, up to date)."""
    measures = list(measures or DEFAULT_MEASURES)
    qrels_cache: dict[tuple[str, str], dict] = {}
    qrels_sha: dict[str, str] = {}
    done = kept = 0
    for run in runs:
        p = run.partition
        level = relevance_level if relevance_level is not None else default_relevance_level(p["dataset"])
        ds = p["dataset"]
        if ds not in qrels_sha:  # one manifest read per dataset, not per run
            qrels_sha[ds] = store.require_manifest(dataset_dir(ds)).files["qrels.parquet"].sha256
        cfg = metrics_config(run, qrels_sha[ds], measures, level)
        stage = metrics_dir(p["model"], p["dataset"], p["split"], int(p["kq"]), int(p["kp"]), p["mode"])
        old = store.read_manifest(stage)
        if old is not None and old.config_hash == config_hash(cfg):
            try:
                store.verify(stage)
                kept += 1
                continue
            except Exception:  # noqa: BLE001 - damaged metrics are recomputed
                pass
        key = (p["dataset"], p["split"])
        if key not in qrels_cache:
            qrels_cache[key] = qrels_from_table(qrels_table(store, *key))
        qrels = qrels_cache[key]
        if not qrels:
            raise ValueError(f"dataset {p['dataset']!r} has no qrels for split {p['split']!r}")
        table = evaluate(qrels, run_from_table(store.read_table(run.stage, RUN_FILE)), measures, level)
        means = {}
        pairs = list(zip(table.column("measure").to_pylist(), table.column("value").to_pylist(), strict=True))
        for name in measures:
            vals = [v for m_, v in pairs if m_ == name]
            means[name] = sum(vals) / len(vals) if vals else None
        m = Manifest.new("metrics", dict(p), cfg, stats={"queries": len(qrels), "means": means})
        with store.stage_writer(stage, m) as w:
            w.write_parquet(METRICS_FILE, METRICS_SCHEMA, [table])
        done += 1
    if done:
        log(f"evaluated {done} run(s), {kept} already up to date")
    return done, kept
