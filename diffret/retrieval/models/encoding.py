"""Batch encoding: texts -> token ids (once per tokenizer), token ids -> encodings tables (one per K).

Pure functions over a tokenizer or a readout; the tokenize and encode stages store what they return.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from diffret.schemas import encodings_schema

from .readouts import Encoded, Pending, Prepared, Readout


def quiet_length_warning(tokenizer: Any) -> None:
    """Mark transformers' "longer than the specified maximum" warning as shown on this tokenizer (its own
    once-per-tokenizer flag): callers tokenize whole texts on purpose and cut them before the model."""
    shown = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(shown, dict):
        shown["sequence-length-is-longer-than-the-specified-maximum"] = True


def tokenize_texts(tokenizer: Any, texts: list[str], max_length: int) -> pa.Table:
    """Token ids cut at ``max_length``, with each text's full length and whether it was cut.

    The texts are tokenized whole on purpose (to record ``n_tokens``), so transformers' warning that a
    sequence is longer than the model's maximum would mislead: nothing that long reaches the model. It is
    marked as already shown on this tokenizer (transformers' own once-per-tokenizer flag; no global state).
    No texts give an empty table (a tokenizer called on none raises).

    >>> tokenize_texts(None, [], 8).num_rows
    0
    """
    quiet_length_warning(tokenizer)
    enc = tokenizer(texts, add_special_tokens=False, truncation=False)["input_ids"] if texts else []  # none: no call
    lengths = [len(e) for e in enc]
    return pa.table(
        {
            "token_ids": pa.array([e[:max_length] for e in enc], pa.list_(pa.int64())),
            "n_tokens": pa.array(lengths, pa.int64()),
            "truncated": pa.array([n > max_length for n in lengths], pa.bool_()),
        }
    )


def length_sorted_batches(lengths: list[int], batch_size: int, sort: bool = True) -> Iterator[list[int]]:
    """Indices in batches of similar length (longest first: memory peaks show up at once)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)) if sort else list(range(len(lengths)))
    for s in range(0, len(order), batch_size):
        yield order[s : s + batch_size]


def encoded_table(ids: list[str], encs: list[Encoded], hidden: int) -> pa.Table:
    head_stats = any(e.entropy is not None for e in encs)
    schema = encodings_schema(hidden, head_stats)
    dense_type = schema.field("dense").type
    flat = [np.asarray(e.dense, dtype=np.float16) for e in encs]
    n_reps = [f.shape[0] for f in flat]
    values = pa.array(np.concatenate([f.reshape(-1) for f in flat]) if flat else np.zeros(0, np.float16), pa.float16())
    inner = pa.FixedSizeListArray.from_arrays(values, hidden)
    offsets = pa.array(np.concatenate([[0], np.cumsum(n_reps)]).astype(np.int32))
    dense = pa.ListArray.from_arrays(offsets, inner).cast(dense_type)
    has_sparse = any(e.sparse_ids is not None for e in encs)
    if has_sparse and any(e.sparse_ids is None or e.sparse_weights is None for e in encs):
        raise ValueError("encoded texts: some have sparse vectors and some do not")
    return pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "n_reps": pa.array(n_reps, pa.int16()),
            "dense": dense,
            "sparse_ids": pa.array(
                [None if e.sparse_ids is None else e.sparse_ids.tolist() for e in encs], pa.list_(pa.int32())
            ),
            "sparse_weights": pa.array(
                [None if e.sparse_weights is None else e.sparse_weights.tolist() for e in encs], pa.list_(pa.float32())
            ),
            "n_tokens": pa.array([e.n_tokens for e in encs], pa.int32()),
            "stopped": pa.array([e.stopped for e in encs], pa.bool_()),
            "tokens": pa.array([None if e.tokens is None else e.tokens.tolist() for e in encs], pa.list_(pa.int32())),
            **(
                {
                    name: pa.array([getattr(e, attr).tolist() for e in encs], pa.list_(pa.float32()))
                    for name, attr in (("slot_entropy", "entropy"), ("slot_maxprob", "maxprob"))
                }
                if head_stats
                else {}
            ),
        },
        schema=schema,
    )


def encode_rows(
    reader: Readout,
    ids: list[str],
    token_ids: list[list[int]],
    texts: list[str] | None,
    *,
    side: str,
    k: int,
    batch_size: int,
    on_batch: Callable[[int], None] | None = None,
    sort_by_length: bool = True,
    filtered: list[list[int]] | None = None,
    head_stats: bool = False,
) -> pa.Table:
    """Encode texts in length-sorted batches and return them in their original order.

    ``texts`` are the raw texts (the sparse content-word filter reads them whole); None decodes the ids.
    ``filtered``: the filter's ids of each text, computed before (the tokenize stage's ``filters/``); the texts
    are then not read. ``head_stats``: the mask readout also stores the LM head's entropy and max probability at
    each slot (columns ``slot_entropy``, ``slot_maxprob``).
    """
    feed: list[str] | list[list[int]] | None = filtered if filtered is not None else texts
    if feed is None and reader.filter is not None:
        feed = reader.bb.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
    out: list[Encoded | None] = [None] * len(ids)
    batches = list(length_sorted_batches([len(t) for t in token_ids], batch_size, sort_by_length))

    def prepare(batch: list[int]) -> Prepared:
        ready = reader.prepare([token_ids[i] for i in batch], [feed[i] for i in batch] if feed else None, side, k)
        ready.head_stats = head_stats
        return ready

    def finish(batch: list[int], pending: Pending) -> None:
        for i, e in zip(batch, pending.result(), strict=True):
            out[i] = e
        if on_batch:
            on_batch(len(batch))

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffret-prepare") as pool:
        ahead = pool.submit(prepare, batches[0]) if batches else None
        last: tuple[list[int], Pending] | None = None
        for n, batch in enumerate(batches):
            assert ahead is not None
            ready = ahead.result()
            if n + 1 < len(batches):  # the next batch is padded while the model runs this one
                ahead = pool.submit(prepare, batches[n + 1])
            launched = reader.launch(ready)  # on a GPU: queued, the previous batch's copy back ahead of it
            if last is not None:  # the previous batch's results, read while the device runs this one
                finish(*last)
            last = (batch, launched)
        if last is not None:
            finish(*last)
    return encoded_table(ids, out, reader.bb.hidden_size)  # type: ignore[arg-type]
