"""The fuse stage (``diffret fuse``): stored runs of any systems fused into a system of its own.

    runs/system=<name>-<hash>/dataset=<d>/split=<s>/kq=0/kp=0/mode=fusion/run.parquet

Per query, each run's top ``depth`` is min-max normalised and the weighted sum over their union is ranked
(missing = 0; ``retrieval.search.modes.fuse_runs``, the rule the fusion modes of one system use, PromptReps' and the
reference's). The inputs are named like compare's (``SYSTEM[:MODE[:KQ:KP]]``: BM25, an imported run, an encoder's
cell, another fusion); the slug hashes them with the weights and depth, so another mix is another system.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import Field, model_validator

from diffret.retrieval.fields import cli
from diffret.retrieval.search.modes import fuse_runs
from diffret.retrieval.search.runs import run_table
from diffret.retrieval.search.scoring import NEG, TopK
from diffret.storage import config_hash
from diffret.storage.layout import FUSION_MODE, run_dir

from .base import Context, Plan, Stage
from .presentation import Presentation
from .readers import dataset_manifest
from .runs import Cell, QueriesConfig, pick_run, read_run, write_run
from .systems import SystemRecord, register, slug_base


class FuseConfig(QueriesConfig):
    """Parameters of the fuse flow."""

    runs: list[str] = Field(
        description="The runs to fuse (two or more): SYSTEM[:MODE[:KQ:KP]] as compare takes them.",
        json_schema_extra=cli(flag="--run"),
    )
    splits: list[str] = Field(
        default=["test"], description="Query splits to fuse.", json_schema_extra=cli(flag="--split")
    )
    weights: list[Annotated[float, Field(ge=0)]] | None = Field(
        default=None,
        description="A weight per run: finite, 0 or more, not all 0 (default: equal, summing to 1).",
        json_schema_extra=cli(flag="--weight"),
    )
    depth: int = Field(default=1000, ge=1, description="Top documents of each run normalised, and documents kept.")
    name: str = Field(default="fusion", description="The fused system's name (its slug adds a hash of the inputs).")

    @model_validator(mode="after")
    def _two_or_more(self) -> FuseConfig:
        if len(self.runs) < 2:
            raise ValueError(f"fusion takes two or more runs (--run twice or more), got {len(self.runs)}")
        if self.weights is not None and len(self.weights) != len(self.runs):
            raise ValueError(f"{len(self.weights)} weights for {len(self.runs)} runs: give one --weight per --run")
        if self.weights is not None and not any(self.weights):
            raise ValueError(
                f"the weights {self.weights} are all 0: the fused run would score every document 0; give "
                "at least one --weight above 0"
            )
        tiny = float(np.finfo(np.float32).tiny)  # fused scores are float32: a smaller weight underflows to 0
        if self.weights is not None and max(self.weights) < tiny:
            raise ValueError(
                f"the weights {self.weights} are all 0 in the fused run's float32 scores (the largest, "
                f"{max(self.weights)!r}, is below float32's smallest normal number {tiny:.3g}): the fused run would "
                f"score every document 0; give at least one --weight of {tiny:.3g} or more"
            )
        return self

    def weight_list(self) -> list[float]:
        return list(self.weights) if self.weights is not None else [1.0 / len(self.runs)] * len(self.runs)


@dataclass
class FuseUnit:
    cells: list[Cell]
    inputs: dict[str, list[str]]  # split -> the input run folders, in order
    weights: list[float]
    depth: int
    record: dict[str, Any]


class Fuse(Stage, name="fuse", config=FuseConfig, noun="run(s)", verb="fused"):
    """Fuse stored runs of any systems (min-max normalised, weighted) into a system of its own."""

    def plan(self, config: FuseConfig, ctx: Context) -> Plan:
        store, corpus = ctx.store, config.corpus_name()
        picked = {s: [pick_run(store, r, config.dataset, s) for r in config.runs] for s in config.splits}
        refs = [p.ref() for p in picked[config.splits[0]]]
        for s, ps in picked.items():
            if [p.ref() for p in ps] != refs:
                raise ValueError(
                    f"the runs name other cells on split {s!r} than on {config.splits[0]!r}: name each as "
                    "SYSTEM:MODE:KQ:KP"
                )
        settings = {"runs": refs, "weights": config.weight_list(), "depth": config.depth, "norm": "minmax"}
        slug = f"{slug_base(config.name)}-{config_hash(settings)[:10]}"
        record = SystemRecord(system=slug, kind="fusion", settings=settings)
        register(store, record, write=False, named=True)
        plan = Plan(system=slug)
        cells, inputs = [], {}
        for split, ps in picked.items():
            cfg = {
                "system": slug,
                "dataset": config.dataset,
                "corpus": corpus,
                "split": split,
                "kq": 0,
                "kp": 0,
                "mode": FUSION_MODE,
                "topk": config.depth,
                "fusion": settings,
                "inputs": {
                    "runs": [store.require_manifest(p.stage).config_hash for p in ps],
                    "queries": dataset_manifest(store, config.dataset).config_hash,
                },
            }
            folder = run_dir(slug, config.dataset, split, 0, 0, FUSION_MODE)
            if plan.needs(ctx, folder, cfg, config.force):
                cells.append(Cell(split, 0, 0, FUSION_MODE, folder, cfg))
                inputs[split] = [p.stage for p in ps]
        if cells:
            plan.units.append(FuseUnit(cells, inputs, config.weight_list(), config.depth, record.model_dump()))
        plan.count = len(cells)
        return plan

    def run(self, unit: FuseUnit, ctx: Context) -> int:
        store = ctx.store
        tables = {}  # every cell fused and checked before anything is written
        for cell in unit.cells:
            inputs = [read_run(store, stage) for stage in unit.inputs[cell.split]]
            qids = list(dict.fromkeys(q for t in inputs for q in t.column("query_id").to_pylist()))
            docs = list(dict.fromkeys(d for t in inputs for d in t.column("doc_id").to_pylist()))
            fused = fuse_runs([_topk(t, qids, docs) for t in inputs], unit.depth, unit.weights)
            _refuse_constant(fused, cell.split, unit.inputs[cell.split])
            tables[cell.stage] = (run_table(fused, qids, docs, depth=unit.depth), len(qids))
        register(store, SystemRecord.model_validate(unit.record))
        for cell in unit.cells:
            table, n = tables[cell.stage]
            write_run(store, cell, table, {"queries": n, "rows": table.num_rows})
        return len(unit.cells)


presentation = Presentation(
    deployment=(
        "Fuse stored runs of any systems (BM25, imported runs, encoder cells: SYSTEM[:MODE[:KQ:KP]]) by per-query "
        "min-max normalisation and a weighted sum, into a system of its own."
    ),
    example={
        "dataset": "scifact",
        "splits": ["test"],
        "runs": ["bm25", "splade"],
    },
    next_step=(
        "evaluate it: `diffret evaluate -d {dataset}`; compare it: `diffret compare -d {dataset} --run {system}`."
    ),
)


def _refuse_constant(fused: TopK, split: str, inputs: list[str]) -> None:
    """A ValueError when every query holding two or more documents scores them all alike (the weighted runs' scores
    are constant within each query: min-max normalisation maps them to 0): its ranking would be document-id order.

    >>> _refuse_constant(TopK(np.array([[0.0, 0.0]], np.float32), np.array([[0, 1]])), "test", ["a", "b"])
    Traceback (most recent call last):
    ...
    ValueError: the fused run of split 'test' scores every document of each query alike (0): the weighted runs' \
scores are constant within each query (a, b); nothing was written
    """
    valid = fused.index >= 0
    several = valid.sum(axis=1) >= 2
    if not several.any():
        return
    s = fused.scores.astype(np.float64)
    lo = np.min(np.where(valid, s, np.inf), axis=1)
    hi = np.max(np.where(valid, s, -np.inf), axis=1)
    if np.all(hi[several] == lo[several]):
        raise ValueError(
            f"the fused run of split {split!r} scores every document of each query alike ({lo[several][0]:g}): the "
            f"weighted runs' scores are constant within each query ({', '.join(inputs)}); nothing was written"
        )


def _topk(table: Any, qids: list[str], docs: list[str]) -> TopK:
    """A run table as a TopK over a shared document index (rows in rank order; queries without results padded)."""
    q_row = {q: i for i, q in enumerate(qids)}
    d_idx = {d: i for i, d in enumerate(docs)}
    t = table.sort_by([("query_id", "ascending"), ("rank", "ascending")])
    per: dict[int, list[tuple[float, int]]] = {}
    for q, d, s in zip(*(t.column(c).to_pylist() for c in ("query_id", "doc_id", "score")), strict=True):
        per.setdefault(q_row[q], []).append((s, d_idx[d]))
    width = max([len(v) for v in per.values()] + [1])
    scores = np.full((len(qids), width), NEG, np.float32)
    index = np.full((len(qids), width), -1, np.int64)
    for row, items in per.items():
        scores[row, : len(items)] = [s for s, _ in items]
        index[row, : len(items)] = [i for _, i in items]
    return TopK(scores, index)


stage = Fuse()
