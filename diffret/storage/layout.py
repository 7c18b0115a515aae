"""The one place that knows where artifacts live, and the schemas of the store's own tables (the domain's tables'
shapes are diffret.schemas).

Every path below is relative to the store root; ``ArtifactStore`` joins it with the root (a local
folder or an fsspec URL). Stage folders are hive-partitioned (``key=value``) so that DuckDB reads any
slice with ``hive_partitioning=true``. A *system* (an encoder with all its settings, or BM25) is named
by its slug, the ``system=`` partition of every folder it produced.
"""

from __future__ import annotations

import re

import pyarrow as pa

from diffret.schemas import (
    CORPUS_SCHEMA,
    GROUPS_SCHEMA,
    METRICS_SCHEMA,
    QRELS_SCHEMA,
    QUERIES_SCHEMA,
    RUN_SCHEMA,
    encodings_schema,
)

DEFAULT_ROOT = "./diffret-store"  # the store root when none is given (CLI --root / $DIFFRET_ROOT, flow configs)
MANIFEST_NAME = "_manifest.json"
STAGING_DIR = "_staging"  # same filesystem as the store: a staged folder is renamed into place
LOCKS_DIR = "_locks"
PLANS_DIR = "_plans"  # what every unit of a stage run shares (its settings), stored once: plan=<key>.json

# ----------------------------------------------------------------------------------------- schemas

DATASET_TABLES: dict[str, pa.Schema] = {
    "corpus": CORPUS_SCHEMA,
    "queries": QUERIES_SCHEMA,
    "qrels": QRELS_SCHEMA,
}

# ------------------------------------------------------------------------------------------- paths

_VALUE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def check_partition_value(key: str, value: object) -> str:
    """A partition value becomes a folder name: keep it to a safe alphabet so paths never escape."""
    text = str(value)
    if not _VALUE_RE.match(text) or len(text) > 200:
        raise ValueError(f"invalid {key} {text!r}: use letters, digits and . _ + - (starting with a letter or digit)")
    return text


def partition(stage: str, **parts: object) -> str:
    """``stage/k1=v1/k2=v2`` with every value checked."""
    segs = [stage] + [f"{k}={check_partition_value(k, v)}" for k, v in parts.items()]
    return "/".join(segs)


def dataset_dir(dataset: str) -> str:
    return partition("datasets", dataset=dataset)


def dataset_file(dataset: str, table: str) -> str:
    if table not in DATASET_TABLES:
        raise ValueError(f"unknown dataset table {table!r}; expected one of {sorted(DATASET_TABLES)}")
    return f"{dataset_dir(dataset)}/{table}.parquet"


def manifest_path(folder: str) -> str:
    return f"{folder}/{MANIFEST_NAME}"


def lock_name(folder: str) -> str:
    return folder.replace("/", "__").replace("=", "-")


TOKENS_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),  # text only, truncated to max_length
        pa.field("n_tokens", pa.int32(), nullable=False),  # length before truncation
        pa.field("truncated", pa.bool_(), nullable=False),
        pa.field("text", pa.string(), nullable=False),  # the raw text (passages: title + sep + text), uncut
    ]
)


# The sparse content-word filter's vocabulary ids per text, computed once at tokenize time (shards named as the
# tokens folder's): every K pass of every system of the tokenizer reads them instead of filtering again.
FILTER_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("allowed_ids", pa.list_(pa.int32()), nullable=False),  # sorted; the mask id is dropped at encode
    ]
)


BOT_FILE = "bot.parquet"
BOT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),  # sorted, unique, special ids dropped: binary
    ]
)


def shard_name(index: int) -> str:
    return f"shard={index:05d}.parquet"


def tokens_dir(tokenizer: str, dataset: str, side: str) -> str:
    return partition("tokens", tokenizer=tokenizer, dataset=dataset, side=side)


def filters_dir(tokenizer: str, dataset: str, side: str, kind: str) -> str:
    """The content filter ``kind``'s ids of a tokens folder's texts (``FILTER_SCHEMA``, one shard per tokens shard)."""
    return partition("filters", tokenizer=tokenizer, dataset=dataset, side=side, filter=kind)


def partial_encodings_dir(system: str, dataset: str, k: int) -> str:
    """The passages of a corpus that late re-scoring needed, encoded by one system at K (``part=NNNNN.parquet``
    in the encodings schema; each run adds the ones still missing)."""
    return partition("partial", system=system, dataset=dataset, k=k)


def pass_units_dir(system: str, dataset: str, kp: int, key: str) -> str:
    """The partial results of one search pass cut into units (``block=NNNNN.parquet``, one per unit: the top-k
    (``TOPK_SCHEMA``) of a score or beta pass's passage blocks or a late pass's query slices, a rerank pass's run
    rows), named by the pass's settings (``key``); merged into its run folders, then removed, when its last unit is
    done. ``kp`` is 0 for a pass without passage encodings (beta, rerank)."""
    return partition("partials", system=system, dataset=dataset, kp=kp, key=key)


def unit_seconds_path(folder: str, name: str) -> str:
    """Where a cut pass's unit records what its search cost (JSON ``{"seconds": ...}``), beside its file: the unit's
    file holds only what its inputs decide, so a unit computed twice (a Dask worker died) writes the same bytes.

    >>> unit_seconds_path("partials/system=s/dataset=d/kp=1/key=k", "block=00003.parquet")
    'partials/system=s/dataset=d/kp=1/key=k/_seconds-block=00003.json'
    """
    return f"{folder}/{UNIT_SECONDS_PREFIX}{name.rsplit('.', 1)[0]}.json"


def bot_dir(tokenizer: str, dataset: str) -> str:
    """SIDR's binary bag-of-tokens index of a dataset's passages under one tokenizer (``tokens/``'s slug)."""
    return partition("bot", tokenizer=tokenizer, dataset=dataset)


def encodings_dir(system: str, dataset: str, side: str, k: int) -> str:
    return partition("encodings", system=system, dataset=dataset, side=side, k=k)


CODEBOOK_FILE = "codebook.npz"
CODES_INDEX_FILE = "ivf.parquet"  # a residual:B system's codes index: the passages of each centroid's cell


def codebook_dir(system: str, dataset: str, k: int) -> str:
    """The codebook a compressed system's K_p passage vectors are coded with (``CODEBOOK_FILE``,
    retrieval/search/codecs.py)."""
    return partition("codebooks", system=system, dataset=dataset, k=k)


def plan_path(key: str) -> str:
    """A stage run's shared unit settings (:meth:`storage.ArtifactStore.put_plan`), by content key."""
    return f"{PLANS_DIR}/plan={key}.json"


def system_dir(system: str) -> str:
    """The registry record of a system: ``systems/system=<slug>/_manifest.json`` (its full settings)."""
    return partition("systems", system=system)


# ------------------------------------------------------------------------- runs, metrics, index

RUN_FILE = "run.parquet"
SHARD_LOG = "_shards.jsonl"  # a sharded folder's appended shard records (local stores), until compacted
SHARD_RECORDS_DIR = "_records"  # the same as one small file per shard (object stores cannot append)
UNIT_SECONDS_PREFIX = "_seconds-"  # a cut pass's unit's search seconds, beside its file (never inside it)
METRICS_FILE = "per_query.parquet"


IMPORTED_MODE = "imported"  # the mode of a run made elsewhere (diffret import-run; kq = kp = 0)
FUSION_MODE = "fusion"  # the mode of a fusion of stored runs (diffret fuse; kq = kp = 0)


def run_dir(system: str, dataset: str, split: str, kq: int, kp: int, mode: str) -> str:
    """One run folder per (system, dataset, split, K_q, K_p, mode); BM25 (no budget) uses kq = kp = 0, mode=bm25."""
    return partition("runs", system=system, dataset=dataset, split=split, kq=kq, kp=kp, mode=mode)


def metrics_dir(system: str, dataset: str, split: str, kq: int, kp: int, mode: str) -> str:
    return partition("metrics", system=system, dataset=dataset, split=split, kq=kq, kp=kp, mode=mode)


def index_dir(system: str, dataset: str, kp: int) -> str:
    """A passage encoding's index: a LanceDB database folder holding one multivector table (``docs``), or a
    ``residual:B`` system's codes index (``CODES_INDEX_FILE``)."""
    return partition("index", system=system, dataset=dataset, kp=kp)


def summary_dir(system: str, dataset: str, split: str) -> str:
    """The pipeline's leaderboard, heatmaps and summary markdown for one system, dataset and split."""
    return partition("summaries", system=system, dataset=dataset, split=split)


def report_dir(name: str) -> str:
    return partition("reports", report=name)


def comparison_dir(name: str) -> str:
    """A table of runs against a baseline (``diffret compare``): comparison.md, .csv and .tex."""
    return partition("comparisons", comparison=name)


GROUPS_FILE = "groups.parquet"
TRAIN_LOG_FILE = "train_log.parquet"
TRAIN_LOG_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int32(), nullable=False),
        pa.field("lr", pa.float64()),
        pa.field("loss", pa.float64()),
        pa.field("dense", pa.float64()),
        pa.field("sparse", pa.float64()),
        pa.field("samples_per_s", pa.float64()),
        pa.field("topk", pa.float64()),  # SIDR's objective: its parametric (top-k) and bag-of-tokens parts
        pa.field("bot", pa.float64()),
    ]
)


def model_dir(name: str) -> str:
    """A fine-tuned model: a transformers folder (``--model`` takes it), its train log and loss curve."""
    return partition("models", model=name)


def checkpoint_path(name: str) -> str:
    """The resumable state of a training run in progress (written atomically every N steps)."""
    return f"checkpoints/model={name}/last.pt"


def training_dir(name: str) -> str:
    """One set of training groups (``groups.parquet``): from a Tevatron file, or mined from a stored run."""
    return partition("training", set=name)


def latency_dir(system: str, kind: str, setting: str) -> str:
    """Latency rows of one system: ``kind`` encode or search, ``setting`` the hash of the settings and machine."""
    return partition("latency", system=system, kind=kind, setting=setting)


ENCODE_LATENCY_FILE = "encode_latency.parquet"
SEARCH_LATENCY_FILE = "search_latency.parquet"
_ENVIRONMENT_FIELDS = [
    pa.field("device", pa.string()),
    pa.field("device_name", pa.string()),
    pa.field("threads", pa.int32()),
    pa.field("dtype", pa.string()),
    pa.field("attention", pa.string()),
    pa.field("torch", pa.string()),
    pa.field("transformers", pa.string()),
]
_TIMING_FIELDS = [
    pa.field("min_ms", pa.float64()),
    pa.field("median_ms", pa.float64()),
    pa.field("max_ms", pa.float64()),
    pa.field("repeats", pa.int32()),
    pa.field("measured_at", pa.timestamp("us", tz="UTC")),
]
# one row per (side, input length, batch size, K): milliseconds per text
ENCODE_LATENCY_SCHEMA = pa.schema(
    [
        pa.field("system", pa.string()),
        pa.field("model", pa.string()),
        pa.field("family", pa.string()),
        pa.field("readout", pa.string()),
        pa.field("denoise_steps", pa.int32()),
        pa.field("hidden", pa.int32()),
        pa.field("side", pa.string()),
        pa.field("length", pa.int32()),
        pa.field("batch_size", pa.int32()),
        pa.field("k", pa.int32()),
        pa.field("input_tokens", pa.float64()),
        pa.field("slots", pa.float64()),
    ]
    + _TIMING_FIELDS
    + _ENVIRONMENT_FIELDS
)
# one row per (engine, mode, index size, K_q, K_p): milliseconds per query
SEARCH_LATENCY_SCHEMA = pa.schema(
    [
        pa.field("system", pa.string()),
        pa.field("engine", pa.string()),
        pa.field("index_type", pa.string()),
        pa.field("mode", pa.string()),
        pa.field("docs", pa.int64()),
        pa.field("kq", pa.int32()),
        pa.field("kp", pa.int32()),
        pa.field("hidden", pa.int32()),
        pa.field("queries", pa.int32()),
        pa.field("topk", pa.int32()),
    ]
    + _TIMING_FIELDS
    + _ENVIRONMENT_FIELDS
)


FEATURES_FILE = "features.parquet"
# one row per (query, feature): what a query's budget is chosen from (diffret budget)
FEATURES_SCHEMA = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("feature", pa.string(), nullable=False),
        pa.field("value", pa.float64(), nullable=False),
    ]
)


def features_dir(system: str, dataset: str, split: str, feature_set: str) -> str:
    """A split's query features for adaptive budgets (``FEATURES_SCHEMA``, long)."""
    return partition("features", system=system, dataset=dataset, split=split, set=feature_set)


# Schema of the files a SQL view reads (used for typed zero-row placeholders).
FILE_SCHEMAS: dict[str, pa.Schema] = {f"{name}.parquet": schema for name, schema in DATASET_TABLES.items()}
FILE_SCHEMAS[RUN_FILE] = RUN_SCHEMA
FILE_SCHEMAS[METRICS_FILE] = METRICS_SCHEMA
FILE_SCHEMAS[GROUPS_FILE] = GROUPS_SCHEMA
FILE_SCHEMAS[TRAIN_LOG_FILE] = TRAIN_LOG_SCHEMA
FILE_SCHEMAS[BOT_FILE] = BOT_SCHEMA
FILE_SCHEMAS[ENCODE_LATENCY_FILE] = ENCODE_LATENCY_SCHEMA
FILE_SCHEMAS[SEARCH_LATENCY_FILE] = SEARCH_LATENCY_SCHEMA
FILE_SCHEMAS[FEATURES_FILE] = FEATURES_SCHEMA


def schema_for_pattern(pattern: str) -> pa.Schema | None:
    """The Arrow schema of the files a view's glob matches."""
    stage = pattern.split("/", 1)[0]
    if stage == "encodings":
        return encodings_schema(1)
    if stage == "tokens":
        return TOKENS_SCHEMA
    return FILE_SCHEMAS.get(pattern.rsplit("/", 1)[-1])


# Every kind of folder: its glob (relative to the root) and the command whose next run rebuilds a damaged one
# (storage.repairs.repair_of names it with the settings that made the folder, where the store holds them).
STAGE_FOLDERS: dict[str, tuple[str, str]] = {
    "datasets": ("datasets/*", "download"),
    "tokens": ("tokens/*/*/*", "tokenize"),
    "filters": ("filters/*/*/*/*", "tokenize"),
    "encodings": ("encodings/*/*/*/*", "encode"),
    "codebooks": ("codebooks/*/*/*", "compress"),
    "systems": ("systems/*", "encode"),
    "runs": ("runs/*/*/*/*/*/*", "score"),
    "metrics": ("metrics/*/*/*/*/*/*", "evaluate"),
    "index": ("index/*/*/*", "index"),
    "bot": ("bot/*/*", "bot"),
    "partial": ("partial/*/*/*", "late"),
    "partials": ("partials/*/*/*/*", "score"),
    "summaries": ("summaries/*/*/*", "summary"),
    "reports": ("reports/*", "report"),
    "comparisons": ("comparisons/*", "compare"),
    "training": ("training/*", "training-data"),
    "models": ("models/*", "train"),
    "latency": ("latency/*/*/*", "latency"),
    "features": ("features/*/*/*/*", "budget"),
}
# The names a store root holds (every folder, and the store's own bookkeeping): a folder holding none of them
# (beside hidden entries) is not a store (:meth:`storage.ArtifactStore.require_root`)
STORE_TOP_FOLDERS = frozenset([*STAGE_FOLDERS, STAGING_DIR, LOCKS_DIR, PLANS_DIR, "checkpoints"])
MODEL_TASK_KEY = b"diffret.task"  # train_log.parquet's schema metadata: "reranker" (train-reranker) or "encoder"
