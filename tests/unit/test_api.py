"""`import diffret` from a notebook: the package's one import name, no Prefect or torch on import, and the Python
API (load, encode in memory, search, evaluate, Store) giving exactly the runs and metrics the stages store for the
same model, collection and settings, in every mode (the sparse scale from the same place)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pytest
from conftest import write_beir
from tiny_models import save_tiny_mlm

import diffret
from diffret.retrieval.models.backbones import BackboneConfig
from diffret.stages import execute, stages
from diffret.stages.download import DownloadConfig
from diffret.stages.encode import EncodeConfig
from diffret.stages.evaluate import EvaluateConfig
from diffret.stages.score import ScoreConfig
from diffret.stages.systems import SystemRef

pytestmark = pytest.mark.usefixtures("one_thread")

CORPUS = [{"_id": f"d{i}", "title": ["Cats", "", "Tea"][i % 3], "text": f"passage {i} about cats dogs tea gardens"}
          for i in range(12)]  # fmt: skip
QUERIES = [{"_id": f"q{i}", "text": f"what about cats {i}"} for i in range(4)]
QRELS = {"test": [("q0", "d0", 1), ("q1", "d3", 2), ("q2", "d5", 1), ("q3", "d7", 1)]}
MODES = ["single_dense", "multi_dense", "sparse_max", "fusion_single_sparse_max", "fusion_multi_sparse_max"]


def test_import_diffret_loads_neither_prefect_nor_torch() -> None:
    code = ("import sys, diffret; print(sorted(m for m in ('prefect', 'torch') if m in sys.modules)); "
            "print(diffret.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "[]"
    assert {"load", "search", "evaluate", "Store", "load_beir"} <= set(eval(out[1]))  # noqa: S307


def test_the_api_gives_the_stages_runs_and_metrics(tmp_path: Path) -> None:
    model = save_tiny_mlm(tmp_path / "model")
    beir = write_beir(tmp_path / "c", CORPUS, QUERIES, QRELS)
    root = str(tmp_path / "store")
    bb = BackboneConfig(model=str(model))
    execute(stages()["download"], DownloadConfig(name="c", source=str(beir), root=root), log=lambda _: None)
    execute(stages()["tokenize"], EncodeConfig(dataset="c", k=[2], backbone=bb, max_length=48,
                                               root=root).tokenize_config(), log=lambda _: None)  # fmt: skip
    execute(stages()["encode"], EncodeConfig(dataset="c", k=[2], backbone=bb, max_length=48, root=root),
            log=lambda _: None)  # fmt: skip
    execute(stages()["score"], ScoreConfig(dataset="c", system=SystemRef(model=str(model)), kq=[2], kp=[2],
                                           root=root), log=lambda _: None)  # fmt: skip
    execute(stages()["evaluate"], EvaluateConfig(root=root), log=lambda _: None)
    store = diffret.Store(root)

    data = diffret.load_beir(beir)
    r = diffret.load(str(model), max_length=48)
    q = r.encode_queries(data.queries("test"), k=2)
    p = r.encode_passages(data.corpus, k=2)
    assert q.sparse_factor == 100.0  # the reference's x100 sparse weights, as the score stage scales them
    for mode in MODES:
        run = diffret.search(q, p, mode)
        stored = store.runs(f"mode = '{mode}'").select(["query_id", "doc_id", "rank", "score"])
        assert run.sort_by([("query_id", "ascending"), ("rank", "ascending")]).equals(
            stored.sort_by([("query_id", "ascending"), ("rank", "ascending")]).cast(run.schema)), mode
        got = diffret.evaluate(run, data.qrels("test"))
        means = store.sql(f"select measure, avg(value) v from metrics where mode = '{mode}' group by measure")
        want = {row["measure"]: row["v"] for row in means.to_pylist()}
        assert got == pytest.approx(want, abs=1e-12), mode
    assert pc.sum(store.cells("split = 'test'").column("queries")).as_py() == 4 * len(MODES)


def test_bad_calls_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unknown option"):
        diffret.load("x", no_such_option=1)
    model = save_tiny_mlm(tmp_path / "model")
    r = diffret.load(str(model), max_length=48)
    q = r.encode_queries(["cats"], k=1)
    p = r.encode_passages({"d": ("T", "cats purr")}, k=1)
    with pytest.raises(ValueError, match="unknown mode"):
        diffret.search(q, p, "best")
    with pytest.raises(ValueError, match="encode_queries' output first"):
        diffret.search(p, q)
    with pytest.raises(ValueError, match="not \\(title, text\\) pairs"):
        r.encode_queries({"q": ("a", "b")})
