"""Reading and validating retrieval test collections (BEIR layout, MS MARCO / TREC TSV files).

Pure domain code: files in, Arrow record batches and a report out. Every problem in the input is
either a ``DatasetError`` naming the file, the line and the field, or a counted, reported anomaly
(empty texts, qrels rows naming unknown ids, repeated judgments) — never silently dropped.
"""

from __future__ import annotations

import gzip
import io
import json
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from diffret.schemas import CORPUS_SCHEMA, QRELS_SCHEMA, QUERIES_SCHEMA

BATCH_ROWS = 50_000
TITLE_SEP = ". "  # the reference encoder's passage text: title + ". " + text
_EXAMPLES = 5  # how many example ids a report keeps per anomaly
UNKNOWN_DOCS = ("error", "drop", "keep")  # what to do with judgments of documents the corpus lacks


def passage_text(title: str | None, text: str, sep: str = TITLE_SEP) -> str:
    """A passage as the encoders read it: ``title + sep + text``, the text alone without a title, the title
    alone without a text (the reference encoder's, scripts/encode.py L79-81, and trainer's).

    >>> passage_text("Cats", "They purr.")
    'Cats. They purr.'
    >>> passage_text("", "They purr.", " "), passage_text("Cats", "")
    ('They purr.', 'Cats')
    """
    if not title:
        return text
    return f"{title}{sep}{text}" if text else title


class DatasetError(ValueError):
    """Malformed input; the message starts with ``file:line`` and names the field."""


# ------------------------------------------------------------------------------------------ report
@dataclass
class SplitReport:
    rows: int = 0
    queries: int = 0
    documents: int = 0
    unknown_query_rows: int = 0
    unknown_doc_rows: int = 0
    duplicate_rows: int = 0
    kept_unknown_doc_rows: int = 0  # with unknown_docs="keep"
    unknown_query_examples: list[str] = field(default_factory=list)
    unknown_doc_examples: list[str] = field(default_factory=list)


@dataclass
class DatasetReport:
    dataset: str
    has_corpus: bool = False
    corpus_rows: int = 0
    corpus_empty_text: int = 0
    corpus_empty_examples: list[str] = field(default_factory=list)
    queries: int = 0
    queries_empty_text: int = 0
    queries_empty_examples: list[str] = field(default_factory=list)
    unjudged_queries: int = 0
    judged_empty_text: list[str] = field(default_factory=list)  # judged queries whose text is empty
    splits: dict[str, SplitReport] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)

    def summary_lines(self) -> list[str]:
        if self.has_corpus:
            out = [
                f"corpus: {self.corpus_rows:,} documents"
                + (
                    f" ({self.corpus_empty_text} with empty text, e.g. {self.corpus_empty_examples})"
                    if self.corpus_empty_text
                    else ""
                )
            ]
        else:
            out = ["corpus: none in this source"]
        out.append(
            f"queries: {self.queries:,}"
            + (f" ({self.queries_empty_text} with empty text)" if self.queries_empty_text else "")
            + (f", {self.unjudged_queries:,} judged in no split" if self.unjudged_queries else "")
        )
        for name, s in sorted(self.splits.items()):
            line = f"qrels[{name}]: {s.rows:,} judgments over {s.queries:,} queries"
            dropped = []
            if s.unknown_query_rows:
                dropped.append(f"{s.unknown_query_rows} naming unknown queries (e.g. {s.unknown_query_examples})")
            if s.unknown_doc_rows:
                dropped.append(f"{s.unknown_doc_rows} naming unknown documents (e.g. {s.unknown_doc_examples})")
            if s.duplicate_rows:
                dropped.append(f"{s.duplicate_rows} repeated (query, document) pairs")
            if dropped:
                line += "; left out: " + "; ".join(dropped)
            if s.kept_unknown_doc_rows:
                line += (
                    f"; kept: {s.kept_unknown_doc_rows} naming documents not in the corpus "
                    f"(e.g. {s.unknown_doc_examples})"
                )
            out.append(line)
        out.extend(f"note: {n}" for n in self.notes)
        return out

    def warnings(self) -> list[str]:
        """What a user must see: judged queries with empty text (encoded as the prompt alone, scored like any)."""
        ids = self.judged_empty_text
        if not ids:
            return []
        shown = ", ".join(map(repr, ids[:_EXAMPLES])) + (", ..." if len(ids) > _EXAMPLES else "")
        return [
            f"{self.dataset}: {len(ids)} judged quer{'y has' if len(ids) == 1 else 'ies have'} empty text ({shown}): "
            "encoded as the prompt alone, they rank passages by the prompt and count in every mean; give them a text "
            "or drop their judgments"
        ]


# --------------------------------------------------------------------------------------- line input
def _open_binary(path: Path) -> io.BufferedIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) for every non-blank line; invalid UTF-8 is an error naming the line."""
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: invalid UTF-8 at byte {exc.start} of the line") from None
            line = line.rstrip("\r\n")
            if lineno == 1 and line.startswith("\ufeff"):
                line = line[1:]
            if line.strip():
                yield lineno, line


def parse_json_object(path: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        where = f"column {exc.colno}" if exc.msg.endswith(" at") else f"at column {exc.colno}"
        raise DatasetError(f"{path}:{lineno}: malformed JSON ({exc.msg} {where})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _id_field(path: Path, lineno: int, obj: dict[str, Any], name: str = "_id") -> str:
    if name not in obj:
        raise DatasetError(f"{path}:{lineno}: missing field {name!r}")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise DatasetError(f"{path}:{lineno}: field {name!r} must be a string or an integer, got {value!r}")
    value = str(value).strip()
    if not value:
        raise DatasetError(f"{path}:{lineno}: field {name!r} is empty")
    return value


def _text_field(path: Path, lineno: int, obj: dict[str, Any], name: str, required: bool) -> str:
    if name not in obj:
        if required:
            raise DatasetError(f"{path}:{lineno}: missing field {name!r}")
        return ""
    value = obj[name]
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise DatasetError(f"{path}:{lineno}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _tsv_fields(path: Path, lineno: int, line: str, what: str) -> tuple[str, str]:
    """(id, text) of an ``id<TAB>text`` line; the text keeps any further tabs."""
    parts = line.split("\t")
    if len(parts) < 2:
        raise DatasetError(f"{path}:{lineno}: expected 'id<TAB>text', found no tab")
    rid = parts[0].strip()
    if not rid:
        raise DatasetError(f"{path}:{lineno}: empty {what} id")
    return rid, "\t".join(parts[1:])


def _metadata(obj: dict[str, Any]) -> str | None:
    meta = obj.get("metadata")
    if meta in (None, {}, []):
        return None
    return json.dumps(meta, ensure_ascii=False, sort_keys=True)


# --------------------------------------------------------------------------------------------- corpus
class DocIds:
    """A corpus's document ids in bounded memory: 8 bytes an id (its 64-bit hash; sorted once all are added), not a
    Python set of strings (~100 bytes an id: about 1 GB at MS MARCO's 8.8M). Membership is by hash: a document id
    the corpus lacks is taken for a member only if its hash equals a member's (about 1 in 10^7 for all of MS
    MARCO's judgments); repeated ids are confirmed on the strings (``repeated_hashes``, then a second read).

    >>> ids = DocIds.of(["d1", "d2"])
    >>> "d1" in ids, "d3" in ids, len(ids)
    (True, False, 2)
    """

    def __init__(self) -> None:
        self._added = array("q")
        self._sorted: np.ndarray | None = None

    @classmethod
    def of(cls, ids: Iterable[str]) -> DocIds:
        out = cls()
        for doc_id in ids:
            out.add(doc_id)
        return out

    def add(self, doc_id: str) -> None:
        self._added.append(hash(doc_id))
        self._sorted = None

    def _hashes(self) -> np.ndarray:
        if self._sorted is None:
            self._sorted = np.sort(np.frombuffer(self._added, dtype=np.int64))
        return self._sorted

    def repeated_hashes(self) -> set[int]:
        """Hashes added more than once: repeated ids (or, rarely, two ids of one hash)."""
        h = self._hashes()
        return set(h[1:][h[1:] == h[:-1]].tolist())

    def __contains__(self, doc_id: object) -> bool:
        h = self._hashes()
        i = int(np.searchsorted(h, hash(doc_id)))
        return i < len(h) and int(h[i]) == hash(doc_id)

    def __len__(self) -> int:
        return len(self._added)


def _corpus_ids(path: Path, fmt: str) -> Iterator[tuple[int, str]]:
    """(line, document id) of every document line of a corpus file."""
    for lineno, line in iter_lines(path):
        if fmt == "tsv":
            yield lineno, line.split("\t", 1)[0].strip()
        else:
            try:
                yield lineno, str(json.loads(line).get("_id", "")).strip()
            except (json.JSONDecodeError, AttributeError):
                continue


def _first_repeat(path: Path, fmt: str, hashes: set[int]) -> tuple[str, int, int] | None:
    """The first document id that a corpus file repeats among those of ``hashes``: (id, its first line, the
    repeat's line); None when the hashes only collided."""
    first: dict[str, int] = {}
    for lineno, doc_id in _corpus_ids(path, fmt):
        if hash(doc_id) in hashes:
            if doc_id in first:
                return doc_id, first[doc_id], lineno
            first[doc_id] = lineno
    return None


def read_corpus(path: Path, fmt: str, report: DatasetReport, doc_ids: DocIds) -> Iterator[pa.RecordBatch]:
    """Stream the corpus as record batches of ``CORPUS_SCHEMA``; fills ``doc_ids`` as it goes. A repeated document
    id is an error (naming both lines) once the whole file is read: the batches already yielded must then be
    discarded, as the download stage's staged writer does.

    ``fmt`` is ``jsonl`` (BEIR: ``_id``, ``text``, optional ``title`` and ``metadata``) or ``tsv``
    (MS MARCO ``collection.tsv``: ``id<TAB>text``).
    """
    report.has_corpus = True
    cols: dict[str, list] = {n: [] for n in CORPUS_SCHEMA.names}

    def flush() -> pa.RecordBatch:
        batch = pa.RecordBatch.from_pydict(cols, schema=CORPUS_SCHEMA)
        for v in cols.values():
            v.clear()
        return batch

    for lineno, line in iter_lines(path):
        if fmt == "tsv":
            doc_id, text = _tsv_fields(path, lineno, line, "document")
            title, meta = "", None
        else:
            obj = parse_json_object(path, lineno, line)
            doc_id = _id_field(path, lineno, obj)
            text = _text_field(path, lineno, obj, "text", required=True)
            title = _text_field(path, lineno, obj, "title", required=False)
            meta = _metadata(obj)
        doc_ids.add(doc_id)
        if not text.strip():
            report.corpus_empty_text += 1
            if len(report.corpus_empty_examples) < _EXAMPLES:
                report.corpus_empty_examples.append(doc_id)
        cols["doc_id"].append(doc_id)
        cols["title"].append(title)
        cols["text"].append(text)
        cols["metadata"].append(meta)
        report.corpus_rows += 1
        if len(cols["doc_id"]) >= BATCH_ROWS:
            yield flush()
    if report.corpus_rows == 0:
        raise DatasetError(f"{path}: no documents (the file is empty or blank)")
    repeated = doc_ids.repeated_hashes()
    if repeated and (found := _first_repeat(path, fmt, repeated)) is not None:
        doc_id, first, again = found
        raise DatasetError(f"{path}:{again}: duplicate document id {doc_id!r} (first at line {first})")
    if cols["doc_id"]:
        yield flush()


# -------------------------------------------------------------------------------------------- queries
@dataclass
class Query:
    text: str
    metadata: str | None
    where: str  # file:line, for messages


def read_queries(path: Path, fmt: str, queries: dict[str, Query], report: DatasetReport) -> None:
    """Add the queries of one file to ``queries`` (several files may feed one dataset); a file without any
    query is an error."""
    lineno = 0
    for lineno, line in iter_lines(path):
        if fmt == "tsv":
            qid, text = _tsv_fields(path, lineno, line, "query")
            meta = None
        else:
            obj = parse_json_object(path, lineno, line)
            qid = _id_field(path, lineno, obj)
            text = _text_field(path, lineno, obj, "text", required=True)
            meta = _metadata(obj)
        prev = queries.get(qid)
        if prev is not None:
            if prev.text == text and not prev.where.startswith(f"{path}:"):
                continue  # the same query listed by two source files (e.g. two splits' topic files)
            raise DatasetError(f"{path}:{lineno}: duplicate query id {qid!r} (first at {prev.where})")
        queries[qid] = Query(text, meta, f"{path}:{lineno}")
        if not text.strip():
            report.queries_empty_text += 1
            if len(report.queries_empty_examples) < _EXAMPLES:
                report.queries_empty_examples.append(qid)
    if lineno == 0:
        raise DatasetError(f"{path}: no queries (the file is empty or blank)")


# ---------------------------------------------------------------------------------------------- qrels
_QRELS_HEADER_FIRST = ("query-id", "query_id", "qid")


def read_qrels(path: Path) -> Iterator[tuple[int, str, str, int]]:
    """(line, query id, doc id, relevance) from BEIR 3-column TSV (header optional) or TREC 4-column qrels."""
    first = True
    for lineno, line in iter_lines(path):
        parts = [p.strip() for p in (line.split("\t") if "\t" in line else line.split())]
        if first:
            first = False
            if parts[0].lower() in _QRELS_HEADER_FIRST:
                continue
        if len(parts) == 3:
            qid, did, rel = parts
        elif len(parts) == 4:
            qid, _, did, rel = parts
        else:
            raise DatasetError(
                f"{path}:{lineno}: expected 'query-id<TAB>corpus-id<TAB>score' or TREC 'qid iter docid rel', "
                f"found {len(parts)} fields"
            )
        if not qid or not did:
            raise DatasetError(f"{path}:{lineno}: empty query or document id")
        try:
            relevance = int(rel)
        except ValueError:
            try:
                as_float = float(rel)
            except ValueError:
                as_float = float("nan")
            if as_float != as_float or not as_float.is_integer():
                raise DatasetError(f"{path}:{lineno}: field 'score' must be an integer, got {rel!r}") from None
            relevance = int(as_float)
        if relevance < 0:
            raise DatasetError(
                f"{path}:{lineno}: grade {relevance} is negative; NDCG would count it as a negative gain (TREC's -1 / "
                "-2 'junk' judgments are non-relevant: write them as 0)"
            )
        yield lineno, qid, did, relevance


def build_qrels(
    split_files: dict[str, Path],
    queries: dict[str, Query],
    doc_ids: DocIds | set[str] | None,
    report: DatasetReport,
    unknown_docs: str = "error",
) -> tuple[pa.Table, dict[str, set[str]]]:
    """The qrels table of every split, and the judged query ids per split.

    Rows naming an unknown query are left out and counted. Rows naming a document the corpus lacks follow
    ``unknown_docs``: ``error`` (default: a wrong corpus or a truncated file must not be evaluated silently),
    ``drop`` (left out and counted: then they do not count in the ideal DCG), or ``keep`` (kept and counted, as
    BEIR's own evaluation does). A (query, document) pair judged twice in one split with the same grade is kept
    once and counted; with two different grades it is an error. ``doc_ids=None`` means the corpus is not
    available, so document ids cannot be checked (said in the report).
    """
    if unknown_docs not in UNKNOWN_DOCS:
        raise ValueError(f"unknown_docs must be one of {', '.join(UNKNOWN_DOCS)}, got {unknown_docs!r}")
    cols: dict[str, list] = {n: [] for n in QRELS_SCHEMA.names}
    judged: dict[str, set[str]] = {}
    for split, path in sorted(split_files.items()):
        rep = SplitReport()
        seen: dict[tuple[str, str], tuple[int, int]] = {}
        qids: set[str] = set()
        dids: set[str] = set()
        for lineno, qid, did, rel in read_qrels(path):
            if qid not in queries:
                rep.unknown_query_rows += 1
                if qid not in rep.unknown_query_examples and len(rep.unknown_query_examples) < _EXAMPLES:
                    rep.unknown_query_examples.append(qid)
                continue
            if doc_ids is not None and did not in doc_ids:
                if did not in rep.unknown_doc_examples and len(rep.unknown_doc_examples) < _EXAMPLES:
                    rep.unknown_doc_examples.append(did)
                if unknown_docs == "keep":
                    rep.kept_unknown_doc_rows += 1
                else:
                    rep.unknown_doc_rows += 1
                    continue
            prev = seen.get((qid, did))
            if prev is not None:
                if prev[1] != rel:
                    raise DatasetError(
                        f"{path}:{lineno}: query {qid!r} / document {did!r} judged {rel} here "
                        f"and {prev[1]} at line {prev[0]}"
                    )
                rep.duplicate_rows += 1
                continue
            seen[(qid, did)] = (lineno, rel)
            qids.add(qid)
            dids.add(did)
            cols["query_id"].append(qid)
            cols["doc_id"].append(did)
            cols["relevance"].append(rel)
            cols["split"].append(split)
            rep.rows += 1
        if rep.unknown_doc_rows and rep.rows and unknown_docs == "error":  # none known: "is this the right corpus?"
            raise DatasetError(
                f"{path}: {rep.unknown_doc_rows} judgment(s) name documents not in the corpus (e.g. "
                f"{', '.join(rep.unknown_doc_examples)}); pass --unknown-judgments drop to leave them out, or keep "
                "to keep them (as BEIR's evaluation does)"
            )
        rep.queries, rep.documents = len(qids), len(dids)
        report.splits[split] = rep
        judged[split] = qids
    return pa.Table.from_pydict(cols, schema=QRELS_SCHEMA), judged


def build_queries(queries: dict[str, Query], judged: dict[str, set[str]], report: DatasetReport) -> pa.Table:
    """One row per (query, split that judges it); a query judged nowhere keeps one row with split null."""
    cols: dict[str, list] = {n: [] for n in QUERIES_SCHEMA.names}
    unjudged = 0
    for qid, q in queries.items():
        splits: list[str | None] = [s for s in sorted(judged) if qid in judged[s]] or [None]
        if splits == [None]:
            unjudged += 1
        elif not q.text.strip():
            report.judged_empty_text.append(qid)
        for s in splits:
            cols["query_id"].append(qid)
            cols["text"].append(q.text)
            cols["split"].append(s)
            cols["metadata"].append(q.metadata)
    report.queries = len(queries)
    report.unjudged_queries = unjudged
    return pa.Table.from_pydict(cols, schema=QUERIES_SCHEMA)
