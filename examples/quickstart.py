"""diffret from Python, as a notebook uses it: SciFact's test queries and corpus encoded in memory by splade-tiny
at (K_q, K_p) = (4, 4), searched in three modes and evaluated: the numbers `diffret run --max-length 128` gives
for that cell (tests/e2e/test_pipeline_shared.py checks it at K = 2). Run from the repository root:
``python examples/quickstart.py [K]``."""

import sys

import diffret

k = int(sys.argv[1]) if len(sys.argv) > 1 else 4

data = diffret.load_beir("../shared/data/scifact")
retriever = diffret.load("../shared/models/splade-tiny-mlm", max_length=128)
queries = retriever.encode_queries(data.queries("test"), k=k)
passages = retriever.encode_passages(data.corpus, k=k)
for mode in ["multi_dense", "sparse_max", "fusion_multi_sparse_max"]:
    run = diffret.search(queries, passages, mode)
    print(mode, diffret.evaluate(run, data.qrels("test")))
