"""The score stage: stored encodings -> one run folder per (split, K_q, K_p, mode).

    runs/system=<slug>/dataset=<d>/split=<s>/kq=<K_q>/kp=<K_p>/mode=<m>/run.parquet
    partials/system=<slug>/dataset=<d>/kp=<K_p>/key=<pass>/block=NNNNN.parquet     (while a pass runs)

A pass over a K_p passage encoding scores every requested K_q and base mode against it, shard by shard
(``retrieval.search.search_pass``). It is cut into units of contiguous shards (``unit_passages``), which run in this
process or on Dask workers (each on its own device); each unit writes its partial top-k (per K_q and base mode, at
the pass's search depth) to the pass's ``partials/`` folder, recorded as it completes, so a killed pass keeps its
finished units. When the last one is in, the planning process merges them (the top k of the top k's: ties go to the
earlier passage, as in one pass), builds the fusions and writes the runs, byte for byte one pass's, then removes
the partials. A cell whose manifest has the same config and whose file verifies is done; a pass whose cells are
all done is not planned (no encoding is read).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from diffret.retrieval.devices import resolve_device
from diffret.retrieval.fields import cli, like
from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.search.codecs import FLOAT16, parse_store
from diffret.retrieval.search.codes import DEFAULT_CANDIDATES, DEFAULT_PROBES, search_codes
from diffret.retrieval.search.exact import DEFAULT_BLOCK_MB, SearchSettings, search_pass
from diffret.retrieval.search.modes import MODE_NAMES, all_modes, base_modes_needed, cell_modes, modes_for
from diffret.retrieval.search.rules import ScoreRules
from diffret.retrieval.search.runs import retrieved_ids, topk_table
from diffret.storage import FileEntry, StoreError, config_hash
from diffret.storage.layout import encodings_dir, index_dir, run_dir

from .base import ClusterConfig, Context, KList, ModeList, check_device, shared_settings
from .passes import Block, Pass, PassPlan, PassStage, PassUnit, cut, merged_blocks, pass_queries, write_unit
from .readers import (
    budgets,
    coded_passages,
    codes_index,
    codes_index_manifest,
    corpus_size,
    dataset_manifest,
    encoding_manifest,
    iter_encodings,
    passage_ids,
    split_queries,
)
from .runs import Cell, RetrievalConfig, cell_config, search_depth, write_runs
from .systems import SystemRef, find_system

DEFAULT_UNIT_PASSAGES = 1_000_000


class ScoreConfig(RetrievalConfig, ClusterConfig):
    """Parameters of the score flow."""

    system: SystemRef = Field(default_factory=SystemRef, description="The encoder system whose encodings to score.")
    kq: KList | None = Field(
        default=None, description="Query budgets K_q (default: every K_q whose query encodings are stored)."
    )
    kp: KList | None = Field(
        default=None, description="Passage budgets K_p (default: every K_p whose passage encodings are stored)."
    )
    modes: ModeList = Field(
        default=list(MODE_NAMES), description="Scoring modes (paper section 3.3).", json_schema_extra=cli(flag="--mode")
    )
    q1p1_multi: Literal["skip", "keep"] = Field(
        default="skip",
        description="At K_q = K_p = 1, skip multi_dense and its fusion as the reference evaluator does, or keep them.",
    )
    # (one slot a side: MaxSim is single_dense clamped at 0; skip is the reference's choice: docs/ARCHITECTURE.md,
    # parity table)
    fusion_depth: int = Field(default=1000, ge=1, description="Top documents of each run that fusion normalises.")
    device: str = like(BackboneConfig, "device")
    block_mb: float = Field(
        default=DEFAULT_BLOCK_MB,
        gt=0,
        description="Memory for the scoring blocks (MiB): "
        "queries and passages are cut so that they fit; results do not depend on it.",
    )
    rules: ScoreRules = Field(
        default_factory=ScoreRules, description="How each mode scores (default: the reference evaluator's)."
    )
    unit_passages: int = Field(
        default=DEFAULT_UNIT_PASSAGES,
        ge=1,
        description="Passages per unit of a K_p pass "
        "(whole shards, at least one): the units run on the workers and a killed run keeps the "
        "finished ones; the runs are the same whatever the cut.",
    )
    search: Literal["exact", "codes"] = Field(
        default="exact",
        description="exact: every passage scored (the "
        "reference's, the ground truth); codes: a residual:B system searched "
        "over its codes in PLAID's order (each query vector's --probes nearest "
        "centroids give the candidates, ranked by centroid interaction; the "
        "best --candidates re-scored by exact MaxSim over their decoded "
        "vectors) through the codes index `diffret index` built for the K_p: "
        "multi_dense only, at most --candidates documents a query.",
    )
    probes: int = Field(
        default=DEFAULT_PROBES,
        ge=1,
        description="--search codes: the nearest centroids (cells) each query vector takes its candidates from.",
    )
    candidates: int = Field(
        default=DEFAULT_CANDIDATES,
        ge=1,
        description="--search codes: candidates a query "
        "re-scored by exact MaxSim (with --probes, the quality / speed knob).",
    )


@dataclass
class ScoreMerge:
    """What merging a K_p pass's blocks into its runs needs."""

    cells: list[Cell]
    passages: int  # the corpus's
    query_ids: list[str]
    split_rows: dict[str, list[int]]
    topk: int
    fusion_depth: int
    rules: ScoreRules
    passage_folder: str


class Score(
    PassStage, name="score", config=ScoreConfig, noun="cell(s)", verb="scored", distributed=True, task_tags=("gpu",)
):
    """Exact search for every (K_q, K_p, mode) cell of the grid."""

    deployment = (  # the Prefect deployment's description (flows/deployments.py)
        "Exact search (chunked, CPU or GPU) for every (K_q, K_p, mode) cell over stored encodings: one run folder "
        "per cell under runs/. One pass over each K_p's passages scores every K_q and mode, cut into units of "
        "unit_passages that run on Dask workers with workers (-1: one per GPU) or dask_address, and resume after a "
        "kill. config.system names the encoder system: `{system: <slug>}`, or `{model: <id or path>, where: "
        "{setting: value}}`."
    )
    example = {
        "dataset": "scifact",
        "splits": ["test"],
        "kq": [1, 2, 4, 8, 16],
        "kp": [1, 2, 4, 8, 16],
        "system": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
        "device": "auto",
        "workers": 0,
        "dask_address": None,
    }  # the deployment's parameters, besides root

    next_step = "evaluate the runs: `diffret evaluate -d {dataset}` (the evaluate deployment)."

    def plan(self, config: ScoreConfig, ctx: Context) -> PassPlan:
        check_device(config.device, config)  # a device this machine lacks: refused before any work
        store = ctx.store
        record = find_system(store, config.system)
        # a representation without sparse vectors is scored in the dense modes only
        modes = modes_for(config.modes, record.has_sparse) or ["single_dense"]
        corpus, ignore = config.corpus_name(), config.ignore_ids()
        config = config.model_copy(
            update={
                "kq": budgets(store, config.kq, record.system, config.dataset, "query", ctx.log),
                "kp": budgets(store, config.kp, record.system, corpus, "passage", ctx.log),
            }
        )
        search = None
        if config.search == "codes":
            modes, search = self._codes_search(config, ctx, record, modes, corpus)
        ds_hash = dataset_manifest(store, config.dataset).config_hash
        n_passages = corpus_size(store, corpus)
        split_ids = {s: split_queries(store, config.dataset, s) for s in config.splits}
        q_folders = {kq: encodings_dir(record.system, config.dataset, "query", kq) for kq in config.kq}
        p_folders = {kp: encodings_dir(record.system, corpus, "passage", kp) for kp in config.kp}
        q_man = {kq: encoding_manifest(store, s) for kq, s in q_folders.items()}
        p_man = {kp: encoding_manifest(store, s, n_passages) for kp, s in p_folders.items()}
        plan = PassPlan(system=record.system, work=0, work_unit="passages")
        todo: list[Cell] = []
        for kp in config.kp:
            for split in config.splits:
                for kq in config.kq:
                    inputs = {
                        "queries": ds_hash,
                        "query_encodings": q_man[kq].config_hash,
                        "passage_encodings": p_man[kp].config_hash,
                    }
                    if search is not None:  # the run of a search over codes: its settings, and its index
                        inputs = {**inputs, "index": search["index_hashes"][kp]}
                    for mode in cell_modes(modes, kq, kp, config.q1p1_multi):
                        cfg = cell_config(
                            record.system,
                            config.dataset,
                            corpus,
                            split,
                            kq,
                            kp,
                            mode,
                            config.depth(split),
                            config.fusion_depth,
                            ignore,
                            inputs,
                            config.rules,
                        )
                        if search is not None:
                            cfg["search"] = search["settings"]
                        folder = run_dir(record.system, config.dataset, split, kq, kp, mode)
                        if plan.needs(ctx, folder, cfg, config.force):
                            todo.append(Cell(split, kq, kp, mode, folder, cfg))
        skipped = [m for m in modes if m not in cell_modes(modes, 1, 1, config.q1p1_multi)]
        if skipped and 1 in config.kq and 1 in config.kp:
            ctx.log(
                f"K_q = K_p = 1: {', '.join(skipped)} not scored, as the reference evaluator does (--q1p1-multi "
                "keep scores them)"
            )
        plan.count = len(todo)
        query_ids = list(dict.fromkeys(q for s in config.splits for q in split_ids[s]))
        row = {q: i for i, q in enumerate(query_ids)}
        split_rows = {s: [row[q] for q in split_ids[s]] for s in config.splits}
        factor = config.rules.factor_for(record.readout, record.settings.get("readout"))
        for kp in sorted({c.kp for c in todo}):
            cells = [c for c in todo if c.kp == kp]
            kqs = sorted({c.kq for c in cells})
            shared = {
                "query_stages": {str(kq): q_folders[kq] for kq in kqs},
                "query_ids": query_ids,
                "modes": base_modes_needed({c.mode for c in cells}),
                "passage_stage": p_folders[kp],
                "topk": search_depth(cells),  # each cell's run is a prefix, cut to its depth
                "ignore": ignore,
                "block_bytes": int(config.block_mb * (1 << 20)),
                "rules": config.rules.model_dump(mode="json"),
                "sparse_factor": factor,
                "device": config.device,
            }
            if search is not None:
                shared["search"] = {**search["settings"], "index_stage": index_dir(record.system, corpus, kp)}
            pass_cfg = {
                **{k: v for k, v in shared.items() if k not in ("query_ids", "block_bytes")},
                "query_ids": config_hash({"ids": query_ids}),
                "unit_passages": config.unit_passages,
                "inputs": {
                    "query_encodings": {str(kq): q_man[kq].config_hash for kq in kqs},
                    "passage_encodings": p_man[kp].config_hash,
                },
            }
            shards = sorted(p_man[kp].files)
            sizes = [int(p_man[kp].files[n].rows or 0) for n in shards]
            blocks = []
            cuts = cut(sizes, config.unit_passages) if search is None else [(0, len(shards))]  # codes: one unit
            for a, b in cuts:
                start = sum(sizes[:a])
                end = start + sum(sizes[a:b])
                blocks.append(Block(start, end, f"K_p={kp} passages {start:,}-{end - 1:,}", shards[a:b]))
            merge = ScoreMerge(
                cells,
                n_passages,
                query_ids,
                split_rows,
                shared["topk"],
                config.fusion_depth,
                config.rules,
                p_folders[kp],
            )
            done = self.add_pass(
                ctx,
                plan,
                system=record.system,
                dataset=config.dataset,
                kp=kp,
                config=pass_cfg,
                shared=shared,
                blocks=blocks,
                merge=merge,
            )
            ctx.log(
                f"K_p={kp}: {len(cells)} cell(s) over {n_passages:,} passages in {len(blocks)} unit(s), "
                f"{done} already done"
            )
        return plan

    def _codes_search(
        self, config: ScoreConfig, ctx: Context, record: Any, modes: list[str], corpus: str
    ) -> tuple[list[str], dict[str, Any]]:
        """``--search codes``: the modes it scores (multi_dense) and its settings, with the codes index of each K_p
        (its config hash: a rebuilt index makes the runs stale); refused for a system without residual codes."""
        spec = record.flat_settings().get("store", FLOAT16)
        if spec == FLOAT16 or parse_store(spec).kind != "residual":
            raise StoreError(
                f"--search codes searches a residual:B system's codes; {record.system} stores "
                f"{spec} (`diffret compress --store residual:B` makes one; --search exact scores any)"
            )
        if config.ignore_ids():
            raise ValueError(
                "--search codes keeps a document whose id is the query's; score --self-hits drop with --search exact"
            )
        if "multi_dense" not in modes:
            raise ValueError("--search codes scores multi_dense (MaxSim over the codes); add it to --mode")
        if modes != ["multi_dense"]:
            ctx.log(
                f"--search codes scores multi_dense only: {', '.join(m for m in modes if m != 'multi_dense')} "
                "not scored (--search exact scores them)"
            )
        hashes = {
            kp: codes_index_manifest(ctx.store, index_dir(record.system, corpus, kp)).config_hash for kp in config.kp
        }
        settings = {"engine": "codes", "probes": config.probes, "candidates": config.candidates}
        return ["multi_dense"], {"settings": settings, "index_hashes": hashes}

    def run(self, unit: PassUnit, ctx: Context) -> FileEntry:
        """One block of a pass's passages against every query set and base mode: its top-k, written to the pass's
        partials folder (indices: corpus positions)."""
        store = ctx.store
        shared = shared_settings(ctx, unit.plan)
        device = resolve_device(shared["device"])
        rules, factor = ScoreRules.model_validate(shared["rules"]), float(shared["sparse_factor"])
        if shared.get("search"):  # on the CPU: numpy over the codes
            return self._run_codes(unit, ctx, shared, pass_queries(ctx, unit.plan, shared, "cpu", rules), rules)
        queries = pass_queries(ctx, unit.plan, shared, str(device), rules)
        p_folder = shared["passage_stage"]
        passages = iter_encodings(
            store, p_folder, encoding_manifest(store, p_folder), str(device), rules, factor, names=unit.shards
        )
        settings = SearchSettings(
            topk=int(shared["topk"]),
            ignore_identical_ids=bool(shared["ignore"]),
            block_bytes=int(shared["block_bytes"]),
            rules=rules,
        )
        start = time.perf_counter()  # reading the passage shards included: it streams them
        tops, doc_ids = search_pass(queries, passages, shared["modes"], settings)
        seconds = time.perf_counter() - start
        if len(doc_ids) != unit.end - unit.start:
            raise StoreError(
                f"{store.abspath(p_folder)}: {len(doc_ids):,} passages in {', '.join(unit.shards)}, "
                f"planned {unit.end - unit.start:,} (re-encoded while scoring?); run the score again"
            )
        for top in tops.values():
            top.index[top.index >= 0] += unit.start
        return write_unit(store, unit, topk_table(tops), seconds)

    @staticmethod
    def _run_codes(
        unit: PassUnit, ctx: Context, shared: dict[str, Any], queries: dict[int, Any], rules: ScoreRules
    ) -> FileEntry:
        """A whole K_p pass searched over its codes (retrieval/search/codes.py): multi_dense per K_q."""
        store, search = ctx.store, shared["search"]
        p_folder = shared["passage_stage"]
        start = time.perf_counter()  # reading the codes and the index included
        coded = coded_passages(store, p_folder, encoding_manifest(store, p_folder))
        if len(coded) != unit.end - unit.start:
            raise StoreError(
                f"{store.abspath(p_folder)}: {len(coded):,} passages, planned {unit.end - unit.start:,} "
                "(re-encoded while scoring?); run the score again"
            )
        index = codes_index(store, search["index_stage"], len(coded))
        tops = {
            (kq, "multi_dense"): search_codes(
                q, coded, index, int(shared["topk"]), int(search["probes"]), int(search["candidates"]), rules
            )
            for kq, q in queries.items()
        }
        return write_unit(store, unit, topk_table(tops), time.perf_counter() - start)

    def merge(self, done: Pass, ctx: Context) -> None:
        """A complete pass: its units' top-k merged, the fusions built, the runs written."""
        info: ScoreMerge = done.merge
        store = ctx.store
        start = time.perf_counter()
        tops, seconds = merged_blocks(store, done.folder, info.topk, info.passages)
        runs = all_modes(tops, info.fusion_depth, info.rules)
        runs, doc_ids = retrieved_ids(runs, passage_ids(store, info.passage_folder))  # the documents retrieved
        write_runs(
            store, info.cells, runs, info.query_ids, doc_ids, info.split_rows, seconds + time.perf_counter() - start
        )


stage = Score()
