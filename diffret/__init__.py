"""diffret: representative-token retrieval experiments (DiffRetriever, PromptReps, DiffEmbed, RepLLaMA, SIDR, BM25)
over an artifact store, as a library, a command line (``diffret``) and Prefect flows.

The library in ten lines (docs/api: ``examples/quickstart.py``)::

    import diffret
    data = diffret.load_beir("../shared/data/scifact")
    r = diffret.load("../shared/models/splade-tiny-mlm")
    q = r.encode_queries(data.queries("test"), k=4)
    p = r.encode_passages(data.corpus, k=4)
    run = diffret.search(q, p, "multi_dense")
    print(diffret.evaluate(run, data.qrels("test")))

Importing diffret loads neither torch nor Prefect: each name below loads what it needs when first used.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# The one version: pyproject.toml reads it from here (dynamic), manifests record it through the installed metadata.
__version__ = "0.2.0"

_API = {
    "load": "diffret.api",
    "Retriever": "diffret.api",
    "Encoded": "diffret.api",
    "search": "diffret.api",
    "evaluate": "diffret.api",
    "evaluate_per_query": "diffret.api",
    "load_beir": "diffret.api",
    "Collection": "diffret.api",
    "Store": "diffret.api",
}
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'diffret' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
