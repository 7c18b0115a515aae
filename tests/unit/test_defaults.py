"""Defaults that send users where they meant to go. `diffret score`, `index` and `beta` without K lists
take the K that are encoded (saying which) instead of the paper's whole grid; none encoded is one line naming
`encode`; `diffret bot` tokenizes the passages first, as `encode` does, instead of refusing until the tokens exist;
at K_q = K_p = 1 score skips multi_dense and its fusion as the reference evaluator does (saying so), and keeps them
with --q1p1-multi keep."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import write_beir
from tiny_models import save_tiny_mlm
from typer.testing import CliRunner

from diffret.flows.cli import app

CORPUS = [{"_id": f"d{i}", "title": f"t{i}", "text": f"passage {i} about cats dogs tea"} for i in range(6)]
QUERIES = [{"_id": f"q{i}", "text": f"what about cats {i}"} for i in range(3)]
QRELS = {"test": [("q0", "d0", 1), ("q1", "d1", 1), ("q2", "d2", 1)]}


def invoke(root: Path, *args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args), env={"DIFFRET_ROOT": str(root), "COLUMNS": "300"})
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("defaults")
    model = str(save_tiny_mlm(base / "model"))
    root = base / "store"
    code, out = invoke(root, "download", "c", "--source", str(write_beir(base / "c", CORPUS, QUERIES, QRELS)))
    assert code == 0, out
    downloaded = base / "downloaded"
    shutil.copytree(root, downloaded)
    code, out = invoke(root, "encode", "-d", "c", "--model", model, "--k", "1,2", "--max-length", "96")
    assert code == 0, out
    return {"root": root, "model": model, "downloaded": downloaded}


def copy(world: dict, tmp_path: Path, key: str = "root") -> Path:
    shutil.copytree(world[key], tmp_path / "store")
    return tmp_path / "store"


def test_score_index_and_beta_take_the_stored_budgets_and_say_which(world: dict, tmp_path: Path) -> None:
    root, model = copy(world, tmp_path), world["model"]
    code, out = invoke(root, "score", "-d", "c", "--model", model, "--mode", "single_dense")
    assert code == 0, out
    assert "K_q = 1, 2" in out and "K_p = 1, 2" in out and "4 cell(s) scored" in out, out
    assert sorted(
        p.parent.parent.parent.name + "/" + p.parent.parent.name
        for p in root.glob("runs/*/dataset=c/split=test/*/*/mode=single_dense/run.parquet")
    ) == ["kq=1/kp=1", "kq=1/kp=2", "kq=2/kp=1", "kq=2/kp=2"]
    code, out = invoke(root, "index", "-d", "c", "--model", model, "--type", "none")
    assert code == 0 and "K_p = 1, 2" in out and "2 index(es) built" in out, out
    code, out = invoke(root, "bot", "-d", "c", "--model", model, "--max-length", "96")
    assert code == 0, out
    code, out = invoke(root, "beta", "-d", "c", "--model", model)
    assert code == 0 and "K_q = 1, 2" in out and "2 run(s) written" in out, out


def test_no_stored_budget_is_one_line_naming_encode(world: dict, tmp_path: Path) -> None:
    root, model = copy(world, tmp_path), world["model"]
    shutil.rmtree(next(root.glob("encodings/*/dataset=c/side=passage")))
    code, out = invoke(root, "score", "-d", "c", "--model", model)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "no passage encodings of 'c'" in errors[0], out
    assert "diffret encode -d c --side passage" in errors[0]


def test_bot_tokenizes_the_passages_first_as_encode_does(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path, "downloaded")  # the dataset only: no tokens yet
    code, out = invoke(root, "bot", "-d", "c", "--model", world["model"], "--max-length", "96")
    assert code == 0 and "1 index(es) built" in out, out
    assert list(root.glob("tokens/*/dataset=c/side=passage/shard=*.parquet"))
    assert not list(root.glob("tokens/*/dataset=c/side=query"))  # the passages only: what the index reads
    code, out = invoke(root, "verify")
    assert code == 0, out


def test_q1_p1_skips_multi_dense_as_the_reference_unless_kept(world: dict, tmp_path: Path) -> None:
    root, model = copy(world, tmp_path), world["model"]
    code, out = invoke(root, "score", "-d", "c", "--model", model, "--kq", "1", "--kp", "1")
    assert code == 0 and "3 cell(s) scored" in out, out
    assert "multi_dense, fusion_multi_sparse_max not scored, as the reference evaluator does" in out, out
    modes = lambda: sorted(p.name for p in root.glob("runs/*/dataset=c/split=test/kq=1/kp=1/mode=*"))  # noqa: E731
    assert modes() == ["mode=fusion_single_sparse_max", "mode=single_dense", "mode=sparse_max"]
    code, out = invoke(root, "score", "-d", "c", "--model", model, "--kq", "1", "--kp", "1", "--q1p1-multi", "keep")
    assert code == 0 and "2 cell(s) scored, 3 already done" in out, out
    assert len(modes()) == 5
