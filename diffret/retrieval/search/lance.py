"""Multi-vector (ColBERT-style MaxSim) retrieval over a LanceDB table, with exact MaxSim re-ranking.

A passage is a bag of ``n_j`` dense vectors, a query a bag of ``K_q`` vectors; both are L2-normalised and

    score(q, p) = (1 / K_q) * sum_i max_j <q_i, p_j>.

LanceDB stores the passage vectors in one multivector column (``list<fixed_size_list<float32, H>>``, cosine only).
What its multivector search returns (lancedb 0.40, measured in tests/unit/test_lance_index.py):

- flat (no index): ``_distance = K_q - sum_i max_j cos(q_i, p_j)``, exact, i.e. ``score = 1 - _distance / K_q``;
- with an IVF index: each query vector is searched on its own for ``limit * LANCE_XTR_OVERFETCH`` (10) nearest
  vectors, the similarity taken as ``1 - d`` where ``d`` is the index's (quantised) squared L2 between unit vectors
  ``= 2 (1 - cos)``, so ``_distance ~= 2 (K_q - sum_i max_j cos)``; a passage that one query vector did not
  retrieve is credited with that search's worst retrieved similarity. A different scale, quantised, and estimated.

So :func:`search` over-fetches candidates from LanceDB and re-ranks them with exact MaxSim on their stored vectors.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from diffret.caching import KeyedCache

from .encodings import padded
from .scoring import maxsim

TABLE = "docs"
VECTOR = "vector"
INDEX_TYPES = ("none", "IVF_PQ", "IVF_HNSW_SQ")
IndexType = Literal["none", "IVF_PQ", "IVF_HNSW_SQ"]

# Candidates fetched from LanceDB per query: max(k * overfetch, MIN_CANDIDATES) (candidate_budget), then re-ranked
# exactly, so recall@k is the share of the exact top k among them. Tuned with benchmarks/search_lance.py (IVF_PQ,
# H=128, K_p=4, K_q=8; docs/operations.md "Scale: ANN"): with refine_factor 4, k x 10 candidates give recall@100
# >= 0.99 against exact MaxSim at 100k and 1M docs, k x 5 did not (0.986 at 100k).
# The earlier cap of 1000 candidates cut k=100 to x10 without refine; what looked like LanceDB turning erratic
# beyond it was PQ noise (without refine, recall@100 sat at 0.95-0.99, not monotone in the limit) and, for IVF_HNSW_SQ,
# an ef below the per-vector depth (limit x LANCE_XTR_OVERFETCH): recall fell to 0.93 at 2000 candidates.
# MAX_CANDIDATES is the memory bound of one query: the re-rank holds limit x max n_j x H float32 (padded; 160 MiB at
# 10,000 candidates of <= 32 vectors of H=128), LanceDB K_q x limit x LANCE_XTR_OVERFETCH x refine_factor
# (row id, distance) pairs (~80 MiB at K_q=16, refine 4). Beyond it candidate_budget raises; it never clamps.
DEFAULT_OVERFETCH = 10
MIN_CANDIDATES = 100
MAX_CANDIDATES = 10_000
# LanceDB searches each query vector for limit * LANCE_XTR_OVERFETCH (default 10) nearest vectors; probe enough
# partitions to hold PROBE_MARGIN times that many vectors (too few probes make LanceDB's recall erratic).
XTR_OVERFETCH = int(os.environ.get("LANCE_XTR_OVERFETCH", "10"))
PROBE_MARGIN = 2
MIN_NPROBES = 20
# IVF_PQ: LanceDB re-scores refine_factor x each query vector's PQ candidates on the stored vectors (PQ alone kept
# recall@100 at 0.95-0.97 at 100k docs with 1000-2000 candidates; see docs/operations.md "Scale: ANN").
DEFAULT_REFINE_FACTOR = 4
# IVF_HNSW_SQ: the graph search breadth, as a multiple of the per-query-vector depth (limit x XTR_OVERFETCH).
HNSW_EF_FACTOR = 1.0
# create_index refuses to train on fewer than max(PQ_CODEBOOK, MIN_VECTORS_PER_PARTITION * num_partitions) vectors
# (LanceDB itself would train degenerate codebooks); the defaults keep >= 256 vectors per partition.
MIN_VECTORS_PER_PARTITION = 4
PQ_CODEBOOK = 256


@dataclass(frozen=True)
class IndexInfo:
    """What :func:`create_index` built."""

    index_type: str
    rows: int
    vectors: int
    params: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class SearchStats:
    """Per-query latencies of a :func:`search` call (LanceDB candidate search + fetch + exact re-rank)."""

    latencies_ms: list[float] = field(default_factory=list)
    candidates: list[int] = field(default_factory=list)
    limit: int = 0
    nprobes: int | None = None
    refine_factor: int | None = None
    ef: int | None = None

    @property
    def mean_ms(self) -> float:
        return float(np.mean(self.latencies_ms)) if self.latencies_ms else 0.0

    @property
    def p95_ms(self) -> float:
        return float(np.percentile(self.latencies_ms, 95)) if self.latencies_ms else 0.0

    @property
    def mean_candidates(self) -> float:
        return float(np.mean(self.candidates)) if self.candidates else 0.0


class SearchResults(list):
    """The ranked ``[(doc_id, score), ...]`` per query (a plain list of lists) carrying its :class:`SearchStats`."""

    def __init__(self, hits: Iterable[list[tuple[str, float]]] = (), stats: SearchStats | None = None):
        super().__init__(hits)
        self.stats = stats if stats is not None else SearchStats()


def table_schema(hidden: int, dtype: Literal["float32", "float16"] = "float32") -> pa.Schema:
    """``doc_id``, ``vector`` (multivector of width ``hidden``) and ``n_vectors`` (its length)."""
    value = pa.float16() if dtype == "float16" else pa.float32()
    return pa.schema(
        [
            pa.field("doc_id", pa.string(), nullable=False),
            pa.field(VECTOR, pa.list_(pa.list_(value, hidden))),
            pa.field("n_vectors", pa.int32(), nullable=False),
        ]
    )


def l2_normalise(x: np.ndarray, what: str = "vector") -> np.ndarray:
    """Row-wise L2 normalisation in float32; a zero (or non-finite) row is an error, since cosine is undefined."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    bad = ~np.isfinite(norms) | (norms == 0)
    if bad.any():
        raise ValueError(f"{int(bad.sum())} {what}(s) have zero or non-finite norm; cosine/MaxSim is undefined")
    return x / norms


def _doc_arrays(ids: Sequence[str], arrays: np.ndarray | Sequence[np.ndarray], hidden: int) -> list[np.ndarray]:
    if isinstance(arrays, np.ndarray):
        if arrays.ndim != 3:
            raise ValueError(f"a batch array must be [docs, K_p, H], got shape {arrays.shape}")
        arrays = list(arrays)
    if len(arrays) != len(ids):
        raise ValueError(f"batch has {len(ids)} doc ids but {len(arrays)} vector arrays")
    out = []
    for doc_id, a in zip(ids, arrays, strict=True):
        a = np.asarray(a)
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2 or a.shape[1] != hidden:
            raise ValueError(f"doc {doc_id!r}: vectors must be [n, {hidden}], got shape {a.shape}")
        if a.shape[0] == 0:
            raise ValueError(f"doc {doc_id!r} has no vectors")
        out.append(a)
    return out


def _record_batch(
    ids: Sequence[str], arrays: np.ndarray | Sequence[np.ndarray], hidden: int, schema: pa.Schema
) -> pa.RecordBatch:
    docs = _doc_arrays(ids, arrays, hidden)
    lengths = np.fromiter((len(a) for a in docs), dtype=np.int32, count=len(docs))
    flat = l2_normalise(np.concatenate(docs, axis=0), "passage vector")
    value_type = schema.field(VECTOR).type.value_type.value_type
    values = pa.array(flat.astype(value_type.to_pandas_dtype(), copy=False).ravel())
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    vectors = pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(values, hidden))
    doc_ids = pa.array([str(i) for i in ids], type=pa.string())
    return pa.RecordBatch.from_arrays([doc_ids, vectors, pa.array(lengths)], schema=schema)


def build_table(
    db_path: str,
    batches: Iterable[tuple[Sequence[str], np.ndarray | Sequence[np.ndarray]]],
    hidden: int,
    *,
    dtype: Literal["float32", "float16"] = "float32",
    table: str = TABLE,
) -> int:
    """Write (doc ids, per-doc [n_j, H] arrays) batches, L2-normalised, as table ``docs`` at ``db_path``; return rows.

    Batches are streamed into LanceDB, so the whole collection never has to be in memory. An existing table of the
    same name is replaced. ``dtype="float16"`` halves the storage but re-ranks on rounded vectors (~1e-3 off).
    """
    import lancedb

    if hidden <= 0:
        raise ValueError(f"hidden must be positive, got {hidden}")
    schema = table_schema(hidden, dtype)
    failed: list[Exception] = []

    def gen() -> Iterator[pa.RecordBatch]:
        try:
            for ids, arrays in batches:
                if len(ids):
                    yield _record_batch(ids, arrays, hidden, schema)
        except Exception as e:  # LanceDB would wrap it in an Arrow RuntimeError
            failed.append(e)
            raise

    db = lancedb.connect(db_path)
    _forget(db_path, table)
    _info_path(db_path, table).unlink(missing_ok=True)
    reader = pa.RecordBatchReader.from_batches(schema, gen())
    try:
        tbl = db.create_table(table, data=reader, schema=schema, mode="overwrite")
    except Exception:
        if failed:
            raise failed[0] from None
        raise
    finally:
        _forget(db_path, table)
    return tbl.count_rows()


def _open(db_path: str, table: str = TABLE) -> Any:
    import lancedb

    db = lancedb.connect(db_path)
    try:
        return db.open_table(table)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"no table {table!r} in LanceDB database {db_path!r}; run build_table first") from e


@dataclass(frozen=True)
class _Opened:
    """An open table with what every search needs from it, valid while its :func:`_signature` is unchanged."""

    signature: tuple
    tbl: Any
    hidden: int
    rows: int
    info: IndexInfo | None


_OPENED: KeyedCache[tuple[str, str], _Opened] = KeyedCache(size=64)  # more tables than one process searches


def _signature(db_path: str, table: str) -> tuple:
    """What changes whenever the table or its index is rewritten: the Lance manifests (``<table>.lance/_versions``:
    every commit adds one; a rebuilt folder is a new directory) and the index record ``<table>.index.json``."""
    versions = Path(db_path) / f"{table}.lance" / "_versions"
    out: list[Any] = []
    for path in (versions, _info_path(db_path, table)):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            out.append(None)
            continue
        out.append((st.st_ino, st.st_mtime_ns, st.st_size))
    try:  # names too: a commit within the file system's timestamp granularity leaves the mtime as it was
        names = sorted(os.listdir(versions))
        out.append((len(names), names[0] if names else "", names[-1] if names else ""))
    except FileNotFoundError:
        out.append(None)
    return tuple(out)


def _opened(db_path: str, table: str = TABLE) -> _Opened:
    """The table at ``db_path`` opened once per process, with its width, row count and :class:`IndexInfo`; reopened
    when :func:`_signature` changes (the table or index was rebuilt, here or by another process)."""
    key = (os.path.abspath(db_path), table)
    sig = _signature(db_path, table)

    def make() -> _Opened:
        tbl = _open(db_path, table)
        path = _info_path(db_path, table)
        info = IndexInfo(**json.loads(path.read_text())) if _vector_indices(tbl) and path.exists() else None
        return _Opened(sig, tbl, table_hidden(tbl), tbl.count_rows(), info)

    hit = _OPENED.get(key, make)
    if hit.signature != sig:  # rebuilt since it was opened: open it again
        _OPENED.pop(key)
        hit = _OPENED.get(key, make)
    return hit


def _forget(db_path: str, table: str) -> None:
    _OPENED.pop((os.path.abspath(db_path), table))


def table_hidden(tbl: Any) -> int:
    """The vector width H of a table written by :func:`build_table`."""
    t = tbl.schema.field(VECTOR).type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_fixed_size_list(t.value_type):
        raise ValueError(f"column {VECTOR!r} is not a multivector column: {t}")
    return t.value_type.list_size


def _count_vectors(tbl: Any) -> int:
    counts = tbl.search().select(["n_vectors"]).limit(None).to_arrow()["n_vectors"]
    return int(pc.sum(counts).as_py() or 0)


def iter_docs(
    db_path: str, batch_size: int = 8192, table: str = TABLE
) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
    """Stream the stored (doc ids, concatenated normalised [sum n, H] float32 vectors, per-doc lengths)."""
    tbl = _open(db_path, table)
    hidden = table_hidden(tbl)
    for rb in tbl.search().select(["doc_id", VECTOR]).limit(None).to_batches(batch_size):
        if rb.num_rows:
            vecs, lengths = _flat_vectors(rb.column(VECTOR), hidden)
            yield rb.column("doc_id").to_pylist(), vecs, lengths


def _vector_indices(tbl: Any) -> list[str]:
    return [ix.name for ix in tbl.list_indices() if VECTOR in list(ix.columns)]


def default_index_params(index_type: str, vectors: int, hidden: int) -> dict[str, Any]:
    """Defaults from the number of vectors: num_partitions ~ sqrt(vectors) / 2 (at least 256 vectors each), k-means
    of 20 iterations on 64 vectors per partition, PQ sub-vectors of 8 dims (dividing H); tuned with
    benchmarks/search_lance.py (docs/operations.md, "Scale: ANN").

    >>> default_index_params("IVF_PQ", 4_000_000, 128)
    {'num_partitions': 1000, 'max_iterations': 20, 'sample_rate': 64, 'num_sub_vectors': 16, 'num_bits': 8}
    """
    if index_type not in INDEX_TYPES:
        raise ValueError(f"unknown index type {index_type!r}; expected one of {', '.join(INDEX_TYPES)}")
    if index_type == "none":
        return {}
    partitions = max(1, min(round(math.sqrt(vectors) / 2), vectors // 256 or 1))
    params: dict[str, Any] = {"num_partitions": partitions, "max_iterations": 20, "sample_rate": 64}
    if index_type == "IVF_PQ":
        sub_dim = next(d for d in (8, 4, 16, 2, 32, 1) if hidden % d == 0)
        params["num_sub_vectors"] = hidden // sub_dim
        params["num_bits"] = 8
    else:
        params["m"] = 20
        params["ef_construction"] = 300
    return params


def min_vectors_for_index(index_type: str, num_partitions: int = 1) -> int:
    """The fewest stored vectors that :func:`create_index` will train ``index_type`` on."""
    if index_type == "none":
        return 0
    return max(PQ_CODEBOOK, MIN_VECTORS_PER_PARTITION * num_partitions)


def create_index(
    db_path: str,
    index_type: IndexType = "IVF_PQ",
    *,
    num_partitions: int | None = None,
    num_sub_vectors: int | None = None,
    m: int | None = None,
    ef_construction: int | None = None,
    max_iterations: int | None = None,
    sample_rate: int | None = None,
    table: str = TABLE,
) -> IndexInfo:
    """Build (replace) the ANN index on the multivector column with metric cosine, or drop it for ``"none"`` (flat).

    Unset parameters come from :func:`default_index_params`; raises ValueError for an unknown type, or when the
    table holds too few vectors to train the index.
    """
    from lancedb.index import HnswSq, IvfPq

    if index_type not in INDEX_TYPES:
        raise ValueError(f"unknown index type {index_type!r}; expected one of {', '.join(INDEX_TYPES)}")
    _forget(db_path, table)
    tbl = _open(db_path, table)
    hidden = table_hidden(tbl)
    rows = tbl.count_rows()
    t0 = time.perf_counter()
    if index_type == "none":
        for name in _vector_indices(tbl):
            tbl.drop_index(name)
        _info_path(db_path, table).unlink(missing_ok=True)
        _forget(db_path, table)
        return IndexInfo("none", rows, _count_vectors(tbl) if rows else 0, {}, time.perf_counter() - t0)
    if rows == 0:
        raise ValueError(f"table {table!r} at {db_path!r} is empty; nothing to index")
    vectors = _count_vectors(tbl)
    params = default_index_params(index_type, vectors, hidden)
    overrides = dict(
        num_partitions=num_partitions,
        num_sub_vectors=num_sub_vectors,
        m=m,
        ef_construction=ef_construction,
        max_iterations=max_iterations,
        sample_rate=sample_rate,
    )
    for key, value in overrides.items():
        if value is not None:
            if key not in params:
                raise ValueError(f"{key} does not apply to {index_type}")
            params[key] = value
    if index_type == "IVF_PQ" and hidden % params["num_sub_vectors"]:
        raise ValueError(f"num_sub_vectors={params['num_sub_vectors']} must divide the vector width {hidden}")
    need = min_vectors_for_index(index_type, params["num_partitions"])
    if vectors < need:
        raise ValueError(
            f"too few vectors to train an {index_type} index with {params['num_partitions']} partitions: "
            f"the table has {vectors} vectors in {rows} rows, at least {need} are needed "
            f"(~{math.ceil(need * rows / vectors)} rows at {vectors / rows:.1f} vectors per row); "
            "use index_type='none' (exact flat search) for a table this small"
        )
    config = (
        IvfPq(distance_type="cosine", **params) if index_type == "IVF_PQ" else HnswSq(distance_type="cosine", **params)
    )
    tbl.create_index(VECTOR, config=config, replace=True)
    info = IndexInfo(index_type, rows, vectors, params, time.perf_counter() - t0)
    _info_path(db_path, table).write_text(json.dumps(asdict(info), indent=1))
    _forget(db_path, table)
    return info


def _info_path(db_path: str, table: str) -> Path:
    return Path(db_path) / f"{table}.index.json"


def index_info(db_path: str, table: str = TABLE) -> IndexInfo | None:
    """The :class:`IndexInfo` recorded by the last :func:`create_index` (None if there is no vector index)."""
    return _opened(db_path, table).info


def default_nprobes(info: IndexInfo | None, limit: int) -> int | None:
    """IVF partitions to probe so that they hold ~PROBE_MARGIN x the vectors LanceDB fetches per query vector."""
    if info is None or not info.params.get("num_partitions"):
        return None
    parts = int(info.params["num_partitions"])
    per_part = max(1.0, info.vectors / parts)
    return min(parts, max(MIN_NPROBES, math.ceil(PROBE_MARGIN * limit * XTR_OVERFETCH / per_part)))


def default_search_params(info: IndexInfo | None, limit: int) -> dict[str, int]:
    """LanceDB search parameters for an index and a candidate budget: ``nprobes`` (:func:`default_nprobes`), and
    ``refine_factor`` = DEFAULT_REFINE_FACTOR for IVF_PQ or ``ef`` = HNSW_EF_FACTOR x LanceDB's per-vector depth
    for IVF_HNSW_SQ; nothing for a flat table.

    >>> default_search_params(IndexInfo("IVF_PQ", 1000, 400_000, {"num_partitions": 632}), 2000)
    {'nprobes': 64, 'refine_factor': 4}
    >>> default_search_params(None, 2000)
    {}
    """
    if info is None:
        return {}
    out: dict[str, int] = {}
    nprobes = default_nprobes(info, limit)
    if nprobes is not None:
        out["nprobes"] = nprobes
    if info.index_type == "IVF_PQ":
        out["refine_factor"] = DEFAULT_REFINE_FACTOR
    elif info.index_type == "IVF_HNSW_SQ":
        out["ef"] = math.ceil(HNSW_EF_FACTOR * limit * XTR_OVERFETCH)
    return out


def maxsim_scores(query: np.ndarray, doc_vectors: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Exact MaxSim of a normalised ``query`` [K_q, H] against concatenated docs [sum n, H] (``lengths`` per doc).

    The same :func:`retrieval.search.scoring.maxsim` as exact search, on the docs padded to one block, on
    LanceDB's scale: the mean over the query vectors, unclamped (``index`` checks recall against exact search
    under the same rules).
    """
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    docs = [doc_vectors[starts[i] : starts[i + 1]] for i in range(len(lengths))]
    p_multi, p_mask = padded(docs)
    q = torch.from_numpy(np.ascontiguousarray(query, dtype=np.float32))[None]
    return maxsim(q, torch.ones(q.shape[:2], dtype=torch.bool), p_multi, p_mask, clamp=False, reduce="mean")[0].numpy()


def _check_query(q: np.ndarray, hidden: int, i: int) -> np.ndarray:
    q = np.asarray(q)
    if q.ndim == 1:
        q = q[None, :]
    if q.ndim != 2 or q.shape[0] == 0 or q.shape[1] != hidden:
        raise ValueError(f"query {i}: expected [K_q, {hidden}] with K_q >= 1, got shape {q.shape}")
    return l2_normalise(q, f"query {i} vector")


def _flat_vectors(col: pa.ChunkedArray | pa.Array, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """A ``list<fixed_size_list<float, H>>`` column -> (concatenated [sum n, H] float32, lengths)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    inner = arr.flatten()  # honours the list offsets and slicing
    values = inner.flatten().to_numpy(zero_copy_only=False)
    return values.astype(np.float32, copy=False).reshape(-1, hidden), lengths


def rank(doc_ids: Sequence[str], scores: np.ndarray, k: int) -> list[tuple[str, float]]:
    """Top ``k`` (doc_id, score) by score descending, then doc_id ascending."""
    order = sorted(range(len(doc_ids)), key=lambda j: (-float(scores[j]), doc_ids[j]))
    return [(doc_ids[j], float(scores[j])) for j in order[:k]]


def candidate_budget(
    k: int,
    overfetch: int = DEFAULT_OVERFETCH,
    min_candidates: int = MIN_CANDIDATES,
    max_candidates: int = MAX_CANDIDATES,
) -> int:
    """Candidates :func:`search` fetches per query: ``max(k * overfetch, min_candidates)``.

    Raises ValueError (one line) when that exceeds ``max_candidates``, the memory bound (see MAX_CANDIDATES): a
    silently clamped budget would silently lose recall at depth.

    >>> candidate_budget(10), candidate_budget(100), candidate_budget(100, 5)
    (100, 1000, 500)
    """
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if overfetch < 1:
        raise ValueError(f"overfetch must be >= 1, got {overfetch}")
    limit = max(k * overfetch, min_candidates)
    if limit > max_candidates:
        raise ValueError(
            f"k={k} x overfetch={overfetch} = {k * overfetch} candidates per query exceeds max_candidates="
            f"{max_candidates} (the memory bound of one query's re-rank); lower k or overfetch, or raise max_candidates"
        )
    return limit


def search(
    db_path: str,
    queries: Sequence[np.ndarray],
    k: int,
    overfetch: int = DEFAULT_OVERFETCH,
    *,
    nprobes: int | None = None,
    refine_factor: int | None = None,
    ef: int | None = None,
    min_candidates: int = MIN_CANDIDATES,
    max_candidates: int = MAX_CANDIDATES,
    use_index: bool = True,
    table: str = TABLE,
) -> SearchResults:
    """Top-``k`` (doc_id, MaxSim score) per query: LanceDB multivector search for :func:`candidate_budget` candidates
    (``k * overfetch``), then exact MaxSim re-rank on their stored vectors.

    ``nprobes`` (IVF), ``refine_factor`` (IVF_PQ) and ``ef`` (HNSW) default to :func:`default_search_params` for the
    table's index; ``use_index=False`` forces LanceDB's flat (exact) search. Queries are [K_q, H] (or [H]) arrays of
    any float dtype, normalised here. The table, its width, row count and index info are opened once per process and
    reopened only when the table or index is rebuilt. The result carries per-query latencies in ``.stats``.

    >>> import tempfile
    >>> db = tempfile.mkdtemp()
    >>> build_table(db, [(["a", "b"], [np.eye(4)[:2], np.eye(4)[2:]])], 4)
    2
    >>> search(db, [np.eye(4)[2:3]], 1)
    [[('b', 1.0)]]
    """
    limit = candidate_budget(k, overfetch, min_candidates, max_candidates)
    opened = _opened(db_path, table)
    normed = [_check_query(q, opened.hidden, i) for i, q in enumerate(queries)]
    if normed and opened.rows == 0:
        raise ValueError(f"table {table!r} at {db_path!r} is empty")
    if use_index:
        defaults = default_search_params(opened.info, limit)
        nprobes = defaults.get("nprobes") if nprobes is None else nprobes
        refine_factor = defaults.get("refine_factor") if refine_factor is None else refine_factor
        ef = defaults.get("ef") if ef is None else ef
    stats = SearchStats(limit=limit, nprobes=nprobes, refine_factor=refine_factor, ef=ef)
    out = SearchResults(stats=stats)
    for q in normed:
        t0 = time.perf_counter()
        builder = opened.tbl.search(q, vector_column_name=VECTOR).distance_type("cosine").limit(limit)
        builder = builder.select(["doc_id", VECTOR, "_distance"])  # naming _distance: no per-query warning
        if nprobes is not None:
            builder = builder.nprobes(nprobes)
        if refine_factor is not None:
            builder = builder.refine_factor(refine_factor)
        if ef is not None:
            builder = builder.ef(ef)
        if not use_index:
            builder = builder.bypass_vector_index()
        res = builder.to_arrow()
        ids = res["doc_id"].to_pylist()
        if ids:
            vecs, lengths = _flat_vectors(res[VECTOR], opened.hidden)
            scores = maxsim_scores(q, vecs, lengths)
            hits = rank(ids, scores, k)
        else:
            hits = []
        stats.latencies_ms.append((time.perf_counter() - t0) * 1000.0)
        stats.candidates.append(len(ids))
        out.append(hits)
    return out


def recall_at(exact: Sequence[Sequence[str]], approx: Sequence[Sequence[str]], k: int) -> float:
    """Mean over queries of |top-k exact ∩ top-k approx| / |top-k exact|: the share of what exact search finds in
    its top k (min(k, the passages there are)) that the approximate search finds too, so a search that finds every
    passage of a corpus smaller than k scores 1.0 (a query with nothing to find counts 1.0).

    >>> recall_at([["a", "b", "c"]], [["c", "a", "b"]], 100), recall_at([["a", "b"]], [["a", "x"]], 10)
    (1.0, 0.5)
    """
    if len(exact) != len(approx):
        raise ValueError(f"{len(exact)} exact rankings but {len(approx)} approximate ones")
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if not exact:
        return 0.0
    return float(
        np.mean(
            [
                len(set(e[:k]) & set(a[:k])) / len(set(e[:k])) if len(e[:k]) else 1.0
                for e, a in zip(exact, approx, strict=True)
            ]
        )
    )
