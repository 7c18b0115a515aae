"""The budget stage on the stage test world (tiny MLM, a 2 x 2 grid scored and evaluated on train and test):
features per split, one adaptive run per selector that evaluate scores like any run, the fixed selector equal to
the train-selected cell's run, a re-run doing nothing, and the refusals (the train split as a target, a missing
cell)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from stage_world import copy_world

from diffret.retrieval.analysis.views import rows
from diffret.stages import execute, stages
from diffret.stages.budget import BudgetConfig
from diffret.stages.encode import EncodeConfig
from diffret.stages.runs import read_run
from diffret.stages.systems import SystemRef
from diffret.storage import ArtifactStore, StoreError
from diffret.storage.layout import run_dir
from diffret.storage.sql import StoreSQL


@pytest.fixture
def world(stage_world: dict) -> dict:
    """The stage test world (``stage_world``, tests/conftest.py), built once for the modules that share it."""
    return stage_world


def budget(root: str, model: Path, **kw) -> BudgetConfig:
    return BudgetConfig(root=root, dataset="tiny", system=SystemRef(model=str(model)), **{"folds": 2, **kw})


def test_adaptive_runs_per_selector_evaluated_like_any_run(world: dict, tmp_path: Path) -> None:
    w = copy_world(world, tmp_path)
    res = execute(stages()["budget"], budget(w["root"], w["model"]), log=print)
    assert res.done == 2 + 4  # features of train and test, a run per selector
    execute(stages()["evaluate"], w["configs"]["evaluate"], log=print)
    with StoreSQL(ArtifactStore(w["root"])) as db:
        got = rows(db, "select mode, kq, kp, queries from cells where mode like 'adaptive_%' order by mode")
        feats = rows(
            db,
            "select split, count(distinct query_id) q, count(distinct feature) f from budget_features "
            "group by split order by split",
        )
    assert [(r["mode"], r["kq"], r["kp"], r["queries"]) for r in got] == [
        (f"adaptive_multi_dense_{s}_joint_encoding", 0, 0, 3) for s in ("classifier", "fixed", "regressor", "rule")
    ]
    # 2 text features + 5 per K_q (1, 2); train 2 queries, test 3
    assert [(r["split"], r["q"], r["f"]) for r in feats] == [("test", 3, 12), ("train", 2, 12)]
    store = ArtifactStore(w["root"])
    system = res.system
    fixed = read_run(store, run_dir(system, "tiny", "test", 0, 0, "adaptive_multi_dense_fixed_joint_encoding"))
    stats = store.read_manifest(
        run_dir(system, "tiny", "test", 0, 0, "adaptive_multi_dense_fixed_joint_encoding")
    ).stats
    kq, kp = stats["fixed"]
    cells = [(1, 2), (2, 1), (2, 2)]  # the grid of multi_dense: none at (1, 1), as the reference scores it
    assert stats["histogram"] == {f"{a}x{b}": 3 * ((a, b) == (kq, kp)) for a, b in cells}
    assert fixed.equals(read_run(store, run_dir(system, "tiny", "test", kq, kp, "multi_dense")))
    assert execute(stages()["budget"], budget(w["root"], w["model"]), log=print).done == 0  # nothing new
    from diffret.retrieval.analysis.report import build_report

    with StoreSQL(store) as db:
        rep = build_report(db, name="t", n_boot=10)
        oracle = rows(
            db,
            "select value from metrics where system = ? and split = 'test' and mode = 'multi_dense' "
            "and measure = 'ndcg_cut_10'",
            [system],
        )
    table = {r.split(",")[6]: r.split(",") for r in rep.files["adaptive_budgets.csv"].decode().splitlines()[1:]}
    assert sorted(table) == ["classifier", "fixed", "regressor", "rule"]
    header = rep.files["adaptive_budgets.csv"].decode().splitlines()[0].split(",")
    fixed_row = dict(zip(header, table["fixed"], strict=True))
    assert fixed_row["ndcg_10"] == fixed_row["fixed_ndcg_10"] and fixed_row["fixed"] == f"{kq}x{kp}"
    assert float(fixed_row["oracle"]) >= float(fixed_row["ndcg_10"]) and oracle
    assert "Adaptive budgets" in dict(rep.sections)


def test_another_feature_set_or_selector_is_a_new_run_beside_the_others(world: dict, tmp_path: Path) -> None:
    w = copy_world(world, tmp_path)
    first = execute(stages()["budget"], budget(w["root"], w["model"], selectors=["rule"]), log=print)
    cfg = budget(w["root"], w["model"], selectors=["rule", "fixed"], features="first_pass", over="kq")
    again = execute(stages()["budget"], cfg, log=print)
    assert (first.done, again.done) == (3, 4)  # new features folders (train, test) and two new runs
    store = ArtifactStore(w["root"])
    with StoreSQL(store) as db:
        modes = [r["mode"] for r in rows(db, "select mode from adaptive_runs order by mode")]
        fp = rows(
            db,
            "select distinct feature from budget_features where set = 'first_pass_multi_dense' "
            "and feature like 'fp_%' order by feature",
        )
    assert modes == [
        "adaptive_multi_dense_fixed_kq_first_pass",
        "adaptive_multi_dense_rule_joint_encoding",
        "adaptive_multi_dense_rule_kq_first_pass",
    ]
    assert [r["feature"] for r in fp] == ["fp_entropy", "fp_gap", "fp_top"]
    stats = store.read_manifest(
        run_dir(first.system, "tiny", "test", 0, 0, "adaptive_multi_dense_rule_kq_first_pass")
    ).stats
    fixed_kp = stats["fixed"][1]
    assert {int(c.split("x")[1]) for c in stats["histogram"]} == {fixed_kp}  # over K_q: K_p stays the fixed one
    assert stats["cost"]["passage_indexes"] == 1 and stats["cost"]["first_pass_searches"] == 1


def test_cross_fitted_on_a_split_without_a_train_split(world: dict, tmp_path: Path) -> None:
    """Each query's budget from selectors learned on the other folds of its own split (scifact-mini has no train
    split): runs of their own (_cf), the report's baseline the cross-fitted fixed selector."""
    w = copy_world(world, tmp_path)
    cfg = budget(w["root"], w["model"], cross_fit=True, selectors=["fixed", "rule"], folds=3)
    res = execute(stages()["budget"], cfg, log=print)
    assert res.done == 1 + 2  # the test split's features (no train features), two runs
    execute(stages()["evaluate"], w["configs"]["evaluate"], log=print)
    from diffret.retrieval.analysis.report import build_report

    with StoreSQL(ArtifactStore(w["root"])) as db:
        runs = rows(db, "select mode, cross_fit, train_split from adaptive_runs order by mode")
        rep = build_report(db, name="t", n_boot=10)
    assert [(r["mode"], r["cross_fit"], r["train_split"]) for r in runs] == [
        ("adaptive_multi_dense_fixed_joint_encoding_cf", True, "test"),
        ("adaptive_multi_dense_rule_joint_encoding_cf", True, "test"),
    ]
    csv = rep.files["adaptive_budgets.csv"].decode().splitlines()
    assert len(csv) == 3 and all("(cross-fitted)" in line and ",per fold," in line for line in csv[1:])
    with pytest.raises(ValueError, match="over joint only"):
        budget(w["root"], w["model"], cross_fit=True, over="kq")


def test_the_train_split_is_never_a_target_and_a_missing_cell_is_named(world: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="never evaluated on the split it learned from"):
        budget(str(tmp_path), Path("m"), splits=["test", "train"])
    w = copy_world(world, tmp_path)
    shutil.rmtree(
        Path(w["root"])
        / "metrics"
        / f"system={w['results']['encode'].system}"
        / "dataset=tiny"
        / "split=test"
        / "kq=2"
        / "kp=1"
        / "mode=multi_dense"
    )
    with pytest.raises(StoreError, match=r"lacks the multi_dense cells \(K_q, K_p\) \[\(2, 1\)\]"):
        execute(stages()["budget"], budget(w["root"], w["model"]), log=print)


def test_head_stats_stored_at_encode_become_features(world: dict, tmp_path: Path) -> None:
    """`encode --head-stats` on the query side: its folders record it and hold the head's entropy and max
    probability per slot (a folder without it keeps its config: turning it on is config drift until --force); the
    passages are not touched; the features then add mean / min / max of both per K_q, and the runs are new."""
    from diffret.storage.layout import encodings_dir
    from diffret.storage.manifest import ConfigDriftError

    w = copy_world(world, tmp_path)
    first = execute(stages()["budget"], budget(w["root"], w["model"], selectors=["rule"]), log=print)
    store = ArtifactStore(w["root"])
    system = first.system
    passage = store.require_manifest(encodings_dir(system, "tiny", "passage", 1))
    enc = w["configs"]["encode"].model_copy(update={"head_stats": True, "sides": ["query"]})
    with pytest.raises(ConfigDriftError):
        execute(stages()["encode"], enc, log=print)
    assert execute(stages()["encode"], enc.model_copy(update={"force": True}), log=print).done == 2  # K = 1, 2
    for k in (1, 2):
        m = store.require_manifest(encodings_dir(system, "tiny", "query", k))
        t = store.read_table(encodings_dir(system, "tiny", "query", k), sorted(m.files)[0])
        assert m.config["head_stats"] is True and [len(e) for e in t.column("slot_entropy").to_pylist()] == [k] * 5
    assert store.require_manifest(encodings_dir(system, "tiny", "passage", 1)) == passage
    again = execute(stages()["budget"], budget(w["root"], w["model"], selectors=["rule"]), log=print)
    assert again.done == 3  # the features (train, test) and the run, from the new query encodings
    with StoreSQL(store) as db:
        names = [
            r["feature"]
            for r in rows(
                db,
                "select distinct feature from budget_features where split = 'test' "
                "and feature like '%@1' order by feature",
            )
        ]
    assert names == sorted(
        f"{f}@1"
        for f in (
            "agreement",
            "distinct",
            "entropy_max",
            "entropy_mean",
            "entropy_min",
            "maxprob_max",
            "maxprob_mean",
            "maxprob_min",
            "slots",
            "sparse_mass",
            "support",
        )
    )
    with pytest.raises(ValueError, match="the diffembed readout has none"):
        EncodeConfig(dataset="tiny", head_stats=True, readout={"readout": "diffembed"})
