"""The grid encoding stage, without Prefect: tokenize a dataset side once, then encode each shard per K.

Store layout (storage/layout.py):
    tokens/tokenizer=<slug>/dataset=<d>/side=<s>/shard=NNNNN.parquet         text token ids
    encodings/model=<slug>/dataset=<d>/side=<s>/k=<K>/shard=NNNNN.parquet    dense + sparse

A shard is a contiguous range of the side's texts (corpus order; queries in first-appearance
order) and the unit of parallelism and of resume: it is done when its manifest entry exists and
its checksum matches. Shard files are written atomically; the manifest is updated by one writer
(the flow) after each shard, so a killed run loses at most the shards in flight.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import AfterValidator, BaseModel, Field

from storage import ArtifactStore, ConfigDriftError, FileEntry, Manifest, config_hash, diff_configs
from storage.layout import (
    TOKENS_SCHEMA,
    dataset_dir,
    encodings_schema,
    shard_name,
    tokens_dir,
)

from .backbones import BackboneConfig
from .readouts import Encoded, Reader, ReadoutConfig

GRID_K = (1, 2, 4, 8, 16)


def sorted_positive_ks(v: list[int]) -> list[int]:
    """A budget list as the flows take it: positive, deduplicated, sorted."""
    if not v or any(k <= 0 for k in v):
        raise ValueError(f"K must be positive integers, got {v}")
    return sorted(set(v))


KList = Annotated[list[int], AfterValidator(sorted_positive_ks)]


class EncodeSettings(BaseModel):
    """Everything that determines the numbers in an encoding (part of the model slug)."""

    backbone: BackboneConfig
    readout: ReadoutConfig = Field(default_factory=ReadoutConfig)
    max_length: int = Field(default=512, ge=1, description="Text tokens kept per text (before the prompt).")


def _slug_base(model: str) -> str:
    base = model.rstrip("/").split("/")[-1] or "model"
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", base).strip("-.")[:60] or "model"


def numeric_settings(s: EncodeSettings) -> dict[str, Any]:
    """The settings that change the numbers (device, attention kernel and batch size do not)."""
    b = s.backbone
    return {
        "model": b.model,
        "gguf_file": b.gguf_file,
        "family": b.family,
        "dtype": b.dtype,
        "mask_token": b.mask_token,
        "turn_end": b.turn_end,
        "readout": s.readout.model_dump(),
        "max_length": s.max_length,
    }


def model_slug(s: EncodeSettings) -> str:
    h = config_hash(numeric_settings(s))[:10]
    return f"{_slug_base(s.backbone.model)}-{s.readout.readout}-{h}"


def tokenizer_slug(model: str, gguf_file: str | None, max_length: int, tokenizer: Any) -> str:
    vocab = tokenizer.get_vocab()
    vh = hashlib.sha256(repr(sorted(vocab.items())).encode()).hexdigest()[:8]
    h = config_hash({"model": model, "gguf": gguf_file, "max_length": max_length, "vocab": vh})[:10]
    return f"{_slug_base(model)}-{h}"


# ------------------------------------------------------------------------------------------ texts
def side_texts(store: ArtifactStore, dataset: str, side: str) -> tuple[list[str], list[str], str]:
    """(ids, texts, dataset config hash) of one side; passages as "title text" when there is a title."""
    stage = dataset_dir(dataset)
    m = store.require_manifest(stage)
    if side == "passage":
        if "corpus.parquet" not in m.files:
            raise ValueError(f"dataset {dataset!r} has no corpus in the store (queries and qrels only)")
        t = store.read_table(stage, "corpus.parquet", columns=["doc_id", "title", "text"])
        ids = t.column("doc_id").to_pylist()
        texts = [
            f"{ti} {tx}".strip() if ti else tx
            for ti, tx in zip(t.column("title").to_pylist(), t.column("text").to_pylist(), strict=True)
        ]
    elif side == "query":
        t = store.read_table(stage, "queries.parquet", columns=["query_id", "text"])
        seen: dict[str, str] = {}
        for qid, tx in zip(t.column("query_id").to_pylist(), t.column("text").to_pylist(), strict=True):
            seen.setdefault(qid, tx)
        ids, texts = list(seen), list(seen.values())
    else:
        raise ValueError(f"unknown side {side!r}; expected query or passage")
    return ids, texts, m.config_hash


def side_size(store: ArtifactStore, dataset: str, side: str) -> tuple[int, str]:
    """(number of texts, dataset config hash) of one side, without reading the texts."""
    stage = dataset_dir(dataset)
    m = store.require_manifest(stage)
    if side == "passage":
        entry = m.files.get("corpus.parquet")
        if entry is None:
            raise ValueError(f"dataset {dataset!r} has no corpus in the store (queries and qrels only)")
        return int(entry.rows or 0), m.config_hash
    if side == "query":
        qids = store.read_table(stage, "queries.parquet", columns=["query_id"]).column("query_id").to_pylist()
        return len(dict.fromkeys(qids)), m.config_hash
    raise ValueError(f"unknown side {side!r}; expected query or passage")


def shard_ranges(n: int, shard_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + shard_size, n)) for s in range(0, n, shard_size)] or [(0, 0)]


# -------------------------------------------------------------------------------------- manifests
def open_stage(store: ArtifactStore, stage: str, stage_name: str, partition: dict[str, str], config: dict) -> Manifest:
    """The stage's manifest (created when absent); refuses a different config, naming the fields."""
    m = store.read_manifest(stage)
    if m is None:
        m = Manifest.new(stage_name, partition, config)
        store.write_manifest(stage, m)
        return m
    if m.config_hash != config_hash(config):
        raise ConfigDriftError(
            store.abspath(stage),
            diff_configs(m.config, config),
            hint="Remove that folder (or use another store root) to encode with the new settings.",
        )
    return m


def done_shards(store: ArtifactStore, stage: str, m: Manifest) -> set[str]:
    """Shards whose manifest entry exists and whose file verifies."""
    done = set()
    for name, entry in m.files.items():
        try:
            store.verify_file(stage, name, entry)
            done.add(name)
        except Exception:  # noqa: BLE001 - any failure means "redo this shard"
            pass
    return done


def record_shard(store: ArtifactStore, stage: str, name: str, entry: FileEntry) -> None:
    """Add one finished shard to the stage manifest (the flow is the only writer)."""
    with store.lock(stage + "/_manifest"):
        m = store.require_manifest(stage)
        m.files[name] = entry
        store.write_manifest(stage, m)


def write_shard(store: ArtifactStore, stage: str, name: str, table: pa.Table) -> FileEntry:
    """Atomically write one shard file (not yet recorded in the manifest)."""
    import io

    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    data = buf.getvalue()
    store.write_bytes(f"{stage}/{name}", data)
    return FileEntry(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), rows=table.num_rows)


# --------------------------------------------------------------------------------------- tokenize
def tokenize_texts(tokenizer: Any, texts: list[str], max_length: int) -> pa.Table:
    """Token ids cut at ``max_length``, with each text's full length and whether it was cut.

    The texts are tokenized whole on purpose (to record ``n_tokens``), so transformers' warning that a
    sequence is longer than the model's maximum would mislead: nothing that long reaches the model. It is
    marked as already shown on this tokenizer (transformers' own once-per-tokenizer flag; no global state).
    """
    shown = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(shown, dict):
        shown["sequence-length-is-longer-than-the-specified-maximum"] = True
    enc = tokenizer(texts, add_special_tokens=False, truncation=False)["input_ids"]
    lengths = [len(e) for e in enc]
    return pa.table(
        {
            "token_ids": [e[:max_length] for e in enc],
            "n_tokens": lengths,
            "truncated": [n > max_length for n in lengths],
        }
    )


@dataclass
class TokensPlan:
    stage: str
    slug: str
    shards: list[tuple[str, int, int]]  # (name, start, end)
    config: dict[str, Any]


def plan_tokens(
    store: ArtifactStore, tokenizer: Any, settings: EncodeSettings, dataset: str, side: str, shard_size: int
) -> TokensPlan:
    n, ds_hash = side_size(store, dataset, side)
    slug = tokenizer_slug(settings.backbone.model, settings.backbone.gguf_file, settings.max_length, tokenizer)
    config = {
        "tokenizer": slug,
        "dataset": dataset,
        "dataset_config_hash": ds_hash,
        "side": side,
        "max_length": settings.max_length,
        "shard_size": shard_size,
        "rows": n,
    }
    stage = tokens_dir(slug, dataset, side)
    shards = [(shard_name(i), s, e) for i, (s, e) in enumerate(shard_ranges(n, shard_size))]
    return TokensPlan(stage, slug, shards, config)


def tokenize_side(store: ArtifactStore, tokenizer: Any, plan: TokensPlan) -> int:
    """Tokenize the shards not yet done (the texts are read only when one is missing); returns how many."""
    m = open_stage(
        store,
        plan.stage,
        "tokens",
        {"tokenizer": plan.slug, "dataset": plan.config["dataset"], "side": plan.config["side"]},
        plan.config,
    )
    done = done_shards(store, plan.stage, m)
    todo = [(name, s, e) for name, s, e in plan.shards if name not in done]
    if not todo:
        return 0
    ids, texts, _ = side_texts(store, plan.config["dataset"], plan.config["side"])
    if len(ids) != plan.config["rows"]:
        raise ValueError(
            f"{plan.config['dataset']}/{plan.config['side']}: {len(ids)} texts, manifest says {plan.config['rows']}"
        )
    for name, s, e in todo:
        t = tokenize_texts(tokenizer, texts[s:e], plan.config["max_length"])
        t = t.add_column(0, "id", pa.array(ids[s:e], pa.string())).cast(TOKENS_SCHEMA)
        record_shard(store, plan.stage, name, write_shard(store, plan.stage, name, t))
    return len(todo)


# ----------------------------------------------------------------------------------------- encode
def length_sorted_batches(lengths: list[int], batch_size: int, sort: bool = True) -> Iterator[list[int]]:
    """Indices in batches of similar length (longest first: memory peaks show up at once)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)) if sort else list(range(len(lengths)))
    for s in range(0, len(order), batch_size):
        yield order[s : s + batch_size]


def encoded_table(ids: list[str], encs: list[Encoded], hidden: int) -> pa.Table:
    schema = encodings_schema(hidden)
    dense_type = schema.field("dense").type
    flat = [np.asarray(e.dense, dtype=np.float16) for e in encs]
    n_reps = [f.shape[0] for f in flat]
    values = pa.array(np.concatenate([f.reshape(-1) for f in flat]) if flat else np.zeros(0, np.float16), pa.float16())
    inner = pa.FixedSizeListArray.from_arrays(values, hidden)
    offsets = pa.array(np.concatenate([[0], np.cumsum(n_reps)]).astype(np.int32))
    dense = pa.ListArray.from_arrays(offsets, inner).cast(dense_type)
    has_sparse = any(e.sparse_ids is not None for e in encs)
    return pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "n_reps": pa.array(n_reps, pa.int16()),
            "dense": dense,
            "sparse_ids": pa.array([e.sparse_ids.tolist() if has_sparse else None for e in encs], pa.list_(pa.int32())),
            "sparse_weights": pa.array(
                [e.sparse_weights.tolist() if has_sparse else None for e in encs], pa.list_(pa.float32())
            ),
            "n_tokens": pa.array([e.n_tokens for e in encs], pa.int32()),
            "stopped": pa.array([e.stopped for e in encs], pa.bool_()),
        },
        schema=schema,
    )


def encode_rows(
    reader: Reader,
    ids: list[str],
    token_ids: list[list[int]],
    side: str,
    k: int,
    batch_size: int,
    on_batch: Callable[[int], None] | None = None,
    sort_by_length: bool = True,
) -> pa.Table:
    """Encode texts in length-sorted batches and return them in their original order."""
    texts = reader.bb.tokenizer.batch_decode(token_ids, skip_special_tokens=True) if reader.filter else None
    out: list[Encoded | None] = [None] * len(ids)
    for batch in length_sorted_batches([len(t) for t in token_ids], batch_size, sort_by_length):
        encs = reader.encode([token_ids[i] for i in batch], [texts[i] for i in batch] if texts else None, side, k)
        for i, e in zip(batch, encs, strict=True):
            out[i] = e
        if on_batch:
            on_batch(len(batch))
    return encoded_table(ids, out, reader.bb.hidden_size)  # type: ignore[arg-type]


def encode_shard(
    store: ArtifactStore,
    reader: Reader,
    tokens_stage: str,
    shard: str,
    out_stage: str,
    side: str,
    k: int,
    batch_size: int,
    on_batch: Callable[[int], None] | None = None,
) -> FileEntry:
    t = store.read_table(tokens_stage, shard)
    table = encode_rows(
        reader, t.column("id").to_pylist(), t.column("token_ids").to_pylist(), side, k, batch_size, on_batch
    )
    return write_shard(store, out_stage, shard, table)


def encodings_config(settings: EncodeSettings, tokens: TokensPlan, k: int) -> dict[str, Any]:
    return {
        **numeric_settings(settings),
        "k": k,
        "tokens": tokens.slug,
        "tokens_config_hash": config_hash(tokens.config),
    }


def check_k(readout: ReadoutConfig, ks: list[int]) -> None:
    bad = [k for k in ks if not isinstance(k, int) or k <= 0]
    if bad or not ks:
        raise ValueError(f"K must be positive integers, got {ks}")
    if readout.readout in ("diffembed", "repllama") and ks != [1]:
        raise ValueError(f"the {readout.readout} readout has one vector per text; use --k 1 (got {ks})")
    if readout.readout == "promptreps" and len(ks) != 1:
        raise ValueError("promptreps decodes sequentially; K is its cap N: give one value (e.g. --k 20)")
