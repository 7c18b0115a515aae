"""Every stage on a tiny store (a random tiny BERT saved to disk, a 12-document collection): plan / skip /
drift / force / stale inputs, the systems registry, and the CLI finding a system by --model alone."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import write_beir
from tiny_models import save_tiny_mlm
from typer.testing import CliRunner

from retrieval.models.backbones import BackboneConfig, BackboneError, load_backbone
from retrieval.models.readouts import ReadoutConfig, make_reader
from retrieval.rerank.training import RerankTrainer, RerankTrainSettings
from retrieval.training.loop import Trainer, TrainSettings
from stages import execute, stages
from stages.base import Context
from stages.beta import BetaConfig
from stages.bm25 import BM25Config
from stages.bot import BotConfig
from stages.compare import CompareConfig
from stages.compress import CompressConfig
from stages.encode import EncodeConfig
from stages.evaluate import EvaluateConfig
from stages.fuse import FuseConfig
from stages.import_run import ImportRunConfig
from stages.index import IndexConfig
from stages.ingest import DownloadConfig
from stages.late import LateConfig
from stages.latency import LatencyConfig
from stages.report import ReportConfig
from stages.rerank import RerankConfig
from stages.score import ScoreConfig
from stages.summary import SummaryConfig
from stages.systems import SystemRef, find_system, list_systems
from stages.tokenize import TokenizeConfig
from stages.train import TrainConfig
from stages.train_reranker import TrainRerankerConfig
from stages.training_data import TrainingDataConfig
from storage import ArtifactStore, ConfigDriftError, IncompleteArtifactError, StoreError
from storage.sql import StoreSQL

WORDS = "cats purr dogs bark tea coffee cocoa garden fox jumps lazy mailman retrieval words query".split()
CORPUS = [{"_id": f"d{i}", "title": WORDS[i], "text": " ".join(WORDS[i : i + 4])} for i in range(12)]
QUERIES = [{"_id": f"q{i}", "text": " ".join(WORDS[2 * i : 2 * i + 2])} for i in range(5)]
QRELS = {"test": [("q0", "d0", 1), ("q1", "d2", 1), ("q2", "d4", 2)], "train": [("q3", "d6", 1), ("q4", "d8", 1)]}


TRAIN = TrainSettings(adapter="full", kq=1, kp=2, batch_size=2, grad_accum=1, n_negatives=2, max_steps=4, lr=1e-3,
                      q_max_len=8, p_max_len=12)  # fmt: skip
TINY_PROMPT = str(Path(__file__).parent / "data" / "rerank_tiny.yaml")
RERANK_TRAIN = RerankTrainSettings(adapter="full", method="logits_listwise", prompt=TINY_PROMPT, list_size=3,
                                   doc_tokens=8, batch_size=1, grad_accum=1, max_steps=4, lr=1e-3)  # fmt: skip


def configs(root: str, model: Path, beir: Path) -> dict[str, object]:
    """One config per stage, in pipeline order."""
    bb = BackboneConfig(model=str(model))
    common = {"root": root}
    ref = SystemRef(model=str(model))
    return {
        "download": DownloadConfig(name="tiny", source=str(beir), **common),
        "tokenize": TokenizeConfig(dataset="tiny", backbone=bb, max_length=96, shard_size=5, **common),
        "bot": BotConfig(dataset="tiny", backbone=bb, max_length=96, **common),
        "encode": EncodeConfig(dataset="tiny", k=[1, 2], backbone=bb, max_length=96, shard_size=5, batch_size=4,
                               **common),  # fmt: skip
        "compress": CompressConfig(dataset="tiny", system=ref, to="int8", **common),
        "score": ScoreConfig(dataset="tiny", system=ref, splits=["test", "train"], kq=[1, 2], kp=[1, 2], **common),
        "beta": BetaConfig(dataset="tiny", system=ref, splits=["test", "train"], kq=[1, 2], **common),
        "bm25": BM25Config(dataset="tiny", splits=["test", "train"], **common),
        "import-run": ImportRunConfig(dataset="tiny", path=str(Path(beir).parent / "ext.trec"), **common),
        "fuse": FuseConfig(dataset="tiny", runs=["bm25", "ext"], **common),
        "late": LateConfig(dataset="tiny", system=ref, kq=1, kp=2, depths=[3, 5], **common),
        "rerank": RerankConfig(dataset="tiny", backbone=bb, depth=5, window=3, step=1, doc_tokens=8,
                               prompt=TINY_PROMPT, **common),  # fmt: skip
        "training": TrainingDataConfig(dataset="tiny", depth=5, n_negatives=3, **common),
        "train": TrainConfig(training_set="tiny", backbone=bb, name="tiny-ft", settings=TRAIN, checkpoint_every=2,
                             **common),  # fmt: skip
        "train-reranker": TrainRerankerConfig(dataset="tiny", backbone=bb, name="tiny-rr", settings=RERANK_TRAIN,
                                              checkpoint_every=2, **common),  # fmt: skip
        "evaluate": EvaluateConfig(**common),
        "compare": CompareConfig(dataset="tiny", runs=["ext", "fusion"], **common),
        "index": IndexConfig(dataset="tiny", system=ref, kq=[1], kp=[2], index_type="none", **common),
        "summary": SummaryConfig(dataset="tiny", bm25="bm25", splits=["test"], **common),
        "latency": LatencyConfig(backbone=bb, max_length=96, lengths=[8, 16], k=[1, 2], search_sizes=[10, 100],
                                 search_k=["1x1", "2x2"], search_queries=2, topk=5, repeats=1, warmup=0, **common),
        "report": ReportConfig(name="t", n_boot=20, **common),
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("stages")
    model = save_tiny_mlm(base / "model")
    beir = write_beir(base / "tiny", CORPUS, QUERIES, QRELS)
    (base / "ext.trec").write_text("q0 Q0 d0 1 3.0 x\nq0 Q0 d1 2 2.0 x\nq1 Q0 d2 1 1.0 x\nq2 Q0 d4 1 1.0 x\n")
    root = str(base / "store")
    cfgs = configs(root, model, beir)
    results = {name: execute(stages()[name], cfg, log=lambda _: None) for name, cfg in cfgs.items()}
    return {"base": base, "root": root, "model": model, "beir": beir, "configs": cfgs, "results": results}


def copy_world(world: dict, tmp_path: Path) -> dict:
    """The store of ``world`` copied (a test that changes it gets its own), with configs pointing at the copy."""
    root = tmp_path / "store"
    shutil.copytree(world["root"], root)
    return {**world, "root": str(root), "configs": configs(str(root), world["model"], world["beir"])}


def f16(world: dict) -> str:
    """The world's float16 encoder system (compress made an int8 one beside it)."""
    return world["results"]["encode"].system


def snapshot(root: str) -> dict[str, int]:
    out = {}
    for base, _, files in os.walk(root):
        if "/_locks" in base:
            continue
        for f in files:
            p = os.path.join(base, f)
            out[p] = os.stat(p).st_mtime_ns
    return out


def test_every_stage_did_its_work_once(world: dict) -> None:
    for name, res in world["results"].items():
        assert res.stage == name and res.done > 0 and res.skipped == 0, (name, res)
    assert world["results"]["encode"].done == 2 * (1 + 3)  # K x shards (5 queries: 1 shard; 12 docs: 3)
    assert world["results"]["score"].done == 2 * 2 * 2 * 5  # splits x K_q x K_p x modes
    assert world["results"]["beta"].done == 2 * 2  # splits x K_q
    assert world["results"]["late"].done == 2  # BM25's top 3 and top 5, re-scored
    # + beta, late, BM25 (test, train), reranked, imported, fused
    assert world["results"]["evaluate"].done == 40 + 4 + 2 + 2 + 1 + 1 + 1


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
    "training": (lambda w: {"depth": 4}, "depth"),
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
    assert execute(stages()["score"], forced, log=lambda _: None).done == 40
    lines: list[str] = []
    res = execute(stages()["evaluate"], w["configs"]["evaluate"], log=lines.append)
    # the encoder's runs are stale; beta's, late's, BM25's, the reranked, the imported and the fused are not
    assert (res.done, res.skipped) == (40, 11)
    stale = [line for line in lines if "built from other inputs" in line]  # one line for the 40, not 40 lines
    assert len(stale) == 1 and stale[0].startswith("40 folders") and stale[0].endswith("and 37 more"), lines


def test_damaged_file_is_redone_alone(world: dict, tmp_path: Path) -> None:
    w = copy_world(world, tmp_path)
    run = next(Path(w["root"]).glob("runs/*/dataset=tiny/split=test/kq=1/kp=2/mode=multi_dense/run.parquet"))
    good = run.read_bytes()
    run.write_bytes(good[:-4] + b"oops")
    res = execute(stages()["score"], w["configs"]["score"], log=lambda _: None)
    assert (res.done, res.skipped) == (1, 39) and run.read_bytes() == good  # deterministic: byte-identical


def test_verify_names_a_flipped_byte_and_the_next_run_redoes_the_shard(world: dict, tmp_path: Path, monkeypatch):
    from flows.cli import app

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


def test_encode_compacts_its_shard_records_when_it_finishes(world: dict) -> None:
    root = Path(world["root"])
    assert not list(root.glob("encodings/**/_shards.jsonl")) and not list(root.glob("tokens/**/_shards.jsonl"))
    m = json.loads((root / f"encodings/system={f16(world)}/dataset=tiny/side=passage/k=2/_manifest.json").read_text())
    assert len(m["files"]) == 3 and all(e["mtime_ns"] > 0 for e in m["files"].values())


class _Killed(Exception):
    pass


def test_encode_killed_before_compaction_resumes_from_its_records(world: dict, tmp_path: Path, monkeypatch) -> None:
    from stages.encode import Encode

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
    import stages.tokenize as tok

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


def test_encode_verify_redoes_a_flipped_byte_whose_mtime_was_restored(world: dict, tmp_path: Path, monkeypatch):
    from flows.cli import app

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    w = copy_world(world, tmp_path)
    shard = sorted(Path(w["root"]).glob(f"encodings/system={f16(w)}/dataset=tiny/side=passage/k=1/shard=*"))[1]
    st, good = shard.stat(), shard.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    shard.write_bytes(bytes(bad))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as recorded
    args = ["encode", "-d", "tiny", "--model", str(w["model"]), "--k", "1,2", "--max-length", "96", "--shard-size",
            "5", "--batch-size", "4", "--root", w["root"]]  # fmt: skip
    plain = CliRunner().invoke(app, args)
    assert plain.exit_code == 0 and "0 shard(s) encoded, 8 already done" in plain.output, plain.output
    assert shard.read_bytes() == bytes(bad)  # trusted by size and mtime
    verified = CliRunner().invoke(app, [*args, "--verify"])
    assert verified.exit_code == 0 and "1 shard(s) encoded, 7 already done" in verified.output, verified.output
    assert shard.read_bytes() == good


def test_registry_records_each_system_and_finds_it(world: dict) -> None:
    store = ArtifactStore(world["root"])
    recs = {r.kind: r for r, _ in list_systems(store) if "store" not in r.settings}  # the float16 one
    enc = recs["encoder"]
    assert enc.model == str(world["model"]) and enc.readout == "diffretriever" and enc.has_sparse
    assert enc.settings["dtype"] == "float32" and enc.settings["max_length"] == 96
    assert find_system(store, SystemRef(model=str(world["model"]))).system == enc.system
    assert find_system(store, SystemRef(system=enc.system[:-4])).system == enc.system  # a unique prefix
    assert find_system(store, SystemRef(system="bm25")).kind == "bm25"
    with pytest.raises(StoreError, match="no encoder system"):
        find_system(store, SystemRef(model=str(world["model"]), where={"dtype": "bfloat16"}))
    with pytest.raises(StoreError, match="unknown system setting"):
        find_system(store, SystemRef(where={"colour": "red"}))


def test_cli_encode_bfloat16_then_score_and_index_by_model_alone(world: dict, tmp_path: Path, monkeypatch) -> None:
    """The encode options are not repeated: score and index look the system up in the registry."""
    from flows.cli import app

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    runner = CliRunner()
    root, model = str(tmp_path / "store"), str(world["model"])

    def cli(*args: str) -> str:
        res = runner.invoke(app, [*args, "--root", root])
        assert res.exit_code == 0, res.output
        return res.output

    cli("download", "tiny", "--source", str(world["beir"]))
    cli("encode", "-d", "tiny", "--model", model, "--dtype", "bfloat16", "--k", "1,2", "--max-length", "96")
    assert "20 cell(s) scored" in cli("score", "-d", "tiny", "--model", model, "--kq", "1,2", "--kp", "1,2")
    indexed = cli("index", "-d", "tiny", "--model", model, "--kq", "1", "--kp", "2", "--type", "none")
    assert "1 index(es) built" in indexed and "| 2 | 1 |" in indexed
    # a second system of the same model: --model alone is now ambiguous, and the error says what differs
    cli("encode", "-d", "tiny", "--model", model, "--k", "1", "--max-length", "96")
    res = runner.invoke(app, ["score", "-d", "tiny", "--model", model, "--kq", "1", "--kp", "1", "--root", root])
    assert res.exit_code == 2 and "2 encoder systems match" in res.output and "--dtype" in res.output
    assert "5 cell(s) scored" in cli("score", "-d", "tiny", "--model", model, "--dtype", "float32", "--kq", "1",
                                     "--kp", "1")  # fmt: skip
    listing = cli("systems", "-f", "json")
    assert sorted(r["kind"] for r in json.loads(listing)) == ["encoder", "encoder"]


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
    cfg = world["configs"]["training"]
    with pytest.raises(ValueError, match="has no split 'dev'"):
        execute(stages()["training"], cfg.model_copy(update={"split": "dev"}), log=lambda _: None)
    with pytest.raises(StoreError, match="no system named 'nosuch'"):
        execute(stages()["training"], cfg.model_copy(update={"negatives": "nosuch"}), log=lambda _: None)
    enc = find_system(ArtifactStore(world["root"]), SystemRef(model=str(world["model"]))).system
    with pytest.raises(StoreError, match="choose one with --kq, --kp and --mode"):
        execute(stages()["training"], cfg.model_copy(update={"negatives": enc}), log=lambda _: None)


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
    assert "| `models/model=tiny-ft` |" in md and "Next: encode and score" in md
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


def test_every_stage_has_a_flow_and_a_deployment() -> None:
    import yaml

    from flows.runner import FLOWS

    root = Path(__file__).parents[2]
    entries = {d["entrypoint"] for d in yaml.safe_load((root / "prefect.yaml").read_text())["deployments"]}
    for name in stages():
        module, fn = FLOWS[name]
        assert f"{module.replace('.', '/')}.py:{fn}" in entries, name


def test_trained_model_encodes_as_a_system_of_its_own(world: dict, tmp_path: Path) -> None:
    """The saved folder loads by path: encoding it registers a system apart from the base model's."""
    w = copy_world(world, tmp_path)
    model = Path(w["root"]) / "models" / "model=tiny-ft"
    assert (model / "config.json").exists() and (model / "loss.png").stat().st_size > 0
    cfg = w["configs"]["encode"].model_copy(update={"backbone": BackboneConfig(model=str(model)), "k": [1]})
    execute(stages()["tokenize"], cfg.tokenize_config(), log=lambda _: None)
    res = execute(stages()["encode"], cfg, log=lambda _: None)
    assert res.done > 0
    base = find_system(ArtifactStore(w["root"]), SystemRef(model=str(w["model"]))).system
    assert res.system != base


def test_lora_adapter_is_saved_alone_and_encodes_as_its_own_system(world: dict, tmp_path: Path) -> None:
    """LoRA saves the peft adapter (not the weights); the folder alone as --model, or --model BASE --adapter
    FOLDER, encodes the same vectors as the merged weights, as systems apart from the base; on another base
    the adapter is refused, naming both."""
    w = copy_world(world, tmp_path)
    lora = TRAIN.model_copy(update={"adapter": "lora", "lr": 5e-2, "max_steps": 2})
    execute(stages()["train"], w["configs"]["train"].model_copy(update={"name": "tiny-lora", "settings": lora}),
            log=lambda _: None)  # fmt: skip
    adapter = Path(w["root"]) / "models" / "model=tiny-lora"
    assert (adapter / "adapter_model.safetensors").exists() and not (adapter / "config.json").exists()
    base_cfg = BackboneConfig(model=str(w["model"]))
    ways = {
        "folder": BackboneConfig(model=str(adapter)),
        "explicit": BackboneConfig(model=str(w["model"]), adapter=str(adapter)),
        "merged": BackboneConfig(model=str(w["model"]), adapter=str(adapter), merge_adapter=True),
        "base": base_cfg,
    }
    dense, systems = {}, {}
    for key, bb in ways.items():
        cfg = w["configs"]["encode"].model_copy(update={"backbone": bb, "k": [2]})
        execute(stages()["tokenize"], cfg.tokenize_config(), log=lambda _: None)
        systems[key] = execute(stages()["encode"], cfg, log=lambda _: None).system
        reader = make_reader(load_backbone(bb), ReadoutConfig(), 96)
        dense[key] = reader.encode([[5, 6, 7, 8]], ["cats purr"], "passage", 2)[0].dense.astype("float32")
    assert len(set(systems.values())) == 4 and systems["folder"].startswith("model-tiny-lora-")
    assert np.array_equal(dense["folder"], dense["explicit"])
    assert np.allclose(dense["merged"], dense["explicit"], atol=2e-3)
    assert not np.allclose(dense["base"], dense["explicit"], atol=1e-2)  # the adapter changed the model
    other = save_tiny_mlm(tmp_path / "other", seed=1)
    with pytest.raises(BackboneError, match=f"trained on '.*model', not on '{other}'"):
        load_backbone(BackboneConfig(model=str(other), adapter=str(adapter)))
    with pytest.raises(BackboneError, match="no adapter_config.json"):
        load_backbone(BackboneConfig(model=str(w["model"]), adapter=str(w["model"])))


def test_training_budget_defaults_to_the_zero_shot_train_selection(world: dict, tmp_path: Path) -> None:
    """Without --kq/--kp, training takes the budget the base model's zero-shot run selected on its train split;
    without such a run the error says what to do."""
    w = copy_world(world, tmp_path)
    with StoreSQL(ArtifactStore(w["root"])) as db:
        _, sel = db.query("select kq_star, kp_star from budget_selection")
    assert len(sel) == 1
    cfg = w["configs"]["train"].model_copy(update={"name": "tiny-sel", "settings": TRAIN.model_copy(
        update={"kq": None, "kp": None, "max_steps": 1})})  # fmt: skip
    lines: list[str] = []
    execute(stages()["train"], cfg, log=lines.append)
    manifest = json.loads((Path(w["root"]) / "models" / "model=tiny-sel" / "_manifest.json").read_text())
    s = manifest["config"]["settings"]
    assert (s["kq"], s["kp"]) == sel[0] and manifest["config"]["budget_from"].startswith("selected zero-shot by ")
    assert any(f"({sel[0][0]}, {sel[0][1]})" in x for x in lines)
    other = save_tiny_mlm(tmp_path / "other", seed=1)
    with pytest.raises(StoreError, match="no training budget given.*give --kq and --kp"):
        execute(stages()["train"], cfg.model_copy(update={"backbone": BackboneConfig(model=str(other))}),
                log=lambda _: None)  # fmt: skip


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
    res = execute(stage, w["configs"]["train-reranker"].model_copy(update={"teacher": "run", "name": "tiny-rr-run"}),
                  log=lambda _: None)  # fmt: skip
    assert res.done == 1


def test_the_sidr_readout_trains_with_sidrs_objective_and_defaults(world: dict, tmp_path: Path) -> None:
    """`diffret train --readout sidr`: SIDR's objective and its hyperparameters as the defaults (full fine-tuning,
    lr 2e-5, grad clip 2, one hard negative), recorded in the model's manifest; the model then encodes."""
    w = copy_world(world, tmp_path)
    small = TrainSettings(max_steps=2, pool_size=2, global_batch=2, batch_size=2, q_max_len=8, p_max_len=12)
    cfg = w["configs"]["train"].model_copy(update={"name": "tiny-sidr", "readout": ReadoutConfig(readout="sidr"),
                                                   "settings": small})  # fmt: skip
    res = execute(stages()["train"], cfg, log=lambda _: None)
    assert res.done == 1
    s = ArtifactStore(w["root"]).require_manifest("models/model=tiny-sidr").config["settings"]
    assert (s["adapter"], s["lr"], s["grad_clip"], s["n_negatives"], s["kq"], s["kp"]) == ("full", 2e-5, 2.0, 1, 1, 1)
    assert s["encoders"] == "separate" and "retrieved_negatives" not in s  # SIDR's two encoders, by default
    model = Path(w["root"]) / "models" / "model=tiny-sidr"
    # the passage encoder is saved apart and encodes the passages; the query model's folder holds its own weights
    from retrieval.models.backbones import load_backbone

    reader = make_reader(load_backbone(BackboneConfig(model=str(model))), ReadoutConfig(readout="sidr"))
    twin = make_reader(load_backbone(BackboneConfig(model=str(model / "passage_encoder"))),
                       ReadoutConfig(readout="sidr"))  # fmt: skip
    assert reader.passage_bb is not None and twin.passage_bb is None
    assert not any("passage_encoder" in k for k in reader.bb.model.state_dict())
    ids = reader.bb.tokenizer(["the cat sat on the mat", "tea"], add_special_tokens=False)["input_ids"]
    for a, b in zip(reader.encode(ids, None, "passage", 1), twin.encode(ids, None, "passage", 1), strict=True):
        assert a.sparse_ids.tolist() == b.sparse_ids.tolist() and np.allclose(a.sparse_weights, b.sparse_weights)
    lr = TrainSettings(lr=1e-2, max_steps=2, pool_size=2, global_batch=2, batch_size=2, q_max_len=8, p_max_len=12)
    apart = cfg.model_copy(update={"name": "tiny-sidr-lr", "settings": lr})
    execute(stages()["train"], apart, log=lambda _: None)
    moved = make_reader(load_backbone(BackboneConfig(model=str(Path(w["root"]) / "models" / "model=tiny-sidr-lr"))),
                        ReadoutConfig(readout="sidr"))  # fmt: skip
    q, p = moved.encode(ids, None, "query", 1), moved.encode(ids, None, "passage", 1)
    assert any(not np.allclose(a.sparse_weights, b.sparse_weights) for a, b in zip(q, p, strict=True))  # two models
    enc = w["configs"]["encode"].model_copy(update={"backbone": BackboneConfig(model=str(model)), "k": [1],
                                                    "readout": ReadoutConfig(readout="sidr")})  # fmt: skip
    execute(stages()["tokenize"], enc.tokenize_config(), log=lambda _: None)
    assert execute(stages()["encode"], enc, log=lambda _: None).system.startswith("model-tiny-sidr-sidr-")


def test_sidr_training_with_retrieved_negatives_reads_the_corpus_bag_of_tokens(world: dict, tmp_path: Path) -> None:
    """`train --readout sidr --retrieved-negatives N` searches the training corpus's bag-of-tokens index (the bot
    stage's, found by the model's vocabulary), records it among the model's inputs and counts the negatives it
    drew; without an index it is refused with the command that builds one, before anything is written."""
    w = copy_world(world, tmp_path)
    small = TrainSettings(max_steps=2, pool_size=2, global_batch=2, batch_size=2, q_max_len=8, p_max_len=12,
                          retrieved_negatives=5)  # fmt: skip
    cfg = w["configs"]["train"].model_copy(update={"name": "tiny-sidr-rn", "readout": ReadoutConfig(readout="sidr"),
                                                   "settings": small})  # fmt: skip
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
        execute(stages()["train"], cfg.model_copy(update={"readout": ReadoutConfig(), "settings": other}),
                log=lambda _: None)  # fmt: skip
