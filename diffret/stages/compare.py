"""The compare stage (``diffret compare``): stored runs against a baseline, with corrected significance, as
``comparisons/comparison=<name>/`` (comparison.md, comparison.csv, comparison.tex), optionally copied to a folder.

Runs are named ``SYSTEM[:MODE[:KQ:KP]]`` (``bm25``, an imported run's name, ``<encoder slug>:multi_dense:4:16``;
none: every run of the dataset and split); each must be evaluated (``diffret evaluate``). Per measure: the mean, a
paired test (t-test or Wilcoxon) on the per-query scores against the baseline, p-values corrected across the whole
table (Holm by default, or Bonferroni), and the per-query win / tie / loss counts (retrieval/evaluation/compare.py).
The table is rebuilt when any run's metrics change.
"""

from __future__ import annotations

import os
import shlex
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from diffret.retrieval.evaluation import DEFAULT_MEASURES
from diffret.retrieval.evaluation.compare import Comparison, compare_runs
from diffret.retrieval.evaluation.measures import check_measures
from diffret.retrieval.fields import cli
from diffret.storage import ArtifactStore, Manifest, StoreError, config_hash
from diffret.storage.layout import METRICS_FILE, comparison_dir, metrics_dir, partition

from .base import Context, Folder, Plan, Stage, StageConfig, StageResult
from .presentation import Presentation
from .runs import PickedRun, pick_run

FILES = {"markdown": "comparison.md", "csv": "comparison.csv", "latex": "comparison.tex"}


class CompareConfig(StageConfig):
    """Parameters of the compare flow."""

    dataset: str = Field(description="The dataset the runs answer.", json_schema_extra=cli(short="-d"))
    split: str = Field(default="test", description="The query split.")
    runs: list[str] | None = Field(
        default=None,
        description="Runs to compare: SYSTEM[:MODE[:KQ:KP]] (a slug or "
        "unique prefix, bm25, an imported run's name; MODE and KQ:KP where the system has several "
        "runs). Default: every run of the dataset and split.",
        json_schema_extra=cli(flag="--run"),
    )
    baseline: str = Field(default="bm25", description="The run every other is tested against (SYSTEM[:MODE[:KQ:KP]]).")
    measures: Annotated[list[str], AfterValidator(check_measures)] = Field(
        default=list(DEFAULT_MEASURES),
        description="Measures (as evaluate stored them).",
        json_schema_extra=cli(flag="--measure"),
    )
    test: Literal["t", "wilcoxon"] = Field(
        default="t", description="Paired test on the per-query scores: t (scipy's ttest_rel) or wilcoxon (signed-rank)."
    )
    correction: Literal["holm", "bonferroni", "none"] = Field(
        default="holm",
        description="Correction of the p-values across the table's comparisons (statsmodels' multipletests).",
    )
    alpha: float = Field(default=0.05, gt=0, lt=1, description="Significance level of the † markers.")
    name: str | None = Field(
        default=None,
        description="comparisons/comparison={name}/ in the store (default: the "
        "dataset, split and a hash of these settings).",
    )
    out_dir: str | None = Field(
        default=None,
        description="Also copy the tables into this folder (outside the store).",
        json_schema_extra=cli(flag="--out", short="-o"),
    )
    show: Literal["markdown", "csv", "latex"] = Field(default="markdown", description="The table printed when done.")

    def settings(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"root", "force", "out_dir", "show", "name"})

    def folder_name(self) -> str:
        """``name``, or ``<dataset>-<split>-<hash of the settings>``.

        >>> CompareConfig(dataset="scifact").folder_name()[:13]
        'scifact-test-'
        """
        return self.name or f"{self.dataset}-{self.split}-{config_hash(self.settings())[:8]}"


def all_runs(store: ArtifactStore, dataset: str, split: str, damaged: dict[str, str] | None = None) -> list[str]:
    """``SYSTEM:MODE:KQ:KP`` of every run of ``dataset``/``split`` in the store; a run folder whose manifest is damaged
    is left out and named in ``damaged`` (folder -> the line with its repair) when given, else its error is raised."""
    out = []
    for folder in store.folders("runs/*/" + partition("x", dataset=dataset, split=split).split("/", 1)[1] + "/*/*/*"):
        try:
            m = store.read_manifest(folder)
        except StoreError as exc:
            if damaged is None:
                raise
            damaged[folder] = str(exc)
            continue
        if m is not None:
            p = m.partition
            out.append(f"{p['system']}:{p['mode']}:{p['kq']}:{p['kp']}")
    return sorted(out)


def _metrics(
    store: ArtifactStore,
    run: PickedRun,
    dataset: str,
    split: str,
    measures: list[str],
    damaged: dict[str, str] | None = None,
) -> Manifest | None:
    """The metrics manifest of ``run``, holding ``measures``; a damaged one is named in ``damaged`` (None returned)
    when given, else its error is raised; none, or one without a measure: refused with the command that makes it."""
    folder = metrics_dir(run.system, dataset, split, run.kq, run.kp, run.mode)
    try:
        m = store.read_manifest(folder)
    except StoreError as exc:
        if damaged is None:
            raise
        damaged[folder] = str(exc)
        return None
    at = store.printed_root()
    root = f" --root {shlex.quote(at)}" if at else ""
    if m is None:
        raise StoreError(
            f"run {run.label!r} has no metrics on {dataset}/{split}: run `diffret evaluate -d {dataset}{root}` first"
        )
    stored = list(m.config.get("measures", []))
    missing = [x for x in measures if x not in stored]
    if missing:  # evaluated again with the measures it has and those asked for (--force replaces them all)
        raise StoreError(
            f"run {run.label!r} was evaluated without {missing}: run `diffret evaluate -d {dataset} "
            + " ".join(f"--measure {x}" for x in stored + missing)
            + f" --force{root}`"
        )
    return m


class Compare(Stage, name="compare", config=CompareConfig, noun="table(s)", verb="written"):
    """Runs against a baseline: means, paired tests corrected across the table, win / tie / loss (Markdown, CSV,
    LaTeX)."""

    def plan(self, config: CompareConfig, ctx: Context) -> Plan:
        store = ctx.store
        if config.out_dir:
            out = store.refuse_inside(config.out_dir)
            if os.path.exists(out) and not os.path.isdir(out):
                raise StoreError(f"--out {config.out_dir} is a file: give a folder to copy the tables into")
        base = pick_run(store, config.baseline, config.dataset, config.split)
        damaged: dict[str, str] | None = None if config.runs else {}  # every run: a damaged one is left out, named
        names = config.runs or [
            r
            for r in all_runs(store, config.dataset, config.split, damaged)
            if r != f"{base.system}:{base.mode}:{base.kq}:{base.kp}"
        ]
        runs = [base] + [pick_run(store, r, config.dataset, config.split) for r in names]
        seen: dict[str, str] = {}
        for r in runs:
            key = r.stage
            if key in seen:
                raise ValueError(f"runs {seen[key]!r} and {r.label!r} are the same run; name each once")
            seen[key] = r.label
        if len(runs) < 2:
            raise StoreError(
                f"nothing to compare with {config.baseline!r} on {config.dataset}/{config.split}: give --run"
            )
        metrics = {
            r.label: _metrics(store, r, config.dataset, config.split, config.measures, None if r is base else damaged)
            for r in runs
        }
        runs = [r for r in runs if metrics[r.label] is not None]
        for why in (damaged or {}).values():
            ctx.log(f"warning: a damaged folder is left out of the comparison: {why}")
        if len(runs) < 2:
            raise StoreError(
                f"nothing to compare with {config.baseline!r} on {config.dataset}/{config.split}: give --run"
            )
        inputs = {r.label: metrics[r.label].config_hash for r in runs}  # type: ignore[union-attr]
        cfg = {**config.settings(), "picked": [{"label": r.label, **r.ref()} for r in runs], "inputs": inputs}
        folder = comparison_dir(config.folder_name())
        plan = Plan()
        if plan.needs_folder(ctx, folder, cfg, config.force, hint="Pass --force to replace it, or --name NEW."):
            plan.units.append(Folder(folder, cfg))
        return plan

    def run(self, unit: Folder, ctx: Context) -> Comparison:
        c = unit.config
        store = ctx.store
        scores: dict[str, dict[str, dict[str, float]]] = {}
        details = {}
        for r in c["picked"]:
            table = store.read_table(
                metrics_dir(r["system"], c["dataset"], c["split"], r["kq"], r["kp"], r["mode"]), METRICS_FILE
            )
            per: dict[str, dict[str, float]] = {m: {} for m in c["measures"]}
            for q, m, v in zip(*(table.column(x).to_pylist() for x in ("query_id", "measure", "value")), strict=True):
                if m in per:
                    per[m][q] = v
            scores[r["label"]] = per
            details[r["label"]] = {k: str(r[k]) for k in ("system", "mode", "kq", "kp")}
        comp = compare_runs(
            scores,
            c["picked"][0]["label"],
            c["measures"],
            c["test"],
            c["correction"],
            c["alpha"],
            where=f"{c['dataset']}/{c['split']}",
        )
        comp.details = details
        m = Manifest.new(
            "comparisons",
            {"comparison": unit.stage.split("=", 1)[1]},
            c,
            stats={"runs": len(comp.rows), "comparisons": comp.comparisons, "queries": comp.queries},
        )
        with store.folder_writer(unit.stage, m) as w:
            w.write_file(FILES["markdown"], comp.markdown().encode())
            w.write_file(FILES["csv"], comp.csv().encode())
            w.write_file(FILES["latex"], comp.latex().encode())
        return comp

    def finish(self, config: CompareConfig, plan: Plan, results: list[Comparison], ctx: Context) -> dict[str, Any]:
        folder = comparison_dir(config.folder_name())
        store = ctx.store
        text = {k: store.fs.cat_file(store.abspath(f"{folder}/{f}")).decode() for k, f in FILES.items()}
        if config.out_dir:
            os.makedirs(config.out_dir, exist_ok=True)
            for k, f in FILES.items():
                with open(os.path.join(config.out_dir, f), "w", encoding="utf-8") as out:
                    out.write(text[k])
        return {"folder": store.url(folder), "markdown": text["markdown"], "shown": text[config.show]}


def _shown(result: StageResult) -> str:
    """The comparison table, as it was asked for (Markdown by default)."""
    return str(result.details.get("shown", ""))


def _printed(result: StageResult) -> list[str]:
    return [f"tables (md, csv, tex): {result.details.get('folder')}"]


presentation = Presentation(
    deployment=(
        "Runs against a baseline per measure: means, paired t-test or Wilcoxon on per-query scores, p-values "
        "corrected across the table (Holm by default), win / tie / loss; `comparisons/comparison=<name>/` as "
        "Markdown, CSV and LaTeX."
    ),
    example={"dataset": "scifact", "split": "test", "baseline": "bm25"},
    next_step="put it in the paper: comparison.tex in the store folder above (or --out DIR).",
    printed=_printed,
    shown=_shown,
)


stage = Compare()
