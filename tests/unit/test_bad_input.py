"""The bad-input catalogue through the CLI: each case ends with one clear error line, a non-zero exit
code and nothing half-written (budgets: test_bad_k.py; a hand-edited manifest and a flipped byte: `diffret verify`
in test_store.py / test_stages_rerun.py; a missing root: test_sql_confinement.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import cli_fork
import duckdb
import pytest
from conftest import REPO, write_beir
from tiny_models import save_tiny_mlm

ENV = {**os.environ, "PREFECT_API_URL": "", "COLUMNS": "200", "NLTK_DATA": os.environ.get("NLTK_DATA", "")}
CORPUS = [{"_id": "d1", "title": "Cats", "text": "cats purr"}, {"_id": "d2", "title": "", "text": "dogs bark"}]
QUERIES = [{"_id": "q1", "text": "what do cats do"}, {"_id": "q2", "text": "barking"}]
QRELS = {"test": [("q1", "d1", 1), ("q2", "d2", 2)]}
SMALL_RUN = ["--kq", "1", "--kp", "1", "--no-bm25", "--mode", "single_dense", "--max-length", "32"]


def cli(*argv: str, prelude: str = "", timeout: int = 300, **kw) -> subprocess.CompletedProcess | subprocess.Popen:
    code = f"{prelude}\nimport sys\nsys.argv = ['diffret', *{list(argv)!r}]\nfrom diffret.flows.cli import main\nmain()"
    args = [sys.executable, "-c", code]
    env = {**ENV, **kw.pop("env_extra", {})}
    if kw.pop("background", False):  # SIGINT back to its default: a shell's background job inherits it ignored
        return subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    if not prelude:  # forked from a process that has the CLI's imports (tests/cli_fork.py): the same, faster
        return cli_fork.run(list(argv), env=env, cwd=REPO, timeout=timeout)
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


def error_line(p: subprocess.CompletedProcess) -> str:
    """The one error line (and check there is exactly one and no traceback)."""
    text = p.stdout + p.stderr
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, text
    return lines[0]


def parquet_files(root: Path, folder: str = "") -> list[Path]:
    return sorted((root / folder).rglob("*.parquet")) if (root / folder).exists() else []


@pytest.fixture(scope="module")
def tiny_mlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_mlm(tmp_path_factory.mktemp("models") / "tiny-mlm")


# --------------------------------------------------------------------------------------------- collections
def _bad_collection(folder: Path, case: str) -> str:
    if case == "empty corpus":
        (folder / "corpus.jsonl").write_bytes(b"")
        return "corpus.jsonl: no documents (the file is empty or blank)"
    if case == "empty queries":
        (folder / "queries.jsonl").write_bytes(b"")
        return "queries.jsonl: no queries (the file is empty or blank)"
    if case == "fractional grade":
        (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t0.5\n")
        return "test.tsv:2: field 'score' must be an integer, got '0.5'"
    if case == "unknown document":
        (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\tnope\t1\n")
        return "test.tsv: 1 judgment(s) name documents not in the corpus (e.g. nope); pass --unknown-judgments"
    assert case == "non-UTF-8"
    with open(folder / "corpus.jsonl", "ab") as f:
        f.write(b'{"_id": "d3", "text": "caf\xe9"}\n')
    return "corpus.jsonl:3: invalid UTF-8 at byte"


@pytest.mark.parametrize("case", ["empty corpus", "empty queries", "fractional grade", "unknown document", "non-UTF-8"])
def test_bad_collection_fails_clearly_and_writes_nothing(tmp_path: Path, case: str) -> None:
    folder = write_beir(tmp_path / "c", CORPUS, QUERIES, QRELS)
    message = _bad_collection(folder, case)
    root = tmp_path / "store"
    p = cli("download", "c", "--source", str(folder), "--root", str(root))
    assert p.returncode == 2
    assert message in error_line(p)
    assert parquet_files(root) == []


def test_unknown_judgments_kept_or_dropped_on_request(tmp_path: Path) -> None:
    folder = write_beir(tmp_path / "c", CORPUS, QUERIES, QRELS)
    _bad_collection(folder, "unknown document")
    for policy, n in (("drop", 1), ("keep", 2)):
        root = tmp_path / policy
        p = cli("download", "c", "--source", str(folder), "--root", str(root), "--unknown-judgments", policy)
        assert p.returncode == 0, p.stdout + p.stderr
        qrels = root / "datasets" / "dataset=c" / "qrels.parquet"
        assert duckdb.sql(f"select count(*) from '{qrels}'").fetchall() == [(n,)]


# ---------------------------------------------------------------------------------------------- models
def _damage(model: Path, case: str) -> str:
    weights = model / "model.safetensors"
    if case == "no weights":
        weights.unlink()
        return "no weights (model.safetensors, pytorch_model.bin, a sharded index or a .gguf file)"
    data = bytearray(weights.read_bytes())
    if case == "corrupt header":
        data[8:40] = b"\xff" * 32
        weights.write_bytes(bytes(data))
        return "model.safetensors: corrupt safetensors file (unreadable header)"
    assert case == "truncated"
    weights.write_bytes(bytes(data[: len(data) - 64]))
    return "model.safetensors: truncated safetensors file"


@pytest.mark.parametrize("case", ["no weights", "corrupt header", "truncated"])
def test_bad_model_folder_fails_before_any_model_work(
    tmp_path: Path, tiny_beir: Path, tiny_mlm: Path, case: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_mlm, model)
    message = _damage(model, case)
    root = tmp_path / "store"
    p = cli("run", "--source", str(tiny_beir), "--model", str(model), "--root", str(root), *SMALL_RUN)
    assert p.returncode == 2
    line = error_line(p)
    assert message in line and "(BertForMaskedLM)" in line  # the model, its architecture, the cause
    assert parquet_files(root, "encodings") == []  # (the token ids, complete, need only the tokenizer)


# ------------------------------------------------------------------------------------------- store root
@contextlib.contextmanager
def read_only_folder(path: Path):
    """A read-only folder: a read-only tmpfs mount when we are root (chmod does not stop root), else chmod."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip("running as root without permission to mount a read-only tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_read_only_store_root_is_one_clear_error(tmp_path: Path, tiny_beir: Path) -> None:
    with read_only_folder(tmp_path / "ro") as ro:
        p = cli("download", "tiny", "--source", str(tiny_beir), "--root", str(ro / "store"))
        assert p.returncode == 2
        line = error_line(p)
        assert str(ro / "store") in line and ("Read-only file system" in line or "Permission denied" in line)
        assert not (ro / "store").exists()


# --------------------------------------------------------------------------------------- two models, one path
def _systems(root: Path) -> list[str]:
    return sorted(p.name.removeprefix("system=") for p in (root / "systems").glob("system=*"))


def _metric_systems(root: Path) -> set[str]:
    """The systems that have per-query metrics (of NDCG@10) in the store."""
    files = [str(f) for f in parquet_files(root, "metrics")]
    rows = duckdb.sql(
        f"select distinct filename from read_parquet({files!r}, filename = true) where measure = 'ndcg_cut_10'"
    ).fetchall()
    return {part.removeprefix("system=") for (f,) in rows for part in Path(f).parts if part.startswith("system=")}


def test_a_model_retrained_in_place_is_refused_then_kept_apart_elsewhere(tmp_path: Path, tiny_beir: Path) -> None:
    """Other weights under a path whose system is stored: refused (the stored artifacts are the first model's,
    never reported as the new one's), nothing touched; saved under another path, it is a system of its own."""
    model, root = tmp_path / "model", tmp_path / "store"
    save_tiny_mlm(model, seed=0)
    args = ("--source", str(tiny_beir), "--root", str(root), *SMALL_RUN)
    p = cli("run", "--model", str(model), *args)
    assert p.returncode == 0, p.stdout + p.stderr
    (first,) = _systems(root)
    before = {f: f.stat().st_mtime_ns for f in parquet_files(root, "encodings") + parquet_files(root, "runs")}
    shutil.rmtree(model)
    save_tiny_mlm(model, seed=1)  # "retrained": the same path, other weights
    p = cli("run", "--model", str(model), *args)
    assert p.returncode == 2
    assert f"its weights are not the ones system {first} was built from" in error_line(p)
    assert {f: f.stat().st_mtime_ns for f in before} == before
    shutil.copytree(model, tmp_path / "model-v2")
    p = cli("run", "--model", str(tmp_path / "model-v2"), *args)
    assert p.returncode == 0, p.stdout + p.stderr
    systems = _systems(root)
    assert len(systems) == 2 and first in systems and _metric_systems(root) == set(systems)
    assert all(f.stat().st_mtime_ns == t for f, t in before.items())  # the first model's files untouched


# -------------------------------------------------------------------------------------------------- SIGINT
SLOW_ENCODE = """
import time, diffret.stages.encode as enc
_encode = enc.encode_rows
def _slow(*a, **k):
    time.sleep(0.4)  # a slow model: the interrupt lands while shards are being encoded
    return _encode(*a, **k)
enc.encode_rows = _slow
"""


def test_sigint_stops_cleanly_and_the_same_command_resumes(tmp_path: Path, tiny_mlm: Path) -> None:
    corpus = [{"_id": f"d{i}", "title": "", "text": f"passage number {i} about cats and dogs"} for i in range(60)]
    folder = write_beir(tmp_path / "c", corpus, QUERIES, {"test": [("q1", "d1", 1), ("q2", "d2", 1)]})
    root = tmp_path / "store"
    args = (
        "run",
        "--source",
        str(folder),
        "--model",
        str(tiny_mlm),
        "--root",
        str(root),
        "--shard-size",
        "5",
        *SMALL_RUN,
    )
    proc = cli(*args, prelude=SLOW_ENCODE, background=True)
    try:
        deadline = time.monotonic() + 240
        while len(parquet_files(root, "encodings")) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out
    assert "interrupted: finished work is kept; run the same command again to resume" in out
    assert "Traceback" not in out
    assert not any((root / "_staging").iterdir()) if (root / "_staging").exists() else True
    assert cli("verify", "--root", str(root)).returncode == 0
    done = {f: f.stat().st_mtime_ns for f in parquet_files(root, "encodings")}
    assert done
    p = cli(*args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "single_dense" in p.stdout  # the leaderboard
    assert all(f.stat().st_mtime_ns == t for f, t in done.items())  # shards finished before the interrupt: kept
    assert cli("verify", "--root", str(root)).returncode == 0
