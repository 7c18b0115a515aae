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

import itertools
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from diffret.retrieval.devices import resolve_device
from diffret.retrieval.fields import cli, like
from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.search.codecs import FLOAT16, parse_store
from diffret.retrieval.search.codes import DEFAULT_CANDIDATES, DEFAULT_PROBES, search_codes
from diffret.retrieval.search.exact import DEFAULT_BLOCK_MB, SearchSettings, search_pass
from diffret.retrieval.search.modes import MODE_NAMES, all_modes, base_modes_needed, cell_modes, modes_for
from diffret.retrieval.search.rules import ScoreRules
from diffret.retrieval.search.runs import retrieved_ids, topk_table
from diffret.storage import FileEntry, Manifest, StoreError
from diffret.storage.layout import encodings_dir, index_dir, run_dir

from .base import ClusterConfig, Context, KList, ModeList, check_device, read_shared
from .passes import (
    Block,
    Pass,
    PassPlan,
    PassShared,
    PassStage,
    PassUnit,
    cut,
    merged_blocks,
    pass_queries,
    write_unit,
)
from .presentation import Presentation
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
from .systems import SystemRecord, SystemRef, find_system

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


class CodesSearch(BaseModel):
    """``--search codes``: the settings a pass searches a residual system's codes with, and its codes index."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Literal["codes"] = "codes"
    probes: int
    candidates: int
    index_folder: str


class ScoreShared(PassShared):
    """What every unit of a K_p pass shares: the queries (:class:`PassShared`), the base modes, the passages'
    folder, the search settings (depth, self hits, the scoring blocks' memory, the rules), the device, and a codes
    search's settings."""

    modes: list[str]
    passage_folder: str
    settings: SearchSettings
    device: str
    search: CodesSearch | None = None

    unkeyed: ClassVar[dict[str, Any]] = {"settings": {"block_bytes"}}  # results do not depend on it


@dataclass
class ScorePlanned:
    """What the plan of a score run resolved once for all its passes."""

    system: SystemRecord
    corpus: str
    modes: list[str]
    q_folders: dict[int, str]
    p_folders: dict[int, str]
    q_hashes: dict[int, str]
    p_manifests: dict[int, Manifest]
    passages: int
    search: CodesSearch | None
    index_hashes: dict[int, str]


class Score(
    PassStage[ScoreMerge],
    name="score",
    config=ScoreConfig,
    noun="cell(s)",
    verb="scored",
    distributed=True,
    task_tags=("gpu",),
):
    """Exact search for every (K_q, K_p, mode) cell of the grid."""

    def plan(self, config: ScoreConfig, ctx: Context) -> PassPlan[ScoreMerge]:
        check_device(config.device, config)  # a device this machine lacks: refused before any work
        config, planned = self._resolve(config, ctx)
        plan: PassPlan[ScoreMerge] = PassPlan(system=planned.system.system, work=0, work_unit="passages")
        todo = self._cells(config, ctx, planned, plan)
        plan.count = len(todo)
        split_ids = {s: split_queries(ctx.store, config.dataset, s) for s in config.splits}
        query_ids = list(dict.fromkeys(q for s in config.splits for q in split_ids[s]))
        row = {q: i for i, q in enumerate(query_ids)}
        split_rows = {s: [row[q] for q in split_ids[s]] for s in config.splits}
        for kp in sorted({c.kp for c in todo}):
            cells = [c for c in todo if c.kp == kp]
            self._plan_pass(config, ctx, planned, plan, kp, cells, query_ids, split_rows)
        return plan

    def _resolve(self, config: ScoreConfig, ctx: Context) -> tuple[ScoreConfig, ScorePlanned]:
        """The system, its modes, the budgets stored (K_q, K_p), their folders and manifests, a codes search's
        settings: what every cell and pass of the run reads."""
        store = ctx.store
        record = find_system(store, config.system)
        # a representation without sparse vectors is scored in the dense modes only
        modes = modes_for(config.modes, record.has_sparse) or ["single_dense"]
        corpus = config.corpus_name()
        config = config.model_copy(
            update={
                "kq": budgets(store, config.kq, record.system, config.dataset, "query", ctx.log),
                "kp": budgets(store, config.kp, record.system, corpus, "passage", ctx.log),
            }
        )
        assert config.kq is not None and config.kp is not None  # budgets() resolved them
        search: CodesSearch | None = None
        index_hashes: dict[int, str] = {}
        if config.search == "codes":
            modes, search, index_hashes = self._codes_search(config, ctx, record, modes, corpus)
        n_passages = corpus_size(store, corpus)
        q_folders = {kq: encodings_dir(record.system, config.dataset, "query", kq) for kq in config.kq}
        p_folders = {kp: encodings_dir(record.system, corpus, "passage", kp) for kp in config.kp}
        planned = ScorePlanned(
            system=record,
            corpus=corpus,
            modes=modes,
            q_folders=q_folders,
            p_folders=p_folders,
            q_hashes={kq: encoding_manifest(store, f).config_hash for kq, f in q_folders.items()},
            p_manifests={kp: encoding_manifest(store, f, n_passages) for kp, f in p_folders.items()},
            passages=n_passages,
            search=search,
            index_hashes=index_hashes,
        )
        return config, planned

    def _cells(
        self, config: ScoreConfig, ctx: Context, planned: ScorePlanned, plan: PassPlan[ScoreMerge]
    ) -> list[Cell]:
        """The (split, K_q, K_p, mode) cells whose run is not current, each with its run folder's config."""
        assert config.kq is not None and config.kp is not None
        ds_hash = dataset_manifest(ctx.store, config.dataset).config_hash
        system, modes = planned.system.system, planned.modes
        todo: list[Cell] = []
        for kp, split, kq in itertools.product(config.kp, config.splits, config.kq):
            inputs = {
                "queries": ds_hash,
                "query_encodings": planned.q_hashes[kq],
                "passage_encodings": planned.p_manifests[kp].config_hash,
            }
            if planned.search is not None:  # the run of a search over codes: its settings, and its index
                inputs["index"] = planned.index_hashes[kp]
            for mode in cell_modes(modes, kq, kp, config.q1p1_multi):
                cfg = cell_config(
                    system=system,
                    dataset=config.dataset,
                    corpus=planned.corpus,
                    split=split,
                    kq=kq,
                    kp=kp,
                    mode=mode,
                    topk=config.depth(split),
                    fusion_depth=config.fusion_depth,
                    ignore=config.ignore_ids(),
                    inputs=inputs,
                    rules=config.rules,
                )
                if planned.search is not None:
                    cfg["search"] = planned.search.model_dump(mode="json", exclude={"index_folder"})
                folder = run_dir(system, config.dataset, split, kq, kp, mode)
                if plan.needs(ctx, folder, cfg, config.force):
                    todo.append(Cell(split, kq, kp, mode, folder, cfg))
        skipped = [m for m in modes if m not in cell_modes(modes, 1, 1, config.q1p1_multi)]
        if skipped and 1 in config.kq and 1 in config.kp:
            ctx.log(
                f"K_q = K_p = 1: {', '.join(skipped)} not scored, as the reference evaluator does (--q1p1-multi "
                "keep scores them)"
            )
        return todo

    def _plan_pass(
        self,
        config: ScoreConfig,
        ctx: Context,
        planned: ScorePlanned,
        plan: PassPlan[ScoreMerge],
        kp: int,
        cells: list[Cell],
        query_ids: list[str],
        split_rows: dict[str, list[int]],
    ) -> None:
        """One K_p pass over the passages for ``cells``: its shared record, its units (blocks of whole shards; a
        codes search is one unit) and its merge."""
        record = planned.system
        kqs = sorted({c.kq for c in cells})
        search = planned.search
        if search is not None:
            search = search.model_copy(update={"index_folder": index_dir(record.system, planned.corpus, kp)})
        shared = ScoreShared(
            query_folders={kq: planned.q_folders[kq] for kq in kqs},
            query_ids=query_ids,
            sparse_factor=config.rules.factor_for(record.readout, record.settings.get("readout")),
            modes=base_modes_needed({c.mode for c in cells}),
            passage_folder=planned.p_folders[kp],
            settings=SearchSettings(
                topk=search_depth(cells),  # each cell's run is a prefix, cut to its depth
                ignore_identical_ids=config.ignore_ids(),
                block_bytes=int(config.block_mb * (1 << 20)),
                rules=config.rules,
            ),
            device=config.device,
            search=search,
        )
        p_man = planned.p_manifests[kp]
        pass_cfg = shared.pass_config(
            unit_passages=config.unit_passages,
            inputs={
                "query_encodings": {str(kq): planned.q_hashes[kq] for kq in kqs},
                "passage_encodings": p_man.config_hash,
            },
        )
        shards = sorted(p_man.files)
        sizes = [int(p_man.files[n].rows or 0) for n in shards]
        blocks = []
        cuts = cut(sizes, config.unit_passages) if search is None else [(0, len(shards))]  # codes: one unit
        for a, b in cuts:
            start = sum(sizes[:a])
            end = start + sum(sizes[a:b])
            blocks.append(Block(start, end, f"K_p={kp} passages {start:,}-{end - 1:,}", shards[a:b]))
        merge = ScoreMerge(
            cells=cells,
            passages=planned.passages,
            query_ids=query_ids,
            split_rows=split_rows,
            topk=shared.settings.topk,
            fusion_depth=config.fusion_depth,
            rules=config.rules,
            passage_folder=planned.p_folders[kp],
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
            f"K_p={kp}: {len(cells)} cell(s) over {planned.passages:,} passages in {len(blocks)} unit(s), "
            f"{done} already done"
        )

    def _codes_search(
        self, config: ScoreConfig, ctx: Context, record: SystemRecord, modes: list[str], corpus: str
    ) -> tuple[list[str], CodesSearch, dict[int, str]]:
        """``--search codes``: the modes it scores (multi_dense), its settings, and the config hash of each K_p's
        codes index (a rebuilt index makes the runs stale); refused for a system without residual codes."""
        assert config.kp is not None
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
        search = CodesSearch(probes=config.probes, candidates=config.candidates, index_folder="")
        return ["multi_dense"], search, hashes

    def run(self, unit: PassUnit, ctx: Context) -> FileEntry:
        """One block of a pass's passages against every query set and base mode: its top-k, written to the pass's
        partials folder (indices: corpus positions)."""
        store = ctx.store
        shared = read_shared(ctx, unit.plan, ScoreShared)
        rules = shared.settings.rules
        if shared.search is not None:  # on the CPU: numpy over the codes
            queries = pass_queries(ctx, unit.plan, shared, "cpu", rules)
            return self._run_codes(unit, ctx, shared, shared.search, queries)
        device = resolve_device(shared.device)
        queries = pass_queries(ctx, unit.plan, shared, str(device), rules)
        p_folder = shared.passage_folder
        passages = iter_encodings(
            store,
            p_folder,
            encoding_manifest(store, p_folder),
            str(device),
            rules,
            shared.sparse_factor,
            names=unit.shards,
        )
        start = time.perf_counter()  # reading the passage shards included: it streams them
        tops, doc_ids = search_pass(queries, passages, shared.modes, shared.settings)
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
        unit: PassUnit, ctx: Context, shared: ScoreShared, search: CodesSearch, queries: dict[int, Any]
    ) -> FileEntry:
        """A whole K_p pass searched over its codes (retrieval/search/codes.py): multi_dense per K_q."""
        store = ctx.store
        p_folder = shared.passage_folder
        start = time.perf_counter()  # reading the codes and the index included
        coded = coded_passages(store, p_folder, encoding_manifest(store, p_folder))
        if len(coded) != unit.end - unit.start:
            raise StoreError(
                f"{store.abspath(p_folder)}: {len(coded):,} passages, planned {unit.end - unit.start:,} "
                "(re-encoded while scoring?); run the score again"
            )
        index = codes_index(store, search.index_folder, len(coded))
        topk, rules = shared.settings.topk, shared.settings.rules
        tops = {
            (kq, "multi_dense"): search_codes(q, coded, index, topk, search.probes, search.candidates, rules)
            for kq, q in queries.items()
        }
        return write_unit(store, unit, topk_table(tops), time.perf_counter() - start)

    def merge(self, done: Pass[ScoreMerge], ctx: Context) -> None:
        """A complete pass: its units' top-k merged, the fusions built, the runs written."""
        info = done.merge
        store = ctx.store
        start = time.perf_counter()
        tops, seconds = merged_blocks(store, done.folder, info.topk, info.passages)
        runs = all_modes(tops, info.fusion_depth, info.rules)
        runs, doc_ids = retrieved_ids(runs, passage_ids(store, info.passage_folder))  # the documents retrieved
        write_runs(
            store, info.cells, runs, info.query_ids, doc_ids, info.split_rows, seconds + time.perf_counter() - start
        )


presentation = Presentation(
    deployment=(
        "Exact search (chunked, CPU or GPU) for every (K_q, K_p, mode) cell over stored encodings: one run folder "
        "per cell under runs/. One pass over each K_p's passages scores every K_q and mode, cut into units of "
        "unit_passages that run on Dask workers with workers (-1: one per GPU) or dask_address, and resume after a "
        "kill. config.system names the encoder system: `{system: <slug>}`, or `{model: <id or path>, where: "
        "{setting: value}}`."
    ),
    example={
        "dataset": "scifact",
        "splits": ["test"],
        "kq": [1, 2, 4, 8, 16],
        "kp": [1, 2, 4, 8, 16],
        "system": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
        "device": "auto",
        "workers": 0,
        "dask_address": None,
    },
    next_step="evaluate the runs: `diffret evaluate -d {dataset}` (the evaluate deployment).",
)


stage = Score()
