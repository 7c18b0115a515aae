"""Runs: a top-k result as a table (diffret.schemas.RUN_SCHEMA), ranked by score then doc_id, and its file bytes; a
unit's partial top-k as a table (diffret.schemas.TOPK_SCHEMA) and back."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from diffret.schemas import RUN_PARQUET_OPTIONS, RUN_SCHEMA, TOPK_SCHEMA

from .scoring import NEG, TopK


def doc_order(doc_ids: Sequence[str]) -> np.ndarray:
    """Each doc's position in doc-id (string) order: the tie-break of :func:`run_table`, computed once per pass.

    >>> doc_order(["c", "a", "b"]).tolist()
    [2, 0, 1]
    """
    lex = np.empty(len(doc_ids), np.int64)
    lex[np.argsort(np.asarray(doc_ids, dtype=object).astype(str), kind="stable")] = np.arange(len(doc_ids))
    return lex


def retrieved_ids(tops: dict[Any, TopK], corpus_ids: pa.Array) -> tuple[dict[Any, TopK], list[str]]:
    """``tops`` re-indexed into the list of the documents they hold (each once, in corpus order), and that list:
    :func:`run_table` over it writes the same runs as over every corpus id, without a Python string per passage.

    >>> tops = {"a": TopK(np.array([[0.9, 0.5]], np.float32), np.array([[7, 2]]))}
    >>> small, ids = retrieved_ids(tops, pa.array([f"d{i}" for i in range(10)]))
    >>> small["a"].index.tolist(), ids
    ([[1, 0]], ['d2', 'd7'])
    """
    held = [t.index[t.index >= 0] for t in tops.values()]
    used = np.unique(np.concatenate(held + [np.zeros(0, np.int64)]))
    out = {}
    for key, t in tops.items():
        index = np.full(t.index.shape, -1, np.int64)
        index[t.index >= 0] = np.searchsorted(used, t.index[t.index >= 0])
        out[key] = TopK(t.scores, index)
    return out, corpus_ids.take(pa.array(used, pa.int64())).to_pylist()


def run_table(
    top: TopK,
    query_ids: list[str],
    doc_ids: list[str],
    query_rows: list[int] | None = None,
    lex: np.ndarray | None = None,
    depth: int | None = None,
) -> pa.Table:
    """A run (RUN_SCHEMA): per query, rank by score descending then doc_id ascending; pads dropped.

    ``query_rows`` selects (and orders) the queries of ``top`` to include (e.g. one split's); ``lex`` is
    :func:`doc_order` of ``doc_ids`` when the caller writes several runs over the same passages; ``depth``
    keeps each query's first ``depth`` documents (a prefix of the deeper run: the same ranks and ties).

    >>> top = TopK(np.array([[0.5, 0.9, -np.inf]], np.float32), np.array([[0, 1, -1]]))
    >>> run_table(top, ["q1"], ["d-a", "d-b"]).to_pylist()[0]
    {'query_id': 'q1', 'doc_id': 'd-b', 'rank': 1, 'score': 0.8999999761581421}
    >>> run_table(top, ["q1"], ["d-a", "d-b"], depth=1).num_rows
    1
    """
    if depth is not None and depth < 1:
        raise ValueError(f"run depth must be >= 1, not {depth}")
    doc_arr = np.asarray(doc_ids, dtype=object)
    if lex is None:
        lex = doc_order(doc_ids)
    elif len(lex) != len(doc_ids):
        raise ValueError(f"doc order of {len(lex)} docs for {len(doc_ids)} doc ids")
    rows = range(len(query_ids)) if query_rows is None else query_rows
    qcol: list[str] = []
    dcol: list[str] = []
    rcol: list[int] = []
    scol: list[float] = []
    for qi in rows:
        s, ix = top.scores[qi], top.index[qi]
        keep = ix >= 0
        s, ix = s[keep], ix[keep]
        order = np.lexsort((lex[ix], -s.astype(np.float64)))[:depth]
        s, ix = s[order], ix[order]
        qcol.extend([query_ids[qi]] * len(ix))
        dcol.extend(doc_arr[ix].tolist())
        rcol.extend(range(1, len(ix) + 1))
        scol.extend(s.tolist())
    return pa.table(
        {
            "query_id": pa.array(qcol, pa.string()),
            "doc_id": pa.array(dcol, pa.string()),
            "rank": pa.array(rcol, pa.int32()),
            "score": pa.array(scol, pa.float32()),
        },
        schema=RUN_SCHEMA,
    )


def run_file_bytes(table: pa.Table) -> bytes:
    """A run table (RUN_SCHEMA) as the bytes of its ``run.parquet`` (``diffret.schemas.RUN_PARQUET_OPTIONS``).

    Lossless: reading the bytes back gives the same table (doc ids as strings, the same ranks and float32
    scores); only the file is smaller (dictionary ids, delta ranks, byte-stream-split scores).

    >>> t = pa.table({"query_id": ["q1", "q1"], "doc_id": ["d-b", "d-a"], "rank": [1, 2], "score": [0.9, 0.5]},
    ...              schema=RUN_SCHEMA)
    >>> pq.read_table(io.BytesIO(run_file_bytes(t))).equals(t)
    True
    """
    if table.schema != RUN_SCHEMA:
        if table.schema.names != RUN_SCHEMA.names:
            raise ValueError(f"not a run table: columns {table.schema.names}, expected {RUN_SCHEMA.names}")
        table = table.cast(RUN_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, **RUN_PARQUET_OPTIONS)
    return buf.getvalue()


def topk_table(tops: dict[tuple[int, str], TopK], first_row: int = 0) -> pa.Table:
    """Top-k results keyed by (K_q, mode) as one table (``TOPK_SCHEMA``): a row per key and query (query rows from
    ``first_row``), its documents best first, pads dropped. Nothing else: no timing, no host, so the same results
    make the same bytes.

    >>> top = TopK(np.array([[0.9, 0.5], [0.7, -np.inf]], np.float32), np.array([[4, 2], [3, -1]]))
    >>> t = topk_table({(1, "single_dense"): top})
    >>> t.column("index").to_pylist(), t.column("row").to_pylist()
    ([[4, 2], [3]], [0, 1])
    >>> back = topk_from_table(t)[(1, "single_dense")]
    >>> back.index.tolist() == top.index.tolist() and back.scores.tolist() == top.scores.tolist()
    True
    """
    parts = []
    for (kq, mode), top in tops.items():
        ok = top.index >= 0  # the documents of a row come first, pads after them
        lengths = ok.sum(1).astype(np.int64)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        n = len(lengths)
        parts.append(
            pa.table(
                {
                    "kq": pa.array(np.full(n, kq, np.int32)),
                    "mode": pa.array([mode] * n, pa.string()),
                    "row": pa.array(np.arange(first_row, first_row + n, dtype=np.int32)),
                    "index": pa.ListArray.from_arrays(offsets, pa.array(top.index[ok], pa.int64())),
                    "score": pa.ListArray.from_arrays(offsets, pa.array(top.scores[ok], pa.float32())),
                },
                schema=TOPK_SCHEMA,
            )
        )
    return pa.concat_tables(parts) if parts else TOPK_SCHEMA.empty_table()


def topk_from_table(table: pa.Table, rows: int | None = None, first_row: int = 0) -> dict[tuple[int, str], TopK]:
    """The (K_q, mode) -> TopK of a :func:`topk_table` table: ``rows`` query rows from ``first_row`` (default: the
    rows it holds), each as wide as its longest list, -inf / -1 padded."""
    out: dict[tuple[int, str], TopK] = {}
    kqs, modes = table.column("kq").to_numpy(), np.asarray(table.column("mode").to_pylist(), dtype=object)
    for kq, mode in dict.fromkeys(zip(kqs.tolist(), modes.tolist(), strict=True)):
        part = table.filter(pa.array((kqs == kq) & (modes == mode)))
        row = part.column("row").to_numpy() - first_row
        index, score = part.column("index").combine_chunks(), part.column("score").combine_chunks()
        lengths = np.diff(index.offsets.to_numpy())
        n = int(row.max()) + 1 if rows is None and len(row) else (rows or 0)
        width = int(lengths.max()) if len(lengths) else 0
        scores = np.full((n, width), NEG, np.float32)
        idx = np.full((n, width), -1, np.int64)
        filled = np.arange(width)[None, :] < lengths[:, None]  # row-major: each row's documents, then pads
        sub_i = np.full((len(row), width), -1, np.int64)
        sub_s = np.full((len(row), width), NEG, np.float32)
        sub_i[filled], sub_s[filled] = index.flatten().to_numpy(), score.flatten().to_numpy()
        idx[row], scores[row] = sub_i, sub_s
        out[(int(kq), str(mode))] = TopK(scores, idx)
    return out


def ranked_run(rows: Sequence[tuple[str, str, float, int | None]], depth: int | None = None) -> pa.Table:
    """A run (RUN_SCHEMA) from (query_id, doc_id, score, rank or None) rows made elsewhere: per query, by score
    descending, ties by the given rank, then doc_id ascending (so a run diffret wrote comes back in its own
    order), cut to ``depth``; queries in first-appearance order. Scores are stored as float32.

    >>> t = ranked_run([("q1", "b", 0.5, 2), ("q1", "a", 0.5, 1), ("q1", "c", 0.9, 3)])
    >>> t.column("doc_id").to_pylist(), t.column("rank").to_pylist()
    (['c', 'a', 'b'], [1, 2, 3])
    """
    by_query: dict[str, list[tuple[float, float, str]]] = {}
    for qid, doc, score, rank in rows:
        by_query.setdefault(qid, []).append((-float(score), float("inf") if rank is None else float(rank), doc))
    cols: dict[str, list] = {"query_id": [], "doc_id": [], "rank": [], "score": []}
    for qid, docs in by_query.items():
        for i, (neg, _rank, doc) in enumerate(sorted(docs)[:depth], start=1):
            cols["query_id"].append(qid)
            cols["doc_id"].append(doc)
            cols["rank"].append(i)
            cols["score"].append(-neg)
    arrays = {
        "query_id": pa.array(cols["query_id"], pa.string()),
        "doc_id": pa.array(cols["doc_id"], pa.string()),
        "rank": pa.array(cols["rank"], pa.int32()),
        "score": pa.array(cols["score"], pa.float64()).cast(pa.float32()),
    }
    return pa.table(arrays, schema=RUN_SCHEMA)
