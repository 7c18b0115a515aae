"""The download stage (``diffret download``): a collection into ``datasets/dataset=<name>/*.parquet``.

The three tables and the manifest are built in a staging folder and moved into place together, so
a collection is either entirely there (with checksums) or not there at all. The config names the source
and the checksum of every source file: a changed source is drift, refused unless ``--force``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from diffret.retrieval.data.collections import (
    DatasetError,
    DatasetReport,
    DocIds,
    Query,
    build_qrels,
    build_queries,
    read_corpus,
    read_queries,
)
from diffret.retrieval.data.sources import BEIR_BASE_URL, SourceFiles, resolve_source, stored_name
from diffret.retrieval.fields import cli
from diffret.schemas import CORPUS_SCHEMA, QRELS_SCHEMA, QUERIES_SCHEMA
from diffret.storage import ArtifactStore, FolderState, Manifest, StoreError
from diffret.storage.layout import dataset_dir

from .base import Context, Plan, Stage, StageConfig, StageResult
from .presentation import Presentation

INGEST_FORMAT = 1  # bump when the way sources become tables changes: old artifacts then count as drift


class DownloadConfig(StageConfig):
    """Parameters of the download flow."""

    def dataset_label(self) -> str:
        return self.dataset

    @property
    def dataset(self) -> str:
        """The name the collection is stored under (:func:`retrieval.data.sources.stored_name`).

        >>> DownloadConfig(name="beir/scifact/test").dataset
        'scifact'
        """
        return stored_name(self.name)

    name: str = Field(
        description="Collection: a BEIR name (scifact, nfcorpus, arguana, fiqa, trec-covid, nq, hotpotqa, quora, "
        "scidocs, ...), msmarco-passage, trec-dl-2019, trec-dl-2020, an ir_datasets id (beir/scifact/test, "
        "msmarco-passage/dev/small, lotte/science/test/search, ...; stored under the catalog's name where it is one, "
        "else with / as -), or any name with a --source.",
        json_schema_extra=cli(positional=True),
    )
    source: str | None = Field(
        default=None,
        description="Mirror of the dataset: a BEIR-layout folder, a .zip/.tar.gz, or a URL of either (offline: "
        "../shared/data/{name} in this repository's checkouts). Default: the official location.",
        json_schema_extra=cli(short="-s"),
    )
    cache_dir: str = Field(default="~/.cache/diffret/downloads", description="Where downloaded archives are kept.")
    beir_base_url: str = Field(
        default=BEIR_BASE_URL, description="Base URL of the BEIR zips (for institutional mirrors)."
    )
    unknown_judgments: Literal["error", "drop", "keep"] = Field(
        default="error",
        description="Judgments of documents the corpus lacks: error, drop (left out) or keep (as BEIR's evaluation).",
    )


@dataclass
class DownloadResult:
    dataset: str
    status: str  # "written" | "unchanged"
    manifest: Manifest
    report_lines: list[str]
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "status": self.status,
            "rows": {k: v.rows for k, v in self.manifest.files.items()},
            "report": self.report_lines,
            "warnings": self.warnings,
        }


def artifact_config(name: str, files: SourceFiles, unknown_judgments: str = "error") -> dict[str, Any]:
    """What identifies the content of a stored collection (the manifest's config)."""
    cfg: dict[str, Any] = {
        "dataset": name,
        "source": files.origin,
        "source_files": dict(sorted(files.inputs.items())),
        "corpus_from": files.corpus_from,
        "ingest_format": INGEST_FORMAT,
    }
    if unknown_judgments != "error":  # "error" stores the same tables as before the option existed
        cfg["unknown_judgments"] = unknown_judgments
    return cfg


DRIFT_HINT = "The store already holds {name!r} from another source; pass --force to replace it."


def _doc_ids_of(store: ArtifactStore, dataset: str) -> DocIds | None:
    """The stored corpus's document ids (DocIds: 8 bytes an id), read a slice at a time."""
    if store.read_manifest(dataset_dir(dataset)) is None:
        return None
    column = store.read_table(dataset_dir(dataset), "corpus.parquet", columns=["doc_id"]).column("doc_id")
    ids = DocIds()
    for start in range(0, len(column), 100_000):
        for doc_id in column.slice(start, 100_000).to_pylist():
            ids.add(doc_id)
    return ids


def materialise(
    store: ArtifactStore,
    name: str,
    files: SourceFiles,
    force: bool = False,
    state: FolderState | None = None,
    unknown_judgments: str = "error",
) -> DownloadResult:
    """Validate and store a collection's files (unless the same source is already stored)."""
    folder = dataset_dir(name)  # validates the name as a partition value
    config = artifact_config(name, files, unknown_judgments)
    if state is None:
        state = store.state(folder, config, force=force, hint=DRIFT_HINT.format(name=name))
    if state is FolderState.CURRENT:
        m = store.require_manifest(folder)
        return DownloadResult(
            name, "unchanged", m, [f"{name}: already in the store with the same source; nothing to do"]
        )
    report = DatasetReport(dataset=name, notes=list(files.notes))
    if state is FolderState.DAMAGED:
        report.notes.append("the stored copy failed its checksums and was rebuilt")
    manifest = Manifest.new("datasets", {"dataset": name}, config)
    with store.folder_writer(folder, manifest) as w:
        doc_ids: DocIds | None
        if files.corpus is not None:
            doc_ids = DocIds()
            w.write_parquet(
                "corpus.parquet", CORPUS_SCHEMA, read_corpus(files.corpus, files.corpus_format, report, doc_ids)
            )
        elif files.corpus_from:
            doc_ids = _doc_ids_of(store, files.corpus_from)
            if doc_ids is None:
                report.notes.append(
                    f"no corpus here; the qrels judge {files.corpus_from!r}, which is not in the store, "
                    "so their document ids were not checked"
                )
            else:
                report.notes.append(f"document ids checked against the corpus of {files.corpus_from!r}")
        else:
            doc_ids = None
            report.notes.append("no corpus.jsonl in the source: queries and qrels only; document ids not checked")

        queries: dict[str, Query] = {}
        for path, fmt in files.queries:
            read_queries(path, fmt, queries, report)
        qrels, judged = build_qrels(files.qrels, queries, doc_ids, report, unknown_judgments)
        for split, rep in report.splits.items():
            if rep.rows == 0:
                raise DatasetError(
                    f"{files.qrels[split]}: no judgment of split {split!r} names a known query and document "
                    f"({rep.unknown_query_rows} unknown queries, {rep.unknown_doc_rows} unknown documents); "
                    "is this the right corpus?"
                )
        w.write_parquet("qrels.parquet", QRELS_SCHEMA, [qrels])
        w.write_parquet("queries.parquet", QUERIES_SCHEMA, [build_queries(queries, judged, report)])
        manifest.stats = {"report": report.to_dict()}
    return DownloadResult(name, "written", manifest, report.summary_lines(), report.warnings())


@dataclass
class DownloadUnit:
    name: str
    files: SourceFiles
    state: FolderState
    unknown_judgments: str = "error"


class Download(Stage, name="download", config=DownloadConfig, noun="collection(s)", verb="written"):
    """Materialise a retrieval test collection into the artifact store."""

    def plan(self, config: DownloadConfig, ctx: Context) -> Plan:
        if config.source is None and not config.force and (stored := self._stored(config, ctx)) is not None:
            return stored
        progress = None
        if ctx.report is not None:
            report = ctx.report

            def progress(label: str, done: int, total: int | None) -> None:
                report(f"download {label}", done, total, "bytes", "")

        name = config.dataset
        dataset_dir(name)  # a name the store cannot hold: refused before any download
        files = resolve_source(
            config.name, config.source, Path(config.cache_dir).expanduser(), config.beir_base_url, progress=progress
        )
        st = ctx.store.state(
            dataset_dir(name),
            artifact_config(name, files, config.unknown_judgments),
            force=config.force,
            hint=DRIFT_HINT.format(name=name),
        )
        if st is FolderState.CURRENT:
            lines = [f"{name}: already in the store with the same source; nothing to do"]
            return Plan(skipped=1, details={"dataset": name, "status": "unchanged", "report": lines})
        return Plan(units=[DownloadUnit(name, files, st, config.unknown_judgments)])

    def _stored(self, config: DownloadConfig, ctx: Context) -> Plan | None:
        """A collection the store holds, used by its name without ``--source`` (downloaded once, from a mirror or
        the network): nothing to do when its files verify; a damaged copy is rebuilt from the source it was made
        from (None: the official location is fetched)."""
        folder = dataset_dir(config.dataset)
        try:
            m = ctx.store.read_manifest(folder, trusted=False)
        except StoreError:
            m = None
        if m is None:
            return None
        origin = str(m.config.get("source") or "")
        state = ctx.store.state(folder, m.config)
        if state is FolderState.CURRENT:
            lines = [f"{config.dataset}: already in the store (from {origin}); nothing to do"]
            return Plan(skipped=1, details={"dataset": config.dataset, "status": "unchanged", "report": lines})
        if origin in ("", "official"):
            return None
        if not (Path(origin).exists() or "://" in origin):
            raise DatasetError(
                f"{ctx.store.abspath(folder)}: the stored copy of {config.dataset!r} is damaged and its "
                f"source {origin} is gone; give it again with --source"
            )
        unknown = m.config.get("unknown_judgments", config.unknown_judgments)
        return self.plan(config.model_copy(update={"source": origin, "unknown_judgments": unknown}), ctx)

    def run(self, unit: DownloadUnit, ctx: Context) -> DownloadResult:
        return materialise(ctx.store, unit.name, unit.files, state=unit.state, unknown_judgments=unit.unknown_judgments)

    def finish(self, config: DownloadConfig, plan: Plan, results: list[DownloadResult], ctx: Context) -> dict[str, Any]:
        """What was stored (or found stored), with the rows of each table and the source (``markdown``)."""
        details = results[0].summary() if results else dict(plan.details)
        m = ctx.store.require_manifest(dataset_dir(config.dataset))
        lines = ["| table | rows |", "|---|---:|"]
        lines += [f"| {name.removesuffix('.parquet')} | {e.rows or 0:,} |" for name, e in sorted(m.files.items())]
        details["rows"] = {name: e.rows for name, e in m.files.items()}
        details["markdown"] = "\n".join(
            [f"Folder: `{dataset_dir(config.dataset)}`", "", *lines, "", f"Source: `{m.config.get('source')}`"]
        )
        return details

    def outputs(self, config: DownloadConfig, plan: Plan, details: dict[str, Any]) -> list[str]:
        return []  # its own table names each table's rows (a sum over corpus, queries and qrels would mislead)


def _printed(result: StageResult) -> list[str]:
    """The collection's validation report, line by line."""
    return list(result.details.get("report", []))


presentation = Presentation(
    deployment=(
        "Materialise a retrieval test collection (BEIR layout, MS MARCO, TREC DL) as corpus / queries / qrels "
        "Parquet under `datasets/dataset=<name>/` in the artifact store. Set config.source to a local folder, "
        "archive or URL to read an offline mirror instead of the official location. Re-running is safe: a "
        "collection already stored from the same source is left as it is."
    ),
    example={"name": "scifact", "source": None},
    next_step=(
        "encode it: `diffret encode -d {dataset} --model MODEL` (the encode deployment), or the whole grid: "
        "`diffret run -d {dataset} --model MODEL` (the pipeline deployment)."
    ),
    printed=_printed,
)


stage = Download()
