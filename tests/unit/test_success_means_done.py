"""Exit 0 means the command did what was asked: each way a command once exited 0 doing something else (selectors
that disagree, a damaged stored model, duplicated negatives, mislabelled or empty outputs, SQL over a changed file,
a stored collection by name offline, misleading output), through the CLI in this process (typer's runner): exit 2
with one error line naming the cause and the repair, nothing written, or the correct result.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, write_beir
from tiny_models import save_tiny_mlm
from typer.testing import CliRunner

from diffret.flows.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")

# 40 passages; each query names its passage's own word, so BM25 finds it; the test split's passages come last
CORPUS = [{"_id": f"d{i:02d}", "title": f"t{i}", "text": f"passage {i} about word{i} and tea"} for i in range(40)]
QUERIES = [{"_id": f"q{i}", "text": f"what about word{i}"} for i in (37, 38, 39, 3, 4, 5, 6)]
QRELS = {
    "test": [(f"q{i}", f"d{i:02d}", 1) for i in (37, 38, 39)],
    "train": [(f"q{i}", f"d{i:02d}", 1) for i in (3, 4, 5)],
    "dev": [("q6", "d06", 1)],
}
TINY_PROMPT = str(Path(__file__).parent / "data" / "rerank_tiny.yaml")
ENCODE = ["--max-length", "32", "--shard-size", "20"]
RERANK = ["--method", "logits_listwise", "--prompt", TINY_PROMPT, "--doc-tokens", "8", "--depth", "5"]


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args), env=env)
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output


def ok(*args: str) -> str:
    code, out = invoke(*args)
    assert code == 0, (args, out)
    return out


def refused(*args: str) -> str:
    """The one error line of a command that must exit 2."""
    code, out = invoke(*args)
    lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(lines) == 1, (args, out)
    return lines[0]


def files_of(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and "_locks" not in p.parts
    }


def sql(root: Path, query: str) -> list[list[str]]:
    return [ln.split(",") for ln in ok("sql", "--root", str(root), "--format", "csv", query).splitlines()[1:]]


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A store: the collection, a tiny BERT's 1 x 1 grid on test and train, BM25, their metrics, a reranker
    trained with LoRA for one step."""
    base = tmp_path_factory.mktemp("silent")
    model = save_tiny_mlm(base / "model")
    beir = write_beir(base / "c", CORPUS, QUERIES, QRELS)
    root = base / "store"
    r = ["--root", str(root)]
    ok("download", "c", "--source", str(beir), *r)
    ok("encode", "-d", "c", "--model", str(model), "--k", "1", *ENCODE, *r)
    ok("score", "-d", "c", "--kq", "1", "--kp", "1", "--q1p1-multi", "keep", "--split", "test", "--split", "train", *r)
    ok("bm25", "-d", "c", "--split", "test", "--split", "train", *r)
    ok("evaluate", *r)
    ok(
        "train-reranker",
        "-d",
        "c",
        "--model",
        str(model),
        *RERANK[:6],
        "--list-size",
        "3",
        "--batch-size",
        "1",
        "--grad-accum",
        "1",
        "--max-steps",
        "1",
        "--name",
        "tiny-rr",
        *r,
    )
    system = json.loads(ok("systems", *r, "--format", "json"))
    slug = next(s["system"] for s in system if s["kind"] == "encoder")
    bm25 = next(s["system"] for s in system if s["kind"] == "bm25")
    return {"base": base, "model": model, "beir": beir, "root": root, "system": slug, "bm25": bm25}


def copy(world: dict, tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(world["root"], root)
    return root


# ----------------------------------------------------------------------------- 1. selectors that disagree
def test_a_slug_and_selectors_that_do_not_describe_it_are_refused_naming_both(world: dict) -> None:
    root, slug = world["root"], world["system"]
    before = files_of(root)
    for extra, named in (
        (["--store", "pq:16"], "--store pq:16"),
        (["--dtype", "bfloat16"], "--dtype bfloat16"),
        (["--readout", "promptreps"], "--readout promptreps"),
        (["--model", str(world["beir"])], f"--model {world['beir']}"),
    ):
        line = refused("score", "-d", "c", "--system", slug, *extra, "--kq", "1", "--kp", "1", "--root", str(root))
        assert f"--system {slug}" in line and named in line, line
    assert files_of(root) == before
    # selectors that describe it are fine (nothing to do: its cells are scored)
    out = ok(
        "score",
        "-d",
        "c",
        "--system",
        slug,
        "--model",
        str(world["model"]),
        "--dtype",
        "float32",
        "--kq",
        "1",
        "--kp",
        "1",
        "--root",
        str(root),
    )
    assert "0 cell(s) scored" in out


# ------------------------------------------------------------------------------- 2. a damaged stored model
def test_a_stored_model_failing_its_manifest_is_refused_before_it_is_loaded(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    folder = root / "models" / "model=tiny-rr"
    weights = folder / "adapter_model.safetensors"
    assert weights.exists() and (folder / "_manifest.json").exists()  # LoRA: the adapter alone
    flip(weights)
    before = files_of(root)
    line = refused(
        "rerank", "-d", "c", "--model", str(folder), *RERANK, "--window", "3", "--step", "1", "--root", str(root)
    )
    assert str(weights) in line and "does not match the manifest" in line and "repair: run `diffret" in line, line
    assert files_of(root) == before  # no run, no reranker system


# ---------------------------------------------------------------------- 3. duplicated negatives, a pool too big
def test_negatives_are_distinct_and_a_pool_that_cannot_fit_is_refused(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    r = ["--root", str(root)]
    out = ok("training-data", "-d", "c", "--depth", "10", "--n-negatives", "1000", *r)
    assert "3 group(s) have fewer than 1,000 distinct negatives in the run's top 10" in out, out
    groups = pq.read_table(root / "training" / "set=c" / "groups.parquet").to_pylist()
    ids = [[p["docid"] for p in g["negative_passages"]] for g in groups]
    assert [(len(x), len(set(x))) for x in ids] == [(9, 9)] * 3  # the top 10 less the positive, each once
    line = refused("train", "-t", "c", "--model", str(world["model"]), "--n-negatives", "1000", *r)
    assert "stores at most 9 per group" in line  # drawn again and again otherwise
    train = [
        "train",
        "-t",
        "c",
        "--model",
        str(world["model"]),
        "--full",
        "--kq",
        "1",
        "--kp",
        "1",
        "--n-negatives",
        "9",
        "--batch-size",
        "2",
        "--pool-size",
        "2",
        "--global-batch",
        "2",
        "--max-steps",
        "1",
        *r,
    ]
    line = refused(*train, "--memory-gb", "0.0001")
    assert "a training step would need about" in line and "--memory-gb 0.0001" in line and "--batch-size" in line
    assert not (root / "models" / "model=tiny-ft").exists() and not list(root.glob("models/model=tiny-ft*"))
    out = ok(*train)  # the same pool in the memory there is
    assert "1 model(s) trained" in out and "Loading weights" not in out  # 7: no library progress bar without -v


# ------------------------------------------------------------------------- 4. labels that say what was done
def test_late_m_beyond_the_first_stage_depth_is_capped_and_recorded_as_such(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    out = ok(
        "late",
        "-d",
        "c",
        "--system",
        world["system"],
        "--mode",
        "single_dense",
        "--depth",
        "5,100000",
        "--root",
        str(root),
    )
    assert "m 100,000 is capped at 1,000, the first stage's depth" in out, out  # BM25 keeps 1,000 a query
    modes = sorted(p.name for p in root.glob(f"runs/system={world['system']}/dataset=c/split=test/*/*/mode=late_*"))
    assert modes == ["mode=late_single_dense_m1000", "mode=late_single_dense_m5"]
    m = json.loads(
        (
            root / f"runs/system={world['system']}/dataset=c/split=test/kq=1/kp=1/"
            "mode=late_single_dense_m1000/_manifest.json"
        ).read_text()
    )
    assert m["config"]["topk"] == 1000


def test_a_summary_of_nothing_is_refused_and_writes_nothing(world: dict) -> None:
    root = world["root"]
    before = files_of(root)
    line = refused("summary", "-d", "nosuch", "--root", str(root))
    assert f"no metrics of {world['system']} on nosuch/test" in line and "c/test" in line, line
    line = refused("summary", "-d", "c", "--split", "dev", "--root", str(root))  # judged, never scored
    assert "on c/dev" in line and "diffret score -d c --split dev" in line, line
    assert files_of(root) == before


def test_evaluate_of_a_dataset_system_or_split_no_run_has_is_refused_naming_the_stored_ones(world: dict) -> None:
    root = world["root"]
    before = files_of(root)
    line = refused("evaluate", "-d", "nosuch", "--root", str(root))
    assert "no stored run has dataset 'nosuch' (-d); the stored runs' datasets: c " in line, line
    line = refused("evaluate", "--system", "nosuch", "--root", str(root))
    assert "system 'nosuch' (--system)" in line and world["system"] in line and world["bm25"] in line, line
    line = refused("evaluate", "-d", "c", "--split", "dev", "--root", str(root))  # judged, never scored
    assert "split 'dev' (--split); the stored runs' splits: test, train " in line, line
    assert files_of(root) == before
    assert "0 run(s) evaluated" in ok("evaluate", "-d", "c", "--split", "test", "--root", str(root))


def test_a_summary_rebuilt_without_its_manifest_keeps_bm25_and_p_values(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    ok("summary", "-d", "c", "--bm25", world["bm25"], "--root", str(root))
    (folder,) = root.glob("summaries/*/dataset=c/split=test")
    first = (folder / "leaderboard.csv").read_text()
    assert "bm25" in first
    (folder / "_manifest.json").unlink()
    ok("summary", "-d", "c", "--root", str(root))  # as `verify` repairs it: the stage again, no --bm25
    assert (folder / "leaderboard.csv").read_text() == first
    board = json.loads((folder / "_manifest.json").read_text())["stats"]["leaderboard"]
    assert [r["mode"] for r in board if r["mode"] == "bm25"] and all(
        r["p_vs_bm25"] is not None for r in board if r["mode"] != "bm25"
    )


def test_settings_that_make_a_stage_nonsense_are_refused(world: dict) -> None:
    root = world["root"]
    before = files_of(root)
    line = refused(
        "rerank",
        "-d",
        "c",
        "--model",
        str(world["model"]),
        *RERANK,
        "--window",
        "5",
        "--step",
        "10",
        "--root",
        str(root),
    )
    assert "--step 10 is larger than --window 5" in line
    line = refused("budget", "-d", "c", "--model", str(world["model"]), "--folds", "1000", "--root", str(root))
    assert "--folds 1000 but c/train has 3 queries to learn from" in line, line
    assert files_of(root) == before


# ------------------------------------------------------------------------------ 5. SQL over a damaged file
def test_sql_checks_size_and_mtime_before_a_view_reads_a_file(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    query = "select count(*), sum(len(dense)) from encodings"
    assert sql(root, query)
    (shard, *_) = sorted(root.glob("encodings/*/dataset=c/side=passage/k=1/shard=*.parquet"))
    flip(shard)
    res = CliRunner().invoke(app, ["sql", "--root", str(root), "--format", "csv", query])  # no --verify
    warned = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert res.exit_code == 0 and len(warned) == 1 and str(shard) in warned[0], res.output  # its folder left out,
    assert "repair: run `diffret encode --verify" in warned[0]  # named with its repair, not read changed
    assert int(res.stdout.splitlines()[1].split(",")[0]) == 7  # the queries' folder is read; the passages' is not
    assert sql(root, "select count(*) from corpus") == [["40"]]  # the views that do not read it work


# --------------------------------------------------------------------------- 6. a stored collection by name
def test_a_downloaded_collection_is_used_by_name_offline(world: dict, tmp_path: Path, monkeypatch) -> None:
    from diffret.retrieval.data import sources as sources

    def offline(url: str, *a: object, **k: object) -> None:
        raise sources.DownloadError(f"{url}: no network in this test")

    monkeypatch.setattr(sources, "download", offline)
    grid = ["--kq", "1", "--kp", "1", "--mode", "single_dense", *ENCODE]
    # a mirror's name: -d c, no --source (the world downloaded it from a folder)
    root = copy(world, tmp_path)
    out = ok("run", "-d", "c", "--model", str(world["model"]), *grid, "--root", str(root))
    assert "download c: unchanged" in out and "bm25" in out
    # the README's: `download --source DIR` under the default name, then `run --model M --root R`
    fresh = tmp_path / "fresh"
    ok("download", "scifact", "--source", str(world["beir"]), "--root", str(fresh))
    dead = dead_mlm(tmp_path / "dead")
    out = ok("run", "--model", str(dead), *grid, "--root", str(fresh))
    assert "download scifact: unchanged" in out and "NDCG@10" in out
    # 7: its best cell is far under BM25's: said after the leaderboard
    assert "warning: " in out and "scores near chance on scifact/test" in out, out


def dead_mlm(folder: Path) -> Path:
    """A tiny MLM that reads every text alike (its last layer's norm a constant) with all-negative logits: every
    document ties, so it ranks them in corpus order (the judged ones last here) with empty sparse vectors."""
    import torch
    from transformers import BertForMaskedLM

    save_tiny_mlm(folder)
    model = BertForMaskedLM.from_pretrained(folder)
    with torch.no_grad():
        norm = model.bert.encoder.layer[-1].output.LayerNorm
        norm.weight.zero_()
        norm.bias.copy_(torch.linspace(0.5, 1.5, norm.bias.numel()))
        model.cls.predictions.bias.fill_(-100.0)
    model.save_pretrained(folder)
    return folder


# -------------------------------------------------------------------- 7. what the output says and where
def test_the_heatmap_scale_runs_from_0_to_bm25_drawn_on_it(monkeypatch) -> None:
    import numpy as np

    from diffret.retrieval.analysis import figures as figures

    seen = []
    monkeypatch.setattr(figures, "_png", lambda fig: seen.append(fig) or b"")
    grid = np.array([[0.0017, 0.0033], [0.002, 0.0025]])
    figures.heatmap_png([1, 4], [1, 4], grid, "noise", reference=0.676)
    figures.heatmap_png([1, 4], [1, 4], grid, "no reference")
    (with_bm25, without) = seen
    low, high = with_bm25.axes[0].images[0].get_clim()
    assert low == 0.0 and 0.676 < high < 0.72  # BM25 on the scale, its line just below the top
    assert "BM25 0.676" in with_bm25.axes[1].get_ylabel()
    assert [line.get_ydata()[0] for line in with_bm25.axes[1].lines] == [0.676]
    assert without.axes[0].images[0].get_clim() == (0.0017, 0.0033)  # a grid alone keeps its own range


def test_help_fits_80_columns_and_library_noise_needs_v() -> None:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, "-m", "diffret.flows.cli", "run", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and "--model" in p.stdout and "--verbose" not in p.stdout
    assert max(map(len, lines)) <= 80 and len(lines) <= 170, (len(lines), max(map(len, lines)))  # ~600 before; 162
    import logging
    import warnings

    from diffret.flows.display import QUIET_LOGGERS

    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    code, out = invoke("views", "--root", str(REPO / "nonexistent-store"))  # any command: the libraries quiet
    assert code == 2 and logging.getLogger("transformers").level == logging.ERROR
    with warnings.catch_warnings(record=True) as caught:
        invoke("views", "--root", str(REPO / "nonexistent-store"))
        warnings.warn("a library's notice", UserWarning, stacklevel=1)
    assert not caught
    invoke("-v", "views", "--root", str(REPO / "nonexistent-store"))
    assert logging.getLogger("transformers").level == logging.INFO
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
