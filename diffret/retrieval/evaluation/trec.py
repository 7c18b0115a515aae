"""TREC files and Arrow tables <-> the run / qrels dicts pytrec_eval takes.

In memory a run is ``{query_id: {doc_id: score}}`` and qrels are ``{query_id: {doc_id: grade}}``. pytrec_eval
(like trec_eval) ignores any rank column: it orders each query's documents by score descending and breaks ties
by doc_id *descending*. Two ways to build a run therefore exist:

* ``read_trec_run`` and ``run_from_table(table, order="score")`` keep the raw scores, so a run is evaluated
  exactly as trec_eval would evaluate it (this is what reproduces trec_eval's reference output);
* ``run_from_table(table)`` (``order="rank"``, the default for our RUN_SCHEMA tables) gives every document the
  score ``-rank``, so the evaluated order is the stored rank order, whatever the scores and their ties (our
  runs break score ties by doc_id ascending, and float32 scores tie more often than the scores they came from).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import pyarrow as pa

from diffret.schemas import RUN_SCHEMA

Qrels = dict[str, dict[str, int]]
Run = dict[str, dict[str, float]]
PathLike = str | os.PathLike[str]

# ------------------------------------------------------------------------------------- TREC files


def _records(path: PathLike, n_fields: int, what: str, extra_ok: bool = False) -> Iterator[tuple[int, list[str]]]:
    """(line number, first ``n_fields`` fields) of a whitespace-separated TREC file; blank lines and ``#``
    comment lines are skipped; with ``extra_ok`` further fields are ignored (as trec_eval does for runs)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            fields = text.split()
            if len(fields) < n_fields or (len(fields) > n_fields and not extra_ok):
                need = f"at least {n_fields}" if extra_ok else str(n_fields)
                raise ValueError(
                    f"{path}:{lineno}: a {what} line needs {need} whitespace-separated fields, got "
                    f"{len(fields)}: {text[:200]!r}"
                )
            yield lineno, fields[:n_fields]


def read_trec_run(path: PathLike) -> Run:
    """A TREC run file (``qid Q0 docid rank score tag``) with its raw scores. As in trec_eval, the rank column is
    ignored, fields after the tag are ignored and lines starting with ``#`` are comments."""
    run: Run = {}
    for lineno, (qid, _q0, doc, _rank, score_text, _tag) in _records(path, 6, "run", extra_ok=True):
        try:
            score = float(score_text)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: score {score_text!r} is not a number") from None
        if math.isnan(score):
            raise ValueError(f"{path}:{lineno}: score is NaN")
        docs = run.setdefault(qid, {})
        if doc in docs:
            raise ValueError(f"{path}:{lineno}: document {doc!r} appears twice for query {qid!r}")
        docs[doc] = score
    return run


def run_file_format(path: PathLike, fmt: str = "auto") -> Literal["trec", "parquet"]:
    """A run file's format: ``parquet`` by its magic bytes (or ``fmt``), else ``trec``.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".run", delete=False) as f:
    ...     _ = f.write("q1 Q0 d1 1 2.5 tag\\n")
    >>> run_file_format(f.name)
    'trec'
    """
    if fmt in ("trec", "parquet"):
        return fmt  # type: ignore[return-value]
    if fmt != "auto":
        raise ValueError(f"run file format must be auto, trec or parquet, not {fmt!r}")
    with open(path, "rb") as f:
        return "parquet" if f.read(4) == b"PAR1" else "trec"


RunRow = tuple[str, str, str, float, int | None]  # (where: "file:line", query_id, doc_id, score, rank or None)


def iter_run_file(path: PathLike, fmt: str = "auto") -> Iterator[RunRow]:
    """The rows of a run made elsewhere, each with where it is (``file:line``, a Parquet file's ``file:row N``):
    a TREC file (``qid Q0 docid rank score tag``) or a Parquet table with ``query_id``, ``doc_id``, ``score`` and
    optionally ``rank``. A score that is not a finite number, a non-integer rank and a (query, document) pair given
    twice are refused as a ValueError naming where.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".run", delete=False) as f:
    ...     _ = f.write("q1 Q0 d1 1 2.5 tag\\nq1 Q0 d2 2 x tag\\n")
    >>> try:
    ...     list(iter_run_file(f.name))
    ... except ValueError as exc:
    ...     print(str(exc).split(": ", 1)[1])
    score 'x' is not a number (the fifth field of qid Q0 docid rank score tag)
    """
    seen: dict[tuple[str, str], str] = {}
    for where, qid, doc, score_text, rank_text in _run_records(path, run_file_format(path, fmt)):
        try:
            score = float(score_text)
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}: score {score_text!r} is not a number (the fifth field of qid Q0 docid rank score tag)"
            ) from None
        if not math.isfinite(score):
            raise ValueError(f"{where}: score {score_text!r} is not a finite number")
        rank = None
        if rank_text is not None:
            try:
                rank = int(rank_text)
            except (TypeError, ValueError):
                raise ValueError(f"{where}: rank {rank_text!r} is not an integer") from None
        key = (qid, doc)
        if key in seen:
            raise ValueError(
                f"{where}: document {doc!r} appears twice for query {qid!r} (first at {seen[key]}); a "
                "run lists each (query, document) pair once"
            )
        seen[key] = where
        yield where, qid, doc, score, rank


def _run_records(path: PathLike, fmt: str) -> Iterator[tuple[str, str, str, Any, Any]]:
    if fmt == "trec":
        for lineno, (qid, _q0, doc, rank, score, _tag) in _records(path, 6, "run", extra_ok=True):
            yield f"{path}:{lineno}", qid, doc, score, rank
        return
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None
    missing = [c for c in ("query_id", "doc_id", "score") if c not in table.schema.names]
    if missing:
        raise ValueError(
            f"{path}: a Parquet run needs columns query_id, doc_id, score (and optionally rank); it lacks "
            f"{missing} (it has {table.schema.names})"
        )
    names = ["query_id", "doc_id", "score"] + (["rank"] if "rank" in table.schema.names else [])
    row = 0
    for batch in table.select(names).to_batches(65536):
        cols = [batch.column(c).to_pylist() for c in names]
        ranks = cols[3] if len(cols) == 4 else [None] * batch.num_rows
        for qid, doc, score, rank in zip(cols[0], cols[1], cols[2], ranks, strict=True):
            row += 1
            where = f"{path}:row {row}"
            if qid is None or doc is None or not str(qid).strip() or not str(doc).strip():
                raise ValueError(f"{where}: empty query_id or doc_id")
            yield where, str(qid), str(doc), score, rank


def read_trec_qrels(path: PathLike) -> Qrels:
    """A TREC qrels file (``qid iter docid relevance``, integer relevance). Lines starting with ``#`` are
    comments; a repeated judgment is accepted only when it has the same grade."""
    qrels: Qrels = {}
    for lineno, (qid, _iter, doc, rel_text) in _records(path, 4, "qrels"):
        try:
            rel = int(rel_text)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: relevance {rel_text!r} is not an integer") from None
        docs = qrels.setdefault(qid, {})
        if docs.get(doc, rel) != rel:
            raise ValueError(f"{path}:{lineno}: document {doc!r} of query {qid!r} judged both {docs[doc]} and {rel}")
        docs[doc] = rel
    return qrels


def trec_order(docs: Mapping[str, float]) -> list[tuple[str, float]]:
    """A query's (doc_id, score) pairs in the order trec_eval/pytrec_eval evaluate them: score descending,
    ties by doc_id descending."""
    return sorted(docs.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)


def _check_token(value: str, what: str) -> str:
    if not value or len(value.split()) != 1 or value.startswith("#"):
        raise ValueError(f"{what} {value!r} cannot be written to a TREC file (empty, whitespace or leading '#')")
    return value


def write_trec_run(
    run: pa.Table | pa.RecordBatch | Mapping[str, Mapping[str, float]] | Iterable[tuple[str, str, int, float]],
    path: PathLike,
    tag: str = "diffret",
) -> int:
    """Write a run as ``qid Q0 docid rank score tag`` lines, queries sorted by id, each in rank order; returns
    the number of lines.

    ``run`` is a RUN_SCHEMA table (its ranks are written as they are), an iterable of (query_id, doc_id, rank,
    score) rows, or a run dict (ranked in trec_order). Scores are written at full precision, but trec_eval will
    read the file by score (ties by doc_id descending), not by the rank column.
    """
    _check_token(tag, "tag")
    if isinstance(run, pa.Table | pa.RecordBatch):
        cols = ("query_id", "doc_id", "rank", "score")
        table = pa.Table.from_batches([run]) if isinstance(run, pa.RecordBatch) else run
        require_columns(table, cols, "run")
        table = table.select(list(cols)).sort_by([("query_id", "ascending"), ("rank", "ascending")])
        rows: Iterable[tuple] = table_rows(table, cols, "run")
    elif isinstance(run, Mapping):
        rows = (
            (qid, doc, rank, score) for qid in sorted(run) for rank, (doc, score) in enumerate(trec_order(run[qid]), 1)
        )
    else:
        rows = sorted(run, key=lambda r: (r[0], r[2]))
    n = 0
    tmp = f"{os.fspath(path)}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            last_qid = None
            for qid, doc, rank, score in rows:
                if qid != last_qid:
                    last_qid = _check_token(qid, "query_id")
                f.write(f"{qid} Q0 {_check_token(doc, 'doc_id')} {int(rank)} {float(score)!r} {tag}\n")
                n += 1
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return n


# ---------------------------------------------------------------------------------- Arrow converters


def require_columns(table: pa.Table | pa.RecordBatch, names: Sequence[str], what: str) -> None:
    """Refuse ``table`` (a ``what`` table) unless it has the columns ``names``, none of them with nulls.

    >>> require_columns(pa.table({"qid": ["q1"]}), ["qid", "docid"], "run")
    Traceback (most recent call last):
    ...
    ValueError: run table lacks column(s) ['docid']; it has ['qid']
    """
    missing = [c for c in names if c not in table.schema.names]
    if missing:
        raise ValueError(f"{what} table lacks column(s) {missing}; it has {table.schema.names}")
    for name in names:
        if table.column(name).null_count:
            raise ValueError(f"{what} table has {table.column(name).null_count} null(s) in column {name!r}")


def table_rows(
    table: pa.Table | pa.RecordBatch, names: Sequence[str], what: str, chunk: int = 65536
) -> Iterator[tuple]:
    """The rows of some columns as Python tuples, converted a slice at a time (bounded memory on big runs)."""
    require_columns(table, names, what)

    def gen() -> Iterator[tuple]:
        for start in range(0, table.num_rows, chunk):
            part = table.slice(start, chunk)
            yield from zip(*(part.column(c).to_pylist() for c in names), strict=True)

    return gen()


def qrels_from_table(table: pa.Table | pa.RecordBatch) -> Qrels:
    """Qrels from a table with query_id, doc_id, relevance (other columns such as split are ignored: filter
    the split first). A repeated (query, doc) pair must carry the same grade."""
    qrels: Qrels = {}
    for qid, doc, rel in table_rows(table, ("query_id", "doc_id", "relevance"), "qrels"):
        docs = qrels.setdefault(qid, {})
        rel = int(rel)
        if docs.get(doc, rel) != rel:
            raise ValueError(f"qrels: document {doc!r} of query {qid!r} judged both {docs[doc]} and {rel}")
        docs[doc] = rel
    return qrels


def run_from_table(table: pa.Table | pa.RecordBatch, order: Literal["rank", "score"] = "rank") -> Run:
    """A run dict from a RUN_SCHEMA table.

    ``order="rank"`` (default): each document gets score ``-rank``, so pytrec_eval evaluates the stored rank
    order exactly (ranks must be unique within a query). ``order="score"``: the stored scores, evaluated as
    trec_eval would (score descending, ties by doc_id descending; the rank column is then ignored).
    """
    if order not in ("rank", "score"):
        raise ValueError(f"order must be 'rank' or 'score', not {order!r}")
    run: Run = {}
    sign = -1.0 if order == "rank" else 1.0
    for qid, doc, val in table_rows(table, ("query_id", "doc_id", order), "run"):
        docs = run.setdefault(qid, {})
        if doc in docs:
            raise ValueError(f"run: document {doc!r} appears twice for query {qid!r}")
        docs[doc] = sign * float(val)
    if order == "rank":
        for qid, docs in run.items():
            if len(set(docs.values())) != len(docs):
                raise ValueError(f"run: query {qid!r} has repeated ranks; ranks must be unique within a query")
    return run


def run_to_table(run: Mapping[str, Mapping[str, float]]) -> pa.Table:
    """A RUN_SCHEMA table from a run dict, ranked in trec_order (score descending, ties by doc_id descending) so
    that ``run_from_table`` of it evaluates like the dict; queries sorted by id. Scores are cast to float32."""
    qcol: list[str] = []
    dcol: list[str] = []
    rcol: list[int] = []
    scol: list[float] = []
    for qid in sorted(run):
        ranked = trec_order(run[qid])
        qcol.extend([qid] * len(ranked))
        dcol.extend(doc for doc, _ in ranked)
        rcol.extend(range(1, len(ranked) + 1))
        scol.extend(score for _, score in ranked)
    arrays = [pa.array(qcol, pa.string()), pa.array(dcol, pa.string())]
    arrays += [pa.array(rcol, pa.int32()), pa.array(scol, pa.float64()).cast(pa.float32())]
    return pa.Table.from_arrays(arrays, schema=RUN_SCHEMA)
