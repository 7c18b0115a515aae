"""The pipeline's stages, importable without Prefect: each plans its units from the store, runs them, and
records what it wrote (see stages/base.py). ``STAGES`` maps a stage's name to it; flows/ runs any of them
in this process or under Prefect through one ``run_stage``.

    download -> tokenize -> encode -> (compress) -> (index) -> score / bm25 -> evaluate -> summary -> report
                                                   import-run / fuse (any runs) -> evaluate -> compare
                                                   bm25 (train split) -> training (groups) -> train
                                                   bm25 (train split) + qrels -> train-reranker -> rerank
"""

from __future__ import annotations

from importlib import import_module

from .base import Context, Plan, Stage, StageConfig, StageResult, execute

_MODULES = (
    "ingest", "tokenize", "encode", "compress", "bot", "index", "score", "beta", "late", "bm25", "import_run", "fuse",
    "rerank", "training_data", "train", "train_reranker", "evaluate", "compare", "budget", "summary", "report",
    "latency",
)  # fmt: skip


def stages() -> dict[str, Stage]:
    """Every stage by name, in pipeline order (modules are imported on first use)."""
    out = {}
    for mod in _MODULES:
        st = import_module(f"{__name__}.{mod}").stage
        out[st.name] = st
    return out


__all__ = ["Context", "Plan", "Stage", "StageConfig", "StageResult", "execute", "stages"]
