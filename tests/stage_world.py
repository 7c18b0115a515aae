"""The stage test world: every stage run once on a tiny store (a random tiny BERT saved to disk, a 12-document
collection, an imported run). ``stage_world`` in tests/conftest.py builds it once per session for the modules of
the ``stage-world`` group (tests/unit/test_stages_*.py, test_budget_stage.py); a test that changes the store works
on a copy (:func:`copy_world`). The data and :func:`configs` are shared with test_runs_compact.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from conftest import write_beir
from tiny_models import save_tiny_mlm

from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.rerank.training import RerankTrainSettings
from diffret.retrieval.training.loop import TrainSettings
from diffret.stages import execute, stages
from diffret.stages.beta import BetaConfig
from diffret.stages.bm25 import BM25Config
from diffret.stages.bot import BotConfig
from diffret.stages.compare import CompareConfig
from diffret.stages.compress import CompressConfig
from diffret.stages.download import DownloadConfig
from diffret.stages.encode import EncodeConfig
from diffret.stages.evaluate import EvaluateConfig
from diffret.stages.fuse import FuseConfig
from diffret.stages.import_run import ImportRunConfig
from diffret.stages.index import IndexConfig
from diffret.stages.late import LateConfig
from diffret.stages.latency import LatencyConfig
from diffret.stages.report import ReportConfig
from diffret.stages.rerank import RerankConfig
from diffret.stages.score import ScoreConfig
from diffret.stages.summary import SummaryConfig
from diffret.stages.systems import SystemRef
from diffret.stages.tokenize import TokenizeConfig
from diffret.stages.train import TrainConfig
from diffret.stages.train_reranker import TrainRerankerConfig
from diffret.stages.training_data import TrainingDataConfig

WORDS = "cats purr dogs bark tea coffee cocoa garden fox jumps lazy mailman retrieval words query".split()
CORPUS = [{"_id": f"d{i}", "title": WORDS[i], "text": " ".join(WORDS[i : i + 4])} for i in range(12)]
QUERIES = [{"_id": f"q{i}", "text": " ".join(WORDS[2 * i : 2 * i + 2])} for i in range(5)]
QRELS = {"test": [("q0", "d0", 1), ("q1", "d2", 1), ("q2", "d4", 2)], "train": [("q3", "d6", 1), ("q4", "d8", 1)]}


TRAIN = TrainSettings(
    adapter="full",
    kq=1,
    kp=2,
    batch_size=2,
    grad_accum=1,
    n_negatives=2,
    max_steps=4,
    lr=1e-3,
    q_max_len=8,
    p_max_len=12,
)
TINY_PROMPT = str(Path(__file__).parent / "unit" / "data" / "rerank_tiny.yaml")
RERANK_TRAIN = RerankTrainSettings(
    adapter="full",
    method="logits_listwise",
    prompt=TINY_PROMPT,
    list_size=3,
    doc_tokens=8,
    batch_size=1,
    grad_accum=1,
    max_steps=4,
    lr=1e-3,
)


def configs(root: str, model: Path, beir: Path) -> dict[str, object]:
    """One config per stage, in pipeline order."""
    bb = BackboneConfig(model=str(model))
    common = {"root": root}
    ref = SystemRef(model=str(model))
    return {
        "download": DownloadConfig(name="tiny", source=str(beir), **common),
        "tokenize": TokenizeConfig(dataset="tiny", backbone=bb, max_length=96, shard_size=5, **common),
        "bot": BotConfig(dataset="tiny", backbone=bb, max_length=96, **common),
        "encode": EncodeConfig(
            dataset="tiny", k=[1, 2], backbone=bb, max_length=96, shard_size=5, batch_size=4, **common
        ),
        "compress": CompressConfig(dataset="tiny", system=ref, store="int8", **common),
        "score": ScoreConfig(dataset="tiny", system=ref, splits=["test", "train"], kq=[1, 2], kp=[1, 2], **common),
        "beta": BetaConfig(dataset="tiny", system=ref, splits=["test", "train"], kq=[1, 2], **common),
        "bm25": BM25Config(dataset="tiny", splits=["test", "train"], **common),
        "import-run": ImportRunConfig(dataset="tiny", path=str(Path(beir).parent / "ext.trec"), **common),
        "fuse": FuseConfig(dataset="tiny", runs=["bm25", "ext"], **common),
        "late": LateConfig(dataset="tiny", system=ref, kq=1, kp=2, depths=[3, 5], **common),
        "rerank": RerankConfig(
            dataset="tiny", backbone=bb, depth=5, window=3, step=1, doc_tokens=8, prompt=TINY_PROMPT, **common
        ),
        "training-data": TrainingDataConfig(dataset="tiny", depth=5, n_negatives=3, **common),
        "train": TrainConfig(
            training_set="tiny", backbone=bb, name="tiny-ft", settings=TRAIN, checkpoint_every=2, **common
        ),
        "train-reranker": TrainRerankerConfig(
            dataset="tiny", backbone=bb, name="tiny-rr", settings=RERANK_TRAIN, checkpoint_every=2, **common
        ),
        "evaluate": EvaluateConfig(**common),
        "compare": CompareConfig(dataset="tiny", runs=["ext", "fusion"], **common),
        "index": IndexConfig(dataset="tiny", system=ref, kq=[1], kp=[2], index_type="none", **common),
        "summary": SummaryConfig(dataset="tiny", bm25="bm25", splits=["test"], **common),
        "latency": LatencyConfig(
            backbone=bb,
            max_length=96,
            lengths=[8, 16],
            k=[1, 2],
            search_sizes=[10, 100],
            search_k=["1x1", "2x2"],
            search_queries=2,
            topk=5,
            repeats=1,
            warmup=0,
            **common,
        ),
        "report": ReportConfig(name="t", n_boot=20, **common),
    }


def build_world(base: Path) -> dict:
    """Every stage run once, in pipeline order, on a store under ``base``: the store, the model, the collection,
    the configs and each stage's result."""
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
