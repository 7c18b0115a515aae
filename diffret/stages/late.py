"""The late stage: late-parametric re-scoring (SIDR's beta(m)) of any first stage's top m by any system's mode.

    runs/system=<re-scoring slug>/dataset=<d>/split=<s>/kq=<K_q>/kp=<K_p>/mode=late_<mode>_m<m>/run.parquet
    partial/system=<slug>/dataset=<corpus>/k=<K_p>/part=NNNNN.parquet      the passages it had to encode

The first stage is any stored run (a beta run over the bag of tokens, BM25, an encoder's). Only the passages in
some query's top m are scored: from the system's full encodings when they are stored, else from its partial
folder, where the passages no earlier late run needed are encoded now (one new part per run), so a larger m,
another split or another mode encodes only what is missing (once, in the planning process: ``prepare``). The
re-scoring is cut into slices of queries (``unit_queries``, at multiples of ``retrieval.search.late.QUERY_GRAIN`` so
that each is scored in the same chunks as all queries at once) that run on the workers; each writes its queries' rows
to the pass's ``partials/`` folder, and the planning process writes the runs when the last one is in. Each run's
manifest counts the passages it needed, the ones encoded by this run, and the corpus.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, field_validator

from diffret.caching import KeyedCache
from diffret.retrieval.fields import cli, like
from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.models.encoding import encode_rows
from diffret.retrieval.search.encodings import encodings_from_table, take
from diffret.retrieval.search.exact import SearchSettings
from diffret.retrieval.search.late import QUERY_GRAIN, rescore
from diffret.retrieval.search.modes import MODE_NAMES, modes_for
from diffret.retrieval.search.rules import ScoreRules
from diffret.retrieval.search.runs import doc_order, retrieved_ids, run_table, topk_table
from diffret.storage import ArtifactStore, FileEntry, Manifest, StoreError
from diffret.storage.layout import encodings_dir, partial_encodings_dir, run_dir, tokens_dir

from .base import ClusterConfig, Context, Plan, Positive, check_device, read_shared
from .encode import EncodeConfig, encodings_config, reader_for
from .passes import Pass, PassPlan, PassShared, PassStage, PassUnit, even_blocks, stacked_slices, write_unit
from .presentation import Presentation
from .readers import (
    codec_for,
    corpus_size,
    encoding_manifest,
    query_encodings,
    shard_ids,
    split_queries,
    tokens_manifest,
)
from .rerank import RerankConfig, first_stage_mode, first_stage_run
from .runs import Cell, QueriesConfig, RetrievalConfig, read_run, search_stats, write_run
from .systems import EncodeSettings, SystemRecord, SystemRef, find_system, settings_of

PART = "part={:05d}.parquet"


class LateConfig(QueriesConfig, ClusterConfig):
    """Parameters of the late flow."""

    splits: list[str] = like(RetrievalConfig, "splits")
    self_hits: str = like(RetrievalConfig, "self_hits")

    system: SystemRef = Field(
        default_factory=SystemRef,
        description="The system whose scores re-rank the "
        "candidates (its query encodings at K_q must be stored; passages are encoded as "
        "needed).",
    )
    kq: int = Field(default=1, ge=1, description="The re-scoring system's query budget K_q.")
    kp: int = Field(default=1, ge=1, description="The re-scoring system's passage budget K_p.")
    mode: str = Field(default="multi_dense", description="The re-scoring mode (multi_dense, sparse_max, a fusion).")
    depths: list[Positive] = Field(
        default=[10, 20, 100],
        description="m: candidates re-scored per query, the first stage's top (one run each).",
        json_schema_extra=cli(flag="--depth"),
    )
    first_stage: str = like(RerankConfig, "first_stage")
    first_kq: int = like(RerankConfig, "first_kq")
    first_kp: int = like(RerankConfig, "first_kp")
    first_mode: str | None = like(RerankConfig, "first_mode")
    batch_size: int = like(EncodeConfig, "batch_size")
    verify: bool = like(
        EncodeConfig,
        "verify",
        description="Check every part of the partial folder by sha256 "
        "(default: its size and mtime); a damaged part is encoded again, even when every run is "
        "current.",
    )
    device: str = like(BackboneConfig, "device")
    rules: ScoreRules = Field(
        default_factory=ScoreRules, description="How the mode scores (default: the reference evaluator's)."
    )
    unit_queries: int = Field(
        default=65_536,
        ge=1,
        description="Queries per unit of the re-scoring (rounded up to "
        "a multiple of 256): the units run on the workers and a killed run keeps the finished "
        "ones; the runs are the same whatever the cut.",
    )

    def ignore_ids(self) -> bool:
        """Whether a document whose id is the query's is dropped (``self_hits="drop"``)."""
        return self.self_hits == "drop"

    @field_validator("depths", mode="before")
    @classmethod
    def _positive_first(cls, v: Any) -> Any:  # its own message before the items' bound answers
        if isinstance(v, list) and any(isinstance(m, int) and m <= 0 for m in v):
            raise ValueError(f"m must be positive integers, got {v}")
        return v

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
            log(
                f"m {m:,} is capped at {first_depth:,}, the first stage's depth (its run keeps {first_depth:,} "
                "documents per query)"
            )
    return sorted({min(m, int(first_depth)) for m in depths})


@dataclass
class Candidates:
    """The folder of a system's passages encoded for late runs (used when its full encodings are not stored): its
    config, and how to encode the passages it lacks."""

    folder: str
    config: dict[str, Any]
    tokens: str  # the corpus's tokens folder
    system: str
    corpus: str
    settings: dict[str, Any]  # the system's EncodeSettings
    batch_size: int
    verify: bool


@dataclass
class LateRepair:
    """Every run is current but the passages they needed are damaged: encoded again (``prepare``)."""

    candidates: Candidates
    first_runs: dict[str, str]  # split -> the first stage's run folder
    depth: int


@dataclass
class LateMerge:
    """What writing a late pass's runs needs; ``first``, ``corpus_ids`` and ``stats`` are read by ``prepare``."""

    cells: list[Cell]
    query_ids: list[str]
    full: bool  # the system's full encodings are stored (else the candidates folder is read)
    candidates: Candidates
    first: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    corpus_ids: pa.Array | None = None
    stats: dict[str, Any] = field(default_factory=dict)


class LateShared(PassShared):
    """What every unit of a late pass shares: the corpus's tokens folder (its passage ids), the queries' folder and
    ids, each split's first-stage run, the passages' encodings folder, what re-scores them, the depths m."""

    dataset: str
    tokens_folder: str
    query_folder: str
    query_ids: list[str]
    first_runs: dict[str, str]  # split -> the first stage's run folder
    passages: str  # the system's full encodings folder, or its candidates folder
    rescore: str
    kq: int
    depths: list[int]
    rules: ScoreRules
    ignore: bool
    sparse_factor: float


@dataclass
class LatePlan(PassPlan[LateMerge]):
    repair: LateRepair | None = None


@dataclass
class LateInputs:
    """What a late run's plan resolved once: the system and its settings, its query encodings, the corpus's tokens,
    whether the full passage encodings are stored, each split's first-stage run (its slug and folder)."""

    record: SystemRecord
    settings: EncodeSettings
    q_folder: str
    q_man: Manifest
    t_folder: str
    t_man: Manifest
    full: str
    full_ok: bool
    first: dict[str, tuple[str, str]]


class Late(PassStage[LateMerge], name="late", config=LateConfig, noun="run(s)", verb="written", distributed=True):
    """Late-parametric re-scoring: a first stage's top m per query, re-scored by a system's mode; only the passages
    some query needs are encoded."""

    def plan(self, config: LateConfig, ctx: Context) -> LatePlan:
        check_device(config.device, config)
        store, corpus = ctx.store, config.corpus_name()
        inputs = self._inputs(config, ctx)
        record = inputs.record
        plan = LatePlan(system=record.system, work=0, work_unit="queries")
        cells = self._cells(config, ctx, inputs, plan)
        plan.count = len(cells)
        partial = partial_encodings_dir(record.system, corpus, config.kp)
        candidates = Candidates(
            partial,
            encodings_config(
                inputs.settings,
                inputs.q_man.config["tokens"],
                inputs.t_man.config_hash,
                config.kp,
                batch_size=config.batch_size,
            ),
            inputs.t_folder,
            record.system,
            corpus,
            inputs.settings.model_dump(),
            config.batch_size,
            config.verify,
        )
        if not cells:
            damage = None if inputs.full_ok else store.shard_damage(partial, candidates.config, config.verify)
            if damage:  # every run is current, but the passages they needed are not: encoded again
                ctx.log(f"{store.abspath(partial)}: {damage}; encoding its passages again")
                capped = [
                    capped_depths(
                        config.depths, store.require_manifest(inputs.first[s][1]).config.get("topk"), lambda _: None
                    )
                    for s in config.splits
                ]
                candidates.verify = True
                plan.repair = LateRepair(
                    candidates, {s: inputs.first[s][1] for s in config.splits}, max(d for c in capped for d in c)
                )
            return plan
        self._plan_pass(config, ctx, inputs, plan, cells, candidates)
        return plan

    def _inputs(self, config: LateConfig, ctx: Context) -> LateInputs:
        """The system (whose readout must have the mode), its query encodings and the corpus's tokens, whether its
        full passage encodings are stored, and each split's first-stage run."""
        store, corpus = ctx.store, config.corpus_name()
        record = find_system(store, config.system)
        if config.mode not in modes_for([config.mode], record.has_sparse):
            raise ValueError(f"{record.system}: the {record.readout} readout has no sparse vectors for {config.mode}")
        q_folder = encodings_dir(record.system, config.dataset, "query", config.kq)
        q_man = encoding_manifest(store, q_folder)
        t_folder = tokens_dir(q_man.config["tokens"], corpus, "passage")
        t_man = tokens_manifest(
            store, t_folder, f"run `diffret tokenize -d {corpus} --side passage --model {record.model}`"
        )
        full = encodings_dir(record.system, corpus, "passage", config.kp)
        f_man = store.read_manifest(full)
        first = {
            s: first_stage_run(
                store, config.dataset, s, config.first_stage, config.first_kq, config.first_kp, config.first_mode
            )
            for s in config.splits
        }
        return LateInputs(
            record=record,
            settings=settings_of(record, config.device),
            q_folder=q_folder,
            q_man=q_man,
            t_folder=t_folder,
            t_man=t_man,
            full=full,
            full_ok=f_man is not None and f_man.total_rows() == corpus_size(store, corpus),
            first=first,
        )

    def _cells(self, config: LateConfig, ctx: Context, inputs: LateInputs, plan: LatePlan) -> list[Cell]:
        """One cell per (split, m) whose run is not current, each with its run folder's config."""
        store, record = ctx.store, inputs.record
        cells = []
        for split in config.splits:
            slug, src = inputs.first[split]
            for m in capped_depths(config.depths, store.require_manifest(src).config.get("topk"), ctx.log):
                mode = f"late_{config.mode}_m{m}"
                cfg = {
                    "system": record.system,
                    "dataset": config.dataset,
                    "corpus": config.corpus_name(),
                    "split": split,
                    "kq": config.kq,
                    "kp": config.kp,
                    "mode": mode,
                    "topk": m,
                    "rescore": config.mode,
                    "first_stage": {
                        "system": slug,
                        "kq": config.first_kq,
                        "kp": config.first_kp,
                        "mode": first_stage_mode(store, config.first_stage, config.first_mode),
                    },
                    "ignore_identical_ids": config.ignore_ids(),
                    "rules": config.rules.model_dump(),
                    "inputs": {"first": store.require_manifest(src).config_hash, "queries": inputs.q_man.config_hash},
                }
                folder = run_dir(record.system, config.dataset, split, config.kq, config.kp, mode)
                if plan.needs(ctx, folder, cfg, config.force):
                    cells.append(Cell(split, config.kq, config.kp, mode, folder, cfg))
        return cells

    def _plan_pass(
        self,
        config: LateConfig,
        ctx: Context,
        inputs: LateInputs,
        plan: LatePlan,
        cells: list[Cell],
        candidates: Candidates,
    ) -> None:
        """The one pass over slices of the queries for ``cells``: its shared record, its units and its merge."""
        store, record = ctx.store, inputs.record
        splits = sorted({c.split for c in cells})
        query_ids = list(dict.fromkeys(q for s in splits for q in split_queries(store, config.dataset, s)))
        shared = LateShared(
            dataset=config.dataset,
            tokens_folder=inputs.t_folder,
            query_folder=inputs.q_folder,
            query_ids=query_ids,
            first_runs={s: inputs.first[s][1] for s in splits},
            passages=inputs.full if inputs.full_ok else candidates.folder,
            rescore=config.mode,
            kq=config.kq,
            depths=sorted({int(c.config["topk"]) for c in cells}),
            rules=config.rules,
            ignore=config.ignore_ids(),
            sparse_factor=config.rules.factor_for(record.readout, record.settings.get("readout")),
        )
        pass_cfg = shared.pass_config(
            unit_queries=config.unit_queries,
            inputs={
                "queries": inputs.q_man.config_hash,
                "tokens": inputs.t_man.config_hash,
                "first": {s: store.require_manifest(inputs.first[s][1]).config_hash for s in splits},
            },
        )
        grain = -(-config.unit_queries // QUERY_GRAIN) * QUERY_GRAIN
        blocks = even_blocks(len(query_ids), grain, "queries")
        merge = LateMerge(cells, query_ids, inputs.full_ok, candidates)
        done = self.add_pass(
            ctx,
            plan,
            system=record.system,
            dataset=config.dataset,
            kp=config.kp,
            config=pass_cfg,
            shared=shared,
            blocks=blocks,
            merge=merge,
            opened=[candidates.folder],
        )
        ctx.log(f"late: {len(cells)} run(s), {len(query_ids):,} queries in {len(blocks)} unit(s), {done} already done")

    def prepare(self, config: LateConfig, plan: Plan, ctx: Context) -> None:
        """The candidates' encodings, once for every unit: from the system's full encodings when stored, else from
        its candidates folder after encoding what it lacks (one new part)."""
        assert isinstance(plan, LatePlan)
        store = ctx.store
        if plan.repair is not None:  # only the candidates folder: its damaged parts dropped, their passages encoded
            repair = plan.repair
            corpus_ids = _corpus_ids(store, repair.candidates.tokens)
            first = _first_tops(store, [repair.depth], repair.first_runs, corpus_ids)
            needed = np.unique(
                np.concatenate([v for f in first.values() for v in f.values()] + [np.zeros(0, np.int64)])
            )
            encoded, _ = self._encode_missing(repair.candidates, ctx, needed, corpus_ids)
            ctx.log(f"{store.abspath(repair.candidates.folder)}: {encoded:,} passage(s) encoded again")
        for done in plan.passes.values():
            info = done.merge
            corpus_ids = _corpus_ids(store, info.candidates.tokens)
            shared = read_shared(ctx, done.plan_key, LateShared)
            first = _first_tops(store, shared.depths, shared.first_runs, corpus_ids)
            needed = np.unique(
                np.concatenate([v for f in first.values() for v in f.values()] + [np.zeros(0, np.int64)])
            )
            encoded, seconds = 0, 0.0
            if not info.full:
                encoded, seconds = self._encode_missing(info.candidates, ctx, needed, corpus_ids)
            info.first, info.corpus_ids = first, corpus_ids
            info.stats = {
                "needed": int(len(needed)),
                "encoded": encoded,
                "corpus": len(corpus_ids),
                "encode_seconds": round(seconds, 4),
            }
            ctx.log(
                f"late re-scoring ({shared.rescore}): {len(needed):,} of {len(corpus_ids):,} passages needed, "
                f"{encoded:,} encoded now"
            )

    def _encode_missing(
        self, candidates: Candidates, ctx: Context, needed: np.ndarray, corpus_ids: pa.Array
    ) -> tuple[int, float]:
        """Encode the ``needed`` passages (global positions) the candidates folder lacks, as one new part; how many,
        and the seconds that took (the model's loading excluded)."""
        store, folder = ctx.store, candidates.folder
        ctx.hold(folder)
        part = {"system": candidates.system, "dataset": candidates.corpus, "k": str(candidates.config["k"])}
        man, done = store.open_sharded(folder, "partial", part, candidates.config, verify=candidates.verify)
        wanted = corpus_ids.take(pa.array(needed, pa.int64()))
        held = [store.read_table(folder, name, columns=["id"]).column("id") for name in sorted(done)]
        if held:
            held_ids = pa.chunked_array(held, pa.string()).combine_chunks()
            wanted = wanted.filter(pc.invert(pc.is_in(wanted, value_set=held_ids)))
        miss = wanted.cast(pa.string())
        if len(miss) == 0:
            return 0, 0.0
        rows = []
        t_man = store.require_manifest(candidates.tokens)
        for name in sorted(t_man.files):
            t = store.read_table(candidates.tokens, name, columns=["id", "token_ids", "text"])
            rows.append(t.filter(pc.is_in(t.column("id"), value_set=miss)))
        todo = pa.concat_tables(rows)
        reader = reader_for(EncodeSettings.model_validate(candidates.settings))
        start = time.perf_counter()
        advance = ctx.progress("late: encoding the candidates", len(miss), "docs")
        new = encode_rows(
            reader,
            todo.column("id").to_pylist(),
            todo.column("token_ids").to_pylist(),
            todo.column("text").to_pylist(),
            side="passage",
            k=int(candidates.config["k"]),
            batch_size=candidates.batch_size,
            on_batch=advance,
        )
        seconds = time.perf_counter() - start
        name = next(PART.format(i) for i in range(len(done) + 1) if PART.format(i) not in done)  # a dropped part's
        # name (damaged, its passages encoded again) or the next free number
        store.record_shard(folder, name, store.write_shard(folder, name, new), man.config_hash)
        store.compact_shards(folder)
        return len(miss), seconds

    def run(self, unit: PassUnit, ctx: Context) -> FileEntry:
        """A slice of the queries: each one's first-stage top m re-scored, for every m, to the pass's partials."""
        store = ctx.store
        shared = read_shared(ctx, unit.plan, LateShared)
        corpus_ids = _corpus_ids(store, shared.tokens_folder)
        first = _first_tops(store, shared.depths, shared.first_runs, corpus_ids)
        query_ids = shared.query_ids[unit.start : unit.end]
        depth = max(shared.depths)
        cands = [_first_top(first, q, depth) for q in query_ids]
        needed = np.unique(np.concatenate(cands + [np.zeros(0, np.int64)]))
        table = _encodings_of(store, shared.passages, corpus_ids.take(pa.array(needed, pa.int64())))
        rules = shared.rules
        settings = SearchSettings(rules=rules, ignore_identical_ids=shared.ignore)
        codec = None  # a compressed system's full encodings are codes (late's own parts are float16)
        if "codes" in table.column_names:
            codec = codec_for(store, shared.passages, store.require_manifest(shared.passages))
        passages = encodings_from_table(table, "cpu", rules, shared.sparse_factor, codec)
        p_index = _positions(corpus_ids, pa.array(passages.ids, pa.string()), shared.passages)
        order = np.argsort(p_index, kind="stable")
        passages, p_index = take(passages, order), p_index[order]
        queries = query_encodings(store, shared.query_folder, query_ids, "cpu", rules, shared.sparse_factor)
        mode, kq = shared.rescore, shared.kq
        tops, start = {}, time.perf_counter()
        for m in shared.depths:
            top = rescore(queries, [c[:m] for c in cands], passages, p_index, [mode], kq, settings, width=m)[mode]
            tops[(kq, f"late_{mode}_m{m}")] = top
        return write_unit(store, unit, topk_table(tops, unit.start), time.perf_counter() - start)

    def merge(self, done: Pass[LateMerge], ctx: Context) -> None:
        """The slices' rows in place, one run per cell (its split's queries, cut at its m)."""
        info = done.merge
        store = ctx.store
        assert info.corpus_ids is not None  # read by prepare
        query_ids, first = info.query_ids, info.first
        tops, seconds = stacked_slices(store, done.folder, len(query_ids))
        tops, doc_ids = retrieved_ids(tops, info.corpus_ids)  # the documents the runs hold, not the corpus
        lex = doc_order(doc_ids)
        row = {q: i for i, q in enumerate(query_ids)}
        for cell in info.cells:
            m = int(cell.config["topk"])
            rows = [row[q] for q in split_queries(store, str(cell.config["dataset"]), cell.split)]
            t = run_table(tops[(cell.kq, cell.mode)], query_ids, doc_ids, rows, lex, depth=m)
            cands = [_first_top(first, query_ids[i], m) for i in rows]
            needed_m = int(len(np.unique(np.concatenate(cands + [np.zeros(0, np.int64)]))))
            m_cells = sum(1 for c in info.cells if c.config["topk"] == cell.config["topk"])
            write_run(
                store,
                cell,
                t,
                {
                    "queries": len(rows),
                    "rows": t.num_rows,
                    **info.stats,
                    "needed_m": needed_m,
                    **search_stats(seconds, len(query_ids), m_cells),
                },
            )


presentation = Presentation(
    deployment=(
        "Late-parametric re-scoring (SIDR's beta(m)): each query's top m of a stored first-stage run (a beta run, "
        "BM25, any encoder's) re-scored by a system's mode; only the passages some query needs are encoded (kept "
        "under partial/ and reused by later runs). One run per m, mode `late_<mode>_m<m>`."
    ),
    example={
        "dataset": "scifact",
        "system": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
        "mode": "multi_dense",
        "depths": [10, 20, 100],
        "first_stage": "bm25",
    },
    next_step="evaluate the runs: `diffret evaluate -d {dataset}` (the evaluate deployment).",
)


_CORPUS: KeyedCache[tuple[str, str], pa.Array] = KeyedCache()


def _corpus_ids(store: ArtifactStore, tokens: str) -> pa.Array:
    """A corpus's passage ids in order (its tokens folder's), as one Arrow array (no Python object per id), read
    once per process."""
    return _CORPUS.get((store.root, tokens), lambda: shard_ids(store, tokens, store.require_manifest(tokens)))


def _positions(corpus_ids: pa.Array, ids: pa.Array, where: str) -> np.ndarray:
    """Each of ``ids``'s position in the corpus (a hashed lookup); an id the corpus lacks is refused, naming
    ``where`` it came from."""
    pos = pc.index_in(ids, value_set=corpus_ids)
    if pos.null_count:
        missing = ids.filter(pc.is_null(pos))[0].as_py()
        raise StoreError(f"{where} names passage {missing!r}, which the corpus does not hold")
    return pos.to_numpy(zero_copy_only=False).astype(np.int64)


def _first_tops(
    store: ArtifactStore, depths: list[int], first_runs: dict[str, str], corpus_ids: pa.Array
) -> dict[str, dict[str, Any]]:
    """Each split's first-stage run (``first_runs``: split -> its folder) as its top (the deepest of ``depths``) per
    query, as corpus positions in rank order."""
    depth = max(depths)
    return {s: _top(read_run(store, src), depth, corpus_ids) for s, src in first_runs.items()}


def _encodings_of(store: ArtifactStore, folder: str, ids: pa.Array) -> pa.Table:
    """The encodings of ``ids`` (each once) from a folder of shards or parts; only those rows are kept."""
    m = store.require_manifest(folder)
    return _rows(pa.concat_tables([_rows(store.read_table(folder, n), ids) for n in sorted(m.files)]), ids)


def _rows(table: pa.Table, ids: pa.Array) -> pa.Table:
    """The rows of ``ids`` (each once)."""
    t = table.filter(pc.is_in(table.column("id"), value_set=ids))
    _, first = np.unique(np.asarray(t.column("id").to_pylist(), dtype=object), return_index=True)
    return t.take(pa.array(np.sort(first)))


def _top(run: pa.Table, depth: int, corpus_ids: pa.Array) -> dict[str, np.ndarray]:
    """Each query's first ``depth`` documents of a run (global passage positions, in rank order)."""
    run = run.filter(pc.less_equal(run.column("rank"), depth))
    pos = _positions(corpus_ids, run.column("doc_id").combine_chunks(), "the first-stage run")
    queries = run.column("query_id").combine_chunks().dictionary_encode()
    code = queries.indices.to_numpy(zero_copy_only=False)
    order = np.lexsort((run.column("rank").to_numpy(), code))  # by query, then rank
    code, pos = code[order], pos[order]
    if not len(code):
        return {}
    starts = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])
    names = queries.dictionary.to_pylist()
    return {names[code[a]]: pos[a:b] for a, b in zip(starts, np.r_[starts[1:], len(code)], strict=True)}


def _first_top(first: dict[str, dict[str, np.ndarray]], query: str, m: int) -> np.ndarray:
    """A query's first-stage top ``m`` (from whichever split holds it)."""
    for by_query in first.values():
        if query in by_query:
            return by_query[query][:m]
    return np.zeros(0, np.int64)


stage = Late()
