"""`import diffret` from a notebook: the package's one import name, no Prefect or torch on import, and the Python
API (load, encode in memory, search, evaluate, Store) giving exactly the runs and metrics the stages store for the
same model, collection and settings, in every mode (the sparse scale from the same place)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
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

CORPUS = [
    {"_id": f"d{i}", "title": ["Cats", "", "Tea"][i % 3], "text": f"passage {i} about cats dogs tea gardens"}
    for i in range(12)
]
QUERIES = [{"_id": f"q{i}", "text": f"what about cats {i}"} for i in range(4)]
QRELS = {"test": [("q0", "d0", 1), ("q1", "d3", 2), ("q2", "d5", 1), ("q3", "d7", 1)]}
MODES = ["single_dense", "multi_dense", "sparse_max", "fusion_single_sparse_max", "fusion_multi_sparse_max"]


def test_import_diffret_loads_neither_prefect_nor_torch() -> None:
    code = (
        "import sys, diffret; print(sorted(m for m in ('prefect', 'torch') if m in sys.modules)); "
        "print(diffret.__all__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "[]"
    assert {"load", "search", "evaluate", "Store", "load_beir"} <= set(eval(out[1]))  # noqa: S307


def test_the_api_gives_the_stages_runs_and_metrics(tmp_path: Path) -> None:
    model = save_tiny_mlm(tmp_path / "model")
    beir = write_beir(tmp_path / "c", CORPUS, QUERIES, QRELS)
    root = str(tmp_path / "store")
    bb = BackboneConfig(model=str(model))
    execute(stages()["download"], DownloadConfig(name="c", source=str(beir), root=root), log=lambda _: None)
    execute(
        stages()["tokenize"],
        EncodeConfig(dataset="c", k=[2], backbone=bb, max_length=48, root=root).tokenize_config(),
        log=lambda _: None,
    )
    execute(
        stages()["encode"], EncodeConfig(dataset="c", k=[2], backbone=bb, max_length=48, root=root), log=lambda _: None
    )
    execute(
        stages()["score"],
        ScoreConfig(dataset="c", system=SystemRef(model=str(model)), kq=[2], kp=[2], root=root),
        log=lambda _: None,
    )
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
            stored.sort_by([("query_id", "ascending"), ("rank", "ascending")]).cast(run.schema)
        ), mode
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


def test_no_texts_give_empty_encodings_and_an_empty_run(tmp_path: Path) -> None:
    model = save_tiny_mlm(tmp_path / "model")
    r = diffret.load(str(model), max_length=48)
    q, p = r.encode_queries(["cats"], k=2), r.encode_passages({"d": ("T", "cats purr")}, k=2)
    none_q, none_p = r.encode_queries([], k=2), r.encode_passages({}, k=2)
    assert (len(none_q), len(none_p)) == (0, 0) and none_q.ids == []
    assert none_q.table.schema.equals(q.table.schema) and none_p.table.schema.equals(p.table.schema)
    for mode in MODES:
        for queries, passages, rows in ((none_q, p, 0), (q, none_p, 0), (none_q, none_p, 0), (q, [none_p, p], 1)):
            run = diffret.search(queries, passages, mode)
            assert run.column_names == ["query_id", "doc_id", "rank", "score"] and run.num_rows == rows, mode


def test_evaluate_refuses_qrels_that_share_no_query_with_the_run(tmp_path: Path) -> None:
    run = pa.table({"query_id": ["q1", "q1"], "doc_id": ["d1", "d2"], "rank": [1, 2], "score": [2.0, 1.0]})
    assert diffret.evaluate(run, {"q1": {"d2": 1}, "q2": {"d1": 1}})["recall_100"] == 0.5  # q2 unanswered: 0
    for qrels in ({"7": {"d1": 1}}, {}, pa.table({"query_id": ["x"], "doc_id": ["d1"], "relevance": [1]})):
        with pytest.raises(ValueError, match="no query in common"):
            diffret.evaluate(run, qrels)
        with pytest.raises(ValueError, match="no query in common"):
            diffret.evaluate_per_query(run, qrels)
    with pytest.raises(ValueError, match="the run answers 0 queries"):
        diffret.evaluate(run.slice(0, 0), {"q1": {"d1": 1}})


def test_a_folder_that_is_not_a_store_is_refused_and_an_empty_one_is_an_empty_store(tmp_path: Path) -> None:
    from diffret.storage import StoreError

    trec = tmp_path / "runs-made-elsewhere"
    trec.mkdir()
    (trec / "bm25.trec").write_text("q1 Q0 d1 1 1.0 x\n")
    (trec / ".hidden").write_text("")
    with pytest.raises(StoreError, match=f"{trec} is not a diffret store: it holds bm25.trec"):
        diffret.Store(trec)
    with pytest.raises(StoreError, match="no store at .*typo"):
        diffret.Store(tmp_path / "typo")
    assert not (tmp_path / "typo").exists()
    empty = tmp_path / "new"
    empty.mkdir()
    assert diffret.Store(empty).sql("select count(*) n from runs").to_pylist() == [{"n": 0}]
    (empty / "notes.txt").write_text("a store may hold other files beside its folders")
    (empty / "runs").mkdir()
    assert diffret.Store(empty).runs().num_rows == 0


def test_every_numeric_argument_is_checked_before_any_work(tmp_path: Path) -> None:
    """A batch size, length, K, depth or level that cannot work is refused at the call, naming it (not later, deep
    inside a loop); the model is not even read."""
    missing = str(tmp_path / "no-model")  # never opened: the arguments are refused first
    for kwargs, name in (
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -3}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"max_length": 0}, "max_length"),
    ):
        with pytest.raises(ValueError, match=f"{name} must be a whole number >= 1( \\(or None\\))?, got"):
            diffret.load(missing, **kwargs)
    r = diffret.load(missing)
    for call in (
        lambda: r.encode_queries(["cats"], k=0),
        lambda: r.encode_passages(["cats"], k=1, batch_size=0),
    ):
        with pytest.raises(ValueError, match="must be a whole number >= 1"):
            call()
    run = pa.table({"query_id": ["q1"], "doc_id": ["d1"], "rank": [1], "score": [1.0]})
    with pytest.raises(ValueError, match="relevance_level must be a whole number >= 0, got -1"):
        diffret.evaluate(run, {"q1": {"d1": 1}}, relevance_level=-1)
    enc = diffret.Encoded(pa.table({"id": ["q"]}), "query", 1)
    for kwargs in ({"topk": 0}, {"fusion_depth": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be a whole number >= 1"):
            diffret.search(enc, diffret.Encoded(pa.table({"id": ["d"]}), "passage", 1), **kwargs)


def test_texts_that_are_not_strings_are_named_and_empty_queries_warned(tmp_path: Path) -> None:
    r = diffret.load(str(tmp_path / "no-model"))  # refused before the model is read
    with pytest.raises(TypeError, match="passage 'd': its text is NoneType None, not a string or a"):
        r.encode_passages({"ok": "fine", "d": None})
    with pytest.raises(TypeError, match="query '1': its text is int 7, not a string"):
        r.encode_queries(["fine", 7])
    with pytest.raises(TypeError, match="passage 'p': its text is tuple"):
        r.encode_passages({"p": ("title", None)})
    model = save_tiny_mlm(tmp_path / "model")
    r = diffret.load(str(model), max_length=48)
    with pytest.warns(UserWarning, match=r"1 query has empty text \('q2'\): encoded as the prompt alone"):
        q = r.encode_queries({"q1": "cats", "q2": "  "})
    assert q.ids == ["q1", "q2"]


def test_evaluate_takes_pytrec_eval_dicts_and_refuses_scores_that_are_not_finite() -> None:
    import math

    table = pa.table(
        {"query_id": ["q1", "q1", "q2"], "doc_id": ["d1", "d2", "d1"], "rank": [1, 2, 1], "score": [2.0, 1.0, 0.5]}
    )
    qrels = {"q1": {"d2": 1}, "q2": {"d1": 2}}
    as_dict = {"q1": {"d2": 1.0, "d1": 2.0}, "q2": {"d1": 0.5}}
    assert diffret.evaluate(as_dict, qrels) == diffret.evaluate(table, qrels)
    assert diffret.evaluate(as_dict, qrels, ["recip_rank"]) == {"recip_rank": pytest.approx(0.75)}
    assert diffret.evaluate_per_query(as_dict, qrels).equals(diffret.evaluate_per_query(table, qrels))
    for bad in (math.nan, math.inf, -math.inf):
        run = {"q1": {"d1": 2.0, "d2": bad}, "q2": {"d1": 0.5}}
        with pytest.raises(ValueError, match=f"query 'q1', document 'd2': score {bad} is not a finite number"):
            diffret.evaluate(run, qrels)
        t = table.set_column(3, "score", pa.array([2.0, bad, 0.5]))
        with pytest.raises(ValueError, match="query 'q1', document 'd2': score .* is not a finite number"):
            diffret.evaluate_per_query(t, qrels)
    with pytest.raises(TypeError, match=r"run\['q1'\]\['d1'\]: score 'x' is not a number"):
        diffret.evaluate({"q1": {"d1": "x"}}, qrels)
