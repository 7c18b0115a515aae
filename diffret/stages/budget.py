"""The budget stage: an adaptive (K_q, K_p) per query, learned on a train split's per-query grid and applied to
other splits (the paper's named future work). It writes, per applied split and selector, a run that evaluate, the
views and the report treat like any other:

    features/system=<slug>/dataset=<d>/split=<s>/set=<text|encoding>/features.parquet   (long: query, feature, value)
    runs/system=<slug>/dataset=<d>/split=<s>/kq=0/kp=0/mode=adaptive_<mode>_<selector>_<over>_<features>/run.parquet

Each query's run is the stored run of the cell chosen for it. The run's manifest records the selector's
hyper-parameters (cross-validated on the train split), what it learned, the features' importances, the
histogram of chosen cells and the cost of the choice (index copies kept, query passes). A selector is never
evaluated on the split it learned from (refused); a split without the whole grid is refused naming the cells.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, model_validator

from diffret.retrieval.analysis.budgets import SELECTORS, Grid, encoding_features, first_pass_features, text_features
from diffret.retrieval.fields import SEED_MAX, cli
from diffret.storage import Manifest
from diffret.storage.layout import (
    FEATURES_FILE,
    FEATURES_SCHEMA,
    METRICS_FILE,
    dataset_dir,
    encodings_dir,
    features_dir,
    metrics_dir,
    run_dir,
    tokens_dir,
)
from diffret.storage.manifest import StoreError

from .base import Context, Folder, Plan, Stage, StageConfig, StageResult
from .presentation import Presentation
from .readers import split_queries
from .runs import Cell, read_run, write_run
from .systems import SystemRef, find_system

SELECTOR_NAMES = list(SELECTORS)


class BudgetConfig(StageConfig):
    """Parameters of the budget flow."""

    system: SystemRef = Field(default_factory=SystemRef, description="The system whose grid to choose from.")
    dataset: str = Field(description="The dataset whose splits hold the grid.", json_schema_extra=cli(short="-d"))
    train_split: str = Field(
        default="train", description="The split the selectors learn from (its grid's per-query metrics)."
    )
    splits: list[str] = Field(
        default=["test"],
        description="Splits to choose budgets for (never the train split).",
        json_schema_extra=cli(flag="--split"),
    )
    mode: str = Field(default="multi_dense", description="The scoring mode whose grid to choose over (fusions too).")
    over: Literal["kq", "kp", "joint"] = Field(
        default="joint",
        description="Choose K_q alone (one passage index, "
        "K_p of the fixed budget), K_p alone (the query picks which stored "
        "passage index to search) or both.",
    )
    selectors: list[str] = Field(
        default=SELECTOR_NAMES,
        description=f"Selectors: {', '.join(SELECTOR_NAMES)}.",
        json_schema_extra=cli(flag="--selector"),
    )
    features: Literal["text", "encoding", "first_pass"] = Field(
        default="encoding",
        description="text: the query's length in tokens and words (free); encoding: also, from "
        "its stored encoding at every K_q of the grid, the slots read, distinct tokens, sparse mass and support, and "
        "the slots' agreement (one query pass per K_q at query time); first_pass: also the top score, the gap to "
        "the second and the top-10 score entropy of the grid's smallest cell's run (one more search).",
    )
    cross_fit: bool = Field(
        default=False,
        description="For a dataset without a train split: learn on each target "
        "split itself, k-fold cross-fitted (each query's budget chosen by selectors learned on the "
        "other folds, never on itself); over joint only. Its runs' modes end in _cf.",
    )
    measure: str = Field(default="ndcg_cut_10", description="The per-query measure the selectors maximise.")
    seed: int = Field(default=0, ge=0, le=SEED_MAX, description="Seed of the folds and the learners.")
    folds: int = Field(default=5, ge=2, description="Cross-validation folds on the train split.")

    @model_validator(mode="after")
    def _never_on_the_train_split(self) -> BudgetConfig:
        if self.cross_fit and self.over != "joint":
            raise ValueError(
                f"cross_fit chooses over joint only (the cells a fold may take would differ), got over={self.over!r}"
            )
        if not self.cross_fit and self.train_split in self.splits:
            raise ValueError(
                f"a selector is never evaluated on the split it learned from: {self.train_split!r} is "
                f"both the train split and among the splits {self.splits}"
            )
        unknown = [s for s in self.selectors if s not in SELECTORS]
        if unknown:
            raise ValueError(f"unknown selector(s) {unknown}; known: {SELECTOR_NAMES}")
        return self


def adaptive_mode(mode: str, selector: str, over: str, features: str, cross_fit: bool = False) -> str:
    """The run mode of an adaptive choice.

    >>> adaptive_mode("multi_dense", "rule", "joint", "encoding"), adaptive_mode("sparse_max", "fixed", "joint",
    ...                                                                          "text", cross_fit=True)
    ('adaptive_multi_dense_rule_joint_encoding', 'adaptive_sparse_max_fixed_joint_text_cf')
    """
    return f"adaptive_{mode}_{selector}_{over}_{features}" + ("_cf" if cross_fit else "")


def feature_set(features: str, mode: str) -> str:
    """The features folder's set: the first pass's depends on the mode whose run it reads.

    >>> feature_set("encoding", "multi_dense"), feature_set("first_pass", "multi_dense")
    ('encoding', 'first_pass_multi_dense')
    """
    return f"first_pass_{mode}" if features == "first_pass" else features


def grid_cells(ctx: Context, system: str, dataset: str, split: str, mode: str) -> dict[tuple[int, int], str]:
    """The evaluated cells of a system's grid on a split, in one mode: (K_q, K_p) -> metrics folder."""
    out = {}
    for folder in ctx.store.folders(f"metrics/system={system}/dataset={dataset}/split={split}/kq=*/kp=*/mode={mode}"):
        parts = dict(p.split("=", 1) for p in folder.split("/")[1:])
        if int(parts["kq"]) > 0:
            out[(int(parts["kq"]), int(parts["kp"]))] = folder
    return out


@dataclass
class BudgetPlan(Plan):
    """A budget run's plan: the grid's cells the selectors choose among, and the adaptive runs' folders."""

    cells: list[list[int]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)


class Budget(Stage, name="budget", config=BudgetConfig, noun="run(s)", verb="chosen"):
    """Adaptive budgets: a (K_q, K_p) per query from features known before search (learned on a train split)."""

    def plan(self, config: BudgetConfig, ctx: Context) -> BudgetPlan:
        system = find_system(ctx.store, config.system).system
        learn = config.splits[0] if config.cross_fit else config.train_split
        train, grids = self._grids(config, ctx, system, learn)
        cells = sorted(train)
        plan = BudgetPlan(system=system, cells=[list(c) for c in cells])
        feats = self._plan_features(config, ctx, plan, system, cells)
        fingerprint = ctx.store.fingerprint
        for split in config.splits:
            source = split if config.cross_fit else config.train_split
            runs = {f"{kq}x{kp}": run_dir(system, config.dataset, split, kq, kp, config.mode) for kq, kp in cells}
            learned_from = grids[split] if config.cross_fit else train
            inputs = {
                "train_metrics": fingerprint(*(learned_from[c] for c in cells)),
                "runs": fingerprint(*runs.values()),
                "features": {s: feats[s] for s in dict.fromkeys((source, split))},
            }
            for selector in config.selectors:
                mode = adaptive_mode(config.mode, selector, config.over, config.features, config.cross_fit)
                cfg = {
                    "kind": "run",
                    "system": system,
                    "dataset": config.dataset,
                    "split": split,
                    "kq": 0,
                    "kp": 0,
                    "mode": mode,
                    "base_mode": config.mode,
                    "selector": selector,
                    "over": config.over,
                    "features": config.features,
                    "measure": config.measure,
                    "cross_fit": config.cross_fit,
                    "train_split": split if config.cross_fit else config.train_split,
                    "seed": config.seed,
                    "folds": config.folds,
                    "cells": [list(c) for c in cells],
                    "inputs": inputs,
                }
                folder = run_dir(system, config.dataset, split, 0, 0, mode)
                plan.runs.append(folder)
                plan.add_folder(ctx, folder, cfg, config.force)
        return plan

    @staticmethod
    def _grids(
        config: BudgetConfig, ctx: Context, system: str, learn: str
    ) -> tuple[dict[tuple[int, int], str], dict[str, dict[tuple[int, int], str]]]:
        """The evaluated grid the selectors learn from (split ``learn``) and each split's: refused when the learning
        split has none, has fewer queries than folds, or a split lacks one of its cells."""
        train = grid_cells(ctx, system, config.dataset, learn, config.mode)
        if not train:
            raise StoreError(
                f"{system} has no evaluated {config.mode} grid on {config.dataset}/{learn}: run "
                f"`diffret score -d {config.dataset} --split {learn}` and `diffret evaluate` "
                "first"
            )
        n_learn = len(split_queries(ctx.store, config.dataset, learn))
        if config.folds > n_learn:  # KFold would quietly use fewer
            raise ValueError(
                f"--folds {config.folds} but {config.dataset}/{learn} has {n_learn} queries to learn "
                f"from: a fold needs at least one; give --folds {min(5, n_learn)} (at most "
                f"{n_learn})"
            )
        grids = {}
        for split in config.splits:
            grids[split] = have = grid_cells(ctx, system, config.dataset, split, config.mode)
            missing = [c for c in sorted(train) if c not in have]
            if missing:
                raise StoreError(
                    f"{config.dataset}/{split} lacks the {config.mode} cells (K_q, K_p) {missing} that "
                    f"{learn} has: score and evaluate them first"
                )
        return train, grids

    @staticmethod
    def _plan_features(
        config: BudgetConfig, ctx: Context, plan: BudgetPlan, system: str, cells: list[tuple[int, int]]
    ) -> dict[str, dict[str, Any]]:
        """A features folder per split the selectors learn from or choose for (unless current); each one's config."""
        fingerprint = ctx.store.fingerprint
        enc_inputs = (
            fingerprint(f"encodings/system={system}/dataset={config.dataset}/side=query/k=*")
            if config.features != "text"
            else None
        )
        feats = {}
        first = cells[0]  # the cheapest cell: the first pass of the first_pass features
        fset = feature_set(config.features, config.mode)
        for split in ([] if config.cross_fit else [config.train_split]) + config.splits:
            cfg: dict[str, Any] = {
                "system": system,
                "dataset": config.dataset,
                "split": split,
                "set": fset,
                "kq": sorted({kq for kq, _ in cells}),
                "inputs": {"encodings": enc_inputs},
            }
            if config.features == "first_pass":
                run = run_dir(system, config.dataset, split, *first, config.mode)
                cfg.update(first_pass=run, inputs={**cfg["inputs"], "first_pass": fingerprint(run)})
            folder = features_dir(system, config.dataset, split, fset)
            feats[split] = cfg
            plan.add_folder(ctx, folder, {**cfg, "kind": "features"}, config.force)
        return feats

    def unit_name(self, unit: Folder) -> str:
        c = unit.config
        return f"{c['kind']} {c['dataset']}/{c['split']}" + (f" {c['selector']}" if c["kind"] == "run" else "")

    def run(self, unit: Folder, ctx: Context) -> int:
        c = unit.config
        if c["kind"] == "features":
            return self._features(unit, ctx)
        store = ctx.store
        cells = [tuple(x) for x in c["cells"]]
        fset = feature_set(c["features"], c["base_mode"])
        selector = SELECTORS[c["selector"]]
        seed, folds = int(c["seed"]), int(c["folds"])
        train = _grid(ctx, c["system"], c["dataset"], c["train_split"], c["base_mode"], cells, c["measure"])
        names, X = _feature_matrix(ctx, c["system"], c["dataset"], c["train_split"], fset, train.queries)
        fixed: list[int] | None
        if c.get("cross_fit"):
            queries = train.queries
            chosen, fixed, fitted_stats = _cross_fit(selector, X, names, train, seed, folds)
            choice_cells = cells
        else:
            best = train.cells[train.best_mean()]
            train = train.restrict(c["over"], best)
            fitted = selector.fit(X, names, train, seed=seed, folds=folds)
            queries = split_queries(store, c["dataset"], c["split"])
            names_t, Xt = _feature_matrix(ctx, c["system"], c["dataset"], c["split"], fset, queries)
            if names_t != names:
                raise StoreError(
                    f"the features of {c['split']} ({names_t}) are not those of {c['train_split']} ({names})"
                )
            choice_cells = train.cells
            chosen = selector.choose(fitted, Xt, Grid(queries, choice_cells, np.zeros((len(queries), len(cells)))))
            fitted_stats = {
                "name": fitted.name,
                "params": fitted.params,
                "learned": fitted.learned,
                "importances": fitted.importances,
                "cv_score": fitted.cv_score,
            }
            fixed = list(best)
        tables = {}
        for cell in sorted(set(chosen.tolist())):
            kq, kp = choice_cells[cell]
            tables[cell] = read_run(store, run_dir(c["system"], c["dataset"], c["split"], kq, kp, c["base_mode"]))
        parts = []
        for cell, table in tables.items():
            want = pa.array([q for q, j in zip(queries, chosen.tolist(), strict=True) if j == cell])
            parts.append(table.filter(pc.is_in(table.column("query_id"), value_set=want)))
        out = pa.concat_tables(parts).sort_by([("query_id", "ascending"), ("rank", "ascending")])
        histogram = {f"{kq}x{kp}": int((chosen == j).sum()) for j, (kq, kp) in enumerate(choice_cells)}
        kps = {kp for kq, kp in choice_cells if histogram[f"{kq}x{kp}"]}
        kqs = sorted({kq for kq, _ in cells})
        stats = {
            "queries": len(queries),
            "rows": out.num_rows,
            "fixed": fixed,
            "histogram": histogram,
            "selector": fitted_stats,
            "cost": {
                "passage_indexes": len(kps) if c["over"] != "kq" else 1,
                # the features read the query's encoding at every K_q of the grid, the chosen one among them
                "query_passes": len(kqs) if c["features"] != "text" else 1,
                "first_pass_searches": int(c["features"] == "first_pass"),
                "note": _COST[c["over"]],
            },
        }
        cell = Cell(c["split"], 0, 0, c["mode"], unit.stage, c)
        write_run(store, cell, out, stats)
        return out.num_rows

    def _features(self, unit: Folder, ctx: Context) -> int:
        c = unit.config
        rows = _compute_features(ctx, c["system"], c["dataset"], c["split"], c["set"], c["kq"], c.get("first_pass"))
        table = pa.Table.from_pylist(rows, schema=FEATURES_SCHEMA)
        part = {"system": c["system"], "dataset": c["dataset"], "split": c["split"], "set": c["set"]}
        m = Manifest.new("features", part, c, stats={"rows": table.num_rows})
        with ctx.store.folder_writer(unit.stage, m) as w:
            w.write_parquet(FEATURES_FILE, FEATURES_SCHEMA, [table])
        return table.num_rows

    def finish(self, config: BudgetConfig, plan: Plan, results: list[Any], ctx: Context) -> dict[str, Any]:
        assert isinstance(plan, BudgetPlan)
        return {"cells": plan.cells, "runs": plan.runs, "adaptive_runs": len(plan.runs)}


def _printed(result: StageResult) -> list[str]:
    return [f"adaptive runs: {result.details.get('adaptive_runs')} (evaluate them: diffret evaluate)"]


presentation = Presentation(
    deployment=(
        "Adaptive budgets: learns, on a train split's per-query grid metrics, a selector (fixed, a one-feature "
        "rule, a classifier over the cells, a regressor of each cell's score) from query features known before "
        "search, and writes for each other split a run of the cell chosen per query (mode "
        "`adaptive_<mode>_<selector>_<over>_<features>`), which evaluate, the views and the report treat like any "
        "run. Never evaluated on the split it learned from."
    ),
    example={"dataset": "scifact"},
    next_step="evaluate them: `diffret evaluate`; compare: `diffret report` (section Adaptive budgets).",
    printed=_printed,
)


_COST = {
    "kq": "one passage index (the fixed K_p); the query is encoded at its chosen K_q",
    "kp": "a passage index per K_p chosen; the query is encoded at the fixed K_q",
    "joint": "a passage index per K_p chosen; the query is encoded at its chosen K_q",
}


def _cross_fit(
    selector: Any, X: np.ndarray, names: list[str], grid: Grid, seed: int, folds: int
) -> tuple[np.ndarray, list[int] | None, dict[str, Any]]:
    """Each query's cell chosen by ``selector`` learned on the other folds of its own split (over every cell); the
    fixed cells of the folds, and per fold what was learned (hyper-parameters, importances averaged)."""
    from sklearn.model_selection import KFold

    n = len(grid.queries)
    chosen = np.zeros(n, dtype=int)
    per_fold: list[dict[str, Any]] = []
    importances: dict[str, float] = {}
    splitter = KFold(max(2, min(folds, n)), shuffle=True, random_state=seed)
    fixed_cells: list[list[int]] = []
    for rest, held in splitter.split(np.arange(n)):
        part = grid.subset([grid.queries[i] for i in rest])
        fitted = selector.fit(X[rest], names, part, seed=seed, folds=folds)
        held_grid = grid.subset([grid.queries[i] for i in held])
        chosen[held] = selector.choose(fitted, X[held], held_grid)
        fixed_cells.append(list(part.cells[part.best_mean()]))
        per_fold.append({"params": fitted.params, "learned": fitted.learned, "cv_score": fitted.cv_score})
        for k, v in fitted.importances.items():
            importances[k] = importances.get(k, 0.0) + v / splitter.get_n_splits()
    stats = {
        "name": selector.name,
        "params": per_fold[0]["params"],
        "folds": per_fold,
        "importances": importances,
        "cv_score": None,
    }
    return chosen, (fixed_cells[0] if len({tuple(f) for f in fixed_cells}) == 1 else None), stats


def _grid(
    ctx: Context, system: str, dataset: str, split: str, mode: str, cells: list[tuple[int, int]], measure: str
) -> Grid:
    rows = []
    for kq, kp in cells:
        t = ctx.store.read_table(metrics_dir(system, dataset, split, kq, kp, mode), METRICS_FILE)
        t = t.filter(pc.equal(t.column("measure"), measure))
        rows += [
            (q, kq, kp, v) for q, v in zip(t.column("query_id").to_pylist(), t.column("value").to_pylist(), strict=True)
        ]
    if not rows:
        raise StoreError(f"no {measure!r} per-query metrics for {system} on {dataset}/{split}")
    return Grid.from_rows(rows, cells)


def _compute_features(
    ctx: Context, system: str, dataset: str, split: str, kind: str, kqs: list[int], first_pass: str | None = None
) -> list[dict[str, Any]]:
    """Long rows (query_id, feature, value) of the split's queries."""
    store = ctx.store
    queries = split_queries(store, dataset, split)
    q = store.read_table(dataset_dir(dataset), "queries.parquet", columns=["query_id", "text"])
    texts = dict(zip(q.column("query_id").to_pylist(), q.column("text").to_pylist(), strict=True))
    enc1 = store.require_manifest(encodings_dir(system, dataset, "query", min(kqs)))
    t_folder = tokens_dir(enc1.config["tokens"], dataset, "query")
    n_tokens: dict[str, int] = {}
    for name in sorted(store.require_manifest(t_folder).files):
        t = store.read_table(t_folder, name, columns=["id", "n_tokens"])
        n_tokens.update(zip(t.column("id").to_pylist(), t.column("n_tokens").to_pylist(), strict=True))
    out = []
    for qid in queries:
        for f, v in text_features(texts[qid], int(n_tokens[qid])).items():
            out.append({"query_id": qid, "feature": f, "value": v})
    if kind != "text":
        stages = {k: encodings_dir(system, dataset, "query", k) for k in kqs}
        mans = {k: store.require_manifest(stage) for k, stage in stages.items()}
        # the head's stats where every K's query encodings hold them (`diffret encode --head-stats`)
        head = all(m.config.get("head_stats") for m in mans.values())
        columns = ["id", "n_reps", "dense", "tokens", "sparse_weights", *(["slot_entropy", "slot_maxprob"] * head)]
        for k, stage in stages.items():
            for name in sorted(mans[k].files):
                t = store.read_table(stage, name, columns=columns)
                t = t.filter(pc.is_in(t.column("id"), value_set=pa.array(queries)))  # this split's: only they convert
                for row in t.to_pylist():
                    feats = encoding_features(
                        np.asarray(row["dense"], dtype=np.float32),
                        int(row["n_reps"]),
                        row["tokens"],
                        row["sparse_weights"],
                        row.get("slot_entropy"),
                        row.get("slot_maxprob"),
                    )
                    out += [{"query_id": row["id"], "feature": f"{f}@{k}", "value": v} for f, v in feats.items()]
    if first_pass is not None:
        run = read_run(store, first_pass, columns=["query_id", "score"])
        scores: dict[str, list[float]] = {q: [] for q in queries}
        for qid, score in zip(run.column("query_id").to_pylist(), run.column("score").to_pylist(), strict=True):
            if qid in scores:
                scores[qid].append(score)
        for qid in queries:
            out += [{"query_id": qid, "feature": f, "value": v} for f, v in first_pass_features(scores[qid]).items()]
    return out


def _feature_matrix(
    ctx: Context, system: str, dataset: str, split: str, kind: str, queries: list[str]
) -> tuple[list[str], np.ndarray]:
    t = ctx.store.read_table(features_dir(system, dataset, split, kind), FEATURES_FILE)
    names = sorted(set(t.column("feature").to_pylist()))
    col = {n: j for j, n in enumerate(names)}
    row = {q: i for i, q in enumerate(queries)}
    X = np.full((len(queries), len(names)), np.nan)
    for q, f, v in zip(*(t.column(c).to_pylist() for c in ("query_id", "feature", "value")), strict=True):
        if q in row:
            X[row[q], col[f]] = v
    missing = np.isnan(X).any(1)
    if missing.any():
        raise StoreError(
            f"{int(missing.sum())} queries of {dataset}/{split} lack features (e.g. "
            f"{queries[int(np.argmax(missing))]!r}): rebuild them with --force"
        )
    return names, X


stage = Budget()
