"""The device check (benchmarks/device_check.py) on this CPU with tiny shapes, as CI runs it between GPU loans: the
whole plan cut to about a minute (every part runs and records its figures, in the JSON shaped as the docs' fixture
is), and each part made to fail in turn, by an injected error and by a process that hangs past its timeout: the other
parts still run and the JSON keeps every figure measured. A part of the SciFact mini collection (12 passages, 6
queries) and the tiny Dream and LLaDA folders' tokenizers come from ../shared (skipped when absent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SHARED

REPO = Path(__file__).resolve().parents[2]
MINI = SHARED / "fixtures" / "reference-parity" / "scifact-mini"
MODELS = {"dream": SHARED / "models" / "tiny-dream-random", "llada": SHARED / "models" / "tiny-llada-random"}
QUERIES, PASSAGES = 6, 12  # of the mini collection: the smoke's stages encode, score and late-score these
FIXTURE = REPO / "tests" / "unit" / "data" / "device_check_fixture.json"
PARTS = ("stages", "score", "tests", "encode_dream", "encode_llada")
# the tiny plan cut to about a minute: 50 passages, one length and batch, one timed run, the encode stage in its
# own process (no Dask cluster to start)
# fmt: off
SMOKE = ["--tiny", "--device", "cpu", "--dtype", "float32", "--stage-passages", "0", "--stage-batch", "32",
         "--stage-workers", "0", "--rows", "4", "--lengths", "115", "--batches", "4", "--repeats", "1",
         "--score-passages", "100"]
# fmt: on


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What device_prepare.py makes, from ../shared: the collection and the model folders (random weights: no
    weight file is read)."""
    if not (MINI / "corpus.jsonl").exists() or not all((m / "config.json").exists() for m in MODELS.values()):
        pytest.skip("../shared fixtures or models are absent")
    dev = tmp_path_factory.mktemp("dev")
    data = dev / "data" / "scifact-sub"
    (data / "qrels").mkdir(parents=True)
    header, *qrels = (MINI / "qrels" / "test.tsv").read_text().splitlines()
    queries = sorted({line.split("\t")[0] for line in qrels})[:QUERIES]
    qrels = [line for line in qrels if line.split("\t")[0] in queries]
    judged = {line.split("\t")[1] for line in qrels}
    corpus = (MINI / "corpus.jsonl").read_text().splitlines()
    corpus.sort(key=lambda d: json.loads(d)["_id"] not in judged)
    (data / "corpus.jsonl").write_text("\n".join(corpus[: max(PASSAGES, len(judged))]) + "\n")
    lines = (MINI / "queries.jsonl").read_text().splitlines()
    (data / "queries.jsonl").write_text("\n".join(q for q in lines if json.loads(q)["_id"] in queries) + "\n")
    (data / "qrels" / "test.tsv").write_text("\n".join([header, *qrels]) + "\n")
    (dev / "models").mkdir()
    for name, folder in MODELS.items():
        (dev / "models" / name).symlink_to(folder)
    return dev


def check(dev: Path, tmp: Path, *extra: str) -> tuple[dict, float, str]:
    """The device check as the lent machine runs it (a process of its own, NLTK_DATA set elsewhere): its JSON, wall
    time and output."""
    env = {**os.environ, "NLTK_DATA": str(tmp / "nowhere"), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(REPO / "benchmarks" / "device_check.py"), *SMOKE, "--dev", str(dev)]
    cmd += ["--out", str(tmp / "out"), "--store", str(tmp / "store"), *extra]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    seconds = time.perf_counter() - t
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((tmp / "out" / "device_check.json").read_text()), seconds, p.stdout


def figures(part: dict) -> list[dict]:
    return [r for r in part["rows"] if "skipped" not in r]


def assert_measured(name: str, part: dict, whole: bool = True) -> None:
    """The part's figures are there: every one when it ran to its end, else the first."""
    rows = figures(part)
    assert rows, (name, part)
    if name == "stages":
        want = ["download", "tokenize", "encode", "score", "late", "evaluate"] if whole else ["download"]
        assert [r["stage"] for r in rows] == want and all(r["seconds"] > 0 for r in rows), part
        assert not whole or part["system"].startswith("random-"), part
    elif name == "score":
        assert all(r["search_pass_s"] > 0 and r["bare_s"] > 0 and r["top10_agreement"] > 0.5 for r in rows), part
        assert not whole or len(rows) == 2, part  # as stored, and tiled to --score-passages
    elif name == "tests":
        assert rows[0]["returncode"] == 0 and "skipped" in rows[0]["summary"], part  # no GPU: each test skips
    else:
        assert all(r["diffret_docs_s"] > 0 and r["bare_docs_s"] > 0 and r["k16_over_k1"] > 0 for r in rows), part
        assert part["params"] > 0 and rows[0]["model"] == name.removeprefix("encode_"), part
    assert part["gpu_peak_gib"] is None and part["gpu_used_peak_gib"] is None, part  # a CPU


def keys(x: object, path: str = "") -> set[str]:
    """Every key path of a JSON value (list items merged), the plan's and the arguments' left out."""
    if isinstance(x, dict):
        return {f"{path}.{k}" for k in x} | {
            p for k, v in x.items() if k not in ("args",) for p in keys(v, f"{path}.{k}")
        }
    if isinstance(x, list):
        return {p for v in x for p in keys(v, f"{path}[]")}
    return set()


def test_the_tiny_device_check_runs_every_part(dev: Path, tmp_path: Path) -> None:
    result, seconds, out = check(dev, tmp_path)
    print(f"the device check's CPU smoke: {seconds:.1f} s")
    assert list(result["parts"]) == list(PARTS) and [p["part"] for p in result["plan"]] == list(PARTS)
    for name, part in result["parts"].items():
        assert part["status"] == "ok", (name, part.get("error"), part.get("traceback"))
        assert 0 < part["seconds"] <= part["budget_s"], (name, part)
        assert_measured(name, part)
        assert json.loads((tmp_path / "out" / f"part-{name}.json").read_text())["rows"] == part["rows"]
    assert result["environment"]["nltk_data"] == str(REPO / "tests" / "unit" / "data" / "nltk_data")
    assert "## device check: cpu" in out and "| encode_llada | ok |" in out  # the summary tables, last
    # the docs' fixture is shaped as this JSON (its figures are made up; the GPU rows hold what a GPU adds: the
    # device's name and the code before's columns)
    gpu_only = {".parts.encode_dream.device", ".parts.encode_llada.device", ".parts.score.device"}
    gpu_only |= {f".parts.{p}.rows[].{k}" for p in ("encode_dream", "encode_llada")
                 for k in ("before_docs_s", "after_over_before", "same_bytes_as_before")}  # fmt: skip
    failed_only = {f".parts.{p}.{k}" for p in PARTS for k in ("error", "traceback")}
    fixture = keys(json.loads(FIXTURE.read_text()))
    assert keys(result) <= fixture and fixture - keys(result) <= gpu_only | failed_only, fixture ^ keys(result)


# Each part fails in one run by an injected error and hangs in the other (its budget cut to make the hang short);
# in each run the parts not made to fail run to their end.
INJECTED = {
    "errors in stages, tests, encode_llada; hangs in score, encode_dream": (
        ["--fail-part", "stages,tests,encode_llada", "--hang-part", "score,encode_dream"],
        ["--budget", "score=6", "--budget", "encode_dream=6"],
    ),
    "errors in score, encode_dream; hangs in stages, tests, encode_llada": (
        ["--fail-part", "score,encode_dream", "--hang-part", "stages,tests,encode_llada"],
        ["--budget", "stages=30", "--budget", "tests=6", "--budget", "encode_llada=6"],
    ),
}


@pytest.mark.parametrize("injected", list(INJECTED), ids=["run1", "run2"])
def test_a_part_that_fails_or_hangs_never_takes_the_others_down(dev: Path, tmp_path: Path, injected: str) -> None:
    faults, budgets = INJECTED[injected]
    fail, hang = faults[1].split(","), faults[3].split(",")
    before = set(hung_processes(tmp_path))  # another run's, on this machine: not this run's to answer for
    result, _, _ = check(dev, tmp_path, *faults, *budgets)
    assert list(result["parts"]) == list(PARTS), result["parts"].keys()  # every part ran, in order
    for name, part in result["parts"].items():
        on_disk = json.loads((tmp_path / "out" / f"part-{name}.json").read_text())
        if name in fail:  # the error and its traceback recorded, the figure measured before it kept
            assert part["status"] == "error" and "InjectedFailure: an injected failure" in part["error"], part
            assert "Traceback (most recent call last)" in part["traceback"] and "InjectedFailure" in part["traceback"]
            assert len(part["rows"]) == 1 and on_disk["rows"] == part["rows"]
            assert_measured(name, part, whole=False)
        elif name in hang:  # killed at its budget, with every process it started
            assert part["seconds"] < part["budget_s"] + 5 and "killed" in part["error"], part
            if name in ("stages", "tests"):  # the hung subprocess killed at the part's time left, the part ended
                assert part["status"] == "error" and "CommandTimeout" in part["error"], part
                assert "ran past its" in part["error"] and "Traceback" in part["traceback"], part
            else:  # the part's own process killed by the check
                assert part["status"] == "timeout" and f"{part['budget_s']:.0f} s budget" in part["error"], part
            if name == "stages":  # tokenize hung: download's figure kept
                assert "diffret tokenize" in part["error"] and [r["stage"] for r in part["rows"]] == ["download"]
        else:
            assert part["status"] == "ok", (name, part.get("error"), part.get("traceback"))
            assert_measured(name, part)
    if "score" not in hang:  # the stages failed or hung and left no encodings: score ran on random ones
        assert result["parts"]["score"]["encodings"].startswith("random"), result["parts"]["score"]
    strays = set(hung_processes(tmp_path)) - before
    assert not strays, "a hung process outlived its timeout"


def hung_processes(tmp: Path) -> list[str]:
    """The PIDs of processes of a device check writing under ``tmp``, and of the hang it injects (``time.sleep(60)``
    in a loop)."""
    found = subprocess.run(["pgrep", "-f", str(tmp / "out")], capture_output=True, text=True).stdout.split()
    return found + subprocess.run(["pgrep", "-f", "time.sleep.60"], capture_output=True, text=True).stdout.split()
