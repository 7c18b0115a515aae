"""Fetching collections over HTTP (a server on 127.0.0.1), archives, checksums, the official catalog."""

from __future__ import annotations

import functools
import hashlib
import http.server
import shutil
import threading
import zipfile
from pathlib import Path

import pytest

from diffret.retrieval.data import sources
from diffret.retrieval.data.collections import DatasetError
from diffret.retrieval.data.sources import resolve_source
from diffret.stages.download import materialise
from diffret.storage import ArtifactStore


@pytest.fixture
def http_root(tmp_path):
    """Serve ``tmp_path/www`` on a free loopback port for the duration of one test."""
    www = tmp_path / "www"
    www.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(www)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield www, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _zip_folder(folder: Path, archive: Path, inner: str) -> str:
    with zipfile.ZipFile(archive, "w") as zf:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                zf.write(p, f"{inner}/{p.relative_to(folder)}")
    return hashlib.md5(archive.read_bytes()).hexdigest()


def test_url_zip_and_url_folder(tmp_path, tiny_beir, http_root):
    www, base = http_root
    _zip_folder(tiny_beir, www / "tiny.zip", "tiny")
    shutil.copytree(tiny_beir, www / "tiny")
    store = ArtifactStore(tmp_path / "store")
    a = materialise(store, "viazip", resolve_source("viazip", f"{base}/tiny.zip", tmp_path / "cache"))
    b = materialise(store, "viafolder", resolve_source("viafolder", f"{base}/tiny/", tmp_path / "cache"))
    for res in (a, b):
        assert {k: v.rows for k, v in res.manifest.files.items()} == {
            "corpus.parquet": 3,
            "qrels.parquet": 3,
            "queries.parquet": 4,
        }
    assert a.manifest.config["source"] == f"{base}/tiny.zip"


def test_official_download_checks_published_md5(tmp_path, tiny_beir, http_root, monkeypatch):
    www, base = http_root
    md5 = _zip_folder(tiny_beir, www / "scifact.zip", "scifact")
    # the published checksum of the real scifact.zip does not match our stand-in: refused, nothing kept
    with pytest.raises(DatasetError, match="does not match the published"):
        resolve_source("scifact", None, tmp_path / "cache", beir_base_url=base)
    assert not list((tmp_path / "cache").rglob("*.zip*"))
    monkeypatch.setitem(sources.BEIR_MD5, "scifact", md5)
    files = resolve_source("scifact", None, tmp_path / "cache", beir_base_url=base)
    assert files.origin == "official" and files.inputs == {"scifact.zip": f"md5:{md5}"}
    res = materialise(ArtifactStore(tmp_path / "store"), "scifact", files)
    assert res.manifest.files["corpus.parquet"].rows == 3
    # cached: a second resolve does not download again (the server is gone after this test anyway)
    (www / "scifact.zip").unlink()
    assert resolve_source("scifact", None, tmp_path / "cache", beir_base_url=base).inputs == files.inputs


def test_download_failure_is_clear(tmp_path, http_root):
    _, base = http_root
    with pytest.raises(DatasetError, match="could not download .*missing.zip"):
        resolve_source("x", f"{base}/missing.zip", tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.part"))


def test_local_zip_source(tmp_path, tiny_beir):
    _zip_folder(tiny_beir, tmp_path / "tiny.zip", "tiny")
    files = resolve_source("tiny", str(tmp_path / "tiny.zip"), tmp_path / "cache")
    assert files.corpus is not None and set(files.qrels) == {"test", "train"}
    assert list(files.inputs) == ["tiny.zip"]


def test_zip_slip_refused(tmp_path):
    with zipfile.ZipFile(tmp_path / "evil.zip", "w") as zf:
        zf.writestr("../../escape.txt", "x")
    with pytest.raises(DatasetError, match="escape"):
        resolve_source("evil", str(tmp_path / "evil.zip"), tmp_path / "cache")


def test_catalog_names():
    cat = sources.catalog()
    for name in [
        "scifact",
        "nfcorpus",
        "arguana",
        "fiqa",
        "trec-covid",
        "nq",
        "hotpotqa",
        "quora",
        "scidocs",
        "msmarco-passage",
        "trec-dl-2019",
        "trec-dl-2020",
    ]:
        assert name in cat
    assert cat["trec-dl-2019"].corpus_from == "msmarco-passage"
    assert all(f.md5 and len(f.md5) == 32 for f in cat["scifact"].files)
