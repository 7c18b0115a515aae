"""Compressed encodings end to end on ../shared: the random-weight tiny Dream (its real code path and
tokenizer) on scifact-mini, through the command line. `diffret compress` of the float16 grid then `diffret score`
gives the runs of `diffret run --store` from the start; the report's Compression section and the views measure
both."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cli_harness import run, sql
from conftest import SHARED

MINI = SHARED / "fixtures" / "reference-parity" / "scifact-mini"
DREAM = SHARED / "models" / "tiny-dream-random"
GRID = [
    "-d",
    "scifact-mini",
    "--kq",
    "1,4",
    "--kp",
    "1,4",
    "--max-length",
    "128",
    "--split",
    "test",
    "--no-bm25",
    "--batch-size",
    "8",
]

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    if not (MINI / "corpus.jsonl").exists() or not (DREAM / "config.json").exists():
        pytest.skip("../shared scifact-mini or models/tiny-dream-random is absent")
    base = tmp_path_factory.mktemp("compress")
    a, b = base / "a", base / "b"
    run("run", "--source", str(MINI), "--root", str(a), "--model", str(DREAM), *GRID)  # float16
    for to in ("residual:2", "int8"):
        run(
            "compress",
            "-d",
            "scifact-mini",
            "--model",
            str(DREAM),
            "--store",
            to,
            "--store-seed",
            "5",
            "--root",
            str(a),
        )
        run(
            "score",
            "-d",
            "scifact-mini",
            "--model",
            str(DREAM),
            "--store",
            to,
            "--kq",
            "1,4",
            "--kp",
            "1,4",
            "--split",
            "test",
            "--root",
            str(a),
        )
    run("evaluate", "--root", str(a))
    run(
        "run",
        "--source",
        str(MINI),
        "--root",
        str(b),
        "--model",
        str(DREAM),
        *GRID,
        "--store",
        "residual:2",
        "--store-seed",
        "5",
    )
    return {"a": a, "b": b}


def test_compress_then_score_gives_the_runs_of_encoding_with_the_store(stores: dict[str, Path]) -> None:
    a, b = stores["a"], stores["b"]
    systems = sql(b, "select system, store, float16_system from compressed_systems")
    assert len(systems) == 1 and systems[0]["store"] == "residual:2"
    slug = systems[0]["system"]
    assert "-residual2-" in slug and slug in {r["system"] for r in sql(a, "select system from compressed_systems")}
    runs_a = sorted((a / "runs" / f"system={slug}").rglob("run.parquet"))
    runs_b = sorted((b / "runs" / f"system={slug}").rglob("run.parquet"))
    assert len(runs_a) == len(runs_b) == 2 * 2 * 5 - 2  # no multi_dense, fusion_multi at q1-p1
    for x, y in zip(runs_a, runs_b, strict=True):
        assert x.relative_to(a) == y.relative_to(b) and pq.read_table(x).equals(pq.read_table(y)), x
    assert not (b / "encodings" / f"system={systems[0]['float16_system']}").exists()  # no float16 copy kept
    cells_a = sql(a, f"select kq, kp, mode, ndcg_10 from cells where system = '{slug}' order by all")
    assert cells_a == sql(b, f"select kq, kp, mode, ndcg_10 from cells where system = '{slug}' order by all")


def test_the_report_measures_each_choice_against_float16(stores: dict[str, Path], tmp_path: Path) -> None:
    a = stores["a"]
    sizes = sql(a, "select store, kp, bytes_per_vector from vector_bytes order by store, kp")
    by = {(r["store"], r["kp"]): r["bytes_per_vector"] for r in sizes}
    for kp in (1, 4):  # Dream's tiny width: the codes are a fraction of float16's
        assert by["int8", kp] < 0.7 * by["float16", kp] and by["residual:2", kp] < 0.35 * by["float16", kp]
    effect = sql(a, "select store, count(*) n, max(abs(ndcg_10_change)) worst from compression_effect group by 1")
    assert {r["store"]: r["n"] for r in effect} == {"int8": 18, "residual:2": 18}  # q1-p1: no multi_dense
    out = tmp_path / "report"
    run("report", "--root", str(a), "--name", "compress-e2e", "--n-boot", "20", "--out", str(out))
    md = (out / "report.md").read_text()
    assert "## Compression" in md and "| residual:2 | scifact-mini |" in md
    assert (out / "compression.png").read_bytes()[:4] == b"\x89PNG"
    # the codebook is named by verify when damaged, and a corrupted one is refused by score
    cb = next((a / "codebooks").rglob("codebook.npz"))
    shutil.copy(cb, tmp_path / "keep.npz")
    data = bytearray(cb.read_bytes())
    data[100] ^= 0xFF
    cb.write_bytes(bytes(data))
    p = run("verify", "--root", str(a), check=False)
    assert p.returncode != 0 and "codebook.npz" in p.stdout + p.stderr and "diffret compress" in p.stdout + p.stderr
    shutil.copy(tmp_path / "keep.npz", cb)
