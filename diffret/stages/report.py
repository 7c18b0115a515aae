"""The report stage: the paper's analyses from the metrics in the store, as ``reports/report=<name>/``
(report.md, PNG figures, CSV tables), optionally copied to a folder.

Its inputs are every metrics folder and the query token ids (the query features): when they change, the
report is rebuilt; when they do not, it is left as it is (and only copied to ``out_dir``).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field

from diffret.retrieval.analysis.report import Report, build_report
from diffret.retrieval.fields import cli, like
from diffret.storage import ArtifactStore, Manifest, StoreError
from diffret.storage.layout import report_dir
from diffret.storage.sql import StoreSQL

from .base import Context, Folder, Plan, Published, Stage, StageConfig, StageResult, inline_figures
from .compare import CompareConfig
from .presentation import Presentation
from .systems import list_systems, random_weights_note

REPORT_FORMAT = 2  # 2: significance corrected across the tables, the section of runs against the baseline


class ReportConfig(StageConfig):
    """Parameters of the report flow."""

    name: str = Field(default="default", description="Report name: reports/report={name}/ in the store.")
    out_dir: str | None = Field(
        default=None,
        description="Also copy the report into this folder (outside the store).",
        json_schema_extra=cli(flag="--out", short="-o"),
    )
    refs: list[str] | None = Field(
        default=None,
        description="Systems the tables' significance markers compare with († first, ‡ second; "
        "default: bm25); the first is the baseline of the section 'Runs against'.",
        json_schema_extra=cli(flag="--ref"),
    )
    test: Literal["t", "wilcoxon"] = like(CompareConfig, "test")
    correction: Literal["holm", "bonferroni", "none"] = like(CompareConfig, "correction")
    finetuned: dict[str, str] = Field(default_factory=dict, description="BASE system slug -> fine-tuned slug.")
    n_boot: int = Field(default=1000, ge=10, description="Bootstrap resamples of the correlation CIs.")
    hidden: int = Field(default=3584, ge=1, description="Footprint projection: hidden size (Dream-7B: 3584).")
    backbones: int = Field(default=4, ge=1, description="Footprint projection: backbones.")
    settings: int = Field(default=2, ge=1, description="Footprint projection: settings per backbone.")


class ReportStage(Stage, name="report", config=ReportConfig, noun="report(s)", verb="written"):
    """The paper's analyses and tables from the metrics (and latency rows) in the store."""

    def plan(self, config: ReportConfig, ctx: Context) -> Plan:
        if config.out_dir:
            out = ctx.store.refuse_inside(config.out_dir)
            if os.path.exists(out) and not os.path.isdir(out):
                raise StoreError(f"--out {config.out_dir} is a file: give a folder to copy the report into")
        ctx.store.require_root()
        if not ctx.store.folders("metrics/*/*/*/*/*/*") and not ctx.store.folders("latency/*/*/*"):
            raise StoreError(
                f"no metrics in the store {ctx.store.root} yet: run `diffret evaluate` (or `diffret run`) "
                "first, or `diffret latency` for the latency figures alone"
            )
        known = {r.system for r, _ in list_systems(ctx.store)}
        named = [*(config.refs or []), *config.finetuned, *config.finetuned.values()]
        unknown = [s for s in named if s not in known and s != "bm25"]
        if unknown:
            raise StoreError(
                f"unknown system {unknown[0]!r} in --ref / --finetuned; the store's systems: "
                f"{', '.join(sorted(known)) or 'none'}"
            )
        # the test and correction recorded when not the defaults: a report of the defaults keeps its settings (it is
        # rebuilt, not refused, as REPORT_FORMAT is one of its inputs)
        plain = {k for k in ("test", "correction") if getattr(config, k) == ReportConfig.model_fields[k].default}
        cfg = config.model_dump(mode="json", exclude={"root", "out_dir", "force", *plain})
        cfg["inputs"] = {
            "store": ctx.store.fingerprint("metrics/*/*/*/*/*/*", "tokens/*/*/side=query", "latency/*/*/*"),
            "format": REPORT_FORMAT,
        }
        folder = report_dir(config.name)
        plan = Plan()
        if plan.needs_folder(
            ctx,
            folder,
            cfg,
            config.force,
            hint="Pass --force to replace it, or --name NEW for a second report beside it.",
        ):
            plan.units.append(Folder(folder, cfg))
        return plan

    def run(self, unit: Folder, ctx: Context) -> Report:
        c = unit.config
        notes = {r.system: n for r, _ in list_systems(ctx.store) if (n := random_weights_note(r.settings))}
        with StoreSQL(ctx.store, warn=lambda line: ctx.log(f"warning: {line}")) as db:
            rep = build_report(
                db,
                name=c["name"],
                refs=c["refs"],
                finetuned=c["finetuned"],
                n_boot=c["n_boot"],
                hidden=c["hidden"],
                backbones=c["backbones"],
                settings=c["settings"],
                test=c.get("test", "t"),
                correction=c.get("correction", "holm"),
                random_weights=notes,
            )
        m = Manifest.new(
            "reports",
            {"report": c["name"]},
            c,
            stats={"sections": [t for t, _ in rep.sections], "warnings": rep.warnings},
        )
        with ctx.store.folder_writer(unit.stage, m) as w:
            for fname, data in sorted(rep.files.items()):
                w.write_file(fname, data)
            w.write_file("report.md", rep.markdown().encode())
        ctx.log(f"report: {ctx.store.url(unit.stage)}/report.md ({len(rep.files)} files)")
        return rep

    def finish(self, config: ReportConfig, plan: Plan, results: list[Report], ctx: Context) -> dict[str, Any]:
        folder = report_dir(config.name)
        m = ctx.store.require_manifest(folder)
        if config.out_dir:
            os.makedirs(config.out_dir, exist_ok=True)
            for fname in m.files:
                with ctx.store.fs.open(ctx.store.abspath(f"{folder}/{fname}"), "rb") as src:
                    data = src.read()
                with open(os.path.join(config.out_dir, fname), "wb") as f:
                    f.write(data)
        sections = {t: body for t, body in results[0].sections} if results else {}
        return {
            "name": config.name,
            "folder": ctx.store.url(folder),
            "files": sorted(m.files),
            "sections": sections,
            "warnings": m.stats.get("warnings", []),
        }


def _printed(result: StageResult) -> list[str]:
    return [f"report written: {result.details.get('folder')}/report.md"]


def _published(result: StageResult, store: ArtifactStore) -> list[Published]:
    """One page per section of the report, its figures embedded (their links point into the report's folder)."""
    name, folder = str(result.details.get("name", "")), result.details["folder"]
    pages = []
    for title, body in result.details["sections"].items():
        body = inline_figures(body.replace("](", f"]({folder}/").replace(f"]({folder}/#", "](#"), store)
        pages.append(Published(("report", name, title), f"## {title}\n\n{body}", title))
    return pages


presentation = Presentation(
    deployment=(
        "The paper's analyses from the metrics in the store: train-split budget selection, (K_q, K_p) landscapes, "
        "per-query oracle, peak-K_q vs query length / entropy correlations with bootstrap CIs, D / S / H tables "
        "with t-test markers, and the storage footprint with its MS MARCO projection. Written to "
        "`reports/report=<name>/` and published as markdown artifacts."
    ),
    example={"name": "default"},
    next_step='query any number behind it: `diffret sql "select * from best_cells"`; `diffret views` lists the tables.',
    printed=_printed,
    published=_published,
)


stage = ReportStage()
