"""Materialise a collection into the artifact store: ``datasets/dataset=<name>/{corpus,queries,qrels}.parquet``.

The three tables and the manifest are built in a staging folder and moved into place together, so
a collection is either entirely there (with checksums) or not there at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storage import ArtifactStore, ChecksumError, ConfigDriftError, Manifest, config_hash, diff_configs
from storage.layout import CORPUS_SCHEMA, QRELS_SCHEMA, QUERIES_SCHEMA, dataset_dir

from .datasets import DatasetError, DatasetReport, Query, build_qrels, build_queries, read_corpus, read_queries
from .sources import SourceFiles

INGEST_FORMAT = 1  # bump when the way sources become tables changes: old artifacts then count as drift


@dataclass
class IngestResult:
    dataset: str
    status: str  # "written" | "unchanged"
    manifest: Manifest
    report_lines: list[str]

    def summary(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "status": self.status,
            "rows": {k: v.rows for k, v in self.manifest.files.items()},
            "report": self.report_lines,
        }


def artifact_config(name: str, files: SourceFiles) -> dict[str, Any]:
    """What identifies the content of a stored collection (the manifest's config)."""
    return {
        "dataset": name,
        "source": files.origin,
        "inputs": dict(sorted(files.inputs.items())),
        "corpus_from": files.corpus_from,
        "ingest_format": INGEST_FORMAT,
    }


def stored_state(store: ArtifactStore, name: str, config: dict[str, Any]) -> str:
    """``absent`` | ``same`` | ``damaged`` (same config, a file fails its checksum) — or ConfigDriftError."""
    stage = dataset_dir(name)
    m = store.read_manifest(stage)
    if m is None:
        return "absent"
    if m.config_hash != config_hash(config):
        raise ConfigDriftError(
            store.abspath(stage),
            diff_configs(m.config, config),
            hint=f"The store already holds {name!r} from another source; pass --force to replace it.",
        )
    try:
        store.verify(stage)
    except ChecksumError:
        return "damaged"
    return "same"


def _doc_ids_of(store: ArtifactStore, dataset: str) -> set[str] | None:
    if store.read_manifest(dataset_dir(dataset)) is None:
        return None
    table = store.read_table(dataset_dir(dataset), "corpus.parquet", columns=["doc_id"])
    return set(table.column("doc_id").to_pylist())


def materialise(store: ArtifactStore, name: str, files: SourceFiles, force: bool = False) -> IngestResult:
    stage = dataset_dir(name)  # validates the name as a partition value
    config = artifact_config(name, files)
    state = "forced" if force else stored_state(store, name, config)
    if state == "same":
        m = store.require_manifest(stage)
        return IngestResult(name, "unchanged", m, [f"{name}: already in the store with the same source; nothing to do"])
    report = DatasetReport(dataset=name, notes=list(files.notes))
    if state == "damaged":
        report.notes.append("the stored copy failed its checksums and was rebuilt")
    manifest = Manifest.new("datasets", {"dataset": name}, config)
    with store.stage_writer(stage, manifest) as w:
        doc_ids: set[str] | None
        if files.corpus is not None:
            doc_ids = set()
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
        qrels, judged = build_qrels(files.qrels, queries, doc_ids, report)
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
    return IngestResult(name, "written", manifest, report.summary_lines())
