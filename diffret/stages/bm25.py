"""The BM25 stage: runs of the lexical baseline (bm25s, Lucene variant), written like every other system's.

Its runs have mode ``bm25`` and kq = kp = 0; the system ``bm25-<hash of its settings>`` is registered like
an encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from diffret.retrieval.search.bm25 import BM25Settings, bm25_search, bm25_search_shards
from diffret.storage.layout import run_dir

from .base import ClusterConfig, Context, Plan, Stage
from .presentation import Presentation
from .readers import corpus_size, dataset_manifest, side_text_ranges, side_texts, split_queries
from .runs import Cell, RetrievalConfig, write_runs
from .systems import SystemRecord, bm25_slug, register


class BM25Config(RetrievalConfig, ClusterConfig):
    """Parameters of the BM25 flow."""

    bm25: BM25Settings = Field(default_factory=BM25Settings, description="BM25's parameters.")
    shard_size: int = Field(
        default=1_000_000,
        ge=1,
        description="Passages per BM25 shard: a larger corpus is "
        "indexed a shard at a time (memory: one shard's index, ~2.7 kB a passage), its scores "
        "equal to the whole corpus's, of the documents tied at the cut-off the first in corpus "
        "order kept; a corpus this size or smaller is indexed whole, as bm25s does.",
    )


@dataclass
class BM25Unit:
    """One split's run: its cell (whose config names the dataset, corpus, BM25 settings, depth and self-hit rule),
    searched as deep as the deepest split the config asks for (each split's run is a prefix of that search, whichever
    splits a run has to do)."""

    cells: list[Cell]
    split_ids: dict[str, list[str]]
    depth: int


class BM25(Stage, name="bm25", config=BM25Config, noun="run(s)", verb="written", distributed=True):
    """BM25 baseline runs (bm25s, Lucene k1=0.9 b=0.4)."""

    def plan(self, config: BM25Config, ctx: Context) -> Plan:
        store = ctx.store
        corpus, ignore = config.corpus_name(), config.ignore_ids()
        system = bm25_slug(config.bm25)
        register(store, SystemRecord(system=system, kind="bm25", has_sparse=True, settings=config.bm25.model_dump()))
        inputs = {
            "queries": dataset_manifest(store, config.dataset).config_hash,
            "corpus": dataset_manifest(store, corpus).config_hash,
        }
        split_ids = {s: split_queries(store, config.dataset, s) for s in config.splits}
        sharded = corpus_size(store, corpus) > config.shard_size
        plan = Plan(system=system)
        todo = []
        for split in config.splits:
            cfg = {
                "system": system,
                "dataset": config.dataset,
                "corpus": corpus,
                "split": split,
                "kq": 0,
                "kp": 0,
                "mode": "bm25",
                "topk": config.depth(split),
                "ignore_identical_ids": ignore,
                "bm25": config.bm25.model_dump(),
                "inputs": inputs,
            }
            if sharded:  # its runs keep, of the documents tied at the cut-off, the first in corpus order
                cfg["shard_size"] = config.shard_size
            folder = run_dir(system, config.dataset, split, 0, 0, "bm25")
            if plan.needs(ctx, folder, cfg, config.force):
                todo.append(Cell(split, 0, 0, "bm25", folder, cfg))
        depth = max(config.depth(s) for s in config.splits)  # every split's search the same, whichever are to do
        plan.units = [BM25Unit([cell], {cell.split: split_ids[cell.split]}, depth) for cell in todo]
        plan.count = len(todo)
        return plan

    def unit_name(self, unit: BM25Unit) -> str:
        return f"split={unit.cells[0].split}"

    def run(self, unit: BM25Unit, ctx: Context) -> int:
        cfg = unit.cells[0].config  # the same search for every split
        store, corpus = ctx.store, cfg["corpus"]
        q_ids, q_texts, _ = side_texts(store, cfg["dataset"], "query")
        text_of = dict(zip(q_ids, q_texts, strict=True))
        query_ids = list(dict.fromkeys(q for cell in unit.cells for q in unit.split_ids[cell.split]))
        queries = [text_of[q] for q in query_ids]
        settings = BM25Settings.model_validate(cfg["bm25"])
        clock: dict[str, float] = {}
        n, size = corpus_size(store, corpus), cfg.get("shard_size")
        if size is None:
            ctx.log(f"BM25 over {n:,} passages for {len(query_ids):,} queries")
            doc_ids, doc_texts, _ = side_texts(store, corpus, "passage")
            top = bm25_search(
                doc_texts, queries, unit.depth, settings, query_ids, doc_ids, cfg["ignore_identical_ids"], clock
            )
            extra = {}
        else:
            ranges = [(s, min(s + size, n)) for s in range(0, n, size)]
            ctx.log(f"BM25 over {n:,} passages in {len(ranges)} shards of {size:,} for {len(query_ids):,} queries")

            def shards():  # noqa: ANN202 - (ids, texts) per shard, read from the store on each pass
                return ((ids, texts) for _, _, ids, texts in side_text_ranges(store, corpus, "passage", ranges))

            top, doc_ids = bm25_search_shards(
                shards, queries, unit.depth, settings, query_ids, cfg["ignore_identical_ids"], clock
            )
            extra = {"bm25_shards": len(ranges)}
        row = {q: i for i, q in enumerate(query_ids)}
        split_rows = {cell.split: [row[q] for q in unit.split_ids[cell.split]] for cell in unit.cells}
        write_runs(
            ctx.store,
            unit.cells,
            {(0, "bm25"): top},
            query_ids,
            doc_ids,
            split_rows,
            clock["search_seconds"],
            {"index_seconds": round(clock["index_seconds"], 4), **extra},
        )
        return len(unit.cells)


presentation = Presentation(
    deployment="BM25 baseline runs (bm25s, Lucene variant, k1=0.9, b=0.4, English stemmer and stopwords).",
    example={"dataset": "scifact", "splits": ["test"]},
    next_step="evaluate the runs: `diffret evaluate -d {dataset}` (the evaluate deployment).",
)


stage = BM25()
