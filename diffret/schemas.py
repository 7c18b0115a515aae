"""The Arrow shapes of the tables the domain makes and the store holds (a collection's corpus, queries and qrels, a
system's encodings, runs, a pass unit's top-k, per-query metrics, training groups) and the headline measures: what
``retrieval`` produces and ``storage`` lays out agree on these, and neither imports the other for them. Where each
table lives is ``storage.layout``'s business.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

CORPUS_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("title", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("metadata", pa.string()),  # the source's metadata object as JSON text, or null
    ]
)

QUERIES_SCHEMA = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        # One row per (query, split) for every split whose qrels judge the query; a query judged in
        # no split keeps one row with split = null (it is still encodable).
        pa.field("split", pa.string()),
        pa.field("metadata", pa.string()),
    ]
)

QRELS_SCHEMA = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("relevance", pa.int32(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
    ]
)


def encodings_schema(hidden_size: int, head_stats: bool = False, code_bytes: int | None = None) -> pa.Schema:
    """One row per text: n_reps dense vectors of width H (float16), the sparse top-k, input length; with
    ``head_stats`` (``diffret encode --head-stats``, the query side of the mask readout) also the LM head's softmax
    entropy and max probability at each of the K slots. With ``code_bytes`` (a compressed store: the codecs) the
    vectors are a ``codes`` column instead of ``dense``: one fixed-size binary code per vector."""
    stats = [pa.field("slot_entropy", pa.list_(pa.float32())), pa.field("slot_maxprob", pa.list_(pa.float32()))]
    vectors = (pa.field("dense", pa.list_(pa.list_(pa.float16(), hidden_size)), nullable=False) if code_bytes is None
               else pa.field("codes", pa.list_(pa.binary(code_bytes)), nullable=False))  # fmt: skip
    return pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field("n_reps", pa.int16(), nullable=False),
            vectors,
            pa.field("sparse_ids", pa.list_(pa.int32())),
            pa.field("sparse_weights", pa.list_(pa.float32())),
            pa.field("n_tokens", pa.int32(), nullable=False),
            pa.field("stopped", pa.bool_()),  # cut before K: a special token (mask), the closing quote (promptreps)
            pa.field("tokens", pa.list_(pa.int32())),  # the token read at each of the K slots (argmax / generated)
            *(stats if head_stats else []),
        ]
    )


RUN_SCHEMA = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),  # 1-based, by score descending then doc_id
        pa.field("score", pa.float32(), nullable=False),
    ]
)

# One unit's top-k of a search pass (partials/): per (K_q, mode) and query row of the pass, the documents it ranks
# (global corpus positions) and their scores, best first, pads dropped. A unit's file covers a block of the passages
# (every query) or a slice of the queries (their whole candidate lists); its metadata holds its search seconds.
TOPK_SCHEMA = pa.schema(
    [
        pa.field("kq", pa.int32(), nullable=False),
        pa.field("mode", pa.string(), nullable=False),
        pa.field("row", pa.int32(), nullable=False),
        pa.field("index", pa.list_(pa.int64()), nullable=False),
        pa.field("score", pa.list_(pa.float32()), nullable=False),
    ]
)

# How a run file is written (``retrieval.search.runs.run_file_bytes``): the logical schema above, stored compactly.
# Rows are in (query, rank) order; ids are dictionary-encoded (Parquet falls back to plain strings in a row group
# whose dictionary outgrows its page, which is smaller at MS MARCO scale than a huge dictionary); ranks are
# delta-encoded (nearly free); float32 scores are byte-stream-split, so zstd packs their sorted high bytes. A
# file written before this (plain Parquet defaults) has the same schema and reads the same. Sizes: docs/schemas.md.
RUN_PARQUET_OPTIONS: dict[str, object] = {
    "compression": "zstd",
    "use_dictionary": ["query_id", "doc_id"],
    "column_encoding": {"rank": "DELTA_BINARY_PACKED", "score": "BYTE_STREAM_SPLIT"},
    "row_group_size": 1 << 20,
}

METRICS_SCHEMA = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("measure", pa.string(), nullable=False),  # ndcg_cut_10, mrr_10, recall_100, ...
        pa.field("value", pa.float64(), nullable=False),
    ]
)


@dataclass(frozen=True)
class Measure:
    """One evaluation measure under its three names."""

    pytrec: str  # the ``measure`` value in the metrics table (pytrec_eval's name, or mrr_<k>)
    short: str  # its column in the ``cells`` view, the leaderboard CSV and the CLI's JSON
    label: str  # its header in tables and reports


# The headline measures: what evaluate computes by default, the columns of the ``cells`` view, the
# leaderboard and the CLI. The first one ranks cells (``best_cells``) and fills the paper tables.
MEASURES: tuple[Measure, ...] = (
    Measure("ndcg_cut_10", "ndcg_10", "NDCG@10"),
    Measure("mrr_10", "mrr_10", "MRR@10"),
    Measure("recall_100", "recall_100", "R@100"),
    Measure("recall_1000", "recall_1000", "R@1000"),
)
PRIMARY = MEASURES[0]

PASSAGE_TYPE = pa.struct([("docid", pa.string()), ("title", pa.string()), ("text", pa.string())])
# Tevatron's training format: one row per query, its positive and (hard) negative passages
GROUPS_SCHEMA = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("query", pa.string(), nullable=False),
        pa.field("positive_passages", pa.list_(PASSAGE_TYPE), nullable=False),
        pa.field("negative_passages", pa.list_(PASSAGE_TYPE), nullable=False),
    ]
)
