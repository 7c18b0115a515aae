"""Run folders: what every retrieval stage (score, bm25) writes, one folder per cell.

runs/system=<slug>/dataset=<d>/split=<s>/kq=<K_q>/kp=<K_p>/mode=<m>/run.parquet
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field

from diffret.retrieval.data.sources import corpus_of
from diffret.retrieval.fields import cli
from diffret.retrieval.search import doc_order, run_table
from diffret.retrieval.search.modes import FUSIONS
from diffret.retrieval.search.rules import ScoreRules
from diffret.retrieval.search.runs import run_file_bytes
from diffret.retrieval.search.scoring import TopK
from diffret.schemas import RUN_SCHEMA
from diffret.storage import ArtifactStore, Manifest, StoreError
from diffret.storage.layout import RUN_FILE

from .base import StageConfig

TRAIN_SPLIT = "train"
TRAIN_TOPK = 100  # train runs feed negatives (top 30) and the train-split budget selection (NDCG@10)


class QueriesConfig(StageConfig):
    """Which queries (a dataset) against which passages (its corpus, or the collection its qrels judge)."""

    dataset: str = Field(description="Queries and qrels (a dataset in the store).", json_schema_extra=cli(short="-d"))
    corpus: str | None = Field(
        default=None, description="Passages (default: the dataset's own corpus; TREC DL -> msmarco-passage)."
    )

    def corpus_name(self) -> str:
        return self.corpus or corpus_of(self.dataset)


class RetrievalConfig(QueriesConfig):
    """What every stage that writes runs takes: which queries, against which passages, how deep."""

    splits: list[str] = Field(
        default=["test"], description="Query splits to score.", json_schema_extra=cli(flag="--split")
    )
    topk: int = Field(default=1000, ge=1, description="Documents kept per query.")
    train_topk: int = Field(
        default=TRAIN_TOPK,
        ge=1,
        description="Documents kept per query of the train split "
        "(at most topk): enough for hard negatives and budget selection.",
    )
    # the reference's choice: docs/ARCHITECTURE.md, parity table
    self_hits: Literal["keep", "drop"] = Field(
        default="keep",
        description="A retrieved document whose id is the query's (ArguAna, Quora): keep (the "
        "reference's choice) or drop (BEIR's evaluation).",
    )

    def ignore_ids(self) -> bool:
        """Whether search drops a document whose id equals the query id (``self_hits="drop"``)."""
        return self.self_hits == "drop"

    def depth(self, split: str) -> int:
        """Documents kept per query of ``split``: ``train_topk`` (at most ``topk``) on train, else ``topk``.

        >>> RetrievalConfig(dataset="scifact").depth("train"), RetrievalConfig(dataset="scifact").depth("test")
        (100, 1000)
        """
        return min(self.train_topk, self.topk) if split == TRAIN_SPLIT else self.topk


@dataclass
class Cell:
    split: str
    kq: int
    kp: int
    mode: str
    stage: str
    config: dict[str, Any]


def cell_config(
    *,
    system: str,
    dataset: str,
    corpus: str,
    split: str,
    kq: int,
    kp: int,
    mode: str,
    topk: int,
    fusion_depth: int,
    ignore: bool,
    inputs: dict[str, str],
    rules: ScoreRules | None = None,
) -> dict[str, Any]:
    """A run folder's config: what it searched, how deep, and the scoring rules its mode depends on."""
    cfg: dict[str, Any] = {
        "system": system,
        "dataset": dataset,
        "corpus": corpus,
        "split": split,
        "kq": kq,
        "kp": kp,
        "mode": mode,
        "topk": topk,
        "ignore_identical_ids": ignore,
        "inputs": inputs,
    }
    if rules is not None:
        cfg["rules"] = rules.for_mode(mode, FUSIONS.get(mode, ()))
    if mode in FUSIONS:
        cfg["fusion"] = {"runs": list(FUSIONS[mode]), "norm": "minmax", "weights": [0.5, 0.5], "depth": fusion_depth}
    return cfg


def search_depth(cells: list[Cell]) -> int:
    """How deep one pass searches so that every cell's run is a prefix of it: the deepest cell, and a fusion's
    input depth when a fusion is among the cells (a train fusion at depth 100 still normalises its inputs' top
    ``fusion.depth``, so it equals the first 100 of the fusion at depth 1000).

    >>> search_depth([Cell("train", 1, 1, "fusion_multi_sparse_max", "s", {"topk": 100, "fusion": {"depth": 1000}})])
    1000
    """
    depths = [int(c.config["topk"]) for c in cells]
    depths += [int(c.config["fusion"]["depth"]) for c in cells if "fusion" in c.config]
    return max(depths)


def write_run(store: ArtifactStore, cell: Cell, table: pa.Table, stats: dict[str, Any] | None = None) -> None:
    """One run folder, atomically, with its manifest; the file is written by ``run_file_bytes`` (compact)."""
    part = {"system": cell.config["system"], "dataset": cell.config["dataset"], "split": cell.split}
    part.update({"kq": str(cell.kq), "kp": str(cell.kp), "mode": cell.mode})
    m = Manifest.new("runs", part, cell.config, stats=stats)
    with store.folder_writer(cell.stage, m) as w:
        entry = w.write_file(RUN_FILE, run_file_bytes(table))
        w.manifest.files[RUN_FILE] = entry.model_copy(update={"rows": table.num_rows})


def write_runs(
    store: ArtifactStore,
    cells: list[Cell],
    runs: dict[tuple[int, str], TopK],
    query_ids: list[str],
    doc_ids: list[str],
    split_rows: dict[str, list[int]],
    seconds: float | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Each cell's run (its split's queries, cut to its depth) from the (K_q, mode) results of one pass;
    ``seconds``: the pass's search time, recorded with every cell it wrote (:func:`search_stats`), ``extra``
    more of its stats (BM25's ``index_seconds``)."""
    lex = doc_order(doc_ids)  # once per pass, not once per cell
    timing = {**search_stats(seconds, len(query_ids), len(cells)), **(extra or {})}
    for cell in cells:
        rows = split_rows[cell.split]
        table = run_table(runs[(cell.kq, cell.mode)], query_ids, doc_ids, rows, lex, depth=int(cell.config["topk"]))
        write_run(store, cell, table, {"queries": len(rows), "rows": table.num_rows, **timing})


def search_stats(seconds: float | None, queries: int, cells: int) -> dict[str, Any]:
    """What a search pass cost, as a run's manifest records it (view ``search_costs``): its wall seconds, the
    queries it searched (every split's at once) and the cells it wrote (a pass scores several modes at once).

    >>> search_stats(1.5, 300, 2)
    {'search_seconds': 1.5, 'searched_queries': 300, 'pass_cells': 2}
    >>> search_stats(None, 300, 2)
    {}
    """
    if seconds is None:
        return {}
    return {"search_seconds": round(seconds, 4), "searched_queries": queries, "pass_cells": cells}


def read_run(store: ArtifactStore, folder: str, columns: list[str] | None = None) -> pa.Table:
    """A stored run (RUN_SCHEMA, doc ids as strings), verified against its manifest.

    Files written before runs were stored compactly have the same schema and read the same; a file of any
    other schema is refused with one line naming the folder.
    """
    table = store.read_table(folder, RUN_FILE, columns=columns)
    want = RUN_SCHEMA if columns is None else pa.schema([RUN_SCHEMA.field(c) for c in columns])
    if [(f.name, f.type) for f in table.schema] != [(f.name, f.type) for f in want]:
        got = ", ".join(f"{f.name}: {f.type}" for f in table.schema)
        raise StoreError(
            f"{store.abspath(folder)}/{RUN_FILE}: not a run file of this version ({got}); re-score it with --force"
        )
    return table


@dataclass(frozen=True)
class PickedRun:
    """A stored run a command named (``SYSTEM[:MODE[:KQ:KP]]``): its system, cell and folder."""

    label: str  # as the command named it
    system: str
    kq: int
    kp: int
    mode: str
    stage: str

    def ref(self) -> dict[str, Any]:
        return {"system": self.system, "kq": self.kq, "kp": self.kp, "mode": self.mode}


def pick_run(store: ArtifactStore, ref: str, dataset: str, split: str) -> PickedRun:
    """The one stored run of ``dataset``/``split`` that ``ref`` names: ``SYSTEM`` (a slug, a unique prefix of one, or
    ``bm25`` for the store's BM25 system), optionally ``:MODE`` and ``:KQ:KP``; a system with one run there needs
    neither. None or several: a StoreError listing the runs to choose from."""
    from diffret.storage.layout import partition

    from .systems import SystemRef, find_system

    parts = ref.split(":")
    if len(parts) not in (1, 2, 4) or not parts[0]:
        raise ValueError(f"run {ref!r}: expected SYSTEM, SYSTEM:MODE or SYSTEM:MODE:KQ:KP")
    try:
        kq, kp = (int(parts[2]), int(parts[3])) if len(parts) == 4 else (None, None)
    except ValueError:
        raise ValueError(f"run {ref!r}: KQ and KP must be integers (SYSTEM:MODE:KQ:KP)") from None
    mode = parts[1] if len(parts) > 1 else None
    record = (
        find_system(store, SystemRef(), kind="bm25")
        if parts[0] == "bm25"
        else find_system(store, SystemRef(system=parts[0]))
    )
    found = []
    for folder in store.folders(partition("runs", system=record.system, dataset=dataset, split=split) + "/*/*/*"):
        p = dict(part.split("=", 1) for part in folder.split("/")[1:])  # the folder's partition, as it was written
        if not ((mode is None or p["mode"] == mode) and (kq is None or (int(p["kq"]), int(p["kp"])) == (kq, kp))):
            continue  # another cell of the system: not read (a damaged one does not stand in the way)
        m = store.read_manifest(folder)  # damaged: its error names the repair
        if m is None or RUN_FILE not in m.files:
            continue
        found.append(PickedRun(ref, record.system, int(p["kq"]), int(p["kp"]), p["mode"], folder))
    if len(found) == 1:
        return found[0]
    if not found:
        raise StoreError(
            f"no run {ref!r} ({record.system}) on {dataset}/{split} in {store.root}; run it first, or "
            'list the runs: diffret sql "select distinct system, mode, kq, kp from runs"'
        )
    names = ", ".join(f"{r.system}:{r.mode}:{r.kq}:{r.kp}" for r in sorted(found, key=lambda r: (r.mode, r.kq, r.kp)))
    raise StoreError(
        f"run {ref!r} names {len(found)} runs on {dataset}/{split}; name one as SYSTEM:MODE:KQ:KP ({names[:600]})"
    )
