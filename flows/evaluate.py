"""The evaluate flow: every run in the store (or a filtered subset) -> per-query metrics with pytrec_eval.

Metrics already computed from the same run and qrels are kept, so the flow is cheap to re-run.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from retrieval.evaluation import DEFAULT_MEASURES
from storage import ArtifactStore


class EvaluateConfig(BaseModel):
    """Parameters of the evaluate flow."""

    root: str = Field(default="./diffret-store", description="Artifact store root.")
    models: list[str] | None = Field(default=None, description="System slugs to evaluate (default: all runs).")
    datasets: list[str] | None = Field(default=None, description="Datasets to evaluate (default: all).")
    splits: list[str] | None = Field(default=None, description="Splits to evaluate (default: all).")
    measures: list[str] = Field(
        default=list(DEFAULT_MEASURES), description="pytrec_eval measures; mrr_10 is recip_rank on the run cut at 10."
    )
    relevance_level: int | None = Field(
        default=None, ge=1, description="Grade counted relevant by binary measures (default: 2 for TREC DL, else 1)."
    )


def run_evaluate(config: EvaluateConfig, log: Callable[[str], None] = print) -> dict:
    from retrieval.metrics import evaluate_runs, list_runs

    store = ArtifactStore(config.root)
    runs = list_runs(store, config.models, config.datasets, config.splits)
    done, kept = evaluate_runs(store, runs, config.measures, config.relevance_level, log)
    return {"runs": len(runs), "evaluated": done, "up_to_date": kept}


@flow(name="evaluate", description="Per-query metrics (pytrec_eval) for the runs in the store.")
def evaluate_flow(config: EvaluateConfig) -> dict:
    summary = run_evaluate(config, get_run_logger().info)
    create_markdown_artifact(
        f"# evaluate\n\n{summary['evaluated']} run(s) evaluated, {summary['up_to_date']} already up to date "
        f"({summary['runs']} in all).\n",
        key="evaluate-summary",
        description="evaluate",
    )
    return summary
