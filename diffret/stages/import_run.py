"""The import-run stage (``diffret import-run``): a run made elsewhere becomes a system of its own in the store.

    runs/system=<name>/dataset=<d>/split=<s>/kq=0/kp=0/mode=imported/run.parquet

A TREC run file (``qid Q0 docid rank score tag``: Pyserini, PLAID, trec_eval's format) or a Parquet table
(``query_id``, ``doc_id``, ``score``, optionally ``rank``) is checked against the collection (every query id the
dataset's, every document id its corpus's; a (query, document) pair once; finite numeric scores: otherwise refused,
naming ``file:line``), ranked by score (ties by the file's rank, then doc_id), cut to ``depth`` and stored as a run.
The system (kind ``run``, its slug the name given) is then evaluated, listed in ``cells`` and the report, compared
(``diffret compare``), fused (``diffret fuse``), reranked (``diffret rerank --first-stage NAME``) and re-scored
(``diffret late --first-stage NAME``) like any other. The file's sha256 is part of the run's settings: another file
under the same name and split is refused unless ``--force``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow.compute as pc
from pydantic import Field

from diffret.retrieval.evaluation.trec import iter_run_file, run_file_format
from diffret.retrieval.fields import cli
from diffret.retrieval.search.runs import ranked_run
from diffret.storage import ArtifactStore
from diffret.storage.layout import IMPORTED_MODE, check_partition_value, dataset_dir, run_dir

from .base import Context, Plan, Stage
from .presentation import Presentation
from .readers import dataset_manifest
from .runs import Cell, QueriesConfig, write_run
from .systems import SystemRecord, register, slug_base


class ImportRunConfig(QueriesConfig):
    """Parameters of the import-run flow."""

    path: str = Field(
        description="The run file: TREC (qid Q0 docid rank score tag) or Parquet (query_id, doc_id, "
        "score, optionally rank).",
        json_schema_extra=cli(positional=True),
    )
    split: str = Field(default="test", description="The query split the run answers.")
    name: str | None = Field(
        default=None, description="The system's name (its slug; default: the file's name without its suffix)."
    )
    format: Literal["auto", "trec", "parquet"] = Field(
        default="auto", description="The file's format (auto: Parquet by its magic bytes, else TREC)."
    )
    depth: int = Field(default=1000, ge=1, description="Documents kept per query (the first by score).")

    def system(self) -> str:
        """The system's slug: ``name`` (or the file's stem) in the store's alphabet.

        >>> ImportRunConfig(dataset="scifact", path="/runs/splade pp.trec").system()
        'splade-pp'
        """
        name = self.name or Path(self.path).name.split(".")[0]
        return check_partition_value("system", slug_base(name))


@dataclass
class ImportUnit:
    cell: Cell
    path: str
    format: str
    record: dict[str, Any]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


class ImportRun(Stage, name="import-run", config=ImportRunConfig, noun="run(s)", verb="imported"):
    """Store a run made elsewhere (TREC or Parquet) as a system of its own: evaluated, compared, fused, reranked."""

    def plan(self, config: ImportRunConfig, ctx: Context) -> Plan:
        path = Path(config.path).expanduser()
        if not path.is_file():
            raise ValueError(f"run file {config.path!r} does not exist (give a TREC or Parquet run file)")
        store, slug, corpus = ctx.store, config.system(), config.corpus_name()
        fmt = run_file_format(path, config.format)
        inputs = {
            "queries": dataset_manifest(store, config.dataset).config_hash,
            "corpus": dataset_manifest(store, corpus).config_hash,
        }
        cfg = {
            "system": slug,
            "dataset": config.dataset,
            "corpus": corpus,
            "split": config.split,
            "kq": 0,
            "kp": 0,
            "mode": IMPORTED_MODE,
            "topk": config.depth,
            "source": {"file": path.name, "format": fmt, "sha256": _sha256(path)},
            "inputs": inputs,
        }
        folder = run_dir(slug, config.dataset, config.split, 0, 0, IMPORTED_MODE)
        plan = Plan(system=slug)
        record = SystemRecord(system=slug, kind="run", settings={"imported": True})
        register(store, record, write=False, named=True)  # a name another kind of system holds: refused here
        if plan.needs_folder(
            ctx,
            folder,
            cfg,
            config.force,
            hint=f"The store holds run {slug!r} of {config.dataset}/"
            f"{config.split} from another file; pass --force to replace it, or --name NEW.",
        ):
            plan.units.append(
                ImportUnit(Cell(config.split, 0, 0, IMPORTED_MODE, folder, cfg), str(path), fmt, record.model_dump())
            )
        plan.count = len(plan.units)
        return plan

    def run(self, unit: ImportUnit, ctx: Context) -> dict[str, Any]:
        store, cfg = ctx.store, unit.cell.config
        rows, stats = checked_rows(store, unit.path, unit.format, cfg["dataset"], cfg["corpus"], cfg["split"])
        table = ranked_run(rows, int(cfg["topk"]))
        register(store, SystemRecord.model_validate(unit.record))
        write_run(store, unit.cell, table, {**stats, "rows": table.num_rows})
        ctx.log(
            f"{cfg['system']}: {stats['queries']:,} queries ({stats['judged']:,} of split {cfg['split']}'s "
            f"{stats['split_queries']:,} judged ones), {table.num_rows:,} documents kept"
        )
        return stats


presentation = Presentation(
    deployment=(
        "Store a run made elsewhere (a TREC run file or a Parquet table: Pyserini, PLAID, an API) as a system of "
        "its own, every id checked against the collection; it is then evaluated, compared, fused, reranked and "
        "re-scored like any."
    ),
    example={
        "dataset": "scifact",
        "split": "test",
        "path": "./runs/splade.trec",
    },
    next_step=(
        "evaluate it: `diffret evaluate -d {dataset}`; then `diffret compare -d {dataset} --baseline bm25 "
        "--run {system}`."
    ),
)


def checked_rows(
    store: ArtifactStore, path: str, fmt: str, dataset: str, corpus: str, split: str
) -> tuple[list[tuple[str, str, float, int | None]], dict[str, Any]]:
    """The file's rows, each query id checked against the dataset's queries and each document id against the
    corpus (a ValueError naming ``file:line`` and the repair), and how many of the split's judged queries it
    answers (none at all: refused, naming the split its queries are judged in)."""
    queries = store.read_table(dataset_dir(dataset), "queries.parquet", columns=["query_id", "split"])
    known_q = set(queries.column("query_id").to_pylist())
    judged = set(queries.filter(pc.equal(queries.column("split"), split)).column("query_id").to_pylist())
    if not judged:
        splits = sorted({s for s in queries.column("split").to_pylist() if s})
        raise ValueError(f"dataset {dataset!r} has no split {split!r}; it has {splits} (give --split)")
    docs = set(store.read_table(dataset_dir(corpus), "corpus.parquet", columns=["doc_id"]).column("doc_id").to_pylist())
    rows = []
    for where, qid, doc, score, rank in iter_run_file(path, fmt):
        if qid not in known_q:
            raise ValueError(
                f"{where}: query {qid!r} is not a query of {dataset!r} (is this run for another collection? give -d)"
            )
        if doc not in docs:
            raise ValueError(
                f"{where}: document {doc!r} is not in the corpus of {corpus!r} (is this run for another "
                "collection? give -d, or --corpus)"
            )
        rows.append((qid, doc, score, rank))
    if not rows:
        raise ValueError(f"{path}: no run lines (an empty file?)")
    answered = {q for q, _, _, _ in rows}
    if not answered & judged:
        splits = sorted(
            {
                s
                for q, s in zip(
                    queries.column("query_id").to_pylist(), queries.column("split").to_pylist(), strict=True
                )
                if q in answered and s
            }
        )
        raise ValueError(
            f"{path}: none of its {len(answered):,} queries is judged in split {split!r} (they are "
            f"judged in {splits or 'no split'}): give --split"
        )
    return rows, {"queries": len(answered), "judged": len(answered & judged), "split_queries": len(judged)}


stage = ImportRun()
