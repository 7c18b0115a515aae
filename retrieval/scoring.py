"""The score stage without Prefect: stored encodings -> one run folder per (split, K_q, K_p, mode).

For each K_p, the passage encoding is streamed once, shard by shard, and every requested K_q and base
mode is scored against it (``search.search_pass``); the fusions are built from those runs. A run
folder is written atomically with its manifest; a cell whose manifest has the same config and whose
file verifies is done, and a K_p pass whose cells are all done is skipped (no encoding is read).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch

from storage import ArtifactStore, ConfigDriftError, IncompleteArtifactError, Manifest, config_hash, diff_configs
from storage.layout import (
    FUSIONS,
    MODES,
    RUN_FILE,
    RUN_SCHEMA,
    dataset_dir,
    encodings_dir,
    run_dir,
)

from .search import Encodings, SearchSettings, TopK, all_modes, encodings_from_table, run_table, search_pass, select

# BEIR drops a retrieved document whose id equals the query id on these (a query is itself a document)
SELF_RETRIEVAL_DATASETS = ("arguana", "quora", "cqadupstack")


def default_ignore_identical_ids(dataset: str) -> bool:
    return dataset.startswith(SELF_RETRIEVAL_DATASETS)


def corpus_of(dataset: str) -> str:
    """The collection whose corpus a dataset's qrels judge (TREC DL -> msmarco-passage)."""
    from .sources import catalog

    entry = catalog().get(dataset)
    return entry.corpus_from if entry is not None and entry.corpus_from else dataset


def split_queries(store: ArtifactStore, dataset: str, split: str) -> list[str]:
    """Query ids judged in ``split`` (in first-appearance order); a clear error for an unknown split."""
    stage = dataset_dir(dataset)
    t = store.read_table(stage, "queries.parquet", columns=["query_id", "split"])
    splits = sorted({s for s in t.column("split").to_pylist() if s is not None})
    if split not in splits:
        raise ValueError(f"dataset {dataset!r} has no split {split!r}; it has {splits}")
    ids = t.filter(pc.equal(t.column("split"), split)).column("query_id").to_pylist()
    return list(dict.fromkeys(ids))


def qrels_table(store: ArtifactStore, dataset: str, split: str) -> pa.Table:
    t = store.read_table(dataset_dir(dataset), "qrels.parquet")
    return t.filter(pc.equal(t.column("split"), split))


def complete_encoding(store: ArtifactStore, stage: str, expected_rows: int) -> Manifest:
    """The manifest of an encoding folder that holds every text; otherwise a clear error."""
    m = store.require_manifest(stage)
    have = m.total_rows()
    if have != expected_rows:
        raise IncompleteArtifactError(
            f"{store.abspath(stage)}: {have:,} of {expected_rows:,} texts encoded; run `diffret encode` to finish it"
        )
    return m


def iter_encodings(store: ArtifactStore, stage: str, m: Manifest, device: str) -> Iterator[Encodings]:
    """The shards of an encoding folder in order, each verified against the manifest."""
    for name in sorted(m.files):
        yield encodings_from_table(store.read_table(stage, name), device)


def read_encodings(store: ArtifactStore, stage: str, m: Manifest, device: str) -> Encodings:
    tables = [store.read_table(stage, name) for name in sorted(m.files)]
    return encodings_from_table(pa.concat_tables(tables), device)


@dataclass
class Cell:
    split: str
    kq: int
    kp: int
    mode: str
    stage: str
    config: dict[str, Any]


@dataclass
class ScorePlan:
    todo: list[Cell] = field(default_factory=list)
    done: int = 0

    def passes(self) -> list[int]:
        return sorted({c.kp for c in self.todo})


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def cell_config(
    system: str,
    dataset: str,
    corpus: str,
    split: str,
    kq: int,
    kp: int,
    mode: str,
    q_manifest: Manifest,
    p_manifest: Manifest,
    ds_hash: str,
    topk: int,
    fusion_depth: int,
    ignore_identical_ids: bool,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "system": system,
        "dataset": dataset,
        "corpus": corpus,
        "split": split,
        "kq": kq,
        "kp": kp,
        "mode": mode,
        "topk": topk,
        "ignore_identical_ids": ignore_identical_ids,
        "queries_config_hash": ds_hash,
        "query_encodings_config_hash": q_manifest.config_hash,
        "passage_encodings_config_hash": p_manifest.config_hash,
    }
    if mode in FUSIONS:
        cfg["fusion"] = {"runs": list(FUSIONS[mode]), "norm": "minmax", "weights": [0.5, 0.5], "depth": fusion_depth}
    return cfg


def cell_done(store: ArtifactStore, stage: str, config: dict[str, Any]) -> bool:
    """True when the run folder exists with this config and its file verifies.

    A folder built from a different config raises ConfigDriftError naming the fields.
    """
    m = store.read_manifest(stage)
    if m is None:
        return False
    if m.config_hash != config_hash(config):
        raise ConfigDriftError(
            store.abspath(stage),
            diff_configs(m.config, config),
            hint="Score into another store root, or remove that run folder to replace it.",
        )
    try:
        store.verify(stage)
    except Exception:  # noqa: BLE001 - a damaged run is redone
        return False
    return RUN_FILE in m.files


def write_run(store: ArtifactStore, cell: Cell, table: pa.Table, stats: dict[str, Any] | None = None) -> None:
    part = {"model": cell.config["system"], "dataset": cell.config["dataset"], "split": cell.split}
    part.update({"kq": str(cell.kq), "kp": str(cell.kp), "mode": cell.mode})
    m = Manifest.new("runs", part, cell.config, stats=stats)
    with store.stage_writer(cell.stage, m) as w:
        w.write_parquet(RUN_FILE, RUN_SCHEMA, [table])


def search_and_write(
    store: ArtifactStore,
    cells: list[Cell],
    queries: dict[int, Encodings],
    split_rows: dict[str, list[int]],
    passages: Iterator[Encodings],
    settings: SearchSettings,
    fusion_depth: int,
) -> int:
    """One pass over a passage encoding: score all cells of one K_p and write their runs."""
    need_modes = {c.mode for c in cells}
    base = {m for m in need_modes if m not in FUSIONS}
    for fused in need_modes & set(FUSIONS):
        base.update(FUSIONS[fused])
    base_modes = [m for m in MODES if m in base]
    tops, doc_ids = search_pass(queries, passages, base_modes, settings)
    runs: dict[tuple[int, str], TopK] = all_modes(tops, fusion_depth)
    for cell in cells:
        q = queries[cell.kq]
        table = run_table(runs[(cell.kq, cell.mode)], q.ids, doc_ids, split_rows[cell.split])
        write_run(store, cell, table, {"queries": len(split_rows[cell.split]), "rows": table.num_rows})
    return len(cells)


def score(
    store: ArtifactStore,
    system: str,
    dataset: str,
    splits: list[str],
    kqs: list[int],
    kps: list[int],
    modes: list[str],
    *,
    corpus: str | None = None,
    topk: int = 1000,
    fusion_depth: int = 1000,
    ignore_identical_ids: bool | None = None,
    device: str = "auto",
    log: Callable[[str], None] = print,
) -> ScorePlan:
    """Plan and run the missing cells; returns the plan (what was done and what was already there)."""
    corpus = corpus or corpus_of(dataset)
    ignore = default_ignore_identical_ids(dataset) if ignore_identical_ids is None else ignore_identical_ids
    device = resolve_device(device)
    ds_hash = store.require_manifest(dataset_dir(dataset)).config_hash
    n_passages = int(store.require_manifest(dataset_dir(corpus)).files["corpus.parquet"].rows or 0)
    split_ids = {s: split_queries(store, dataset, s) for s in splits}
    q_stages = {kq: encodings_dir(system, dataset, "query", kq) for kq in kqs}
    p_stages = {kp: encodings_dir(system, corpus, "passage", kp) for kp in kps}
    for st in [*q_stages.values(), *p_stages.values()]:
        if store.read_manifest(st) is None:
            raise IncompleteArtifactError(
                f"{store.abspath(st)}: no encodings; run `diffret encode` for this model, dataset and K first"
            )
    q_man = {kq: store.require_manifest(s) for kq, s in q_stages.items()}
    p_man = {kp: complete_encoding(store, s, n_passages) for kp, s in p_stages.items()}
    plan = ScorePlan()
    for kp in kps:
        for split in splits:
            for kq in kqs:
                for mode in modes:
                    cfg = cell_config(
                        system, dataset, corpus, split, kq, kp, mode, q_man[kq], p_man[kp], ds_hash, topk,
                        fusion_depth, ignore,
                    )  # fmt: skip
                    stage = run_dir(system, dataset, split, kq, kp, mode)
                    if cell_done(store, stage, cfg):
                        plan.done += 1
                    else:
                        plan.todo.append(Cell(split, kq, kp, mode, stage, cfg))
    if not plan.todo:
        return plan
    # the queries of every requested split, once
    all_ids = list(dict.fromkeys(q for s in splits for q in split_ids[s]))
    row = {q: i for i, q in enumerate(all_ids)}
    split_rows = {s: [row[q] for q in split_ids[s]] for s in splits}
    settings = SearchSettings(topk=topk, ignore_identical_ids=ignore)
    loaded: dict[int, Encodings] = {}  # query encodings, read once for every K_p pass
    for kq in sorted({c.kq for c in plan.todo}):
        enc = read_encodings(store, q_stages[kq], q_man[kq], device)
        try:
            loaded[kq] = select(enc, all_ids)
        except KeyError as exc:
            raise IncompleteArtifactError(f"{store.abspath(q_stages[kq])}: {exc.args[0]}") from None
    for kp in plan.passes():
        cells = [c for c in plan.todo if c.kp == kp]
        queries = {kq: loaded[kq] for kq in sorted({c.kq for c in cells})}
        log(f"scoring K_p={kp}: {len(cells)} cell(s) over {n_passages:,} passages on {device}")
        search_and_write(
            store, cells, queries, split_rows, iter_encodings(store, p_stages[kp], p_man[kp], device), settings,
            fusion_depth,
        )  # fmt: skip
    return plan


# -------------------------------------------------------------------------------------- BM25
def bm25_slug(settings: Any) -> str:
    return f"bm25-{config_hash(settings.model_dump())[:10]}"


def score_bm25(
    store: ArtifactStore,
    dataset: str,
    splits: list[str],
    settings: Any = None,
    *,
    corpus: str | None = None,
    topk: int = 1000,
    ignore_identical_ids: bool | None = None,
    log: Callable[[str], None] = print,
) -> tuple[str, ScorePlan]:
    """BM25 runs (mode ``bm25``, kq = kp = 0) for each split, written like every other system's runs."""
    from .bm25 import BM25Settings, bm25_search
    from .encoding import side_texts

    settings = settings or BM25Settings()
    corpus = corpus or corpus_of(dataset)
    ignore = default_ignore_identical_ids(dataset) if ignore_identical_ids is None else ignore_identical_ids
    system = bm25_slug(settings)
    ds_hash = store.require_manifest(dataset_dir(dataset)).config_hash
    corpus_hash = store.require_manifest(dataset_dir(corpus)).config_hash
    split_ids = {s: split_queries(store, dataset, s) for s in splits}
    plan = ScorePlan()
    for split in splits:
        cfg = {
            "system": system,
            "dataset": dataset,
            "corpus": corpus,
            "split": split,
            "kq": 0,
            "kp": 0,
            "mode": "bm25",
            "topk": topk,
            "ignore_identical_ids": ignore,
            "bm25": settings.model_dump(),
            "queries_config_hash": ds_hash,
            "corpus_config_hash": corpus_hash,
        }
        stage = run_dir(system, dataset, split, 0, 0, "bm25")
        if cell_done(store, stage, cfg):
            plan.done += 1
        else:
            plan.todo.append(Cell(split, 0, 0, "bm25", stage, cfg))
    if not plan.todo:
        return system, plan
    doc_ids, doc_texts, _ = side_texts(store, corpus, "passage")
    q_ids, q_texts, _ = side_texts(store, dataset, "query")
    text_of = dict(zip(q_ids, q_texts, strict=True))
    all_ids = list(dict.fromkeys(q for c in plan.todo for q in split_ids[c.split]))
    log(f"BM25 over {len(doc_ids):,} passages for {len(all_ids):,} queries")
    top = bm25_search(doc_texts, [text_of[q] for q in all_ids], topk, settings, all_ids, doc_ids, ignore)
    row = {q: i for i, q in enumerate(all_ids)}
    for cell in plan.todo:
        rows = [row[q] for q in split_ids[cell.split]]
        table = run_table(top, all_ids, doc_ids, rows)
        write_run(store, cell, table, {"queries": len(rows), "rows": table.num_rows})
    return system, plan
