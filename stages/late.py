"""The late stage: late-parametric re-scoring (SIDR's beta(m)) of any first stage's top m by any system's mode.

    runs/system=<re-scoring slug>/dataset=<d>/split=<s>/kq=<K_q>/kp=<K_p>/mode=late_<mode>_m<m>/run.parquet
    partial/system=<slug>/dataset=<corpus>/k=<K_p>/part=NNNNN.parquet      the passages it had to encode

The first stage is any stored run (a beta run over the bag of tokens, BM25, an encoder's). Only the passages in
some query's top m are scored: from the system's full encodings when they are stored, else from its partial
folder, where the passages no earlier late run needed are encoded now (one new part per run), so a larger m,
another split or another mode encodes only what is missing. Each run's manifest counts the passages it needed,
the ones encoded by this run, and the corpus.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, field_validator

from retrieval.devices import resolve_device
from retrieval.fields import cli, like
from retrieval.models.backbones import BackboneConfig
from retrieval.models.encoding import encode_rows
from retrieval.search.encodings import encodings_from_table, take
from retrieval.search.exact import SearchSettings
from retrieval.search.late import rescore
from retrieval.search.modes import MODE_NAMES, modes_for
from retrieval.search.rules import ScoreRules
from retrieval.search.runs import doc_order, run_table
from storage import StoreError, remove_empty_sharded
from storage.layout import encodings_dir, partial_dir, run_dir, tokens_dir

from .base import Context, Plan, Stage
from .encode import EncodeConfig, encodings_config, reader_for
from .readers import corpus_size, encoding_manifest, query_encodings, split_queries, tokens_manifest
from .rerank import RerankConfig, first_stage_mode, first_stage_run
from .runs import Cell, QueriesConfig, RetrievalConfig, read_run, search_stats, write_run
from .systems import EncodeSettings, SystemRef, find_system, settings_of

PART = "part={:05d}.parquet"


class LateConfig(QueriesConfig):
    """Parameters of the late flow."""

    splits: list[str] = like(RetrievalConfig, "splits")
    self_hits: str = like(RetrievalConfig, "self_hits")

    system: SystemRef = Field(default_factory=SystemRef, description="The system whose scores re-rank the "
                              "candidates (its query encodings at K_q must be stored; passages are encoded as "
                              "needed).")  # fmt: skip
    kq: int = Field(default=1, ge=1, description="The re-scoring system's query budget K_q.")
    kp: int = Field(default=1, ge=1, description="The re-scoring system's passage budget K_p.")
    mode: str = Field(default="multi_dense", description="The re-scoring mode (multi_dense, sparse_max, a fusion).")
    depths: list[int] = Field(default=[10, 20, 100], description="m: candidates re-scored per query, the first "
                              "stage's top (one run each).", json_schema_extra=cli(flag="--depth",
                                                                                   deprecated=["--m"]))  # fmt: skip
    first_stage: str = like(RerankConfig, "first_stage")
    # rerank's former spellings (--kq, --kp, --mode) are this command's re-scoring budgets and mode: not taken here
    first_kq: int = like(RerankConfig, "first_kq", json_schema_extra=None)
    first_kp: int = like(RerankConfig, "first_kp", json_schema_extra=None)
    first_mode: str | None = like(RerankConfig, "first_mode", json_schema_extra=None)
    batch_size: int = like(EncodeConfig, "batch_size")
    verify: bool = like(EncodeConfig, "verify", description="Check every part of the partial folder by sha256 "
                        "(default: its size and mtime); a damaged part is encoded again, even when every run is "
                        "current.")  # fmt: skip
    device: str = like(BackboneConfig, "device")
    rules: ScoreRules = Field(default_factory=ScoreRules, description="How the mode scores (default: the "
                              "reference evaluator's).")  # fmt: skip

    def ignore_ids(self) -> bool:
        """Whether a document whose id is the query's is dropped (``self_hits="drop"``)."""
        return self.self_hits == "drop"

    @field_validator("depths")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or min(v) <= 0:
            raise ValueError(f"m must be positive integers, got {v}")
        return sorted(set(v))

    @field_validator("mode")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in MODE_NAMES:
            raise ValueError(f"unknown mode {v!r}; expected one of {', '.join(MODE_NAMES)}")
        return v


def capped_depths(depths: list[int], first_depth: int | None, log: Any = print) -> list[int]:
    """The m's a late run can honour: each at most the first stage's depth (the documents its run keeps per query),
    so that a run's label and ``topk`` say what was re-scored; a cap is logged.

    >>> capped_depths([10, 100, 100000], 1000, log=print)
    m 100,000 is capped at 1,000, the first stage's depth (its run keeps 1,000 documents per query)
    [10, 100, 1000]
    """
    if not first_depth:
        return depths
    for m in depths:
        if m > first_depth:
            log(f"m {m:,} is capped at {first_depth:,}, the first stage's depth (its run keeps {first_depth:,} "
                "documents per query)")  # fmt: skip
    return sorted({min(m, int(first_depth)) for m in depths})


@dataclass
class LateUnit:
    cells: list[Cell]
    first_runs: dict[str, str]  # split -> first-stage run folder
    system: str
    settings: dict[str, Any]  # the re-scoring system's EncodeSettings
    q_stage: str
    full_stage: str | None  # the system's complete passage encodings, when stored
    partial_stage: str
    tokens_stage: str
    partial_config: dict[str, Any]
    dataset: str
    corpus: str
    batch_size: int
    sparse_factor: float
    splits: list[str]  # the runs' splits and depth: what the partial folder must hold (cells or not)
    depth: int
    verify: bool = False


class Late(Stage, name="late", config=LateConfig, noun="run(s)", verb="written"):
    """Late-parametric re-scoring: a first stage's top m per query, re-scored by a system's mode; only the passages
    some query needs are encoded."""

    deployment = (  # the Prefect deployment's description (flows/deployments.py)
        "Late-parametric re-scoring (SIDR's beta(m)): each query's top m of a stored first-stage run (a beta run, "
        "BM25, any encoder's) re-scored by a system's mode; only the passages some query needs are encoded (kept "
        "under partial/ and reused by later runs). One run per m, mode `late_<mode>_m<m>`."
    )
    example = {
        "dataset": "scifact",
        "system": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
        "mode": "multi_dense",
        "depths": [10, 20, 100],
        "first_stage": "bm25",
    }  # the deployment's parameters, besides root

    next_step = "evaluate the runs: `diffret evaluate -d {dataset}` (the evaluate deployment)."

    def plan(self, config: LateConfig, ctx: Context) -> Plan:
        resolve_device(config.device)
        store, corpus = ctx.store, config.corpus_name()
        record = find_system(store, config.system)
        if config.mode not in modes_for([config.mode], record.has_sparse):
            raise ValueError(f"{record.system}: the {record.readout} readout has no sparse vectors for {config.mode}")
        settings = settings_of(record, config.device)
        q_stage = encodings_dir(record.system, config.dataset, "query", config.kq)
        q_man = encoding_manifest(store, q_stage)
        tokens = q_man.config["tokens"]
        t_stage = tokens_dir(tokens, corpus, "passage")
        t_man = tokens_manifest(store, t_stage, f"run `diffret tokenize -d {corpus} --side passage --model "
                                f"{record.model}`")  # fmt: skip
        full = encodings_dir(record.system, corpus, "passage", config.kp)
        f_man = store.read_manifest(full)
        full_ok = f_man is not None and f_man.total_rows() == corpus_size(store, corpus)
        first = {s: first_stage_run(store, config.dataset, s, config.first_stage, config.first_kq, config.first_kp,
                                    config.first_mode) for s in config.splits}  # fmt: skip
        plan = Plan(system=record.system)
        cells = []
        for split in config.splits:
            slug, src = first[split]
            for m in capped_depths(config.depths, store.require_manifest(src).config.get("topk"), ctx.log):
                mode = f"late_{config.mode}_m{m}"
                cfg = {
                    "system": record.system, "dataset": config.dataset, "corpus": corpus, "split": split,
                    "kq": config.kq, "kp": config.kp, "mode": mode, "topk": m, "rescore": config.mode,
                    "first_stage": {"system": slug, "kq": config.first_kq, "kp": config.first_kp,
                                    "mode": first_stage_mode(store, config.first_stage, config.first_mode)},
                    "ignore_identical_ids": config.ignore_ids(), "rules": config.rules.model_dump(),
                    "inputs": {"first": store.require_manifest(src).config_hash, "queries": q_man.config_hash},
                }  # fmt: skip
                stage = run_dir(record.system, config.dataset, split, config.kq, config.kp, mode)
                if plan.needs(ctx, stage, cfg, config.force):
                    cells.append(Cell(split, config.kq, config.kp, mode, stage, cfg))
        partial = partial_dir(record.system, corpus, config.kp)
        partial_cfg = encodings_config(settings, tokens, t_man.config_hash, config.kp)
        damage = None if cells or full_ok else store.shard_damage(partial, partial_cfg, config.verify)
        if damage:  # every run is current, but the passages they needed are not: encoded again
            ctx.log(f"{store.abspath(partial)}: {damage}; encoding its passages again")
        if cells or damage:
            factor = config.rules.factor_for(record.readout, record.settings.get("readout"))
            splits = sorted({c.split for c in cells}) if cells else list(config.splits)
            depth = max(int(c.config["topk"]) for c in cells) if cells else max(config.depths)
            plan.units.append(LateUnit(
                cells, {s: first[s][1] for s in splits}, record.system, settings.model_dump(), q_stage,
                full if full_ok else None, partial, t_stage, partial_cfg, config.dataset, corpus, config.batch_size,
                factor, splits, depth, config.verify,
            ))  # fmt: skip
        plan.count = len(cells)
        return plan

    def run(self, unit: LateUnit, ctx: Context) -> dict[str, int]:
        store = ctx.store
        t_man = store.require_manifest(unit.tokens_stage)
        corpus_ids: list[str] = []
        for name in sorted(t_man.files):
            corpus_ids.extend(store.read_table(unit.tokens_stage, name, columns=["id"]).column("id").to_pylist())
        position = {d: i for i, d in enumerate(corpus_ids)}
        query_ids = list(dict.fromkeys(q for s in unit.splits for q in split_queries(store, unit.dataset, s)))
        first: dict[str, dict[str, np.ndarray]] = {s: _top(read_run(store, unit.first_runs[s]), unit.depth, position)
                                                   for s in unit.splits}  # fmt: skip
        needed = np.unique(np.concatenate([v for s in unit.splits for v in first[s].values()]
                                          + [np.zeros(0, np.int64)]))  # fmt: skip
        table, encoded, encode_seconds = self._passages(unit, ctx, needed, corpus_ids)
        if not unit.cells:  # only the partial folder was repaired
            ctx.log(f"{ctx.store.abspath(unit.partial_stage)}: {encoded:,} passage(s) encoded again")
            return {"needed": int(len(needed)), "encoded": encoded, "corpus": len(corpus_ids)}
        settings = SearchSettings(rules=ScoreRules.model_validate(unit.cells[0].config["rules"]),
                                  ignore_identical_ids=bool(unit.cells[0].config["ignore_identical_ids"]))
        passages = encodings_from_table(table, "cpu", settings.rules, unit.sparse_factor)
        p_index = np.array([position[d] for d in passages.ids], np.int64)
        order = np.argsort(p_index, kind="stable")
        passages, p_index = take(passages, order), p_index[order]
        queries = query_encodings(store, unit.q_stage, query_ids, "cpu", settings.rules, unit.sparse_factor)
        lex = doc_order(corpus_ids)
        rescore_mode = unit.cells[0].config["rescore"]
        stats = {"needed": int(len(needed)), "encoded": encoded, "corpus": len(corpus_ids),
                 "encode_seconds": round(encode_seconds, 4)}  # fmt: skip
        for m in sorted({int(c.config["topk"]) for c in unit.cells}):
            cands = [_first_top(first, q, m) for q in query_ids]
            start = time.perf_counter()
            top = rescore(queries, cands, passages, p_index, [rescore_mode], unit.cells[0].kq, settings)[rescore_mode]
            m_cells = [c for c in unit.cells if int(c.config["topk"]) == m]
            timing = search_stats(time.perf_counter() - start, len(query_ids), len(m_cells))
            row = {q: i for i, q in enumerate(query_ids)}
            for cell in m_cells:
                rows = [row[q] for q in split_queries(store, unit.dataset, cell.split)]
                t = run_table(top, query_ids, corpus_ids, rows, lex, depth=m)
                needed_m = int(len(np.unique(np.concatenate([cands[i] for i in rows] + [np.zeros(0, np.int64)]))))
                write_run(store, cell, t, {"queries": len(rows), "rows": t.num_rows, **stats, "needed_m": needed_m,
                                           **timing})  # fmt: skip
        ctx.log(f"late re-scoring ({rescore_mode}): {len(needed):,} of {len(corpus_ids):,} passages needed, "
                f"{encoded:,} encoded now")  # fmt: skip
        return stats

    def _passages(self, unit: LateUnit, ctx: Context, needed: np.ndarray,
                  corpus_ids: list[str]) -> tuple[pa.Table, int, float]:  # fmt: skip
        """The encodings of the ``needed`` passages (global positions): from the full folder, or the partial one
        after encoding what it lacks (one new part); how many were encoded now, and the seconds that took (the
        model's loading excluded)."""
        store = ctx.store
        want = pa.array([corpus_ids[i] for i in needed.tolist()], pa.string())
        if unit.full_stage is not None:  # only the needed rows of each shard are kept (a corpus's vectors are large)
            m = store.require_manifest(unit.full_stage)
            parts = [_rows(store.read_table(unit.full_stage, n), want) for n in sorted(m.files)]
            return _rows(pa.concat_tables(parts), want), 0, 0.0
        stage = unit.partial_stage
        ctx.hold(stage)
        part = {"system": unit.system, "dataset": unit.corpus, "k": str(unit.partial_config["k"])}
        man, done = store.open_sharded(stage, "partial", part, unit.partial_config, verify=unit.verify)
        store.drop_shards(stage, set(man.files) - done)  # damaged parts: what they held is encoded again below
        have = [store.read_table(stage, n) for n in sorted(done)]
        held = set(pc.unique(pa.concat_arrays([t.column("id").combine_chunks() for t in have])).to_pylist()) \
            if have else set()  # fmt: skip
        missing = [d for d in want.to_pylist() if d not in held]
        if missing:
            rows = []
            t_man = store.require_manifest(unit.tokens_stage)
            miss = pa.array(missing, pa.string())
            for name in sorted(t_man.files):
                t = store.read_table(unit.tokens_stage, name, columns=["id", "token_ids", "text"])
                rows.append(t.filter(pc.is_in(t.column("id"), value_set=miss)))
            todo = pa.concat_tables(rows)
            reader = reader_for(EncodeSettings.model_validate(unit.settings))
            start = time.perf_counter()
            new = encode_rows(reader, todo.column("id").to_pylist(), todo.column("token_ids").to_pylist(),
                              todo.column("text").to_pylist(), "passage", int(unit.partial_config["k"]),
                              unit.batch_size, ctx.advance)  # fmt: skip
            seconds = time.perf_counter() - start
            name = next(PART.format(i) for i in range(len(done) + 1) if PART.format(i) not in done)
            entry = store.write_shard(stage, name, new)
            store.record_shard(stage, name, entry, man.config_hash)
            store.compact_shards(stage)
            have.append(new)
            return _rows(pa.concat_tables(have), want), len(missing), seconds
        return _rows(pa.concat_tables(have), want), 0, 0.0


    def abort(self, config: LateConfig, plan: Plan, ctx: Context) -> None:
        """A failed run keeps the parts it finished; a partial folder it opened and never filled is removed."""
        remove_empty_sharded(ctx.store, [u.partial_stage for u in plan.units])


def _rows(table: pa.Table, ids: pa.Array) -> pa.Table:
    """The rows of ``ids`` (each once)."""
    t = table.filter(pc.is_in(table.column("id"), value_set=ids))
    _, first = np.unique(np.asarray(t.column("id").to_pylist(), dtype=object), return_index=True)
    return t.take(pa.array(np.sort(first)))


def _top(run: pa.Table, depth: int, position: dict[str, int]) -> dict[str, np.ndarray]:
    """Each query's first ``depth`` documents of a run (global passage positions, in rank order)."""
    out: dict[str, list[int]] = {}
    for q, d, r in zip(run.column("query_id").to_pylist(), run.column("doc_id").to_pylist(),
                       run.column("rank").to_pylist(), strict=True):  # fmt: skip
        if r <= depth:
            if d not in position:
                raise StoreError(f"the first-stage run names passage {d!r}, which the corpus does not hold")
            out.setdefault(q, []).append((r, position[d]))  # type: ignore[arg-type]
    return {q: np.array([p for _, p in sorted(v)], np.int64) for q, v in out.items()}


def _first_top(first: dict[str, dict[str, np.ndarray]], query: str, m: int) -> np.ndarray:
    """A query's first-stage top ``m`` (from whichever split holds it)."""
    for by_query in first.values():
        if query in by_query:
            return by_query[query][:m]
    return np.zeros(0, np.int64)


stage = Late()
