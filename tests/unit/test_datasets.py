"""Reading, validating and materialising collections (inline fixtures; no ../shared needed)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import write_beir

from diffret.retrieval.data.collections import DatasetError
from diffret.retrieval.data.sources import resolve_source
from diffret.stages.download import materialise
from diffret.storage import ArtifactStore, ConfigDriftError
from diffret.storage.sql import DamagedFolderWarning, StoreSQL


def _download(
    tmp_path: Path,
    folder: Path,
    name: str = "tiny",
    root: Path | None = None,
    force: bool = False,
    unknown: str = "error",
):
    files = resolve_source(name, str(folder), tmp_path / "cache")
    return materialise(ArtifactStore(root or tmp_path / "store"), name, files, force=force, unknown_judgments=unknown)


def test_tiny_collection_tables(tmp_path, tiny_beir):
    res = _download(tmp_path, tiny_beir)
    assert res.status == "written"
    base = tmp_path / "store" / "datasets" / "dataset=tiny"
    corpus = pq.read_table(base / "corpus.parquet").to_pylist()
    assert [d["doc_id"] for d in corpus] == ["d1", "d2", "d3"]
    assert json.loads(corpus[1]["metadata"]) == {"year": 2020} and corpus[0]["metadata"] is None
    queries = pq.read_table(base / "queries.parquet").to_pylist()
    assert {(q["query_id"], q["split"]) for q in queries} == {
        ("q1", "test"),
        ("q2", "test"),
        ("q2", "train"),
        ("q3", None),
    }
    qrels = pq.read_table(base / "qrels.parquet").to_pylist()
    assert {(r["query_id"], r["doc_id"], r["relevance"], r["split"]) for r in qrels} == {
        ("q1", "d1", 1, "test"),
        ("q2", "d2", 2, "test"),
        ("q2", "d1", 0, "train"),
    }
    # empty texts are kept, counted and reported
    assert any("1 with empty text" in line and "d3" in line for line in res.report_lines)
    assert any("1 judged in no split" in line for line in res.report_lines)


def test_second_run_is_a_no_op(tmp_path, tiny_beir):
    _download(tmp_path, tiny_beir)
    manifest = (tmp_path / "store" / "datasets" / "dataset=tiny" / "_manifest.json").read_bytes()
    res = _download(tmp_path, tiny_beir)
    assert res.status == "unchanged" and "nothing to do" in res.report_lines[0]
    assert (tmp_path / "store" / "datasets" / "dataset=tiny" / "_manifest.json").read_bytes() == manifest


def test_changed_source_is_config_drift_until_forced(tmp_path, tiny_beir):
    _download(tmp_path, tiny_beir)
    with open(tiny_beir / "queries.jsonl", "a") as f:
        f.write(json.dumps({"_id": "q9", "text": "new"}) + "\n")
    with pytest.raises(ConfigDriftError) as err:
        _download(tmp_path, tiny_beir)
    assert [f for f, _, _ in err.value.differences] == ["source_files.queries.jsonl"]
    assert "--force" in str(err.value)
    assert _download(tmp_path, tiny_beir, force=True).status == "written"


def test_damaged_copy_is_rebuilt(tmp_path, tiny_beir):
    _download(tmp_path, tiny_beir)
    (tmp_path / "store" / "datasets" / "dataset=tiny" / "qrels.parquet").write_bytes(b"garbage")
    res = _download(tmp_path, tiny_beir)
    assert res.status == "written" and any("failed its checksums" in line for line in res.report_lines)
    ArtifactStore(tmp_path / "store").verify("datasets/dataset=tiny")


@pytest.mark.parametrize(
    "corpus_lines, message",
    [
        (['{"_id": "a", "text": "x"}', '{"_id": "b", "text": "y"'], r"corpus.jsonl:2: malformed JSON"),
        (['{"_id": "a", "text": "x"}', '{"title": "no id", "text": "y"}'], r"corpus.jsonl:2: missing field '_id'"),
        (['{"_id": "a", "title": "no text"}'], r"corpus.jsonl:1: missing field 'text'"),
        (['{"_id": "a", "text": 5}'], r"corpus.jsonl:1: field 'text' must be a string"),
        (
            ['{"_id": "a", "text": "x"}', '{"_id": "b", "text": "y"}', '{"_id": "a", "text": "z"}'],
            r"corpus.jsonl:3: duplicate document id 'a' \(first at line 1\)",
        ),
        (['["not", "an", "object"]'], r"corpus.jsonl:1: expected a JSON object"),
    ],
)
def test_malformed_corpus_names_file_line_field(tmp_path, corpus_lines, message):
    folder = write_beir(tmp_path / "bad", None, [{"_id": "q", "text": "q"}], {"test": [("q", "a", 1)]})
    (folder / "corpus.jsonl").write_text("\n".join(corpus_lines) + "\n")
    with pytest.raises(DatasetError, match=message):
        _download(tmp_path, folder, name="bad")
    assert not (tmp_path / "store" / "datasets" / "dataset=bad").exists()


def test_invalid_utf8_names_line(tmp_path):
    folder = write_beir(
        tmp_path / "bad", [{"_id": "a", "text": "x"}], [{"_id": "q", "text": "q"}], {"test": [("q", "a", 1)]}
    )
    with open(folder / "queries.jsonl", "ab") as f:
        f.write(b'{"_id": "q2", "text": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match=r"queries.jsonl:2: invalid UTF-8"):
        _download(tmp_path, folder, name="bad")


def test_duplicate_query_id_in_one_file(tmp_path):
    folder = write_beir(
        tmp_path / "bad",
        [{"_id": "a", "text": "x"}],
        [{"_id": "q", "text": "q"}, {"_id": "q", "text": "q"}],
        {"test": [("q", "a", 1)]},
    )
    with pytest.raises(DatasetError, match=r"queries.jsonl:2: duplicate query id 'q' \(first at .*queries.jsonl:1\)"):
        _download(tmp_path, folder, name="bad")


def test_qrels_unknown_ids_are_counted_and_left_out(tmp_path):
    folder = write_beir(
        tmp_path / "c",
        [{"_id": "a", "text": "x"}, {"_id": "b", "text": "y"}],
        [{"_id": "q", "text": "q"}],
        {"test": [("q", "a", 1), ("q", "zzz", 1), ("nope", "a", 1), ("q", "a", 1), ("q", "b", 0)]},
    )
    # by default a judgment of a document the corpus lacks is an error, and nothing is stored
    with pytest.raises(DatasetError, match=r"test.tsv: 1 judgment\(s\) name documents not in the corpus \(e.g. zzz\)"):
        _download(tmp_path, folder, name="c")
    assert not (tmp_path / "store" / "datasets" / "dataset=c").exists()
    res = _download(tmp_path, folder, name="c", unknown="drop")
    rep = res.manifest.stats["report"]["splits"]["test"]
    assert (rep["rows"], rep["unknown_doc_rows"], rep["unknown_query_rows"], rep["duplicate_rows"]) == (2, 1, 1, 1)
    assert rep["unknown_doc_examples"] == ["zzz"] and rep["unknown_query_examples"] == ["nope"]
    line = next(x for x in res.report_lines if x.startswith("qrels[test]"))
    assert "1 naming unknown queries" in line and "1 naming unknown documents" in line
    # keep (BEIR's evaluation keeps them: they count in the ideal DCG) is another config: drift unless forced
    with pytest.raises(ConfigDriftError):
        _download(tmp_path, folder, name="c", unknown="keep")
    res = _download(tmp_path, folder, name="c", unknown="keep", force=True)
    qrels = pq.read_table(tmp_path / "store" / "datasets" / "dataset=c" / "qrels.parquet")
    assert sorted(qrels.column("doc_id").to_pylist()) == ["a", "b", "zzz"]
    line = next(x for x in res.report_lines if x.startswith("qrels[test]"))
    assert "kept: 1 naming documents not in the corpus" in line


@pytest.mark.parametrize(
    ("empty", "message"),
    [("corpus.jsonl", "corpus.jsonl: no documents"), ("queries.jsonl", "queries.jsonl: no queries")],
)
def test_empty_corpus_or_queries_file_is_an_error(tmp_path, empty, message):
    folder = write_beir(
        tmp_path / "c", [{"_id": "a", "text": "x"}], [{"_id": "q", "text": "q"}], {"test": [("q", "a", 1)]}
    )
    (folder / empty).write_bytes(b"" if empty == "corpus.jsonl" else b"\n  \n")  # 0 bytes; blank lines only
    with pytest.raises(DatasetError, match=message):
        _download(tmp_path, folder, name="c")
    assert not (tmp_path / "store" / "datasets" / "dataset=c").exists()


def test_qrels_conflicting_grades_and_bad_rows(tmp_path):
    folder = write_beir(
        tmp_path / "c",
        [{"_id": "a", "text": "x"}],
        [{"_id": "q", "text": "q"}],
        {"test": [("q", "a", 1), ("q", "a", 2)]},
    )
    with pytest.raises(DatasetError, match=r"test.tsv:3: query 'q' / document 'a' judged 2 here and 1 at line 2"):
        _download(tmp_path, folder, name="c")
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq\ta\thigh\n")
    with pytest.raises(DatasetError, match=r"test.tsv:2: field 'score' must be an integer"):
        _download(tmp_path, folder, name="c")
    (folder / "qrels" / "test.tsv").write_text("q\ta\n")
    with pytest.raises(DatasetError, match=r"test.tsv:1: expected"):
        _download(tmp_path, folder, name="c")


def test_split_with_no_known_ids_is_an_error(tmp_path):
    folder = write_beir(
        tmp_path / "c", [{"_id": "a", "text": "x"}], [{"_id": "q", "text": "q"}], {"test": [("q", "other", 1)]}
    )
    with pytest.raises(DatasetError, match="right corpus"):
        _download(tmp_path, folder, name="c")


def test_trec_and_tsv_formats_and_gzip(tmp_path):
    """MS MARCO style: collection.tsv, queries tsv(.gz), TREC 4-column qrels."""
    from diffret.retrieval.data.collections import DatasetReport, DocIds, build_qrels, read_corpus, read_queries

    (tmp_path / "collection.tsv").write_text("0\tfirst passage\n1\tsecond\tpassage with a tab\n")
    with gzip.open(tmp_path / "q.tsv.gz", "wt") as f:
        f.write("100\thow many\n200\twhat is\n")
    (tmp_path / "qrels.txt").write_text("100 0 1 2\n200 Q0 0 0\n")
    rep = DatasetReport("m")
    ids = DocIds()
    rows = [r for b in read_corpus(tmp_path / "collection.tsv", "tsv", rep, ids) for r in b.to_pylist()]
    assert rows[1]["text"] == "second\tpassage with a tab" and len(ids) == 2 and "0" in ids and "1" in ids
    queries: dict = {}
    read_queries(tmp_path / "q.tsv.gz", "tsv", queries, rep)
    assert queries["200"].text == "what is"
    table, judged = build_qrels({"test": tmp_path / "qrels.txt"}, queries, ids, rep)
    assert table.to_pylist()[0] == {"query_id": "100", "doc_id": "1", "relevance": 2, "split": "test"}
    assert judged == {"test": {"100", "200"}}


def test_unknown_collection_and_missing_source(tmp_path):
    with pytest.raises(DatasetError, match="unknown collection 'nosuch'"):
        resolve_source("nosuch", None, tmp_path)
    with pytest.raises(DatasetError, match="does not exist"):
        resolve_source("x", str(tmp_path / "absent"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="not a BEIR-layout folder"):
        resolve_source("x", str(tmp_path / "empty"), tmp_path)


def test_sql_views_see_only_complete_stages(tmp_path, tiny_beir):
    root = tmp_path / "store"
    root.mkdir()
    with StoreSQL(ArtifactStore(root)) as db:  # empty store: views exist, zero rows
        assert db.query("select count(*) from corpus")[1] == [(0,)]
        assert db.query("select count(*) from manifests")[1] == [(0,)]
    _download(tmp_path, tiny_beir, root=root)
    # a folder of files without a manifest is damage: the view that would read it leaves it out, with a warning
    # naming it; the complete folders are read
    stray = root / "datasets" / "dataset=stray"
    stray.mkdir(parents=True)
    shutil.copy(root / "datasets" / "dataset=tiny" / "corpus.parquet", stray / "corpus.parquet")
    with StoreSQL(ArtifactStore(root)) as db:
        with pytest.warns(DamagedFolderWarning, match="dataset=stray.*files without a manifest"):
            assert db.query("select dataset, count(*) from corpus group by 1")[1] == [("tiny", 3)]
    shutil.rmtree(stray)
    with StoreSQL(ArtifactStore(root)) as db:
        assert db.query("select dataset, count(*) from corpus group by 1")[1] == [("tiny", 3)]
        cols, rows = db.query("select split, judged_queries, judgments from dataset_summary order by 1")
        assert rows == [("test", 2, 2), ("train", 1, 1)]
        assert db.query("select stage, file, rows from artifact_files order by file")[1] == [
            ("datasets", "corpus.parquet", 3),
            ("datasets", "qrels.parquet", 3),
            ("datasets", "queries.parquet", 4),
        ]
