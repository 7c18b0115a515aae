"""The artifact store: atomic writes, checksums, config drift, manifests, partitions."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

from storage import (
    ArtifactStore,
    ChecksumError,
    ConfigDriftError,
    IncompleteArtifactError,
    Manifest,
    StageState,
    StoreError,
    config_hash,
    diff_configs,
)
from storage.layout import CORPUS_SCHEMA, dataset_dir, partition

STAGE = "datasets/dataset=toy"


def _corpus(n: int) -> pa.Table:
    return pa.table(
        {
            "doc_id": [str(i) for i in range(n)],
            "title": [""] * n,
            "text": [f"t{i}" for i in range(n)],
            "metadata": [None] * n,
        },
        schema=CORPUS_SCHEMA,
    )


def _write(store: ArtifactStore, config: dict, n: int = 3) -> Manifest:
    m = Manifest.new("datasets", {"dataset": "toy"}, config)
    with store.stage_writer(STAGE, m) as w:
        w.write_parquet("corpus.parquet", CORPUS_SCHEMA, [_corpus(n)])
    return m


def test_manifest_round_trip(tmp_path):
    store = ArtifactStore(tmp_path)
    cfg = {"dataset": "toy", "nested": {"k": [1, 2]}, "x": 1.5}
    written = _write(store, cfg)
    read = store.read_manifest(STAGE)
    assert read == written
    assert read.config == cfg and read.config_hash == config_hash(cfg)
    entry = read.files["corpus.parquet"]
    assert entry.rows == 3 and entry.bytes == os.path.getsize(tmp_path / STAGE / "corpus.parquet")
    assert {"python", "pyarrow"} <= set(read.versions)
    assert Manifest.from_json(read.to_json()) == read


def test_read_table_verifies_and_returns_rows(tmp_path):
    store = ArtifactStore(tmp_path)
    _write(store, {"a": 1}, n=5)
    t = store.read_table(STAGE, "corpus.parquet")
    assert t.num_rows == 5 and t.schema == CORPUS_SCHEMA


def test_checksum_mismatch_detected(tmp_path):
    store = ArtifactStore(tmp_path)
    _write(store, {"a": 1})
    path = tmp_path / STAGE / "corpus.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="sha256"):
        ArtifactStore(tmp_path).read_table(STAGE, "corpus.parquet")
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(ChecksumError, match="bytes"):
        ArtifactStore(tmp_path).verify(STAGE)
    path.unlink()
    with pytest.raises(ChecksumError, match="missing"):
        ArtifactStore(tmp_path).verify(STAGE)


def test_config_drift_refused_naming_fields(tmp_path):
    store = ArtifactStore(tmp_path)
    _write(store, {"model": "m1", "max_length": 512, "prompt": {"variant": "few"}})
    with pytest.raises(ConfigDriftError) as err:
        store.state(STAGE, {"model": "m1", "max_length": 256, "prompt": {"variant": "one"}})
    fields = [f for f, _, _ in err.value.differences]
    assert fields == ["max_length", "prompt.variant"]
    assert "max_length: stored 512 != requested 256" in str(err.value) and "--force" in str(err.value)
    # the same config is accepted
    assert store.state(STAGE, {"model": "m1", "max_length": 512, "prompt": {"variant": "few"}}) is StageState.CURRENT


def test_verify_all_reports_a_changed_file_and_a_hand_edited_manifest(tmp_path):
    store = ArtifactStore(tmp_path)
    _write(store, {"model": "m1"})
    assert store.verify_all() == (1, [])
    manifest = tmp_path / STAGE / "_manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"m1"', '"m0"'))
    checked, problems = ArtifactStore(tmp_path).verify_all()
    assert checked == 1 and len(problems) == 1 and "edited by hand" in problems[0]
    manifest.write_text(text)
    data = (tmp_path / STAGE / "corpus.parquet").read_bytes()
    (tmp_path / STAGE / "corpus.parquet").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    _, problems = store.verify_all()  # the same store object: its checksum cache does not hide the change
    assert len(problems) == 1 and "corpus.parquet" in problems[0] and "does not match" in problems[0]


def test_stage_state_absent_stale_damaged(tmp_path):
    store = ArtifactStore(tmp_path)
    cfg = {"model": "m1", "inputs": {"upstream": "aaa"}}
    assert store.state(STAGE, cfg) is StageState.ABSENT
    _write(store, cfg)
    assert store.state(STAGE, cfg) is StageState.CURRENT
    # only the inputs differ: stale (recomputed), not drift
    assert store.state(STAGE, {**cfg, "inputs": {"upstream": "bbb"}}) is StageState.STALE
    # a setting differs: drift, unless forced
    assert store.state(STAGE, {**cfg, "model": "m2"}, force=True) is StageState.STALE
    # a file fails its checksum, or the manifest was edited by hand: damaged
    manifest = tmp_path / STAGE / "_manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"m1"', '"m0"'))
    with pytest.raises(ConfigDriftError):
        store.state(STAGE, cfg)  # the stored config is what counts, not the hash recorded beside it
    manifest.write_text(text.replace(json.loads(text)["config_hash"], "0" * 64))
    assert store.state(STAGE, cfg) is StageState.DAMAGED
    manifest.write_text(text)
    (tmp_path / STAGE / "corpus.parquet").write_bytes(b"broken")
    assert store.state(STAGE, cfg) is StageState.DAMAGED


def test_diff_configs_reports_added_and_removed_fields():
    assert diff_configs({"a": 1, "b": 2}, {"a": 1, "c": 3}) == [("b", 2, "<absent>"), ("c", "<absent>", 3)]
    assert diff_configs({"a": {"x": 1}}, {"a": {"x": 1}}) == []


def test_no_manifest_means_nothing_to_read(tmp_path):
    store = ArtifactStore(tmp_path)
    (tmp_path / STAGE).mkdir(parents=True)
    (tmp_path / STAGE / "corpus.parquet").write_bytes(b"PAR1 half written")
    with pytest.raises(IncompleteArtifactError, match="interrupted"):
        store.read_table(STAGE, "corpus.parquet")


def test_failed_build_leaves_previous_version_intact(tmp_path):
    store = ArtifactStore(tmp_path)
    _write(store, {"v": 1}, n=3)
    before = (tmp_path / STAGE / "_manifest.json").read_bytes()

    def exploding():
        yield _corpus(2).to_batches()[0]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with store.stage_writer(STAGE, Manifest.new("datasets", {"dataset": "toy"}, {"v": 2})) as w:
            w.write_parquet("corpus.parquet", CORPUS_SCHEMA, exploding())
    assert (tmp_path / STAGE / "_manifest.json").read_bytes() == before
    assert store.read_table(STAGE, "corpus.parquet").num_rows == 3
    assert not any((tmp_path / "_staging").iterdir())


def test_replacing_a_stage_is_atomic_and_cleans_up(tmp_path):
    store = ArtifactStore(tmp_path)
    _write(store, {"v": 1}, n=3)
    _write(store, {"v": 2}, n=7)
    assert store.verify(STAGE).config == {"v": 2}
    assert store.read_table(STAGE, "corpus.parquet").num_rows == 7
    assert sorted(os.listdir(tmp_path / STAGE)) == ["_manifest.json", "corpus.parquet"]
    assert not any((tmp_path / "_staging").iterdir())


def test_stale_staging_from_killed_run_is_cleared(tmp_path):
    store = ArtifactStore(tmp_path)
    stale = tmp_path / "_staging" / "datasets__dataset-toy.deadbeef"
    stale.mkdir(parents=True)
    (stale / "corpus.parquet").write_bytes(b"partial")
    _write(store, {"v": 1})
    assert not stale.exists()


def test_concurrent_writer_is_refused(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.lock(STAGE):
        with pytest.raises(StoreError, match="another process"):
            _write(ArtifactStore(tmp_path), {"v": 1})


def test_write_bytes_is_atomic(tmp_path):
    store = ArtifactStore(tmp_path)
    store.write_bytes("a/b.json", b"one")
    store.write_bytes("a/b.json", b"two")
    assert (tmp_path / "a" / "b.json").read_bytes() == b"two"
    assert os.listdir(tmp_path / "a") == ["b.json"]  # no temporary left behind


def test_fsspec_memory_store_round_trip():
    store = ArtifactStore("memory://diffret-test-store")
    assert not store.is_local
    _write(store, {"v": 1}, n=4)
    assert store.read_table(STAGE, "corpus.parquet").num_rows == 4
    assert store.list_partitions("datasets", "dataset") == ["toy"]
    store.remove_stage(STAGE)
    assert store.read_manifest(STAGE) is None


def test_partition_values_are_checked():
    assert dataset_dir("trec-dl-2019") == "datasets/dataset=trec-dl-2019"
    assert partition("runs", model="m", kq=4) == "runs/model=m/kq=4"
    for bad in ["../etc", "a/b", "", "x=y", ".hidden"]:
        with pytest.raises(ValueError):
            dataset_dir(bad)
