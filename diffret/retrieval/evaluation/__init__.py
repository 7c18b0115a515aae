"""Evaluation with pytrec_eval: TREC files, Arrow converters, per-query metrics, paired t-tests."""

from .measures import DEFAULT_MEASURES, evaluate, mean_metrics
from .significance import TTest, paired_ttest, paired_ttest_values
from .trec import (
    Qrels,
    Run,
    qrels_from_table,
    read_trec_qrels,
    read_trec_run,
    run_from_table,
    run_to_table,
    trec_order,
    write_trec_run,
)

__all__ = [
    "DEFAULT_MEASURES",
    "Qrels",
    "Run",
    "TTest",
    "evaluate",
    "mean_metrics",
    "paired_ttest",
    "paired_ttest_values",
    "qrels_from_table",
    "read_trec_qrels",
    "read_trec_run",
    "run_from_table",
    "run_to_table",
    "trec_order",
    "write_trec_run",
]
