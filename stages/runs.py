"""Run folders: what every retrieval stage (score, bm25) writes, one folder per cell.

    runs/system=<slug>/dataset=<d>/split=<s>/kq=<K_q>/kp=<K_p>/mode=<m>/run.parquet
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pydantic import Field

from retrieval.data.sources import corpus_of
from retrieval.search import doc_order, run_table
from retrieval.search.modes import FUSIONS
from retrieval.search.scoring import TopK
from storage import ArtifactStore, Manifest
from storage.layout import RUN_FILE, RUN_SCHEMA

from .base import StageConfig

# BEIR drops a retrieved document whose id equals the query id on these (a query is itself a document)
SELF_RETRIEVAL_DATASETS = ("arguana", "quora", "cqadupstack")


def default_ignore_identical_ids(dataset: str) -> bool:
    return dataset.startswith(SELF_RETRIEVAL_DATASETS)


class QueriesConfig(StageConfig):
    """Which queries (a dataset) against which passages (its corpus, or the collection its qrels judge)."""

    dataset: str = Field(description="Queries and qrels (a dataset in the store).")
    corpus: str | None = Field(default=None, description="Passages (default: the dataset's own corpus; TREC DL ->"
                               " msmarco-passage).")  # fmt: skip

    def corpus_name(self) -> str:
        return self.corpus or corpus_of(self.dataset)


class RetrievalConfig(QueriesConfig):
    """What every stage that writes runs takes: which queries, against which passages, how deep."""

    splits: list[str] = Field(default=["test"], description="Query splits to score.")
    topk: int = Field(default=1000, ge=1, description="Documents kept per query.")
    ignore_identical_ids: bool | None = Field(
        default=None, description="Drop a document whose id equals the query id (default: on for ArguAna, Quora)."
    )

    def ignore_ids(self) -> bool:
        if self.ignore_identical_ids is None:
            return default_ignore_identical_ids(self.dataset)
        return self.ignore_identical_ids


@dataclass
class Cell:
    split: str
    kq: int
    kp: int
    mode: str
    stage: str
    config: dict[str, Any]


def cell_config(system: str, dataset: str, corpus: str, split: str, kq: int, kp: int, mode: str, topk: int,
                fusion_depth: int, ignore: bool, inputs: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    cfg: dict[str, Any] = {
        "system": system, "dataset": dataset, "corpus": corpus, "split": split, "kq": kq, "kp": kp, "mode": mode,
        "topk": topk, "ignore_identical_ids": ignore, "inputs": inputs,
    }  # fmt: skip
    if mode in FUSIONS:
        cfg["fusion"] = {"runs": list(FUSIONS[mode]), "norm": "minmax", "weights": [0.5, 0.5], "depth": fusion_depth}
    return cfg


def write_run(store: ArtifactStore, cell: Cell, table: pa.Table, stats: dict[str, Any] | None = None) -> None:
    """One run folder, atomically, with its manifest."""
    part = {"system": cell.config["system"], "dataset": cell.config["dataset"], "split": cell.split}
    part.update({"kq": str(cell.kq), "kp": str(cell.kp), "mode": cell.mode})
    m = Manifest.new("runs", part, cell.config, stats=stats)
    with store.stage_writer(cell.stage, m) as w:
        w.write_parquet(RUN_FILE, RUN_SCHEMA, [table])


def write_runs(store: ArtifactStore, cells: list[Cell], runs: dict[tuple[int, str], TopK], query_ids: list[str],
               doc_ids: list[str], split_rows: dict[str, list[int]]) -> None:  # fmt: skip
    """Each cell's run (its split's queries) from the (K_q, mode) results of one pass."""
    lex = doc_order(doc_ids)  # once per pass, not once per cell
    for cell in cells:
        rows = split_rows[cell.split]
        table = run_table(runs[(cell.kq, cell.mode)], query_ids, doc_ids, rows, lex)
        write_run(store, cell, table, {"queries": len(rows), "rows": table.num_rows})


