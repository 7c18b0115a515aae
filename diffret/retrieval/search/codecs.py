"""Storage choices for dense vectors: float16 as encoded, or fixed-width byte codes that decode to vectors.

A choice is named by a spec string (``EncodeSettings.store``):

- ``float16``: the vectors as encoded (2 H bytes), the default;
- ``int8``: a float32 scale (the vector's largest magnitude / 127, symmetric) and H int8 values (4 + H bytes);
- ``residual:B`` (B in 1, 2, 4), or ``residual:B:C`` for C centroids: ColBERTv2's residual compression. Spherical
  k-means centroids trained on a sample of the corpus's own unit vectors; a vector is its nearest centroid's id
  (4 bytes) and, per dimension, the B-bit bucket of its residual (cut at the quantiles of the residuals of a
  held-out 5% of the sample that k-means did not see, as ColBERTv2 does, decoded to the bucket's median);
  4 + ceil(H B / 8) bytes. C defaults to ColBERTv2's 2^floor(log2(16 sqrt(n))) for n vectors in the corpus (at
  most the vectors k-means sees);
- ``pq:M``: product quantisation, M sub-quantisers of 8 bits (M bytes), trained by faiss.

Codebooks (centroids, bucket cutoffs and values, PQ centroids) are trained with faiss from a seeded sample and
stored as an npz without pickles: :class:`Codebook`. :func:`compress_table` and :func:`vectors_of` are the one
path between the encodings schema's float16 ``dense`` column and its ``codes`` column.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

FLOAT16 = "float16"
RESIDUAL_BITS = (1, 2, 4)
PQ_BITS = 8
ID_BYTES = 4  # a residual code's centroid id (uint32, as ColBERTv2 stores its codes)
HELDOUT = 0.05, 50_000  # residual: the share of the sample (and its cap) held out of k-means for the buckets
KMEANS_ITERATIONS = 20  # residual: k-means iterations of a codebook (`compress`'s)


class CodebookError(ValueError):
    """A codebook that cannot be read, or that was trained for other vectors."""


@dataclass(frozen=True)
class StoreSpec:
    """A parsed storage choice: ``kind`` (float16, int8, residual, pq) and its parameters."""

    kind: str
    bits: int = 0  # residual: bits per dimension
    centroids: int = 0  # residual: 0 = ColBERTv2's count for the corpus
    m: int = 0  # pq: sub-quantisers

    @property
    def trained(self) -> bool:
        """Whether the choice needs a codebook trained on the corpus's vectors."""
        return self.kind in ("residual", "pq")


def parse_store(spec: str) -> StoreSpec:
    """A storage choice from its spec; a clear error naming the choices for anything else.

    >>> parse_store("residual:2"), parse_store("pq:32").m
    (StoreSpec(kind='residual', bits=2, centroids=0, m=0), 32)
    >>> try:
    ...     parse_store("int4")
    ... except ValueError as exc:
    ...     print(str(exc)[:45])
    unknown store 'int4': expected float16, int8,
    """
    parts = spec.strip().split(":")
    try:
        if parts == [FLOAT16] or parts == ["int8"]:
            return StoreSpec(parts[0])
        if parts[0] == "residual" and len(parts) in (2, 3) and int(parts[1]) in RESIDUAL_BITS:
            c = int(parts[2]) if len(parts) == 3 else 0
            if len(parts) == 3 and c < 2:
                raise ValueError
            return StoreSpec("residual", bits=int(parts[1]), centroids=c)
        if parts[0] == "pq" and len(parts) == 2 and int(parts[1]) >= 1:
            return StoreSpec("pq", m=int(parts[1]))
    except ValueError:
        pass
    raise ValueError(
        f"unknown store {spec!r}: expected float16, int8, residual:B (B in 1, 2, 4; residual:2:16384 "
        "for 16,384 centroids) or pq:M"
    )


def store_tag(spec: str) -> str:
    """The storage choice as a slug fragment (``residual:2`` -> ``residual2``).

    >>> store_tag("residual:2:16384"), store_tag("int8")
    ('residual2c16384', 'int8')
    """
    s = parse_store(spec)
    if s.kind == "residual":
        return f"residual{s.bits}" + (f"c{s.centroids}" if s.centroids else "")
    if s.kind == "pq":
        return f"pq{s.m}"
    return s.kind


def code_bytes(spec: str, hidden: int) -> int:
    """Bytes of one vector of width ``hidden`` under a storage choice.

    >>> [code_bytes(s, 128) for s in ("float16", "int8", "residual:1", "residual:2", "pq:32")]
    [256, 132, 20, 36, 32]
    """
    s = parse_store(spec)
    if s.kind == FLOAT16:
        return 2 * hidden
    if s.kind == "int8":
        return 4 + hidden
    if s.kind == "residual":
        return ID_BYTES + math.ceil(hidden * s.bits / 8)
    if hidden % s.m:
        raise ValueError(f"pq:{s.m} needs a width divisible by {s.m}; the vectors have {hidden} dimensions")
    return s.m * PQ_BITS // 8


def colbert_centroids(n_vectors: int) -> int:
    """ColBERTv2's number of centroids for ``n_vectors`` vectors: 2^floor(log2(16 sqrt(n))).

    >>> colbert_centroids(100_000), colbert_centroids(8_841_823 * 16)
    (4096, 131072)
    """
    return 2 ** int(math.floor(math.log2(16 * math.sqrt(max(n_vectors, 1)))))


# ------------------------------------------------------------------------------------------- codebooks
@dataclass
class Codebook:
    """What a trained storage choice decodes with, and what it was trained for (``meta``: spec, dim, and the
    system, dataset and K_p it belongs to).

    ``arrays``: residual: ``centroids`` [C, H] float32, ``cutoffs`` [2^B - 1], ``values`` [2^B]; pq: ``centroids``
    [M, 256, H / M] float32.
    """

    spec: str
    dim: int
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def to_bytes(self) -> bytes:
        """The npz bytes (no pickles; the same codebook gives the same bytes)."""
        buf = io.BytesIO()
        info = json.dumps({"spec": self.spec, "dim": self.dim, **self.meta}, sort_keys=True)
        arrays: dict[str, Any] = {"info": np.frombuffer(info.encode(), np.uint8), **self.arrays}
        np.savez(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "codebook") -> Codebook:
        """Read :meth:`to_bytes`'s bytes (a truncated or foreign file: :class:`CodebookError` naming ``where``)."""
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            info = json.loads(arrays.pop("info").tobytes().decode())
            spec, dim = info.pop("spec"), int(info.pop("dim"))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same error
            raise CodebookError(f"{where}: not a readable codebook ({type(exc).__name__}: {exc})") from None
        return cls(spec, dim, arrays, info)

    def check(self, spec: str, dim: int, **trained_for: Any) -> None:
        """Refuse to code vectors this codebook was not trained for, naming both.

        >>> cb = Codebook("int8", 4, {}, {"k": 16, "dataset": "scifact"})
        >>> cb.check("int8", 4, k=16, dataset="scifact")
        >>> try:
        ...     cb.check("int8", 4, k=4, dataset="scifact")
        ... except CodebookError as exc:
        ...     print(exc)
        codebook trained for k=16, not k=4 (dataset='scifact'): train one for these vectors
        """
        want = {"spec": spec, "dim": dim, **trained_for}
        have = {"spec": self.spec, "dim": self.dim, **self.meta}
        for key, value in want.items():
            if key in have and have[key] != value:
                same = ", ".join(f"{k}={v!r}" for k, v in want.items() if k != key and k not in ("spec", "dim"))
                raise CodebookError(
                    f"codebook trained for {key}={have[key]!r}, not {key}={value!r}"
                    + (f" ({same})" if same else "")
                    + ": train one for these vectors"
                )

    def __getstate__(self) -> dict[str, Any]:  # pickled to Dask workers: the faiss objects are rebuilt there
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def train_codebook(
    vectors: np.ndarray,
    spec: str,
    seed: int = 0,
    n_corpus: int | None = None,
    iterations: int = KMEANS_ITERATIONS,
    **meta: Any,
) -> Codebook:
    """Train a storage choice's codebook on a sample of vectors ([n, H]; unit vectors for residual), seeded.

    ``n_corpus``: vectors in the whole corpus (ColBERTv2's centroid count; default: the sample's). ``meta`` is
    recorded (what the codebook is for: :meth:`Codebook.check`). residual: k-means (``iterations`` of them; ColBERTv2
    and fast-plaid run 4) sees all but a seeded 5% of the sample (at most 50,000 vectors), whose residuals set the
    buckets.

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(600, 16)).astype(np.float32)
    >>> cb = train_codebook(x, "residual:2", seed=1)
    >>> cb.arrays["centroids"].shape, cb.arrays["values"].shape
    ((256, 16), (4,))
    """
    import faiss

    s = parse_store(spec)
    x = np.ascontiguousarray(vectors, np.float32)
    n, dim = x.shape
    if not s.trained:
        return Codebook(spec, dim, {}, dict(meta))
    if s.kind == "pq":
        code_bytes(spec, dim)  # the width must divide
        if n < 2**PQ_BITS:
            raise CodebookError(
                f"pq:{s.m} needs at least {2**PQ_BITS} vectors to train its 8-bit sub-quantisers; "
                f"the sample has {n}: use int8 or residual:B for so few vectors"
            )
        pq = faiss.ProductQuantizer(dim, s.m, PQ_BITS)
        pq.cp.seed = seed
        pq.train(x)
        cents = faiss.vector_to_array(pq.centroids).reshape(s.m, 2**PQ_BITS, dim // s.m)
        return Codebook(spec, dim, {"centroids": cents.astype(np.float32)}, dict(meta))
    x = _unit(x)
    # ColBERTv2: k-means on the sample less a seeded held-out share, whose residuals set the buckets (the sample's
    # own residuals are too small where k-means fits them closely: many centroids for few vectors)
    held = int(min(HELDOUT[0] * n, HELDOUT[1]))
    order = np.random.default_rng(seed).permutation(n)
    train, heldout = (x[order[held:]], x[order[:held]]) if held and n - held >= 2 else (x, x)
    c = s.centroids or colbert_centroids(n_corpus or n)
    c = max(2, min(c, len(train)))
    km = faiss.Kmeans(
        dim,
        c,
        niter=iterations,
        seed=seed,
        spherical=True,
        min_points_per_centroid=1,
        max_points_per_centroid=max(256, -(-len(train) // c)),
        verbose=False,
    )
    km.train(np.ascontiguousarray(train))
    assert km.centroids is not None  # set by train
    cents = _unit(km.centroids)
    residual = heldout - cents[_nearest(cents, heldout)]
    levels = 2**s.bits
    flat = residual.ravel()
    cutoffs = np.quantile(flat, np.arange(1, levels) / levels).astype(np.float32)
    values = np.quantile(flat, (np.arange(levels) + 0.5) / levels).astype(np.float32)
    return Codebook(spec, dim, {"centroids": cents, "cutoffs": cutoffs, "values": values}, dict(meta))


def _nearest(centroids: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The nearest (largest inner product) centroid of each row of ``x``."""
    import faiss

    index = faiss.IndexFlatIP(centroids.shape[1])
    index.add(np.ascontiguousarray(centroids))
    out = np.empty(len(x), np.int64)
    for i in range(0, len(x), 65536):
        out[i : i + 65536] = index.search(np.ascontiguousarray(x[i : i + 65536]), 1)[1][:, 0]
    return out


# ------------------------------------------------------------------------------------- encode / decode
def encode(vectors: np.ndarray, spec: str, codebook: Codebook | None = None) -> np.ndarray:
    """Vectors [n, H] -> codes [n, code_bytes(spec, H)] uint8.

    >>> x = np.array([[0.5, -1.0, 0.25, 0.0]], np.float32)
    >>> encode(x, "int8").shape, float(np.abs(decode(encode(x, "int8"), "int8") - x).max()) <= 0.5 / 127
    ((1, 8), True)
    """
    s = parse_store(spec)
    x = np.ascontiguousarray(vectors, np.float32)
    n, dim = x.shape
    if s.kind == FLOAT16:
        return x.astype(np.float16).view(np.uint8).reshape(n, 2 * dim)
    if s.kind == "int8":
        scale = (np.abs(x).max(axis=1) / 127).astype(np.float32)
        q = np.rint(x / np.where(scale > 0, scale, 1)[:, None]).clip(-127, 127).astype(np.int8)
        return np.concatenate([scale[:, None].view(np.uint8), q.view(np.uint8)], axis=1)
    if codebook is None:
        raise CodebookError(f"{spec} needs its codebook")
    if s.kind == "pq":
        return _pq(codebook).compute_codes(x)
    x = _unit(x)
    cents = codebook.arrays["centroids"]
    ids = _nearest(cents, x).astype("<u4")
    buckets = np.searchsorted(codebook.arrays["cutoffs"], x - cents[ids], side="right").astype(np.uint8)
    bits = (buckets[:, :, None] >> np.arange(s.bits - 1, -1, -1, dtype=np.uint8)) & 1  # [n, H, B], high bit first
    packed = np.packbits(bits.reshape(n, dim * s.bits), axis=1)
    return np.concatenate([ids[:, None].view(np.uint8), packed], axis=1)


def decode(codes: np.ndarray, spec: str, codebook: Codebook | None = None, dim: int | None = None) -> np.ndarray:
    """Codes [n, B] uint8 -> vectors [n, H] float32 (``dim``: H, else the codebook's); float16 is bit for bit."""
    s = parse_store(spec)
    c = np.ascontiguousarray(codes, np.uint8)
    n = c.shape[0]
    dim = dim or (codebook.dim if codebook else None)
    if s.kind == FLOAT16:
        return c.view(np.float16).astype(np.float32).reshape(n, -1)
    if s.kind == "int8":
        scale = c[:, :4].copy().view(np.float32)
        return c[:, 4:].view(np.int8).astype(np.float32) * scale
    if codebook is None:
        raise CodebookError(f"{spec} needs its codebook")
    if s.kind == "pq":
        return _pq(codebook).decode(c)
    ids = c[:, :ID_BYTES].copy().view("<u4")[:, 0]
    if "pairs" not in codebook._cache:  # the values of each byte, and of each pair of bytes (a little-endian uint16)
        table = byte_table(codebook.arrays["values"], s.bits)
        v = np.arange(2**16)
        codebook._cache["bytes"] = table
        codebook._cache["pairs"] = np.ascontiguousarray(np.concatenate([table[v & 255], table[v >> 8]], axis=1))
    body = c[:, ID_BYTES:]
    if body.shape[1] % 2 == 0:  # one row gather per two bytes
        residual = np.take(codebook._cache["pairs"], body.view("<u2"), axis=0)
    else:
        residual = np.take(codebook._cache["bytes"], body, axis=0)
    residual = residual.reshape(n, -1)[:, : codebook.dim]
    out = np.take(codebook.arrays["centroids"], ids, axis=0)
    out += residual
    return _unit_rows(out)


def _unit_rows(x: np.ndarray) -> np.ndarray:
    """The rows of a float32 array L2-normalised in place (torch's row norm: several times numpy's speed).

    >>> _unit_rows(np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)).tolist()
    [[0.6000000238418579, 0.800000011920929], [0.0, 0.0]]
    """
    import torch

    t = torch.from_numpy(x)
    t.div_(torch.linalg.vector_norm(t, dim=1, keepdim=True).clamp_min_(1e-12))
    return x


def byte_table(values: np.ndarray, bits: int) -> np.ndarray:
    """The residual values one packed byte holds: [256, 8 / bits], for each byte value its 8 / bits dimensions'
    bucket values in order (each dimension's bits high first, as :func:`encode` packs them), so decoding a code is
    one lookup per byte instead of unpacking its bits.

    >>> byte_table(np.array([-1.0, -0.5, 0.5, 1.0], np.float32), 2)[0b11_00_10_01].tolist()
    [1.0, -1.0, 0.5, -0.5]
    """
    per = 8 // bits
    v = np.arange(256)[:, None] >> (bits * np.arange(per - 1, -1, -1))[None, :]
    return np.asarray(values, np.float32)[v & (2**bits - 1)]


def _pq(codebook: Codebook) -> Any:
    """The codebook's faiss ProductQuantizer (built once per process)."""
    import faiss

    if "pq" not in codebook._cache:
        cents = codebook.arrays["centroids"]
        pq = faiss.ProductQuantizer(codebook.dim, cents.shape[0], PQ_BITS)
        faiss.copy_array_to_vector(np.ascontiguousarray(cents, np.float32).ravel(), pq.centroids)
        codebook._cache["pq"] = pq
    return codebook._cache["pq"]


# ------------------------------------------------------------------------------------ encodings tables
@dataclass
class Codec:
    """A storage choice with its codebook (None for float16 and int8): what a compressed folder decodes with."""

    spec: str
    dim: int  # the vectors' width (0: any; int8 needs none)
    codebook: Codebook | None = None
    digest: str | None = None  # the codebook file's sha256


def compress_table(table: pa.Table, codec: Codec) -> pa.Table:
    """An encodings table with its float16 ``dense`` column replaced by ``codes``: per text, one
    fixed-size binary code per vector (the other columns as they are).

    >>> from diffret.schemas import encodings_schema
    >>> t = pa.Table.from_pylist([{"id": "a", "n_reps": 1, "dense": [[0.0, 4.0]], "n_tokens": 3}],
    ...                          schema=encodings_schema(2))
    >>> c = compress_table(t, Codec("int8", 2))
    >>> c.schema.field("codes").type, vectors_of(c, Codec("int8", 2)).round(2).tolist()
    (ListType(list<item: fixed_size_binary[6]>), [[0.0, 4.0]])
    """
    dense = table.column("dense").combine_chunks()
    inner = dense.flatten()
    width = inner.type.list_size
    if codec.dim and width != codec.dim:
        raise CodebookError(f"the vectors have {width} dimensions; the codec was made for {codec.dim}")
    x = inner.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, width)
    codes = encode(x, codec.spec, codec.codebook)
    size = codes.shape[1]
    values = pa.FixedSizeBinaryArray.from_buffers(pa.binary(size), len(codes), [None, pa.py_buffer(codes.tobytes())])
    offsets = dense.offsets if dense.offset == 0 else pa.array(np.asarray(dense.offsets) - dense.offsets[0].as_py())
    col = pa.ListArray.from_arrays(offsets, values)
    i = table.schema.get_field_index("dense")
    return table.set_column(i, pa.field("codes", pa.list_(pa.binary(size)), nullable=False), col)


def codes_of(table: pa.Table) -> np.ndarray:
    """The codes of a compressed encodings table as stored, one row per vector in text order ([sum n_reps, B] uint8,
    a view of the column's buffer: nothing decoded).

    >>> from diffret.schemas import encodings_schema
    >>> t = pa.Table.from_pylist([{"id": "a", "n_reps": 1, "dense": [[0.0, 4.0]], "n_tokens": 3}],
    ...                          schema=encodings_schema(2))
    >>> codes_of(compress_table(t, Codec("int8", 2))).shape
    (1, 6)
    """
    if "codes" not in table.column_names:
        raise CodebookError("these encodings are not compressed (no codes column)")
    column = table.column("codes")
    size = column.type.value_type.byte_width
    parts = []
    for chunk in column.chunks:
        inner = chunk.flatten()
        raw = np.frombuffer(inner.buffers()[1], np.uint8)[inner.offset * size : (inner.offset + len(inner)) * size]
        parts.append(raw.reshape(len(inner), size))
    if not parts:
        return np.zeros((0, size), np.uint8)
    return np.concatenate(parts) if len(parts) != 1 else parts[0]


def vectors_of(table: pa.Table, codec: Codec | None = None) -> np.ndarray:
    """The vectors of an encodings table, one row per vector in text order ([sum n_reps, H] float32): the
    ``dense`` column as stored, or the ``codes`` column decoded with ``codec``."""
    if "dense" in table.column_names:  # chunk by chunk into one float32 array: no combined copy of the column
        column = table.column("dense")
        hidden = column.type.value_type.list_size
        chunks = [chunk.flatten().flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks]
        out = np.empty((sum(len(c) for c in chunks) // hidden, hidden), np.float32)
        at = 0
        for chunk in chunks:
            out[at : at + len(chunk) // hidden] = chunk.reshape(-1, hidden)
            at += len(chunk) // hidden
        return out
    if codec is None:
        raise CodebookError("these encodings are compressed (a codes column): read them with their codec")
    inner = table.column("codes").combine_chunks().flatten()
    size = inner.type.byte_width
    if codec.dim and size != code_bytes(codec.spec, codec.dim):
        raise CodebookError(
            f"codes of {size} bytes, but {codec.spec} at {codec.dim} dimensions makes "
            f"{code_bytes(codec.spec, codec.dim)}"
        )
    buf = inner.buffers()[1]
    raw = np.frombuffer(buf, np.uint8)[inner.offset * size : (inner.offset + len(inner)) * size]
    return decode(raw.reshape(len(inner), size), codec.spec, codec.codebook, codec.dim)
