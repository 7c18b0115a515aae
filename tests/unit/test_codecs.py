"""Storage choices (retrieval/search/codecs.py): each code decodes within its bound, codebooks are seeded, readable only
as what they are, and refuse vectors they were not trained for; the encodings table's codes round-trip."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from diffret.retrieval.search.codecs import (
    Codebook,
    CodebookError,
    Codec,
    code_bytes,
    compress_table,
    decode,
    encode,
    parse_store,
    train_codebook,
    vectors_of,
)
from diffret.schemas import encodings_schema


def clustered(n: int, dim: int, clusters: int = 32, noise: float = 0.15, seed: int = 0) -> np.ndarray:
    """Unit vectors around random centres (as a model's vectors are: far from uniform on the sphere)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    x = centres[rng.integers(0, clusters, n)] + noise * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_float16_is_bit_for_bit() -> None:
    x = clustered(50, 24).astype(np.float16).astype(np.float32)
    assert np.array_equal(decode(encode(x, "float16"), "float16"), x)


def test_int8_is_within_half_a_step_per_component() -> None:
    x = np.random.default_rng(1).normal(size=(200, 40)).astype(np.float32)
    x[3] = 0.0  # a zero vector stays zero
    codes = encode(x, "int8")
    assert codes.shape == (200, code_bytes("int8", 40))
    err = np.abs(decode(codes, "int8") - x)
    assert (err <= np.abs(x).max(1, keepdims=True) / 127 / 2 + 1e-7).all() and not decode(codes, "int8")[3].any()


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_residual_packs_every_bucket_and_more_bits_lose_less(bits: int) -> None:
    x = clustered(3000, 32)
    cb = train_codebook(x, f"residual:{bits}", seed=0)
    codes = encode(x, f"residual:{bits}", cb)
    assert codes.shape == (3000, 4 + 32 * bits // 8)
    # unpacking gives back the buckets encode chose (every level used)
    out = decode(codes, f"residual:{bits}", cb)
    assert np.allclose(np.linalg.norm(out, axis=1), 1, atol=1e-5)
    ids = codes[:, :4].copy().view("<u4")[:, 0]
    resid = x - cb.arrays["centroids"][ids]
    buckets = np.searchsorted(cb.arrays["cutoffs"], resid, side="right")
    assert set(np.unique(buckets)) == set(range(2**bits))
    quality = {1: 0.96, 2: 0.985, 4: 0.995}[bits]
    assert cosine(out, x).mean() > quality


@pytest.mark.parametrize(("bits", "dim"), [(1, 24), (2, 20), (4, 18), (4, 16)])
def test_residual_decodes_each_dimension_to_its_bucket_value(bits: int, dim: int) -> None:
    """Decoding reads the packed bytes two at a time (an odd count: one at a time); each dimension gets the value of
    the bucket encode chose, added to its centroid, unit-normalised."""
    x = clustered(600, dim)
    cb = train_codebook(x, f"residual:{bits}", seed=0)
    codes = encode(x, f"residual:{bits}", cb)
    ids = codes[:, :4].copy().view("<u4")[:, 0]
    buckets = np.searchsorted(cb.arrays["cutoffs"], x - cb.arrays["centroids"][ids], side="right")
    want = cb.arrays["centroids"][ids] + cb.arrays["values"][buckets]
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(decode(codes, f"residual:{bits}", cb), want, rtol=0, atol=1e-6)


def test_residual_centroids_follow_colbertv2_or_the_spec() -> None:
    x = clustered(2000, 16)
    assert train_codebook(x, "residual:2").arrays["centroids"].shape == (512, 16)  # 2^floor(log2(16 sqrt 2000))
    assert train_codebook(x, "residual:2:64").arrays["centroids"].shape == (64, 16)
    # at most the vectors k-means sees: the sample less its held-out 5%
    assert train_codebook(x, "residual:2", n_corpus=10**6).arrays["centroids"].shape[0] == 1900


def test_residual_buckets_are_cut_from_vectors_kmeans_did_not_see() -> None:
    """ColBERTv2 holds 5% of the sample out of k-means: with a centroid per vector k-means sees, those vectors'
    residuals are zero, and buckets cut from them would decode every other vector to its centroid alone."""
    x = clustered(1000, 16)
    cb = train_codebook(x, "residual:2:1000", seed=0)
    assert cb.arrays["centroids"].shape[0] == 950
    assert np.abs(cb.arrays["values"]).min() > 1e-3 and np.abs(cb.arrays["cutoffs"]).max() > 1e-3
    out = decode(encode(x, "residual:2", cb), "residual:2", cb)
    assert cosine(out, x).mean() > 0.99


def test_more_centroids_decode_closer() -> None:
    x = clustered(4000, 32, clusters=400, noise=0.3)
    few, many = (train_codebook(x, f"residual:2:{c}", seed=0) for c in (16, 1024))
    assert (
        cosine(decode(encode(x, "residual:2", many), "residual:2", many), x).mean()
        > cosine(decode(encode(x, "residual:2", few), "residual:2", few), x).mean()
    )


def test_pq_codes_m_bytes_and_refuses_too_few_vectors() -> None:
    x = clustered(2000, 32)
    cb = train_codebook(x, "pq:8", seed=0)
    codes = encode(x, "pq:8", cb)
    assert codes.shape == (2000, 8) and cosine(decode(codes, "pq:8", cb), x).mean() > 0.95
    with pytest.raises(CodebookError, match="at least 256 vectors"):
        train_codebook(x[:100], "pq:8")
    with pytest.raises(ValueError, match="divisible by 5"):
        train_codebook(x, "pq:5")


@pytest.mark.parametrize("spec", ["residual:2", "pq:8"])
def test_codebooks_are_seeded_and_round_trip_as_bytes(spec: str) -> None:
    x = clustered(1500, 16)
    a, b = (train_codebook(x, spec, seed=7, k=16, dataset="d") for _ in range(2))
    assert a.to_bytes() == b.to_bytes()
    assert train_codebook(x, spec, seed=8, k=16, dataset="d").to_bytes() != a.to_bytes()
    back = Codebook.from_bytes(a.to_bytes())
    assert back.spec == spec and back.meta == {"k": 16, "dataset": "d"}
    assert np.array_equal(encode(x, spec, back), encode(x, spec, a))
    import pickle  # a codebook sent to a Dask worker rebuilds its faiss objects there

    assert np.array_equal(encode(x, spec, pickle.loads(pickle.dumps(a))), encode(x, spec, a))


def test_a_foreign_or_truncated_codebook_is_not_read() -> None:
    data = train_codebook(clustered(600, 16), "residual:1").to_bytes()
    for bad in (data[: len(data) // 2], b"not a codebook", b""):
        with pytest.raises(CodebookError, match="where.npz: not a readable codebook"):
            Codebook.from_bytes(bad, "where.npz")


def test_a_codebook_refuses_other_vectors_naming_both() -> None:
    cb = train_codebook(clustered(600, 16), "residual:2", k=4, dataset="scifact", system="s")
    cb.check("residual:2", 16, k=4, dataset="scifact", system="s")
    with pytest.raises(CodebookError, match="k=4, not k=16"):
        cb.check("residual:2", 16, k=16, dataset="scifact")
    with pytest.raises(CodebookError, match="dataset='scifact', not dataset='nfcorpus'"):
        cb.check("residual:2", 16, k=4, dataset="nfcorpus")
    with pytest.raises(CodebookError, match="dim=16, not dim=32"):
        cb.check("residual:2", 32)


def test_bad_specs_are_refused() -> None:
    for bad in ("int4", "residual:3", "residual:2:1", "pq:0", "pq", "float32", "residual:x"):
        with pytest.raises(ValueError, match="unknown store"):
            parse_store(bad)


@pytest.mark.parametrize("spec", ["int8", "residual:2", "pq:4"])
def test_compressed_tables_keep_rows_and_decode_in_text_order(spec: str) -> None:
    dim, reps = 16, [1, 3, 2, 4] * 100
    vecs = clustered(sum(reps), dim)
    rows, at = [], 0
    for i, n in enumerate(reps):
        rows.append(
            {
                "id": f"d{i}",
                "n_reps": n,
                "dense": vecs[at : at + n].tolist(),
                "sparse_ids": [1],
                "sparse_weights": [0.5],
                "n_tokens": 3,
            }
        )
        at += n
    table = pa.Table.from_pylist(rows, schema=encodings_schema(dim))
    cb = train_codebook(vecs, spec, seed=0)
    codec = Codec(spec, dim, cb if parse_store(spec).trained else None)
    c = compress_table(table, codec)
    assert c.column_names == [("codes" if n == "dense" else n) for n in table.column_names]
    assert c.schema == encodings_schema(dim, code_bytes=code_bytes(spec, dim))
    f16 = vecs.astype(np.float16).astype(np.float32)
    out = vectors_of(c, codec)
    assert out.shape == f16.shape and cosine(out, f16).mean() > 0.95
    # a slice of the table (Arrow offsets not at 0) codes and decodes the same vectors
    part = compress_table(table.slice(7, 20), codec)
    lo, hi = sum(reps[:7]), sum(reps[:27])
    assert np.allclose(vectors_of(part, codec), out[lo:hi])
    with pytest.raises(CodebookError, match="read them with their codec"):
        vectors_of(c)
