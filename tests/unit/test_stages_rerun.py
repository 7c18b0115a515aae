"""Every stage on the stage test world (tests/stage_world.py), run again: what each did the first time (the
report's latency axes included), a current stage redoing nothing (skip), a changed setting refused naming the field
until forced (drift / force), changed inputs making downstream stale (not drifted), and a damaged file redone alone
(plan / skip / drift / force / stale / damaged)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from stage_world import RERANK_TRAIN, TRAIN, copy_world, f16, snapshot
from typer.testing import CliRunner

from diffret.stages import execute, stages
from diffret.storage import ConfigDriftError


@pytest.fixture
def world(stage_world: dict) -> dict:
    """The stage test world (``stage_world``, tests/conftest.py), built once for the modules that share it."""
    return stage_world


def test_every_stage_did_its_work_once(world: dict) -> None:
    for name, res in world["results"].items():
        assert res.stage == name and res.done > 0 and res.skipped == 0, (name, res)
    assert world["results"]["encode"].done == 2 * (1 + 3)  # K x shards (5 queries: 1 shard; 12 docs: 3)
    assert world["results"]["score"].done == 2 * (2 * 2 * 5 - 2)  # splits x K_q x K_p x modes, less q1-p1's multi
    assert world["results"]["beta"].done == 2 * 2  # splits x K_q
    assert world["results"]["late"].done == 2  # BM25's top 3 and top 5, re-scored
    # + beta, late, BM25 (test, train), reranked, imported, fused
    assert world["results"]["evaluate"].done == 36 + 4 + 2 + 2 + 1 + 1 + 1


def test_the_report_puts_the_system_on_the_latency_axes(world: dict) -> None:
    folder = Path(world["results"]["report"].details["folder"])
    points = (folder / "fig1_cost_effect.csv").read_text().splitlines()
    assert points[0].split(",") == ["system", "multi", "kq", "kp", "ms", "ndcg_10"]
    system = world["results"]["encode"].system
    assert [p.split(",")[:4] for p in points[1:]] == [[system, "False", "1", "1"], [system, "True", "2", "2"]]
    assert all((folder / f).stat().st_size > 1000 for f in ("fig1_cost_effect.png", "fig3_encode_latency.png"))


# budget: its own test (test_budget_stage.py) on a copy of this world, since it reads the evaluated grid and
# leaves runs for evaluate
@pytest.mark.parametrize("name", [n for n in stages() if n != "budget"])
def test_current_stage_redoes_nothing(world: dict, name: str) -> None:
    before = snapshot(world["root"])
    res = execute(stages()[name], world["configs"][name], log=lambda _: None)
    assert res.done == 0 and res.skipped == world["results"][name].done + world["results"][name].skipped
    assert snapshot(world["root"]) == before  # not a byte rewritten


def _encode_manifest_edit(world: dict) -> str:
    """Encode has no setting outside its system slug: simulate a store whose manifest says otherwise."""
    path = Path(world["root"]) / f"encodings/system={f16(world)}/dataset=tiny/side=query/k=1/_manifest.json"
    m = json.loads(path.read_text())
    m["config"]["readout"]["sparse_topk"] = 99
    path.write_text(json.dumps(m))
    return "readout.sparse_topk"


DRIFT = {  # stage -> (change of a setting, the field the error names)
    "download": (lambda w: {"source": str(w["beir"]) + "-v2"}, "source"),
    "tokenize": (lambda w: {"shard_size": 4}, "shard_size"),
    "encode": (None, "readout.sparse_topk"),
    "score": (lambda w: {"topk": 10}, "topk"),
    "bm25": (lambda w: {"topk": 10}, "topk"),
    "beta": (lambda w: {"topk": 10}, "topk"),
    "late": (lambda w: {"self_hits": "drop"}, "ignore_identical_ids"),
    "training-data": (lambda w: {"depth": 4}, "depth"),
    "train": (lambda w: {"settings": TRAIN.model_copy(update={"lr": 2e-3})}, "settings.lr"),
    "train-reranker": (lambda w: {"settings": RERANK_TRAIN.model_copy(update={"loss": "ranknet"})}, "settings.loss"),
    "evaluate": (lambda w: {"relevance_level": 2}, "relevance_level"),
    "index": (lambda w: {"overfetch": 5}, "overfetch"),
    "summary": (lambda w: {"bm25": None}, "bm25"),
    "report": (lambda w: {"n_boot": 30}, "n_boot"),
}


@pytest.mark.parametrize("name", list(DRIFT))
def test_drift_is_refused_naming_the_field_until_forced(world: dict, tmp_path: Path, name: str) -> None:
    w = copy_world(world, tmp_path)
    change, field = DRIFT[name]
    if name == "download":
        shutil.copytree(w["beir"], str(w["beir"]) + "-v2", dirs_exist_ok=True)
    if change is None:
        _encode_manifest_edit(w)
        config = w["configs"][name]
    else:
        config = w["configs"][name].model_copy(update=change(w))
    before = snapshot(w["root"])
    with pytest.raises(ConfigDriftError) as err:
        execute(stages()[name], config, log=lambda _: None)
    assert field in [f for f, _, _ in err.value.differences] and "--force" in str(err.value)
    assert snapshot(w["root"]) == before  # refused before anything was written
    forced = execute(stages()[name], config.model_copy(update={"force": True}), log=lambda _: None)
    assert forced.done > 0


def test_changed_inputs_make_downstream_stale_not_drifted(world: dict, tmp_path: Path) -> None:
    """Runs replaced (forced, other topk): their metrics are recomputed by a plain evaluate, not refused."""
    w = copy_world(world, tmp_path)
    forced = w["configs"]["score"].model_copy(update={"topk": 3, "force": True})
    assert execute(stages()["score"], forced, log=lambda _: None).done == 36
    lines: list[str] = []
    res = execute(stages()["evaluate"], w["configs"]["evaluate"], log=lines.append)
    # the encoder's runs are stale; beta's, late's, BM25's, the reranked, the imported and the fused are not
    assert (res.done, res.skipped) == (36, 11)
    stale = [line for line in lines if "built from other inputs" in line]  # one line for the 36, not 36 lines
    assert len(stale) == 1 and stale[0].startswith("36 folders") and stale[0].endswith("and 33 more"), lines


def test_damaged_file_is_redone_alone(world: dict, tmp_path: Path) -> None:
    w = copy_world(world, tmp_path)
    run = next(Path(w["root"]).glob("runs/*/dataset=tiny/split=test/kq=1/kp=2/mode=multi_dense/run.parquet"))
    good = run.read_bytes()
    run.write_bytes(good[:-4] + b"oops")
    res = execute(stages()["score"], w["configs"]["score"], log=lambda _: None)
    assert (res.done, res.skipped) == (1, 35) and run.read_bytes() == good  # deterministic: byte-identical


def test_verify_names_a_flipped_byte_and_the_next_run_redoes_the_shard(world: dict, tmp_path: Path, monkeypatch):
    from diffret.flows.cli import app

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    w = copy_world(world, tmp_path)
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", "--root", w["root"]])
    assert ok.exit_code == 0 and "match their manifests" in ok.output, ok.output
    shard = sorted(Path(w["root"]).glob(f"encodings/system={f16(w)}/dataset=tiny/side=passage/k=2/shard=*"))[0]
    good = bytearray(shard.read_bytes())
    bad = good.copy()
    bad[len(bad) // 2] ^= 0x01  # one bit, same size
    shard.write_bytes(bytes(bad))
    res = runner.invoke(app, ["verify", "--root", w["root"]])
    assert res.exit_code == 1 and shard.name in res.output and "does not match the manifest" in res.output
    enc = execute(stages()["encode"], w["configs"]["encode"], log=lambda _: None)
    assert enc.done >= 1 and shard.read_bytes() == bytes(good)  # redone, byte-identical
    assert runner.invoke(app, ["verify", "--root", w["root"]]).exit_code == 0


def test_encode_verify_redoes_a_flipped_byte_whose_mtime_was_restored(world: dict, tmp_path: Path, monkeypatch):
    from diffret.flows.cli import app

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    w = copy_world(world, tmp_path)
    shard = sorted(Path(w["root"]).glob(f"encodings/system={f16(w)}/dataset=tiny/side=passage/k=1/shard=*"))[1]
    st, good = shard.stat(), shard.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    shard.write_bytes(bytes(bad))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as recorded
    args = [
        "encode",
        "-d",
        "tiny",
        "--model",
        str(w["model"]),
        "--k",
        "1,2",
        "--max-length",
        "96",
        "--shard-size",
        "5",
        "--batch-size",
        "4",
        "--root",
        w["root"],
    ]
    plain = CliRunner().invoke(app, args)
    assert plain.exit_code == 0 and "0 shard(s) encoded, 8 already done" in plain.output, plain.output
    assert shard.read_bytes() == bytes(bad)  # trusted by size and mtime
    verified = CliRunner().invoke(app, [*args, "--verify"])
    assert verified.exit_code == 0 and "1 shard(s) encoded, 7 already done" in verified.output, verified.output
    assert shard.read_bytes() == good
