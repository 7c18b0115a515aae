"""The training stages on the stage test world (tests/stage_world.py): groups mined from the BM25 train run,
their refusals, the budget taken from the zero-shot train selection, a reranker's teacher lists, and SIDR's
objective, defaults and retrieved negatives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from stage_world import CORPUS, TRAIN, copy_world
from tiny_models import save_tiny_mlm

from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
from diffret.retrieval.training.loop import TrainSettings
from diffret.stages import execute, stages
from diffret.stages.base import Context
from diffret.stages.systems import SystemRef, find_system
from diffret.storage import ArtifactStore, IncompleteArtifactError, StoreError
from diffret.storage.sql import StoreSQL


@pytest.fixture
def world(stage_world: dict) -> dict:
    """The stage test world (``stage_world``, tests/conftest.py), built once for the modules that share it."""
    return stage_world


def test_training_groups_mined_from_the_bm25_train_run(world: dict) -> None:
    store = ArtifactStore(world["root"])
    with StoreSQL(store) as db:
        _, rows = db.query("select query_id, positive_passages, negative_passages from training_groups order by 1")
    assert [r[0] for r in rows] == ["q3", "q4"]  # the train split's judged queries
    for qid, pos, neg in rows:
        assert [p["docid"] for p in pos] == [{"q3": "d6", "q4": "d8"}[qid]]
        assert len(neg) == 3 and not {p["docid"] for p in neg} & {p["docid"] for p in pos}
        assert pos[0]["title"] and pos[0]["text"]  # title and text kept apart, as Tevatron has them


def test_training_needs_a_split_and_a_run(world: dict) -> None:
    cfg = world["configs"]["training-data"]
    with pytest.raises(ValueError, match="has no split 'dev'"):
        execute(stages()["training-data"], cfg.model_copy(update={"split": "dev"}), log=lambda _: None)
    with pytest.raises(StoreError, match="no system named 'nosuch'"):
        execute(stages()["training-data"], cfg.model_copy(update={"negatives": "nosuch"}), log=lambda _: None)
    enc = find_system(ArtifactStore(world["root"]), SystemRef(model=str(world["model"]))).system
    with pytest.raises(StoreError, match="choose one with --kq, --kp and --mode"):
        execute(stages()["training-data"], cfg.model_copy(update={"negatives": enc}), log=lambda _: None)


def test_training_budget_defaults_to_the_zero_shot_train_selection(world: dict, tmp_path: Path) -> None:
    """Without --kq/--kp, training takes the budget the base model's zero-shot run selected on its train split;
    without such a run the error says what to do."""
    w = copy_world(world, tmp_path)
    with StoreSQL(ArtifactStore(w["root"])) as db:
        _, sel = db.query("select kq_star, kp_star from budget_selection")
    assert len(sel) == 1
    cfg = w["configs"]["train"].model_copy(
        update={"name": "tiny-sel", "settings": TRAIN.model_copy(update={"kq": None, "kp": None, "max_steps": 1})}
    )
    lines: list[str] = []
    execute(stages()["train"], cfg, log=lines.append)
    manifest = json.loads((Path(w["root"]) / "models" / "model=tiny-sel" / "_manifest.json").read_text())
    s = manifest["config"]["settings"]
    assert (s["kq"], s["kp"]) == sel[0] and manifest["config"]["budget_from"].startswith("selected zero-shot by ")
    assert any(f"({sel[0][0]}, {sel[0][1]})" in x for x in lines)
    other = save_tiny_mlm(tmp_path / "other", seed=1)
    with pytest.raises(StoreError, match="no training budget given.*give --kq and --kp"):
        execute(
            stages()["train"], cfg.model_copy(update={"backbone": BackboneConfig(model=str(other))}), log=lambda _: None
        )


def test_reranker_teacher_lists_from_qrels_or_from_the_run_alone(world: dict, tmp_path: Path) -> None:
    w = copy_world(world, tmp_path)
    stage = stages()["train-reranker"]
    ctx = Context(store=ArtifactStore(w["root"]), log=lambda _: None)
    for teacher, n in (("qrels", 2), ("run", 2)):  # train: q3 -> d6, q4 -> d8; BM25 ranks both queries
        cfg = w["configs"]["train-reranker"].model_copy(update={"teacher": teacher, "name": f"tiny-rr-{teacher}"})
        plan = stage.plan(cfg, ctx)
        lists, stats = stage.lists(plan.units[0].config, ctx)
        assert stats["lists"] == len(lists) == n
        if teacher == "qrels":
            assert [ls.labels[0] for ls in lists] == [1.0, 1.0] and all(ls.labels[1:] == [0.0] * 2 for ls in lists)
            assert lists[0].docs[0].startswith(CORPUS[6]["title"]) or lists[0].docs[0].startswith(CORPUS[8]["title"])
        else:
            assert all(ls.labels is None and len(ls.docs) == 3 for ls in lists)
    res = execute(
        stage,
        w["configs"]["train-reranker"].model_copy(update={"teacher": "run", "name": "tiny-rr-run"}),
        log=lambda _: None,
    )
    assert res.done == 1


def test_the_sidr_readout_trains_with_sidrs_objective_and_defaults(world: dict, tmp_path: Path) -> None:
    """`diffret train --readout sidr`: SIDR's objective and its hyperparameters as the defaults (full fine-tuning,
    lr 2e-5, grad clip 2, one hard negative), recorded in the model's manifest; the model then encodes."""
    w = copy_world(world, tmp_path)
    small = TrainSettings(max_steps=2, pool_size=2, global_batch=2, batch_size=2, q_max_len=8, p_max_len=12)
    cfg = w["configs"]["train"].model_copy(
        update={"name": "tiny-sidr", "readout": ReadoutConfig(readout="sidr"), "settings": small}
    )
    res = execute(stages()["train"], cfg, log=lambda _: None)
    assert res.done == 1
    s = ArtifactStore(w["root"]).require_manifest("models/model=tiny-sidr").config["settings"]
    assert (s["adapter"], s["lr"], s["grad_clip"], s["n_negatives"], s["kq"], s["kp"]) == ("full", 2e-5, 2.0, 1, 1, 1)
    assert s["encoders"] == "separate" and "retrieved_negatives" not in s  # SIDR's two encoders, by default
    model = Path(w["root"]) / "models" / "model=tiny-sidr"
    # the passage encoder is saved apart and encodes the passages; the query model's folder holds its own weights

    reader = make_reader(load_backbone(BackboneConfig(model=str(model))), ReadoutConfig(readout="sidr"))
    twin = make_reader(
        load_backbone(BackboneConfig(model=str(model / "passage_encoder"))), ReadoutConfig(readout="sidr")
    )
    assert reader.passage_bb is not None and twin.passage_bb is None
    assert not any("passage_encoder" in k for k in reader.bb.model.state_dict())
    ids = reader.bb.tokenizer(["the cat sat on the mat", "tea"], add_special_tokens=False)["input_ids"]
    for a, b in zip(reader.encode(ids, None, "passage", 1), twin.encode(ids, None, "passage", 1), strict=True):
        assert a.sparse_ids.tolist() == b.sparse_ids.tolist() and np.allclose(a.sparse_weights, b.sparse_weights)
    lr = TrainSettings(lr=1e-2, max_steps=2, pool_size=2, global_batch=2, batch_size=2, q_max_len=8, p_max_len=12)
    apart = cfg.model_copy(update={"name": "tiny-sidr-lr", "settings": lr})
    execute(stages()["train"], apart, log=lambda _: None)
    moved = make_reader(
        load_backbone(BackboneConfig(model=str(Path(w["root"]) / "models" / "model=tiny-sidr-lr"))),
        ReadoutConfig(readout="sidr"),
    )
    q, p = moved.encode(ids, None, "query", 1), moved.encode(ids, None, "passage", 1)
    assert any(not np.allclose(a.sparse_weights, b.sparse_weights) for a, b in zip(q, p, strict=True))  # two models
    enc = w["configs"]["encode"].model_copy(
        update={"backbone": BackboneConfig(model=str(model)), "k": [1], "readout": ReadoutConfig(readout="sidr")}
    )
    execute(stages()["tokenize"], enc.tokenize_config(), log=lambda _: None)
    assert execute(stages()["encode"], enc, log=lambda _: None).system.startswith("model-tiny-sidr-sidr-")


def test_sidr_training_with_retrieved_negatives_reads_the_corpus_bag_of_tokens(world: dict, tmp_path: Path) -> None:
    """`train --readout sidr --retrieved-negatives N` searches the training corpus's bag-of-tokens index (the bot
    stage's, found by the model's vocabulary), records it among the model's inputs and counts the negatives it
    drew; without an index it is refused with the command that builds one, before anything is written."""
    w = copy_world(world, tmp_path)
    small = TrainSettings(
        max_steps=2, pool_size=2, global_batch=2, batch_size=2, q_max_len=8, p_max_len=12, retrieved_negatives=5
    )
    cfg = w["configs"]["train"].model_copy(
        update={"name": "tiny-sidr-rn", "readout": ReadoutConfig(readout="sidr"), "settings": small}
    )
    store = ArtifactStore(w["root"])
    saved = tmp_path / "bot"
    shutil.move(store.abspath("bot"), saved)
    with pytest.raises(IncompleteArtifactError, match="diffret bot -d"):
        execute(stages()["train"], cfg, log=lambda _: None)
    assert not store.exists("models/model=tiny-sidr-rn")
    shutil.move(saved, store.abspath("bot"))
    assert execute(stages()["train"], cfg, log=lambda _: None).done == 1
    m = store.require_manifest("models/model=tiny-sidr-rn")
    assert m.config["bot"] == "tiny" and len(m.config["inputs"]["bot"]) == 64  # the corpus, its bags' sha256
    assert m.stats["retrieved_negatives"] + m.stats["retrieved_fallback_queries"] == 2 * 2
    with pytest.raises(ValueError, match="readout sidr"):
        other = small.model_copy(update={"n_negatives": 1, "kq": 1, "kp": 1})
        execute(
            stages()["train"],
            cfg.model_copy(update={"readout": ReadoutConfig(), "settings": other}),
            log=lambda _: None,
        )
