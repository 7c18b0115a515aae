"""End-to-end: the ``diffret`` command on the real collections in ../shared/data (skipped when absent)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_harness import DIFFRET, ENV, run, sql

from diffret.storage import ArtifactStore, IncompleteArtifactError
from diffret.storage.sql import StoreSQL


@pytest.mark.e2e
def test_scifact_nfcorpus_cranfield(tmp_path, shared_data):
    root = tmp_path / "store"
    for name in ("scifact", "nfcorpus", "cranfield"):
        run("download", name, "--source", str(shared_data / name), "--root", str(root))
    rows = sql(
        root,
        "select split, count(distinct query_id) q, count(*) n from qrels "
        "where dataset = 'scifact' group by 1 order by 1",
    )
    assert rows == [{"split": "test", "q": 300, "n": 339}, {"split": "train", "q": 809, "n": 919}]
    counts = {r["dataset"]: r["n"] for r in sql(root, "select dataset, count(*) n from corpus group by 1")}
    assert counts == {"scifact": 5183, "nfcorpus": 3633, "cranfield": 1400}
    nf = sql(root, "select count(distinct query_id) q, count(*) n from qrels where dataset='nfcorpus' and split='test'")
    assert nf == [{"q": 323, "n": 12334}]
    cran = sql(root, "select count(distinct query_id) q from queries where dataset = 'cranfield'")
    assert cran == [{"q": 225}]
    # the same command again does nothing and says so
    again = run("download", "scifact", "--source", str(shared_data / "scifact"), "--root", str(root))
    assert "nothing to do" in again.stderr
    # csv output
    csv_out = run("sql", "-r", str(root), "-f", "csv", "select count(*) as n from corpus").stdout
    assert csv_out == "n\n10216\n"


@pytest.mark.e2e
def test_msmarco_mirror_subfolders(tmp_path, shared_data):
    root = tmp_path / "store"
    run("download", "trec-dl-2019", "--source", str(shared_data / "msmarco-passage"), "--root", str(root))
    rows = sql(root, "select count(distinct query_id) q, count(*) n from qrels where dataset = 'trec-dl-2019'")
    assert rows == [{"q": 43, "n": 9260}]


def _copy_scifact(shared_data: Path, dest: Path) -> Path:
    dest.mkdir()
    (dest / "qrels").mkdir()
    for rel in ("queries.jsonl", "qrels/test.tsv", "qrels/train.tsv"):
        (dest / rel).write_bytes((shared_data / "scifact" / rel).read_bytes())
    return dest


@pytest.mark.e2e
def test_broken_copies_fail_clearly_and_write_nothing(tmp_path, shared_data):
    root = tmp_path / "store"
    lines = (shared_data / "scifact" / "corpus.jsonl").read_text().splitlines()

    truncated = _copy_scifact(shared_data, tmp_path / "truncated")
    bad = list(lines)
    bad[99] = bad[99][: len(bad[99]) // 2]  # line 100 cut in the middle
    (truncated / "corpus.jsonl").write_text("\n".join(bad) + "\n")
    p = run("download", "scifact", "--source", str(truncated), "--root", str(root), check=False)
    assert p.returncode == 2
    assert f"{truncated / 'corpus.jsonl'}:100: malformed JSON" in p.stderr

    duplicated = _copy_scifact(shared_data, tmp_path / "duplicated")
    dup = list(lines)
    dup_id = json.loads(dup[10])["_id"]
    dup.insert(2000, dup[10])
    (duplicated / "corpus.jsonl").write_text("\n".join(dup) + "\n")
    p = run("download", "scifact", "--source", str(duplicated), "--root", str(root), check=False)
    assert p.returncode == 2
    assert f"corpus.jsonl:2001: duplicate document id '{dup_id}' (first at line 11)" in p.stderr

    assert not (root / "datasets" / "dataset=scifact").exists()
    assert not (root / "_staging").exists(), "an empty staging area is removed"
    assert sql(root, "select count(*) n from corpus") == [{"n": 0}]


@pytest.mark.e2e
def test_kill_9_mid_download_then_rerun(tmp_path, shared_data):
    """kill -9 while the corpus is being written: nothing is accepted; the re-run completes."""
    src = _copy_scifact(shared_data, tmp_path / "big")
    docs = [json.loads(x) for x in (shared_data / "scifact" / "corpus.jsonl").read_text().splitlines()]
    with open(src / "corpus.jsonl", "w") as f:
        for rep in range(30):  # ~155k documents: long enough to be killed in the middle
            for d in docs:
                f.write(json.dumps({**d, "_id": d["_id"] if rep == 0 else f"{d['_id']}-{rep}"}) + "\n")
    root = tmp_path / "store"
    proc = subprocess.Popen(
        [*DIFFRET, "download", "big", "--source", str(src), "--root", str(root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
        start_new_session=True,
    )
    staging = root / "_staging"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if any(staging.glob("*/corpus.parquet")):
                break
            assert proc.poll() is None, "the download finished before it could be killed"
            time.sleep(0.05)
        else:
            pytest.fail("the download never started writing")
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    store = ArtifactStore(root)
    with pytest.raises(IncompleteArtifactError):
        store.read_table("datasets/dataset=big", "corpus.parquet")
    assert not (root / "datasets" / "dataset=big").exists()
    with StoreSQL(store) as db:
        assert db.query("select count(*) from corpus")[1] == [(0,)]

    run("download", "big", "--source", str(src), "--root", str(root))
    assert store.verify("datasets/dataset=big").files["corpus.parquet"].rows == 30 * len(docs)
    assert not staging.exists(), "the re-run clears the killed run's staging"
