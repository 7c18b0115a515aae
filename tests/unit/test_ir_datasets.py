"""``diffret download`` of ir_datasets ids, offline: a collection registered in ir_datasets from local files is stored
byte-identical to the same files given by --source; the BEIR / MS MARCO / TREC DL ids map to the catalog's collections
and their files come through ir_datasets' download (its cache here: nothing is fetched)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import ir_datasets
from conftest import write_beir
from typer.testing import CliRunner

from diffret.flows.cli import app
from diffret.retrieval.data import sources
from diffret.retrieval.data.sources import IRDS_NAMES, catalog, stored_name
from diffret.storage import ArtifactStore

BEIR_7 = {
    "beir/nq": "nq",
    "beir/hotpotqa/test": "hotpotqa",
    "beir/scifact/test": "scifact",
    "beir/fiqa/test": "fiqa",
    "beir/arguana": "arguana",
    "beir/quora/test": "quora",
    "beir/trec-covid": "trec-covid",
}
MSMARCO = {
    "msmarco-passage/dev/small": "msmarco-passage",
    "msmarco-passage/trec-dl-2019/judged": "trec-dl-2019",
    "msmarco-passage/trec-dl-2020/judged": "trec-dl-2020",
}


def collection(folder: Path) -> Path:
    """Two splits, a query judged nowhere, titles and none, non-ASCII text."""
    corpus = [{"_id": f"d{i}", "title": "T" * (i % 2), "text": f"text {i} é"} for i in range(1, 7)]
    queries = [{"_id": f"q{i}", "text": f"query {i}"} for i in range(1, 6)]
    qrels = {"train": [("q1", "d1", 1), ("q2", "d2", 2)], "test": [("q3", "d3", 1), ("q4", "d4", 1), ("q4", "d5", 0)]}
    return write_beir(folder, corpus, queries, qrels)


def register(name: str, src: Path) -> None:
    """``name`` (docs and queries) and ``name/<split>`` (with qrels) in ir_datasets' registry, read from ``src``."""
    from ir_datasets.datasets.base import Dataset
    from ir_datasets.datasets.beir import BeirDocs, BeirQrels, BeirQueries, BeirTitleDoc
    from ir_datasets.formats import GenericQuery
    from ir_datasets.util import LocalDownload

    docs = BeirDocs(name, LocalDownload(src / "corpus.jsonl"), BeirTitleDoc)
    queries = BeirQueries(name, LocalDownload(src / "queries.jsonl"), GenericQuery)
    ir_datasets.registry.register(name, Dataset(docs, queries))
    for split in ("train", "test"):
        qrels = BeirQrels(LocalDownload(src / "qrels" / f"{split}.tsv"), {0: "no", 1: "yes", 2: "very"})
        ir_datasets.registry.register(f"{name}/{split}", Dataset(docs, queries, qrels))


def stored(root: Path, dataset: str) -> dict[str, str]:
    m = ArtifactStore(str(root)).read_manifest(f"datasets/dataset={dataset}")
    return {name: e.sha256 for name, e in m.files.items()}


def download(*args: str) -> str:
    res = CliRunner().invoke(app, ["download", *args])
    assert res.exit_code == 0, res.output
    return res.output


def test_a_registered_collection_is_stored_as_its_files_are(tmp_path, monkeypatch):
    monkeypatch.setenv("IR_DATASETS_HOME", str(tmp_path / "irds"))
    src = collection(tmp_path / "mini")
    register("diffret-test/mini", src)
    cache = str(tmp_path / "cache")
    out = download("diffret-test/mini", "--root", str(tmp_path / "a"), "--cache-dir", cache)
    assert "stored as 'diffret-test-mini': give -d diffret-test-mini" in out, out
    download("diffret-test-mini", "--source", str(src), "--root", str(tmp_path / "b"), "--cache-dir", cache)
    a, b = stored(tmp_path / "a", "diffret-test-mini"), stored(tmp_path / "b", "diffret-test-mini")
    assert a == b and set(a) == {"corpus.parquet", "queries.parquet", "qrels.parquet"}
    m = ArtifactStore(str(tmp_path / "a")).read_manifest("datasets/dataset=diffret-test-mini")
    assert m.config["source"] == "ir_datasets:diffret-test/mini"
    # one split of it: its qrels alone, stored under its own name
    download("diffret-test/mini/test", "--root", str(tmp_path / "a"), "--cache-dir", cache)
    m = ArtifactStore(str(tmp_path / "a")).read_manifest("datasets/dataset=diffret-test-mini-test")
    assert m.stats["report"]["splits"].keys() == {"test"}
    # again: nothing to do
    assert "nothing to do" in download("diffret-test/mini", "--root", str(tmp_path / "a"), "--cache-dir", cache)


def test_the_paper_collections_ids_map_to_the_catalogs_names():
    assert {i: stored_name(i) for i in {**BEIR_7, **MSMARCO}} == {**BEIR_7, **MSMARCO}
    assert all(i in ir_datasets.registry for i in {**BEIR_7, **MSMARCO})
    assert set(IRDS_NAMES.values()) <= set(catalog())
    # every file of the catalog is one ir_datasets downloads, under the same URL and checksum
    index = sources._irds_url_index()
    from ir_datasets.util import DownloadConfig

    for entry in catalog().values():
        for f in entry.files:
            group, key = index[f.url]
            assert f.md5 in (None, DownloadConfig.contents()[group][key].get("expected_md5")), f.url


def test_a_beir_id_is_the_catalogs_collection_through_ir_datasets_cache(tmp_path, monkeypatch):
    """beir/scifact/test and scifact store the same dataset, the zip taken from ir_datasets' cache (no network)."""
    home = tmp_path / "irds"
    monkeypatch.setenv("IR_DATASETS_HOME", str(home))
    src = collection(tmp_path / "scifact")
    zipped = home / "beir" / "scifact" / "source.zip"  # where ir_datasets keeps beir/scifact's download
    zipped.parent.mkdir(parents=True)
    with zipfile.ZipFile(zipped, "w") as z:
        for p in sorted(src.rglob("*")):
            if p.is_file():
                z.write(p, f"scifact/{p.relative_to(src)}")
    monkeypatch.setitem(sources.BEIR_MD5, "scifact", hashlib.md5(zipped.read_bytes()).hexdigest())
    download("beir/scifact/test", "--root", str(tmp_path / "a"), "--cache-dir", str(tmp_path / "c1"))
    download("scifact", "--root", str(tmp_path / "b"), "--cache-dir", str(tmp_path / "c2"))
    ma = ArtifactStore(str(tmp_path / "a")).read_manifest("datasets/dataset=scifact")
    mb = ArtifactStore(str(tmp_path / "b")).read_manifest("datasets/dataset=scifact")
    assert ma.config == mb.config and stored(tmp_path / "a", "scifact") == stored(tmp_path / "b", "scifact")
    assert ma.config["source"] == "official" and list(ma.config["source_files"]) == ["scifact.zip"]


def test_an_unknown_id_is_one_line(tmp_path):
    res = CliRunner().invoke(app, ["download", "nosuch/collection", "--root", str(tmp_path)])
    assert res.exit_code == 2 and "any ir_datasets id" in res.output, res.output
