"""The summary stage: a system's leaderboard (best cell per mode, BM25, t-tests), a heatmap per mode and a
markdown page, per split, from the metrics in the store.

    summaries/system=<slug>/dataset=<d>/split=<s>/{summary.md, leaderboard.csv, heatmap_<mode>.png}

Its inputs are the metrics it reads (their manifests' config hashes and checksums): when they change, the
summary is rewritten; when they do not, nothing is done.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from diffret.retrieval.analysis.summary import build_summary
from diffret.retrieval.fields import cli
from diffret.storage import ArtifactStore, Manifest, StoreError
from diffret.storage.layout import summary_dir
from diffret.storage.sql import StoreSQL

from .base import Context, Folder, Plan, Stage, StageConfig
from .presentation import Presentation
from .systems import SystemRef, find_system, list_systems, load, random_weights_note


class SummaryConfig(StageConfig):
    """Parameters of the summary stage (the last step of `diffret run`)."""

    system: str | None = Field(
        default=None,
        description="The system to summarise (a slug or a unique prefix; default: the store's only encoder system).",
    )
    dataset: str = Field(description="The dataset its runs were scored on.", json_schema_extra=cli(short="-d"))
    splits: list[str] = Field(
        default=["test"], description="The splits to summarise.", json_schema_extra=cli(flag="--split")
    )
    bm25: str | None = Field(
        default="auto",
        description="The BM25 system to compare with (a slug or prefix); "
        "auto: the store's BM25 system evaluated on the dataset, if any; none: no BM25 "
        "row.",
    )


class Summary(Stage, name="summary", config=SummaryConfig, noun="summary(ies)", verb="written"):
    """Leaderboard, heatmaps and summary markdown of one system on one dataset."""

    def plan(self, config: SummaryConfig, ctx: Context) -> Plan:
        store = ctx.store
        system = find_system(store, SystemRef(system=config.system)).system
        bm25 = _bm25(store, config.bm25, config.dataset)
        plan = Plan(system=system, details={"bm25": bm25})
        systems = [system] + ([bm25] if bm25 else [])
        for split in config.splits:  # a summary of nothing is never written
            if not store.folders(f"metrics/system={system}/dataset={config.dataset}/split={split}/*/*/*"):
                have = sorted(
                    {
                        d.split("/")[2].split("=", 1)[1] + "/" + d.split("/")[3].split("=", 1)[1]
                        for d in store.folders(f"metrics/system={system}/*/*/*/*/*")
                    }
                )
                raise StoreError(
                    f"no metrics of {system} on {config.dataset}/{split} in {store.root}, so there is "
                    f"nothing to summarise (it has metrics on: {', '.join(have) or 'nothing'}); score "
                    f"and evaluate it first (`diffret score -d {config.dataset} --split {split}`, "
                    "`diffret evaluate`)"
                )
            cfg = {
                "system": system,
                "bm25": bm25,
                "dataset": config.dataset,
                "split": split,
                "inputs": {
                    "metrics": ctx.store.fingerprint(
                        *(f"metrics/system={s}/dataset={config.dataset}/split={split}/*/*/*" for s in systems)
                    )
                },
            }
            folder = summary_dir(system, config.dataset, split)
            plan.add_folder(ctx, folder, cfg, config.force)
        return plan

    def run(self, unit: Folder, ctx: Context) -> None:
        c = unit.config
        note = random_weights_note(load(ctx.store, c["system"]).settings)  # a slug's record never changes
        with StoreSQL(ctx.store, warn=lambda line: ctx.log(f"warning: {line}")) as db:
            s = build_summary(db, c["system"], c["dataset"], c["split"], c["bm25"], note)
        part = {"system": c["system"], "dataset": c["dataset"], "split": c["split"]}
        board = [r.as_dict() for r in s.rows]
        m = Manifest.new(
            "summaries", part, c, stats={"rows": len(s.rows), "leaderboard": board, "warnings": s.warnings()}
        )
        with ctx.store.folder_writer(unit.stage, m) as w:
            for name, data in s.files().items():
                w.write_file(name, data)

    def finish(self, config: SummaryConfig, plan: Plan, results: list[Any], ctx: Context) -> dict[str, Any]:
        """The leaderboard of each split (from the stored summaries) and where each summary folder is."""
        out: dict[str, Any] = {"leaderboards": {}, "folders": {}, "warnings": []}
        pages = []
        for split in config.splits:
            folder = summary_dir(plan.system, config.dataset, split)  # type: ignore[arg-type]
            m = ctx.store.require_manifest(folder)
            out["leaderboards"][split] = m.stats.get("leaderboard", [])
            out["folders"][split] = ctx.store.url(folder)
            out["warnings"] += m.stats.get("warnings", [])
            pages.append(summary_page(ctx.store, folder))
        out["markdown"] = "\n".join(pages)
        return out


presentation = Presentation(
    deployment=(
        "Leaderboard (best cell per mode, BM25, paired t-tests), a heatmap per mode and summary.md of one system "
        "on one dataset, from the metrics in the store; rewritten only when those metrics change."
    ),
    example={"dataset": "scifact"},
    next_step=(
        "the paper's analyses over every stored system: `diffret report` (the report deployment); ad-hoc SQL: "
        "`diffret sql`."
    ),
)


def _bm25(store: ArtifactStore, given: str | None, dataset: str) -> str | None:
    """The BM25 system a summary compares with: the one named, none, or (auto) the store's BM25 system evaluated on
    ``dataset`` (several: refused, naming them), so that a summary rebuilt without the pipeline keeps its row."""
    if given in (None, "none"):
        return None
    if given != "auto":
        return find_system(store, SystemRef(system=given)).system
    found = [
        r.system
        for r, _ in list_systems(store)
        if r.kind == "bm25" and store.folders(f"metrics/system={r.system}/dataset={dataset}/*/*/*/*")
    ]
    if len(found) > 1:
        raise StoreError(
            f"{len(found)} BM25 systems are evaluated on {dataset} ({', '.join(found)}): name one with "
            "--bm25 SLUG (or --bm25 none)"
        )
    return found[0] if found else None


def summary_page(store: ArtifactStore, folder: str) -> str:
    """A stored summary.md with its figure links relative to the store root (``inline_figures`` embeds them)."""
    return store.read_bytes(f"{folder}/summary.md").decode().replace("](heatmap_", f"]({folder}/heatmap_")


stage = Summary()
