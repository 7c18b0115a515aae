"""Killed stage runs on the stage test world (tests/stage_world.py) resume: sharded stages (encode, tokenize)
from the shard records of a run killed before compaction, training and reranker training from their last
checkpoint, bit-identical to the uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from stage_world import copy_world, f16

from diffret.retrieval.rerank.training import RerankTrainer
from diffret.retrieval.training.loop import Trainer
from diffret.stages import execute, presentation_of, stages
from diffret.storage import ArtifactStore
from diffret.storage.sql import StoreSQL


@pytest.fixture
def world(stage_world: dict) -> dict:
    """The stage test world (``stage_world``, tests/conftest.py), built once for the modules that share it."""
    return stage_world


def test_encode_compacts_its_shard_records_when_it_finishes(world: dict) -> None:
    root = Path(world["root"])
    assert not list(root.glob("encodings/**/_shards.jsonl")) and not list(root.glob("tokens/**/_shards.jsonl"))
    m = json.loads((root / f"encodings/system={f16(world)}/dataset=tiny/side=passage/k=2/_manifest.json").read_text())
    assert len(m["files"]) == 3 and all(e["mtime_ns"] > 0 for e in m["files"].values())


class _Killed(Exception):
    pass


def test_encode_killed_before_compaction_resumes_from_its_records(world: dict, tmp_path: Path, monkeypatch) -> None:
    from diffret.stages.encode import Encode

    w = copy_world(world, tmp_path)
    stage = Path(w["root"]) / f"encodings/system={f16(w)}/dataset=tiny/side=passage/k=2"
    good = {p.name: p.read_bytes() for p in stage.glob("shard=*.parquet")}
    shutil.rmtree(stage)
    committed: list[str] = []
    real = Encode.commit

    def commit_then_die(self, unit, result, ctx):  # the process dies after its second recorded shard
        real(self, unit, result, ctx)
        committed.append(unit.shard)
        if len(committed) == 2:
            raise _Killed

    with monkeypatch.context() as mp:
        mp.setattr(Encode, "commit", commit_then_die)
        with pytest.raises(_Killed):
            execute(stages()["encode"], w["configs"]["encode"], log=lambda _: None)
    assert json.loads((stage / "_manifest.json").read_text())["files"] == {}  # never rewritten per shard
    assert [json.loads(r)["name"] for r in (stage / "_shards.jsonl").read_text().splitlines()] == committed
    res = execute(stages()["encode"], w["configs"]["encode"], log=lambda _: None)
    assert (res.done, res.skipped) == (1, 7)  # the two recorded shards are not redone
    assert {p.name: p.read_bytes() for p in stage.glob("shard=*.parquet")} == good
    assert sorted(json.loads((stage / "_manifest.json").read_text())["files"]) == sorted(good)
    assert not (stage / "_shards.jsonl").exists()


def test_tokenize_killed_mid_side_keeps_the_shards_it_finished(world: dict, tmp_path: Path, monkeypatch) -> None:
    from diffret.stages import tokenize as tok

    w = copy_world(world, tmp_path)
    stage = next(Path(w["root"]).glob("tokens/*/dataset=tiny/side=passage"))
    good = {p.name: p.read_bytes() for p in stage.glob("shard=*.parquet")}
    assert len(good) == 3
    shutil.rmtree(stage)
    real, calls = tok.tokenize_texts, []

    def tokenize_then_die(*a, **k):  # the process dies while tokenizing the side's third shard
        calls.append(1)
        if len(calls) == 3:
            raise _Killed
        return real(*a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(tok, "tokenize_texts", tokenize_then_die)
        with pytest.raises(_Killed):
            execute(stages()["tokenize"], w["configs"]["tokenize"], log=lambda _: None)
    kept = {p.name: p.stat().st_mtime_ns for p in stage.glob("shard=*.parquet")}
    assert len(kept) == 2
    res = execute(stages()["tokenize"], w["configs"]["tokenize"], log=lambda _: None)
    assert (res.done, res.skipped) == (1, 3)  # only the third passage shard (1 query shard, 2 kept)
    assert {p.name: p.read_bytes() for p in stage.glob("shard=*.parquet")} == good
    assert all(stage.joinpath(n).stat().st_mtime_ns == t for n, t in kept.items())


def test_killed_training_resumes_bit_identical(world: dict, tmp_path: Path, monkeypatch) -> None:
    """A run killed after its step-2 checkpoint, re-run: the saved weights equal the uninterrupted run's."""
    w = copy_world(world, tmp_path)
    straight = Path(world["root"]) / "models" / "model=tiny-ft" / "model.safetensors"
    real_step = Trainer.train_step

    def dies_at_step_3(self):
        if self.step == 2:
            raise KeyboardInterrupt("killed")
        return real_step(self)

    shutil.rmtree(Path(w["root"]) / "models" / "model=tiny-ft")  # train it again
    cfg = w["configs"]["train"]
    monkeypatch.setattr(Trainer, "train_step", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        execute(stages()["train"], cfg, log=lambda _: None)
    ckpts = list(Path(w["root"]).glob("checkpoints/model=tiny-ft-*/last.pt"))
    assert len(ckpts) == 1 and not (Path(w["root"]) / "models" / "model=tiny-ft").exists()  # step 2 only
    monkeypatch.setattr(Trainer, "train_step", real_step)
    lines: list[str] = []
    res = execute(stages()["train"], w["configs"]["train"], log=lines.append)
    assert res.done == 1 and any("resumed tiny-ft at step 2 of 4" in x for x in lines)
    md = res.markdown()  # the Prefect artifact: the loss curve and the logged steps
    loss = md[md.index(res.details["markdown"]) :]  # the stage's own section, after the summary
    assert "data:image/png;base64," in loss and loss.count("\n| ") == 1 + 4  # header + steps 1-4
    assert "| `models/model=tiny-ft` |" in md
    res.next = presentation_of(stages()["train"]).next_for(w["configs"]["train"], res.system)  # as the flows set it
    assert "Next: encode and score" in res.markdown()
    resumed = Path(w["root"]) / "models" / "model=tiny-ft" / "model.safetensors"
    assert resumed.read_bytes() == straight.read_bytes()
    assert not list(Path(w["root"]).glob("checkpoints/model=tiny-ft-*"))  # removed once saved
    with StoreSQL(ArtifactStore(w["root"])) as db:
        _, rows = db.query("select model, count(*), min(step), max(step) from train_log group by model order by 1")
    assert rows == [("tiny-ft", 4, 1, 4), ("tiny-rr", 4, 1, 4)]


def test_killed_reranker_training_resumes_bit_identical(world: dict, tmp_path: Path, monkeypatch) -> None:
    w = copy_world(world, tmp_path)
    straight = Path(world["root"]) / "models" / "model=tiny-rr" / "model.safetensors"
    real_step = RerankTrainer.train_step

    def dies_at_step_3(self):
        if self.step == 2:
            raise KeyboardInterrupt("killed")
        return real_step(self)

    shutil.rmtree(Path(w["root"]) / "models" / "model=tiny-rr")
    monkeypatch.setattr(RerankTrainer, "train_step", dies_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        execute(stages()["train-reranker"], w["configs"]["train-reranker"], log=lambda _: None)
    monkeypatch.setattr(RerankTrainer, "train_step", real_step)
    lines: list[str] = []
    res = execute(stages()["train-reranker"], w["configs"]["train-reranker"], log=lines.append)
    assert res.done == 1 and any("resumed tiny-rr at step 2 of 4" in x for x in lines)
    assert (Path(w["root"]) / "models" / "model=tiny-rr" / "model.safetensors").read_bytes() == straight.read_bytes()
    assert not list(Path(w["root"]).glob("checkpoints/model=tiny-rr-*"))
