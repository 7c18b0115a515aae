"""The score flow: stored encodings -> runs for every (split, K_q, K_p, mode) cell; and the BM25 baseline.

One pass over each K_p's passage encoding scores every K_q and mode (exact search, CPU or GPU); cells
already in the store with the same config are skipped, so a re-run resumes a killed one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import AfterValidator, BaseModel, Field

from retrieval.backbones import BackboneConfig
from retrieval.bm25 import BM25Settings
from retrieval.encoding import GRID_K, EncodeSettings, KList, model_slug
from retrieval.readouts import ReadoutConfig
from retrieval.search import check_modes
from storage import ArtifactStore
from storage.layout import MODES
from tasks.keys import artifact_key

DEFAULT_MODEL = "dllm-hub/ModernBERT-base-chat-v0.1"
ModeList = Annotated[list[str], AfterValidator(check_modes)]


def system_slug(system: str | None, backbone: BackboneConfig, readout: ReadoutConfig, max_length: int) -> str:
    """The model slug of the encodings a stage reads: given, or derived like the encode flow does."""
    if system:
        return system
    return model_slug(EncodeSettings(backbone=backbone, readout=readout, max_length=max_length))


class ScoreConfig(BaseModel):
    """Parameters of the score flow. The model fields are those of the encode flow (they name the encodings)."""

    root: str = Field(default="./diffret-store", description="Artifact store root.")
    dataset: str = Field(description="Queries and qrels (a dataset in the store).")
    corpus: str | None = Field(default=None, description="Passages (default: the dataset's own corpus; TREC DL ->"
                               " msmarco-passage).")  # fmt: skip
    splits: list[str] = Field(default=["test"], description="Query splits to score.")
    kq: KList = Field(default=list(GRID_K), description="Query budgets K_q.")
    kp: KList = Field(default=list(GRID_K), description="Passage budgets K_p.")
    modes: ModeList = Field(default=list(MODES), description="Scoring modes (paper section 3.3).")
    backbone: BackboneConfig = Field(default_factory=lambda: BackboneConfig(model=DEFAULT_MODEL))
    readout: ReadoutConfig = Field(default_factory=ReadoutConfig)
    max_length: int = Field(default=512, ge=1)
    system: str | None = Field(default=None, description="Model slug of the encodings (overrides the model fields).")
    topk: int = Field(default=1000, ge=1, description="Documents kept per query.")
    fusion_depth: int = Field(default=1000, ge=1, description="Top documents of each run that fusion normalises.")
    ignore_identical_ids: bool | None = Field(
        default=None, description="Drop a document whose id equals the query id (default: on for ArguAna, Quora)."
    )
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")

    def slug(self) -> str:
        return system_slug(self.system, self.backbone, self.readout, self.max_length)


class BM25Config(BaseModel):
    """Parameters of the BM25 flow."""

    root: str = Field(default="./diffret-store", description="Artifact store root.")
    dataset: str = Field(description="Queries and qrels (a dataset in the store).")
    corpus: str | None = Field(default=None, description="Passages (default: the dataset's own corpus).")
    splits: list[str] = Field(default=["test"])
    topk: int = Field(default=1000, ge=1)
    bm25: BM25Settings = Field(default_factory=BM25Settings)
    ignore_identical_ids: bool | None = None


def run_score(config: ScoreConfig, log: Callable[[str], None] = print) -> dict:
    from retrieval.scoring import score

    system = config.slug()
    modes = config.modes
    if not config.system and config.readout.readout in ("diffembed", "repllama"):
        # single-vector readouts have no sparse vector: sparse_max and the fusions would be empty runs
        modes = [m for m in modes if m in ("single_dense", "multi_dense")] or ["single_dense"]
    plan = score(
        ArtifactStore(config.root), system, config.dataset, config.splits, config.kq, config.kp, modes,
        corpus=config.corpus, topk=config.topk, fusion_depth=config.fusion_depth,
        ignore_identical_ids=config.ignore_identical_ids, device=config.device, log=log,
    )  # fmt: skip
    return {"system": system, "scored": len(plan.todo), "skipped": plan.done}


def run_bm25(config: BM25Config, log: Callable[[str], None] = print) -> dict:
    from retrieval.scoring import score_bm25

    system, plan = score_bm25(
        ArtifactStore(config.root), config.dataset, config.splits, config.bm25, corpus=config.corpus,
        topk=config.topk, ignore_identical_ids=config.ignore_identical_ids, log=log,
    )  # fmt: skip
    return {"system": system, "scored": len(plan.todo), "skipped": plan.done}


@flow(name="score", description="Exact search for every (K_q, K_p, mode) cell of the grid.")
def score_flow(config: ScoreConfig) -> dict:
    logger = get_run_logger()
    summary = run_score(config, logger.info)
    create_markdown_artifact(
        f"# score {config.dataset} with `{summary['system']}`\n\n{summary['scored']} cell(s) scored, "
        f"{summary['skipped']} already done.\n",
        key=artifact_key("score", config.dataset),
        description="score",
    )
    return summary


@flow(name="bm25", description="BM25 baseline runs (bm25s, Lucene k1=0.9 b=0.4).")
def bm25_flow(config: BM25Config) -> dict:
    return run_bm25(config, get_run_logger().info)
