"""Training groups in Tevatron's format: one query, its positive passages and its hard negatives.

Pure domain code. Groups come either from a Tevatron file (jsonl, jsonl.gz or Parquet with ``query_id``,
``query``, ``positive_passages``, ``negative_passages``; each passage ``{docid, title, text}``; the format of
MS MARCO passage-aug, which the paper trains on), validated with errors that name the file and the line, or
are mined from a ranked list: the top ``depth`` minus the positives, ``n_negatives`` sampled per query.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from diffret.schemas import GROUPS_SCHEMA

from .collections import DatasetError, iter_lines, parse_json_object

Passage = dict[str, str]  # {"docid", "title", "text"}


@dataclass
class Group:
    query_id: str
    query: str
    positives: list[Passage]
    negatives: list[Passage]


@dataclass
class MiningReport:
    """What mining counted: nothing is dropped silently."""

    queries: int = 0  # judged train queries
    groups: int = 0  # groups written
    positives_missing: int = 0  # judged positives not in the corpus (left out of their group)
    no_positive: int = 0  # queries left without a positive (no group)
    no_run: int = 0  # queries the run does not rank (no group)
    no_negative: int = 0  # queries whose top ``depth`` holds only positives (no group)
    short: int = 0  # groups with fewer than ``n_negatives`` distinct candidates (stored as they are, no duplicates)
    negatives_short: int = 0  # negatives those groups lack in all
    examples: dict[str, list[str]] = field(default_factory=dict)

    def note(self, what: str, qid: str) -> None:
        setattr(self, what, getattr(self, what) + 1)
        ex = self.examples.setdefault(what, [])
        if len(ex) < 5:
            ex.append(qid)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def sample_fill(rng: random.Random, items: Sequence[Any], n: int) -> list[Any]:
    """``n`` of ``items``: sampled without replacement, or all of them then drawn with replacement when fewer.

    >>> sample_fill(random.Random(0), ["a"], 3)
    ['a', 'a', 'a']
    """
    if len(items) >= n:
        return rng.sample(list(items), n)
    return list(items) + [rng.choice(items) for _ in range(n - len(items))] if items else []


def _passage(path: Path, where: str, obj: Any) -> Passage:
    if not isinstance(obj, Mapping):
        raise DatasetError(f"{path}:{where}: a passage must be an object with docid, title, text; got {obj!r:.60}")
    if "docid" not in obj or obj["docid"] in (None, ""):
        raise DatasetError(f"{path}:{where}: a passage has no 'docid'")
    text = obj.get("text")
    if not isinstance(text, str):
        raise DatasetError(f"{path}:{where}: passage {obj['docid']!r}: 'text' must be a string")
    title = obj.get("title") or ""
    if not isinstance(title, str):
        raise DatasetError(f"{path}:{where}: passage {obj['docid']!r}: 'title' must be a string")
    return {"docid": str(obj["docid"]), "title": title, "text": text}


def parse_group(path: Path, where: str, obj: Mapping[str, Any]) -> Group:
    """One Tevatron record; a DatasetError naming ``path:where`` and the field when it is malformed."""
    for name in ("query_id", "query", "positive_passages"):
        if name not in obj or obj[name] is None:
            raise DatasetError(f"{path}:{where}: missing field {name!r}")
    if not isinstance(obj["query"], str) or not obj["query"].strip():
        raise DatasetError(f"{path}:{where}: field 'query' must be a non-empty string")
    lists = {}
    for name in ("positive_passages", "negative_passages"):
        value = obj.get(name) or []
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise DatasetError(f"{path}:{where}: field {name!r} must be a list of passages")
        lists[name] = [_passage(path, where, p) for p in value]
    if not lists["positive_passages"]:
        raise DatasetError(f"{path}:{where}: query {obj['query_id']!r} has no positive passage")
    return Group(str(obj["query_id"]), obj["query"], lists["positive_passages"], lists["negative_passages"])


def read_tevatron(path: Path) -> Iterator[Group]:
    """The groups of a Tevatron file (``.jsonl``, ``.jsonl.gz``, ``.json`` lines or ``.parquet``), in file order.

    >>> import json, tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "train.jsonl"
    >>> _ = p.write_text(json.dumps({"query_id": "1", "query": "cats", "positive_passages": [
    ...     {"docid": "d1", "title": "", "text": "cats purr"}], "negative_passages": []}) + "\\n")
    >>> [(g.query_id, len(g.positives), len(g.negatives)) for g in read_tevatron(p)]
    [('1', 1, 0)]
    """
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file")
    seen: dict[str, str] = {}
    if path.suffix == ".parquet":
        rows = ((f"row {i + 1}", r) for i, r in enumerate(pq.read_table(path).to_pylist()))
    else:
        rows = ((str(n), parse_json_object(path, n, line)) for n, line in iter_lines(path))
    for where, obj in rows:
        g = parse_group(path, where, obj)
        if g.query_id in seen:
            raise DatasetError(f"{path}:{where}: query_id {g.query_id!r} repeats (first at {seen[g.query_id]})")
        seen[g.query_id] = where
        yield g


def mine_groups(
    queries: Mapping[str, str],
    positives: Mapping[str, Sequence[str]],
    ranked: Mapping[str, Sequence[str]],
    passage: Mapping[str, tuple[str, str]],
    depth: int = 30,
    n_negatives: int = 15,
    seed: int = 0,
) -> tuple[list[Group], MiningReport]:
    """Groups from a ranked list: per judged query, the top ``depth`` minus its positives, ``n_negatives``
    sampled without replacement; when fewer are left, all of them (never a duplicate stored as another negative:
    counted as ``short``, and the negatives missing as ``negatives_short``).

    ``positives`` maps a query to its relevant doc ids; ``ranked`` a query to its run, best first;
    ``passage`` a doc id to (title, text). Sampling is seeded per query, so a group does not depend on the
    others.

    >>> groups, rep = mine_groups({"q": "cats"}, {"q": ["d1"]}, {"q": ["d1", "d2", "d3"]},
    ...                           {"d1": ("", "a"), "d2": ("", "b"), "d3": ("", "c")}, depth=3, n_negatives=2)
    >>> [p["docid"] for p in groups[0].positives], sorted(p["docid"] for p in groups[0].negatives), rep.short
    (['d1'], ['d2', 'd3'], 0)
    >>> groups, rep = mine_groups({"q": "cats"}, {"q": ["d1"]}, {"q": ["d1", "d2", "d3"]},
    ...                           {"d1": ("", "a"), "d2": ("", "b"), "d3": ("", "c")}, depth=3, n_negatives=1000)
    >>> len(groups[0].negatives), rep.short, rep.negatives_short
    (2, 1, 998)
    """
    if depth <= 0 or n_negatives <= 0:
        raise ValueError(f"depth and n_negatives must be positive (got {depth}, {n_negatives})")
    report = MiningReport(queries=len(positives))
    out = []
    for qid, rel in positives.items():
        pos = [d for d in dict.fromkeys(rel) if d in passage]
        for _ in range(len(set(rel)) - len(pos)):
            report.note("positives_missing", qid)
        if not pos:
            report.note("no_positive", qid)
            continue
        if qid not in ranked:
            report.note("no_run", qid)
            continue
        rel_set = set(rel)
        cands = [d for d in ranked[qid][:depth] if d not in rel_set and d in passage]
        if not cands:
            report.note("no_negative", qid)
            continue
        if len(cands) < n_negatives:
            report.note("short", qid)
            report.negatives_short += n_negatives - len(cands)
        negs = random.Random(f"{seed}:{qid}").sample(cands, min(n_negatives, len(cands)))
        as_passage = lambda d: {"docid": d, "title": passage[d][0], "text": passage[d][1]}  # noqa: E731
        out.append(Group(qid, queries[qid], [as_passage(d) for d in pos], [as_passage(d) for d in negs]))
    report.groups = len(out)
    return out, report


def drop_repeated_negatives(groups: Sequence[Group]) -> int:
    """Keep each group's first copy of a negative (a file that repeats one would train on it as two); how many were
    dropped.

    >>> g = Group("q", "cats", [], [{"docid": "a", "title": "", "text": "x"}] * 3)
    >>> drop_repeated_negatives([g]), len(g.negatives)
    (2, 1)
    """
    dropped = 0
    for g in groups:
        kept = list({p["docid"]: p for p in reversed(g.negatives)}.values())[::-1]
        dropped += len(g.negatives) - len(kept)
        g.negatives = kept
    return dropped


def groups_from_table(table: pa.Table) -> list[Group]:
    """The groups of a ``GROUPS_SCHEMA`` table (the inverse of :func:`groups_table`)."""
    return [Group(r["query_id"], r["query"], r["positive_passages"], r["negative_passages"]) for r in table.to_pylist()]


def groups_table(groups: Sequence[Group]) -> pa.Table:
    """Groups as a table of ``diffret.schemas.GROUPS_SCHEMA``."""
    return pa.table(
        {
            "query_id": [g.query_id for g in groups],
            "query": [g.query for g in groups],
            "positive_passages": [g.positives for g in groups],
            "negative_passages": [g.negatives for g in groups],
        },
        schema=GROUPS_SCHEMA,
    )
