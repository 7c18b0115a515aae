"""Training groups: Tevatron files validated line by line, negatives mined from a ranked list, the stage."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffret.retrieval.data.collections import DatasetError
from diffret.retrieval.data.training import groups_table, mine_groups, read_tevatron
from diffret.schemas import GROUPS_SCHEMA
from diffret.stages import execute, stages
from diffret.stages.training_data import TrainingDataConfig
from diffret.storage import ArtifactStore
from diffret.storage.layout import GROUPS_FILE, training_dir
from diffret.storage.sql import StoreSQL


def passage(d: str) -> dict:
    return {"docid": d, "title": f"T{d}", "text": f"text of {d}"}


def record(q: str, pos: list[str], neg: list[str]) -> dict:
    return {
        "query_id": q,
        "query": f"query {q}",
        "positive_passages": [passage(d) for d in pos],
        "negative_passages": [passage(d) for d in neg],
    }


def write_jsonl(path: Path, rows: list) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def test_tevatron_jsonl_gz_and_parquet_read_the_same(tmp_path):
    rows = [record("1", ["a"], ["b", "c"]), record("2", ["d", "e"], [])]
    gz = write_jsonl(tmp_path / "train.jsonl.gz", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    a, b = list(read_tevatron(gz)), list(read_tevatron(tmp_path / "train.parquet"))
    assert [(g.query_id, len(g.positives), len(g.negatives)) for g in a] == [("1", 1, 2), ("2", 2, 0)]
    assert a == b
    t = groups_table(a)
    assert t.schema == GROUPS_SCHEMA and t.column("positive_passages").to_pylist()[0] == [passage("a")]


@pytest.mark.parametrize(
    "bad,message",
    [
        ("{not json", "train.jsonl:2: malformed JSON"),
        (json.dumps({"query": "x", "positive_passages": [passage("a")]}), "train.jsonl:2: missing field 'query_id'"),
        (json.dumps(record("9", [], ["b"])), "train.jsonl:2: query '9' has no positive passage"),
        (
            json.dumps({**record("9", ["a"], []), "positive_passages": [{"title": "t", "text": "x"}]}),
            "train.jsonl:2: a passage has no 'docid'",
        ),
        (
            json.dumps({**record("9", ["a"], []), "negative_passages": "b"}),
            "train.jsonl:2: field 'negative_passages' must be a list",
        ),
        (json.dumps(record("1", ["a"], [])), "train.jsonl:2: query_id '1' repeats (first at 1)"),
    ],
)
def test_malformed_tevatron_names_file_and_line(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "train.jsonl", [record("1", ["a"], ["b"]), bad])
    with pytest.raises(DatasetError) as err:
        list(read_tevatron(path))
    assert message in str(err.value)


def test_mining_takes_the_top_depth_minus_positives_and_counts_every_gap():
    docs = {f"d{i}": ("", f"doc {i}") for i in range(40)}
    queries = {q: f"text {q}" for q in ("full", "short", "gone", "unranked", "allpos")}
    positives = {"full": ["d0", "d39x"], "short": ["d1"], "gone": ["nope"], "unranked": ["d2"], "allpos": ["d3"]}
    ranked = {
        "full": [f"d{i}" for i in range(40)],  # d0 is a positive; the top 30 leave 29 candidates
        "short": ["d1", "d5", "d6"],  # 2 candidates for 4 negatives
        "allpos": ["d3"],
    }
    groups, rep = mine_groups(queries, positives, ranked, docs, depth=30, n_negatives=4, seed=7)
    by = {g.query_id: g for g in groups}
    assert set(by) == {"full", "short"}
    full = [p["docid"] for p in by["full"].negatives]
    assert len(full) == len(set(full)) == 4 and set(full) <= {f"d{i}" for i in range(1, 30)}
    assert [p["docid"] for p in by["full"].positives] == ["d0"]
    assert sorted(p["docid"] for p in by["short"].negatives) == ["d5", "d6"]  # the 2 there are, no duplicates
    assert (
        rep.queries,
        rep.groups,
        rep.positives_missing,
        rep.no_positive,
        rep.no_run,
        rep.no_negative,
        rep.short,
        rep.negatives_short,
    ) == (5, 2, 2, 1, 1, 1, 1, 2)
    assert rep.examples["no_run"] == ["unranked"]
    again, _ = mine_groups(queries, positives, ranked, docs, depth=30, n_negatives=4, seed=7)
    assert again == groups  # seeded per query
    other, _ = mine_groups(queries, positives, ranked, docs, depth=30, n_negatives=4, seed=8)
    assert other != groups
    with pytest.raises(ValueError, match="positive"):
        mine_groups(queries, positives, ranked, docs, depth=0)


def test_stage_from_a_tevatron_file_and_a_malformed_one(tmp_path):
    root = str(tmp_path / "store")
    good = write_jsonl(tmp_path / "good.jsonl", [record("1", ["a"], ["b"]), record("2", ["c"], ["d", "e"])])
    res = execute(stages()["training-data"], TrainingDataConfig(root=root, source=str(good)), log=lambda _: None)
    assert res.done == 1
    store = ArtifactStore(root)
    m = store.read_manifest(training_dir("good"))
    assert m.stats["groups"] == 2 and m.config["inputs"]["good.jsonl"]
    with StoreSQL(store) as db:
        _, rows = db.query('select "set", query_id, n_positives, n_negatives from training_groups order by 2')
    assert rows == [("good", "1", 1, 1), ("good", "2", 1, 2)]
    again = execute(stages()["training-data"], TrainingDataConfig(root=root, source=str(good)), log=lambda _: None)
    assert (again.done, again.skipped) == (0, 1)
    bad = write_jsonl(tmp_path / "bad.jsonl", [record("1", ["a"], ["b"]), "{oops"])
    with pytest.raises(DatasetError, match="bad.jsonl:2: malformed JSON"):
        execute(stages()["training-data"], TrainingDataConfig(root=root, source=str(bad)), log=lambda _: None)
    assert store.read_manifest(training_dir("bad")) is None and not store.exists(f"{training_dir('bad')}/{GROUPS_FILE}")
    with pytest.raises(ValueError, match="exactly one of source"):
        TrainingDataConfig(root=root)
