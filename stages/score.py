"""The score stage: stored encodings -> one run folder per (split, K_q, K_p, mode).

    runs/system=<slug>/dataset=<d>/split=<s>/kq=<K_q>/kp=<K_p>/mode=<m>/run.parquet

A unit is one pass over a K_p passage encoding: shard by shard, every requested K_q and base mode is
scored against it (``retrieval.search.search_pass``) and the fusions are built from those runs. A cell
whose manifest has the same config and whose file verifies is done; a pass whose cells are all done is
not planned (no encoding is read).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import Field

from retrieval.devices import resolve_device
from retrieval.fields import cli, like
from retrieval.models.backbones import BackboneConfig
from retrieval.search.exact import DEFAULT_BLOCK_MB, SearchSettings, search_pass
from retrieval.search.modes import MODE_NAMES, all_modes, base_modes_needed, cell_modes, modes_for
from retrieval.search.rules import ScoreRules
from storage.layout import encodings_dir, run_dir

from .base import Context, KList, ModeList, Plan, Stage
from .readers import (
    budgets,
    corpus_size,
    dataset_manifest,
    encoding_manifest,
    iter_encodings,
    query_encodings,
    split_queries,
)
from .runs import Cell, RetrievalConfig, cell_config, search_depth, write_runs
from .systems import SystemRef, find_system


class ScoreConfig(RetrievalConfig):
    """Parameters of the score flow."""

    system: SystemRef = Field(default_factory=SystemRef, description="The encoder system whose encodings to score.")
    kq: KList | None = Field(default=None, description="Query budgets K_q (default: every K_q whose query encodings "
                             "are stored).")  # fmt: skip
    kp: KList | None = Field(default=None, description="Passage budgets K_p (default: every K_p whose passage "
                             "encodings are stored).")  # fmt: skip
    modes: ModeList = Field(default=list(MODE_NAMES), description="Scoring modes (paper section 3.3).",
                            json_schema_extra=cli(flag="--mode"))  # fmt: skip
    q1p1_multi: Literal["skip", "keep"] = Field(default="skip", description="At K_q = K_p = 1, skip multi_dense "
                                                "and its fusion as the reference evaluator does, or keep them.")
    # (one slot a side: MaxSim is single_dense clamped at 0; diffret 0.1 kept them)
    fusion_depth: int = Field(default=1000, ge=1, description="Top documents of each run that fusion normalises.")
    device: str = like(BackboneConfig, "device")
    block_mb: float = Field(default=DEFAULT_BLOCK_MB, gt=0, description="Memory for the scoring blocks (MiB): "
                            "queries and passages are cut so that they fit; results do not depend on it.")
    rules: ScoreRules = Field(default_factory=ScoreRules, description="How each mode scores (default: the "
                              "reference evaluator's).")  # fmt: skip


@dataclass
class ScorePass:
    """One pass over the K_p passage encoding for the cells still to score."""

    kp: int
    cells: list[Cell]
    query_stages: dict[int, str]
    passage_stage: str
    query_ids: list[str]  # every requested split's queries, once
    split_rows: dict[str, list[int]]  # split -> rows of query_ids
    settings: SearchSettings
    fusion_depth: int
    device: str
    sparse_factor: float = 1.0  # ScoreRules.sparse_factor for this system's sparse weights


class Score(Stage, name="score", config=ScoreConfig, noun="cell(s)", verb="scored"):
    """Exact search for every (K_q, K_p, mode) cell of the grid."""

    deployment = (  # the Prefect deployment's description (flows/deployments.py)
        "Exact search (chunked, CPU or GPU) for every (K_q, K_p, mode) cell over stored encodings: one run folder "
        "per cell under runs/. One pass over each K_p's passages scores every K_q and mode. config.system names "
        "the encoder system: `{system: <slug>}`, or `{model: <id or path>, where: {setting: value}}`."
    )
    example = {
        "dataset": "scifact",
        "splits": ["test"],
        "kq": [1, 2, 4, 8, 16],
        "kp": [1, 2, 4, 8, 16],
        "system": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
        "device": "auto",
    }  # the deployment's parameters, besides root

    next_step = "evaluate the runs: `diffret evaluate -d {dataset}` (the evaluate deployment)."

    def plan(self, config: ScoreConfig, ctx: Context) -> Plan:
        resolve_device(config.device)  # a device this machine lacks: refused before any work
        store = ctx.store
        record = find_system(store, config.system)
        # a representation without sparse vectors is scored in the dense modes only
        modes = modes_for(config.modes, record.has_sparse) or ["single_dense"]
        corpus, ignore = config.corpus_name(), config.ignore_ids()
        config = config.model_copy(update={
            "kq": budgets(store, config.kq, record.system, config.dataset, "query", ctx.log),
            "kp": budgets(store, config.kp, record.system, corpus, "passage", ctx.log)})  # fmt: skip
        ds_hash = dataset_manifest(store, config.dataset).config_hash
        n_passages = corpus_size(store, corpus)
        split_ids = {s: split_queries(store, config.dataset, s) for s in config.splits}
        q_stages = {kq: encodings_dir(record.system, config.dataset, "query", kq) for kq in config.kq}
        p_stages = {kp: encodings_dir(record.system, corpus, "passage", kp) for kp in config.kp}
        q_man = {kq: encoding_manifest(store, s) for kq, s in q_stages.items()}
        p_man = {kp: encoding_manifest(store, s, n_passages) for kp, s in p_stages.items()}
        plan = Plan(system=record.system, work_unit="passes")
        todo: list[Cell] = []
        for kp in config.kp:
            for split in config.splits:
                for kq in config.kq:
                    inputs = {"queries": ds_hash, "query_encodings": q_man[kq].config_hash,
                              "passage_encodings": p_man[kp].config_hash}  # fmt: skip
                    for mode in cell_modes(modes, kq, kp, config.q1p1_multi):
                        cfg = cell_config(record.system, config.dataset, corpus, split, kq, kp, mode,
                                          config.depth(split), config.fusion_depth, ignore, inputs,
                                          config.rules)  # fmt: skip
                        stage = run_dir(record.system, config.dataset, split, kq, kp, mode)
                        if plan.needs(ctx, stage, cfg, config.force):
                            todo.append(Cell(split, kq, kp, mode, stage, cfg))
        skipped = [m for m in modes if m not in cell_modes(modes, 1, 1, config.q1p1_multi)]
        if skipped and 1 in config.kq and 1 in config.kp:
            ctx.log(f"K_q = K_p = 1: {', '.join(skipped)} not scored, as the reference evaluator does (--q1p1-multi "
                    "keep scores them)")  # fmt: skip
        plan.count = len(todo)
        query_ids = list(dict.fromkeys(q for s in config.splits for q in split_ids[s]))
        row = {q: i for i, q in enumerate(query_ids)}
        split_rows = {s: [row[q] for q in split_ids[s]] for s in config.splits}
        settings = SearchSettings(topk=config.topk, ignore_identical_ids=ignore,
                                  block_bytes=int(config.block_mb * (1 << 20)), rules=config.rules)
        device = str(resolve_device(config.device))
        factor = config.rules.factor_for(record.readout, record.settings.get("readout"))
        for kp in sorted({c.kp for c in todo}):
            cells = [c for c in todo if c.kp == kp]
            stages = {kq: q_stages[kq] for kq in sorted({c.kq for c in cells})}
            deep = replace(settings, topk=search_depth(cells))  # each cell's run is a prefix, cut to its depth
            plan.units.append(
                ScorePass(kp, cells, stages, p_stages[kp], query_ids, split_rows, deep, config.fusion_depth, device,
                          factor)  # fmt: skip
            )
        return plan

    def run(self, unit: ScorePass, ctx: Context) -> int:
        store = ctx.store
        rules, factor = unit.settings.rules, unit.sparse_factor
        queries = {kq: query_encodings(store, st, unit.query_ids, unit.device, rules, factor)
                   for kq, st in unit.query_stages.items()}  # fmt: skip
        p_man = encoding_manifest(store, unit.passage_stage)
        passages = iter_encodings(store, unit.passage_stage, p_man, unit.device, rules, factor)
        n = p_man.total_rows()
        ctx.log(f"scoring K_p={unit.kp}: {len(unit.cells)} cell(s) over {n:,} passages on {unit.device}")
        base = base_modes_needed({c.mode for c in unit.cells})
        start = time.perf_counter()  # reading the passage shards included: it streams them
        tops, doc_ids = search_pass(queries, passages, base, unit.settings)
        runs = all_modes(tops, unit.fusion_depth, rules)
        seconds = time.perf_counter() - start
        write_runs(store, unit.cells, runs, unit.query_ids, doc_ids, unit.split_rows, seconds)
        return len(unit.cells)


stage = Score()
