"""Issue 22, must-show 3: every kind of stage folder (dataset, tokens, encodings, runs, metrics, index, models,
summaries) x four faults (manifest deleted, a file truncated, a byte flipped, the manifest edited by hand):
`diffret verify` names the damage with its repair, SQL on the views that do not read it keeps working meanwhile,
and the repair (the command that made the folder, run again: the one `verify` prints) restores it, after which
`verify` is clean. The CLI runs in this process (typer's runner) to keep the 32 cases fast.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import write_beir
from tiny_models import save_tiny_mlm
from typer.testing import CliRunner

from flows.cli import app

CORPUS = [{"_id": f"d{i}", "title": f"t{i}", "text": f"passage {i} about cats dogs tea and gardens"} for i in range(8)]
QUERIES = [{"_id": f"q{i}", "text": f"what about cats {i}"} for i in range(3)]
QRELS = {"test": [("q0", "d0", 1), ("q1", "d1", 1), ("q2", "d2", 1)]}
GRID = ["--kq", "1", "--kp", "1", "--max-length", "32", "--mode", "single_dense", "--mode", "sparse_max"]

# kind -> (a glob of its folders, the view that reads it or None, a view that does not)
KINDS = {
    "dataset": ("datasets/dataset=c", "corpus", "runs"),
    "tokens": ("tokens/*/dataset=c/side=passage", "tokens", "corpus"),
    "encodings": ("encodings/*/dataset=c/side=passage/k=1", "encodings", "corpus"),
    "runs": ("runs/*/dataset=c/split=test/kq=1/kp=1/mode=single_dense", "runs", "corpus"),
    "metrics": ("metrics/*/dataset=c/split=test/kq=1/kp=1/mode=single_dense", "metrics", "corpus"),
    "index": ("index/*/dataset=c/kp=1", None, "corpus"),
    "models": ("models/model=tiny-ft", "train_log", "corpus"),
    "summaries": ("summaries/*/dataset=c/split=test", None, "corpus"),
}
FAULTS = ("delete manifest", "truncate", "flip byte", "edit manifest")


def invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("faults")
    model = save_tiny_mlm(base / "model")
    beir = write_beir(base / "c", CORPUS, QUERIES, QRELS)
    root = str(base / "store")
    commands = {
        "run": ["run", "--dataset", "c", "--source", str(beir), "--model", str(model), *GRID, "--root", root],
        "index": ["index", "-d", "c", "--model", str(model), "--kq", "1", "--kp", "1", "--type", "none", "--root",
                  root],  # fmt: skip
        "training": ["training-data", "-d", "c", "--split", "test", "--n-negatives", "3", "--root", root],
        "train": ["train", "-t", "c", "--model", str(model), "--full", "--kq", "1", "--kp", "1", "--n-negatives", "3",
                  "--batch-size", "2", "--pool-size", "2", "--global-batch", "2", "--max-steps", "2", "--q-max-len",
                  "8", "--p-max-len", "12", "--name", "tiny-ft", "--root", root],  # fmt: skip
    }
    code, out = invoke(*commands["run"][:-2], "--split", "test", "--root", root)
    assert code == 0, out
    for name in ("index", "training", "train"):
        code, out = invoke(*commands[name])
        assert code == 0, (name, out)
    code, out = invoke("verify", "--root", root)
    assert code == 0, out
    repairs = {
        "dataset": [commands["run"]], "tokens": [[*commands["run"], "--verify"]],
        "encodings": [[*commands["run"], "--verify"]], "runs": [commands["run"]], "metrics": [commands["run"]],
        "index": [commands["index"]], "models": [commands["train"]], "summaries": [commands["run"]],
    }  # fmt: skip
    return {"root": Path(root), "repairs": repairs}


def damage(folder: Path, fault: str) -> None:
    manifest = folder / "_manifest.json"
    m = json.loads(manifest.read_text())
    name = sorted(m["files"], key=lambda n: (not n.endswith(".parquet"), n))[0]
    target = folder / name
    if fault == "delete manifest":
        manifest.unlink()
    elif fault == "truncate":
        target.write_bytes(target.read_bytes()[: max(1, target.stat().st_size // 3)])
    elif fault == "flip byte":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        m["files"][name]["sha256"] = "f" * 64
        manifest.write_text(json.dumps(m))


def count(root: Path, view: str) -> int:
    code, out = invoke("sql", "--root", str(root), "--format", "csv", f"select count(*) from {view}")
    assert code == 0, out
    return int(out.splitlines()[1])


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_damage_is_named_isolated_and_repaired(world: dict, tmp_path: Path, kind: str, fault: str) -> None:
    root = tmp_path / "store"
    shutil.copytree(world["root"], root, symlinks=True)
    pattern, view, other = KINDS[kind]
    (folder,) = list(root.glob(pattern))
    before_other = count(root, other)
    damage(folder, fault)
    code, out = invoke("verify", "--root", str(root))
    assert code == 1 and str(folder) in out and "repair: run `diffret" in out, out
    assert count(root, other) == before_other  # every other view keeps working
    if view is not None:  # its view fails alone, naming it (a flipped byte DuckDB may read through: --verify)
        verify = ["--verify"] if fault == "flip byte" else []
        code, out = invoke("sql", "--root", str(root), *verify, f"select count(*) from {view}")
        assert code == 2 and "repair:" in out and str(folder) in out, out
    for args in world["repairs"][kind]:
        rel = [str(root) if a == str(world["root"]) else a for a in args]
        code, out = invoke(*rel)
        assert code == 0, (rel, out)
    code, out = invoke("verify", "--root", str(root))
    assert code == 0, out
    assert os.path.exists(folder / "_manifest.json")
