"""The artifact store: atomic writes, checksums, config drift, manifests, partitions."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

from diffret.schemas import CORPUS_SCHEMA
from diffret.storage import (
    ArtifactStore,
    ChecksumError,
    ConfigDriftError,
    FolderState,
    IncompleteArtifactError,
    Manifest,
    StoreError,
    config_hash,
    diff_configs,
)
from diffret.storage.layout import dataset_dir, partition

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
    with store.folder_writer(STAGE, m) as w:
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


def test_iter_batches_reads_every_row_in_order_a_row_group_at_a_time(tmp_path):
    """The corpus streamed, a row group at a time: every row once, in order, batches of at most ``batch_size`` rows,
    over a file of several row groups."""
    import pyarrow.parquet as pq

    store = ArtifactStore(tmp_path)
    t = _corpus(11)
    with store.folder_writer(STAGE, Manifest.new("datasets", {"dataset": "toy"}, {"a": 1})) as w:
        w.write_parquet("corpus.parquet", CORPUS_SCHEMA, [t.slice(0, 4), t.slice(4, 5), t.slice(9, 2)])
    assert pq.ParquetFile(tmp_path / STAGE / "corpus.parquet").metadata.num_row_groups == 3
    batches = list(store.iter_batches(STAGE, "corpus.parquet", columns=["doc_id", "text"], batch_size=3))
    assert all(b.num_rows <= 3 for b in batches) and [b.schema.names for b in batches][0] == ["doc_id", "text"]
    assert [d for b in batches for d in b.column("doc_id").to_pylist()] == [str(i) for i in range(11)]


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
    assert "max_length: 512 stored, 256 now" in str(err.value) and "--force" in str(err.value)
    # the same config is accepted
    assert store.state(STAGE, {"model": "m1", "max_length": 512, "prompt": {"variant": "few"}}) is FolderState.CURRENT


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
    assert store.state(STAGE, cfg) is FolderState.ABSENT
    _write(store, cfg)
    assert store.state(STAGE, cfg) is FolderState.CURRENT
    # only the inputs differ: stale (recomputed), not drift
    assert store.state(STAGE, {**cfg, "inputs": {"upstream": "bbb"}}) is FolderState.STALE
    # a setting differs: drift, unless forced
    assert store.state(STAGE, {**cfg, "model": "m2"}, force=True) is FolderState.STALE
    # a file fails its checksum, or the manifest was edited by hand: damaged
    manifest = tmp_path / STAGE / "_manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"m1"', '"m0"'))
    with pytest.raises(ConfigDriftError):
        store.state(STAGE, cfg)  # the stored config is what counts, not the hash recorded beside it
    manifest.write_text(text.replace(json.loads(text)["config_hash"], "0" * 64))
    assert store.state(STAGE, cfg) is FolderState.DAMAGED
    manifest.write_text(text)
    (tmp_path / STAGE / "corpus.parquet").write_bytes(b"broken")
    assert store.state(STAGE, cfg) is FolderState.DAMAGED


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
        with store.folder_writer(STAGE, Manifest.new("datasets", {"dataset": "toy"}, {"v": 2})) as w:
            w.write_parquet("corpus.parquet", CORPUS_SCHEMA, exploding())
    assert (tmp_path / STAGE / "_manifest.json").read_bytes() == before
    assert store.read_table(STAGE, "corpus.parquet").num_rows == 3
    assert not (tmp_path / "_staging").exists()  # nothing staged is left behind, not even the folder


def test_replacing_a_stage_is_atomic_and_cleans_up(tmp_path):
    store = ArtifactStore(tmp_path)
    _write(store, {"v": 1}, n=3)
    _write(store, {"v": 2}, n=7)
    assert store.verify(STAGE).config == {"v": 2}
    assert store.read_table(STAGE, "corpus.parquet").num_rows == 7
    assert sorted(os.listdir(tmp_path / STAGE)) == ["_manifest.json", "corpus.parquet"]
    assert not (tmp_path / "_staging").exists()  # nothing staged is left behind, not even the folder


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
    store.remove_folder(STAGE)
    assert store.read_manifest(STAGE) is None


def test_files_a_stage_writes_into_its_work_folder_reach_an_object_store():
    """A stage that writes a folder of its own into the writer's work folder (a LanceDB table) and lists its files
    in the manifest: on an object store they are uploaded with the manifest, and verify finds every one."""
    import hashlib
    import uuid

    from diffret.storage import FileEntry

    store = ArtifactStore(f"memory://diffret-work-{uuid.uuid4().hex}")
    m = Manifest.new("index", {"kp": "1"}, {"v": 1})
    with store.folder_writer("index/kp=1", m) as w:
        os.makedirs(os.path.join(w.work_dir, "docs.lance", "data"))
        with open(os.path.join(w.work_dir, "docs.lance", "data", "0.lance"), "wb") as f:
            f.write(b"rows")
        m.files["docs.lance/data/0.lance"] = FileEntry(sha256=hashlib.sha256(b"rows").hexdigest(), bytes=4)
    assert store.read_bytes("index/kp=1/docs.lance/data/0.lance") == b"rows"
    assert set(store.verify("index/kp=1").files) == {"docs.lance/data/0.lance"}  # raises on a missing file


def test_partition_values_are_checked():
    assert dataset_dir("trec-dl-2019") == "datasets/dataset=trec-dl-2019"
    assert partition("runs", model="m", kq=4) == "runs/model=m/kq=4"
    for bad in ["../etc", "a/b", "", "x=y", ".hidden"]:
        with pytest.raises(ValueError):
            dataset_dir(bad)


# ----------------------------------------------------------------------------------- sharded folders
SHARDED = "tokens/tokenizer=t/dataset=toy/side=passage"
PART = {"tokenizer": "t", "dataset": "toy", "side": "passage"}
CFG = {"tokenizer": "t", "shard_size": 2, "inputs": {"dataset": "aaa"}}


def _shard(i: int) -> pa.Table:
    return pa.table({"id": [f"d{i}", f"e{i}"], "x": [i, i + 1]})


def _fill(store: ArtifactStore, names: list[str], config: dict = CFG) -> Manifest:
    """Open the folder and write + record ``names`` without compacting (a run killed before its end)."""
    m, _ = store.open_sharded(SHARDED, "tokens", PART, config)
    for i, name in enumerate(names):
        store.record_shard(SHARDED, name, store.write_shard(SHARDED, name, _shard(i)), m.config_hash)
    return m


def _names(n: int) -> list[str]:
    return [f"shard={i:05d}.parquet" for i in range(n)]


def test_shards_are_recorded_without_rewriting_the_manifest_then_compacted_once(tmp_path):
    store = ArtifactStore(tmp_path)
    store.open_sharded(SHARDED, "tokens", PART, CFG)
    manifest = tmp_path / SHARDED / "_manifest.json"
    before = manifest.read_bytes()
    _fill(store, _names(3))
    assert manifest.read_bytes() == before  # recording appends one line, the manifest is not rewritten
    lines = (tmp_path / SHARDED / "_shards.jsonl").read_text().splitlines()
    assert [json.loads(line)["name"] for line in lines] == _names(3)
    # readers see recorded shards before compaction
    assert store.read_table(SHARDED, _names(1)[0]).num_rows == 2
    assert ArtifactStore(tmp_path).verify_all() == (3, [])
    assert store.compact_shards(SHARDED) == 3
    m = store.read_manifest(SHARDED)
    assert sorted(m.files) == _names(3) and all(e.mtime_ns and e.rows == 2 for e in m.files.values())
    assert not (tmp_path / SHARDED / "_shards.jsonl").exists()
    assert store.compact_shards(SHARDED) == 0  # idempotent
    assert ArtifactStore(tmp_path).verify_all() == (3, [])


def test_a_run_killed_before_compaction_resumes_with_every_recorded_shard(tmp_path):
    _fill(ArtifactStore(tmp_path), _names(2))  # killed: no compaction
    m, done = ArtifactStore(tmp_path).open_sharded(SHARDED, "tokens", PART, CFG)
    assert done == set(_names(2)) and sorted(m.files) == _names(2)
    assert sorted(ArtifactStore(tmp_path).read_manifest(SHARDED).files) == _names(2)  # compacted on open
    assert not (tmp_path / SHARDED / "_shards.jsonl").exists()


def test_a_shard_redone_after_its_record_is_read_through_the_newer_record(tmp_path):
    store = ArtifactStore(tmp_path)
    _fill(store, _names(1))
    store.compact_shards(SHARDED)
    m = _fill(store, [])  # open again; then the shard is rewritten with other rows and recorded again
    entry = store.write_shard(SHARDED, _names(1)[0], pa.table({"id": ["a", "b", "c"], "x": [1, 2, 3]}))
    store.record_shard(SHARDED, _names(1)[0], entry, m.config_hash)
    assert store.read_table(SHARDED, _names(1)[0]).num_rows == 3  # the manifest's entry fails, the record holds
    assert store.compact_shards(SHARDED) == 1
    assert store.read_manifest(SHARDED).files[_names(1)[0]].rows == 3


def test_a_line_torn_by_a_crash_loses_only_its_own_shard(tmp_path):
    store = ArtifactStore(tmp_path)
    m = _fill(store, _names(1))
    log = tmp_path / SHARDED / "_shards.jsonl"
    with open(log, "ab") as f:
        f.write(b'{"config_hash": "')  # a crash mid-line
    entry = store.write_shard(SHARDED, _names(2)[1], _shard(1))
    store.record_shard(SHARDED, _names(2)[1], entry, m.config_hash)
    _, problems = ArtifactStore(tmp_path).verify_all()
    assert len(problems) == 1 and "unreadable shard record" in problems[0]
    _, done = ArtifactStore(tmp_path).open_sharded(SHARDED, "tokens", PART, CFG)
    assert done == set(_names(2))


def test_records_of_another_config_are_never_merged(tmp_path):
    store = ArtifactStore(tmp_path)
    _fill(store, _names(1))
    stray = store.write_shard(SHARDED, "shard=00001.parquet", _shard(1))
    store.record_shard(SHARDED, "shard=00001.parquet", stray, config_hash("other config"))
    assert store.compact_shards(SHARDED) == 1
    assert sorted(store.read_manifest(SHARDED).files) == _names(1)
    assert not (tmp_path / SHARDED / "_shards.jsonl").exists()  # the stray record is dropped too
    # a replacement killed after removing the manifest leaves records behind: a new config ignores them
    _fill(store, ["shard=00002.parquet"])
    (tmp_path / SHARDED / "_manifest.json").unlink()
    other = {**CFG, "inputs": {"dataset": "bbb"}}
    m, done = store.open_sharded(SHARDED, "tokens", PART, other)
    assert done == set() and m.files == {} and m.config == other


def test_a_stale_folder_is_replaced_records_included(tmp_path):
    store = ArtifactStore(tmp_path)
    _fill(store, _names(2))
    m, done = store.open_sharded(SHARDED, "tokens", PART, {**CFG, "inputs": {"dataset": "bbb"}})
    assert done == set() and m.files == {}
    assert sorted(os.listdir(tmp_path / SHARDED)) == ["_manifest.json"]


def test_planning_checks_size_and_mtime_without_reading_shards(tmp_path, monkeypatch):
    import diffret.storage.integrity  # where ArtifactStore.verify_file looks sha256_file up

    store = ArtifactStore(tmp_path)
    _fill(store, _names(3))
    store.compact_shards(SHARDED)

    def no_hashing(*_a, **_k):
        raise AssertionError("planning read a shard's contents")

    with monkeypatch.context() as mp:
        mp.setattr(diffret.storage.integrity, "sha256_file", no_hashing)
        _, done = ArtifactStore(tmp_path).open_sharded(SHARDED, "tokens", PART, CFG)
    assert done == set(_names(3))
    first, second, third = (tmp_path / SHARDED / n for n in _names(3))
    # a flipped byte: same size, new mtime -> hashed, damaged, redone
    st = first.stat()
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 1
    first.write_bytes(bytes(data))
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    # a flipped byte with its mtime restored: only --verify finds it
    st = second.stat()
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 1
    second.write_bytes(bytes(data))
    os.utime(second, ns=(st.st_atime_ns, st.st_mtime_ns))
    # a resized file is redone without hashing
    third.write_bytes(third.read_bytes() + b"x")
    _, done = ArtifactStore(tmp_path).open_sharded(SHARDED, "tokens", PART, CFG)
    assert done == {_names(3)[1]}
    _, done = ArtifactStore(tmp_path).open_sharded(SHARDED, "tokens", PART, CFG, verify=True)
    assert done == set()


def test_a_touched_but_whole_shard_is_hashed_once_and_its_mtime_recorded(tmp_path, monkeypatch):
    import diffret.storage.integrity  # where ArtifactStore.verify_file looks sha256_file up

    store = ArtifactStore(tmp_path)
    _fill(store, _names(2))
    store.compact_shards(SHARDED)
    path = tmp_path / SHARDED / _names(2)[0]
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # a copied store: same bytes, new mtime
    hashed = []
    real = diffret.storage.integrity.sha256_file
    monkeypatch.setattr(diffret.storage.integrity, "sha256_file", lambda p, fs=None: hashed.append(p) or real(p, fs))
    _, done = ArtifactStore(tmp_path).open_sharded(SHARDED, "tokens", PART, CFG)
    assert done == set(_names(2)) and len(hashed) == 1
    _, done = ArtifactStore(tmp_path).open_sharded(SHARDED, "tokens", PART, CFG)  # compacts the new mtime
    assert done == set(_names(2)) and len(hashed) == 1
    assert ArtifactStore(tmp_path).read_manifest(SHARDED).files[_names(2)[0]].mtime_ns == st.st_mtime_ns + 5 * 10**9


def test_manifests_without_mtimes_stay_readable_and_are_checked_by_sha256(tmp_path):
    store = ArtifactStore(tmp_path)
    _fill(store, _names(2))
    store.compact_shards(SHARDED)
    manifest = tmp_path / SHARDED / "_manifest.json"
    old = json.loads(manifest.read_text())
    for entry in old["files"].values():
        del entry["mtime_ns"]  # as written before mtimes were recorded
    manifest.write_text(json.dumps(old))
    assert all(e.mtime_ns is None for e in store.read_manifest(SHARDED).files.values())
    _, done = ArtifactStore(tmp_path).open_sharded(SHARDED, "tokens", PART, CFG)
    assert done == set(_names(2))
    store.compact_shards(SHARDED)
    assert all(e.mtime_ns for e in store.read_manifest(SHARDED).files.values())
    assert '"mtime_ns"' not in _write(store, {"v": 1}).to_json()  # unsharded entries keep their old shape


def test_verify_all_sees_a_damaged_shard_that_is_not_compacted_yet(tmp_path):
    store = ArtifactStore(tmp_path)
    _fill(store, _names(2))
    path = tmp_path / SHARDED / _names(2)[1]
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    checked, problems = store.verify_all()
    assert checked == 2 and len(problems) == 1 and _names(2)[1] in problems[0]
    with pytest.raises(ChecksumError):
        store.read_table(SHARDED, _names(2)[1])
    log = tmp_path / SHARDED / "_shards.jsonl"
    log.write_text("{not json\n" + log.read_text().splitlines()[1] + "\n")
    _, problems = ArtifactStore(tmp_path).verify_all()
    assert any("unreadable shard record" in p for p in problems)


def test_record_shard_refuses_a_name_outside_the_folder(tmp_path):
    store = ArtifactStore(tmp_path)
    m, _ = store.open_sharded(SHARDED, "tokens", PART, CFG)
    entry = store.write_shard(SHARDED, "shard=00000.parquet", _shard(0))
    for bad in ["../x.parquet", "", "_manifest.json"]:
        with pytest.raises(StoreError, match="invalid shard name"):
            store.record_shard(SHARDED, bad, entry, m.config_hash)


def test_sharded_folder_on_a_memory_store():
    store = ArtifactStore("memory://diffret-test-sharded")
    store.remove_folder(SHARDED)
    m = _fill(store, _names(2))
    assert store.read_table(SHARDED, _names(2)[1]).num_rows == 2  # through its record
    _, done = ArtifactStore(store.root).open_sharded(SHARDED, "tokens", PART, CFG)
    assert done == set(_names(2)) and store.read_manifest(SHARDED).config_hash == m.config_hash
    assert not store.fs.exists(store.abspath(f"{SHARDED}/_records/{_names(2)[0]}.json"))
    store.remove_folder(SHARDED)


def test_cleanup_of_a_stopping_run_skips_a_folder_being_written(tmp_path) -> None:
    """A run stopped (Ctrl-C) while a shard is being recorded: its cleanup leaves that folder alone instead of
    failing with 'being written by another process' (the stop must still exit 130, not 2)."""
    from diffret.storage import remove_empty_sharded

    store = ArtifactStore(str(tmp_path))
    store.open_sharded("t/side=q", "t", {"side": "q"}, {"n": 1})
    store.open_sharded("t/side=p", "t", {"side": "p"}, {"n": 1})
    with store.lock("t/side=q/_manifest"):  # held by a recording unit
        assert remove_empty_sharded(store, ["t/side=q", "t/side=p"]) == ["t/side=p"]
    assert store.exists("t/side=q") and not store.exists("t/side=p")


def test_writers_of_other_folders_share_staging_at_once(tmp_path) -> None:
    """Units on several workers write their own folders at once: one writer's cleanup removing an empty
    ``_staging/`` never fails another's start (it did, now and then, between os.makedirs' two mkdirs)."""
    import threading

    store = ArtifactStore(str(tmp_path))
    table = pa.table({"x": [1]})
    errors: list[str] = []

    def write(i: int) -> None:
        for j in range(40):
            try:
                stage = partition("things", i=i, j=j)
                with store.folder_writer(stage, Manifest.new("things", {"i": str(i), "j": str(j)}, {})) as w:
                    w.write_parquet("t.parquet", table.schema, [table])
            except Exception as e:  # noqa: BLE001 - every failure is collected, then shown
                errors.append(repr(e))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(list(tmp_path.glob("things/*/*/_manifest.json"))) == 320
