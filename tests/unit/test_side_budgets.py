"""Each side is encoded at its own budgets: `diffret run --kq 4 --kp 16` makes one query pass (K = 4) and one
passage pass (K = 16), not a pass of each side at both; `diffret encode --kq/--kp` the same."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import write_beir
from tiny_models import save_tiny_mlm
from typer.testing import CliRunner

from diffret.flows.cli import app
from diffret.stages.encode import EncodeConfig
from diffret.stages.pipeline import PipelineConfig

CORPUS = [{"_id": f"d{i}", "title": f"t{i}", "text": f"passage {i} about cats dogs tea and gardens"} for i in range(6)]
QUERIES = [{"_id": f"q{i}", "text": f"what about cats {i}"} for i in range(3)]
QRELS = {"test": [("q0", "d0", 1), ("q1", "d1", 1), ("q2", "d2", 1)]}

pytestmark = pytest.mark.usefixtures("one_thread")


def passes(root: Path) -> list[str]:
    """Every encoding pass in the store: side and K of each encodings folder."""
    return sorted(f"{p.parent.name}/{p.name}" for p in root.glob("encodings/*/*/side=*/k=*"))


def invoke(*args: str) -> str:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def test_run_encodes_queries_at_kq_and_passages_at_kp_only(tmp_path: Path) -> None:
    model = save_tiny_mlm(tmp_path / "model")
    beir = write_beir(tmp_path / "c", CORPUS, QUERIES, QRELS)
    root = tmp_path / "store"
    invoke(
        "run",
        "-d",
        "c",
        "--source",
        str(beir),
        "--model",
        str(model),
        "--kq",
        "4",
        "--kp",
        "16",
        "--max-length",
        "48",
        "--mode",
        "multi_dense",
        "--no-bm25",
        "--root",
        str(root),
    )
    assert passes(root) == ["side=passage/k=16", "side=query/k=4"]  # one pass per side
    # the same settings through `diffret encode`: nothing left to do
    out = invoke(
        "encode", "-d", "c", "--model", str(model), "--kq", "4", "--kp", "16", "--max-length", "48", "--root", str(root)
    )
    assert "0 shard(s) encoded" in out, out
    # another passage budget adds a passage pass alone
    invoke(
        "encode",
        "-d",
        "c",
        "--model",
        str(model),
        "--kq",
        "4",
        "--kp",
        "16,2",
        "--max-length",
        "48",
        "--root",
        str(root),
    )
    assert passes(root) == ["side=passage/k=16", "side=passage/k=2", "side=query/k=4"]


def test_a_side_without_its_own_budgets_takes_k() -> None:
    cfg = EncodeConfig(dataset="d", k=[1, 8], kq=[2])
    assert cfg.budgets("query") == [2] and cfg.budgets("passage") == [1, 8]
    (enc,) = PipelineConfig(dataset="scifact", kq=[4], kp=[16]).encodes()
    assert enc.budgets("query") == [4] and enc.budgets("passage") == [16]
    with pytest.raises(ValueError, match="beyond --max-length"):
        EncodeConfig(dataset="d", k=[1], kp=[64], max_length=32)


def test_a_side_read_a_batch_at_a_time_gives_each_shard_its_rows() -> None:
    """The tokenize stage reads the corpus in batches (memory: a shard, not the corpus): any batch sizes and any
    subset of shard ranges give the rows a whole-side read gives them."""
    import random

    from diffret.stages.readers import cut_ranges

    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(0, 40)
        ids, texts = list(range(n)), [str(i) for i in range(n)]
        batches, i = [], 0
        while i < n:
            k = rng.randint(1, 7)
            batches.append((ids[i : i + k], texts[i : i + k]))
            i += k
        size = rng.randint(1, 6)
        shards = [(s, min(s + size, n)) for s in range(0, n, size)] or [(0, 0)]
        todo = [r for r in shards if rng.random() < 0.6] or shards[:1]
        got = list(cut_ranges(iter(batches), todo))
        assert got == [(s, e, ids[s:e], texts[s:e]) for s, e in sorted(todo)], (n, batches, todo)
