"""The index flow: a LanceDB multivector table (+ optional ANN index) per K_p, checked against exact search.

Each build reports recall@10 and @100 of the index (over-fetch + exact MaxSim re-rank) against exact
search for the queries of one split, and its latency, in the index manifest and a Prefect artifact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from retrieval.backbones import BackboneConfig
from retrieval.encoding import GRID_K, KList
from retrieval.readouts import ReadoutConfig
from storage import ArtifactStore
from tasks.keys import artifact_key

from .score import DEFAULT_MODEL, system_slug


class IndexConfig(BaseModel):
    """Parameters of the index flow (model fields as in the encode flow: they name the encodings)."""

    root: str = Field(default="./diffret-store", description="Artifact store root.")
    dataset: str = Field(description="Dataset whose queries check the index against exact search.")
    corpus: str | None = Field(default=None, description="Passages (default: the dataset's own corpus).")
    split: str = Field(default="test", description="Query split of the recall check.")
    kq: KList = Field(default=list(GRID_K), description="Query budgets of the recall check.")
    kp: KList = Field(default=list(GRID_K), description="Passage budgets to index (one table each).")
    backbone: BackboneConfig = Field(default_factory=lambda: BackboneConfig(model=DEFAULT_MODEL))
    readout: ReadoutConfig = Field(default_factory=ReadoutConfig)
    max_length: int = Field(default=512, ge=1)
    system: str | None = Field(default=None, description="Model slug of the encodings (overrides the model fields).")
    index_type: Literal["none", "IVF_PQ", "IVF_HNSW_SQ"] = Field(default="IVF_PQ", description="none: flat table.")
    overfetch: int | None = Field(default=None, ge=1, description="Candidates per result = k x overfetch.")

    def slug(self) -> str:
        return system_slug(self.system, self.backbone, self.readout, self.max_length)


def run_index(config: IndexConfig, log: Callable[[str], None] = print) -> dict:
    from retrieval.indexing import build_index
    from retrieval.scoring import corpus_of

    store = ArtifactStore(config.root)
    system = config.slug()
    corpus = config.corpus or corpus_of(config.dataset)
    built = skipped = 0
    checks = {}
    for kp in config.kp:
        new, stats = build_index(
            store, system, config.dataset, corpus, config.split, config.kq, kp, config.index_type, config.overfetch,
            log,
        )  # fmt: skip
        built += int(new)
        skipped += int(not new)
        checks[kp] = stats.get("check", {})
    return {"system": system, "built": built, "skipped": skipped, "checks": checks}


def checks_markdown(summary: dict) -> str:
    lines = ["| K_p | K_q | recall@10 | recall@100 | mean ms | p95 ms |", "|---:|---:|---:|---:|---:|---:|"]
    for kp, by_kq in sorted(summary["checks"].items()):
        for kq, c in sorted(by_kq.items(), key=lambda x: int(x[0])):
            lines.append(
                f"| {kp} | {kq} | {c['recall_10']:.4f} | {c['recall_100']:.4f} | "
                f"{c['latency_ms_mean']:.1f} | {c['latency_ms_p95']:.1f} |"
            )
    return "\n".join(lines)


@flow(name="index", description="LanceDB multivector index per K_p, with recall against exact search.")
def index_flow(config: IndexConfig) -> dict:
    summary = run_index(config, get_run_logger().info)
    create_markdown_artifact(
        f"# index `{summary['system']}` ({config.index_type})\n\n{checks_markdown(summary)}\n",
        key=artifact_key("index", config.dataset),
        description="index recall against exact search",
    )
    return summary
