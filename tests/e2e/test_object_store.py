"""A store on an object store: an S3-compatible server started in this process (moto's server mode, on 127.0.0.1 and
a free port) holds ``s3://bucket/store``; the pipeline runs into it on scifact-mini with splade-tiny, then a score
whose units run on two Dask workers (separate processes, writing to the bucket themselves), evaluate, index, verify
and sql over it. Every run and metrics file is byte-identical to a local store's built by the same commands (its
units in this process), the SQL answers are the same, and the printed summary folder keeps its ``s3://``. The
environment the commands get is the one docs/operations.md shows (credentials, endpoint)."""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_harness import ENV, run
from conftest import SHARED

pytestmark = pytest.mark.e2e

moto_server = pytest.importorskip(
    "moto.server", reason="moto's server mode is not installed (pip install 'moto[server]', in the dev extras)"
)

SPLADE = SHARED / "models" / "splade-tiny-mlm"
MINI = SHARED / "fixtures" / "reference-parity" / "scifact-mini"
BUCKET = "bucket"
ROOT = f"s3://{BUCKET}/store"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """The server, an empty bucket, and the commands' environment (docs/operations.md, "A store on an object
    store"): credentials (any, for this server) and the endpoint s3fs reads from FSSPEC_S3_ENDPOINT_URL."""
    for need in (SPLADE / "model.safetensors", MINI / "corpus.jsonl"):
        if not need.exists():
            pytest.skip(f"{need} is absent")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        **ENV,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    try:
        import s3fs

        s3fs.S3FileSystem(
            key="testing", secret="testing", client_kwargs={"endpoint_url": env["FSSPEC_S3_ENDPOINT_URL"]}
        ).mkdir(BUCKET)
        yield env
    finally:
        server.stop()


def bucket_files(env: dict[str, str], pattern: str) -> dict[str, bytes]:
    """The bucket's store files matching ``pattern`` (a glob below the store root), by their path in it."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key="testing",
        secret="testing",
        client_kwargs={"endpoint_url": env["FSSPEC_S3_ENDPOINT_URL"]},
        use_listings_cache=False,
    )
    base = f"{BUCKET}/store/"
    return {p.removeprefix(base): fs.cat_file(p) for p in sorted(fs.glob(base + pattern))}


def local_files(root: Path, pattern: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob(pattern))}


def digests(files: dict[str, bytes]) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}


def in_process(*args: str) -> str:
    """``diffret *args`` in this process (the local store: no start-up to pay), its output; fails unless exit 0."""
    from typer.testing import CliRunner

    from diffret.flows.cli import app

    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, (args, res.output)
    return res.output


PIPELINE = ("run", "--preset", "laptop", "--source", str(MINI), "--model", str(SPLADE), "--kq", "1", "--kp", "1")
PIPELINE += ("--max-length", "64", "--mode", "single_dense")
SCORE = ("score", "-d", "scifact", "--model", str(SPLADE), "--kq", "1", "--kp", "1", "--mode", "sparse_max")
QUERY = "select system, mode, kq, kp, round(ndcg_10, 6) as ndcg from best_cells order by system, mode"


def test_a_store_on_an_object_store_holds_the_same_bytes_as_a_local_one(s3_env, tmp_path: Path) -> None:
    """The pipeline, then a score on two Dask workers, evaluate, index, verify and sql, into ``s3://bucket/store``
    (in subprocesses, with the documented environment), and the same commands into a local store (in this process,
    the score's units too): the same runs and metrics, byte for byte, and the same SQL answers."""
    local = str(tmp_path / "local")
    for args in (PIPELINE, SCORE, ("evaluate",)):
        in_process(*args, "--root", local)
    local_sql = in_process("sql", "--format", "json", "--root", local, QUERY)

    r = ("--root", ROOT)

    def s3(*args: str) -> str:
        p = run(*args, *r, env=s3_env)
        return " ".join((p.stdout + p.stderr).split())  # as printed, the terminal's wrapping undone

    assert f"summary, leaderboard and heatmaps: {ROOT}/summaries/system=" in s3(*PIPELINE)
    scored = s3(*SCORE, "--workers", "2")  # two worker processes write the units' files to the bucket
    assert "1 cell(s) scored" in scored and "on 2 Dask worker(s)" in scored, scored
    assert "1 run(s) evaluated" in s3("evaluate")
    assert "1 index(es) built" in s3("index", "-d", "scifact", "--model", str(SPLADE), "--kp", "1", "--type", "none")
    verified = s3("verify")
    assert "damaged" not in verified and "missing" not in verified, verified
    answer = run("sql", "--format", "json", *r, QUERY, env=s3_env).stdout
    assert json.loads(answer) == json.loads(local_sql) and len(json.loads(answer)) == 3, answer

    runs = digests(bucket_files(s3_env, "runs/**/run.parquet"))
    assert len(runs) == 3 and runs == digests(local_files(Path(local), "runs/**/run.parquet"))  # dense, sparse, bm25
    metrics = digests(bucket_files(s3_env, "metrics/**/per_query.parquet"))
    assert len(metrics) == 3 and metrics == digests(local_files(Path(local), "metrics/**/per_query.parquet"))
    assert len(bucket_files(s3_env, "index/**/_manifest.json")) == 1
    assert not bucket_files(s3_env, "partials/**") and not bucket_files(s3_env, "_staging/**")
