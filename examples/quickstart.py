"""diffret from Python, as a notebook uses it: SciFact's test queries and corpus encoded in memory by splade-tiny at
(K_q, K_p) = (4, 4), searched and evaluated, then the store of the README's offline demo read with SQL. The settings
are the demo's (`diffret run --preset laptop`: 256 tokens, batches of 16, so every vector is the same bytes), so the
means printed first are the ones the demo stored for its (4, 4) fusion_multi_sparse_max cell, to the last bit. This
file is the README's "From Python" block (tests/e2e/test_readme_commands.py checks both). Run it from the repository
root after the demo: ``python examples/quickstart.py``."""

import diffret

data = diffret.load_beir("../shared/data/scifact")  # or any BEIR-layout folder
retriever = diffret.load("../shared/models/splade-tiny-mlm", batch_size=16)  # the demo's settings
queries = retriever.encode_queries(data.queries("test"), k=4)  # in memory, no store
passages = retriever.encode_passages(data.corpus, k=4)
run = diffret.search(queries, passages, "fusion_multi_sparse_max")  # any of the five modes
print(diffret.evaluate(run, data.qrels("test")))  # {'ndcg_cut_10': ..., 'mrr_10': ..., ...}

store = diffret.Store("/tmp/r")  # a store the CLI or Prefect wrote
print(store.sql("select mode, kq, kp, ndcg_10 from best_cells where split = 'test'"))  # an Arrow table
