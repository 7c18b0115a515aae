"""diffret from Python, as a notebook uses it: SciFact's test queries and corpus encoded in memory by splade-tiny
at (K_q, K_p) = (4, 4), searched in three modes and evaluated: the numbers `diffret run --max-length 128` stores
for that cell (tests/e2e/test_pipeline_shared.py checks it). Run from the repository root:
``python examples/quickstart.py``."""

import diffret

data = diffret.load_beir("../shared/data/scifact")
retriever = diffret.load("../shared/models/splade-tiny-mlm", max_length=128)
queries = retriever.encode_queries(data.queries("test"), k=4)
passages = retriever.encode_passages(data.corpus, k=4)
for mode in ["multi_dense", "sparse_max", "fusion_multi_sparse_max"]:
    run = diffret.search(queries, passages, mode)
    print(mode, diffret.evaluate(run, data.qrels("test")))
