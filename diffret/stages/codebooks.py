"""Codebooks of compressed systems: one per (system, dataset, K_p), trained once from a seeded sample of the
corpus's own float16 vectors and stored beside the encodings (``codebooks/system=/dataset=/k=/codebook.npz``).

``diffret encode --store`` and ``diffret compress`` both train through :func:`ensure_codebook`, over the same
shards in the same seeded order (:func:`codebook_sample`), so for one seed they train the same codebook and write
the same codes. Encode-stage and compress-stage code share these helpers; neither calls the other stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator

from diffret.retrieval.search.codecs import Codebook, Codec, parse_store, train_codebook
from diffret.storage import ArtifactStore, FolderState, Manifest
from diffret.storage.layout import CODEBOOK_FILE, codebook_dir

from .readers import codebook_digest

DEFAULT_SAMPLE = 65536  # vectors a codebook is trained on, by default


def check_sample(v: int | str) -> int | str:
    """A codebook sample: a count of at least 256 vectors, or ``"colbert"`` (:func:`sample_vectors`; the type
    admits no other word)."""
    if v != "colbert" and int(v) < 256:
        raise ValueError(f"codebook_sample must be at least 256 vectors or 'colbert', got {v}")
    return v


# a count of vectors, or ColBERTv2's sample (:func:`sample_vectors`)
SampleSize = Annotated[int | Literal["colbert"], AfterValidator(check_sample)]


def sample_vectors(sample: SampleSize, n_passages: int, k: int) -> int:
    """The vectors a codebook of ``n_passages`` passages of ``k`` vectors is trained on: ``sample`` itself, or for
    ``"colbert"`` ColBERTv2's k-means sample (fast-plaid's too): every vector of min(1 + 16 sqrt(120 n), n)
    passages, which grows with the collection as its centroid count does (about 20-60 vectors a centroid, where the
    fixed default gives MS MARCO's 131,072 centroids half a vector each).

    >>> sample_vectors(65536, 8_841_823, 16), sample_vectors("colbert", 8_841_823, 16)
    (65536, 8338768)
    >>> sample_vectors("colbert", 1_000, 4)  # a small collection: all of it
    4000
    """
    if sample == "colbert":
        return min(1 + int(16 * math.sqrt(120 * n_passages)), n_passages) * k
    return int(sample)


def codebook_sample(shards: list[str], vectors: Callable[[str], np.ndarray], n: int, seed: int) -> np.ndarray:
    """Up to ``n`` vectors for training: the shards are taken in a seeded order until they hold ``n`` vectors,
    then ``n`` of those are drawn (seeded). ``vectors(shard)`` gives a shard's [m, H] float32 vectors, so only the
    shards needed are read (or encoded).

    >>> data = {f"s{i}": np.full((3, 2), i, np.float32) for i in range(4)}
    >>> codebook_sample(sorted(data), data.__getitem__, 4, seed=0).shape
    (4, 2)
    """
    rng = np.random.default_rng(seed)
    parts, have = [], 0
    for i in rng.permutation(len(shards)):
        parts.append(vectors(shards[int(i)]))
        have += len(parts[-1])
        if have >= n:
            break
    x = np.concatenate(parts) if parts else np.zeros((0, 1), np.float32)
    if len(x) > n:
        x = x[np.sort(rng.choice(len(x), n, replace=False))]
    return x


def codebook_config(
    spec: str, seed: int, sample: int, dataset: str, k: int, source_hash: str, n_corpus: int
) -> dict[str, Any]:
    """A codebook folder's config: the choice, its seed and sample, what it codes, and the float16 encodings its
    sample comes from (their folder's config hash: the same for encode --store and compress)."""
    return {
        "store": spec,
        "seed": seed,
        "sample": sample,
        "dataset": dataset,
        "k": k,
        "n_corpus": n_corpus,
        "inputs": {"passage_encodings": source_hash},
    }


def ensure_codebook(
    store: ArtifactStore,
    *,
    system: str,
    dataset: str,
    k: int,
    config: dict[str, Any],
    force: bool,
    shards: list[str],
    vectors: Callable[[str], np.ndarray],
    log: Callable[[str], None] = print,
) -> str:
    """The codebook of ``system``'s K_p = ``k`` passages, trained and written unless current (resumable: a
    killed training leaves nothing); its file's sha256, which the encodings folders it codes record."""
    folder = codebook_dir(system, dataset, k)
    if store.state(folder, config, force=force) is not FolderState.CURRENT:
        spec, n = config["store"], int(config["sample"])
        log(f"training the {spec} codebook of K_p={k} on up to {n:,} vectors (seed {config['seed']})")
        x = codebook_sample(shards, vectors, n, int(config["seed"]))
        cb = train_codebook(x, spec, int(config["seed"]), int(config["n_corpus"]), system=system, dataset=dataset, k=k)
        cents = len(cb.arrays.get("centroids", ()))
        if parse_store(spec).kind == "residual" and len(x) < 16 * cents:
            log(
                f"note: {len(x):,} vectors trained {cents:,} centroids ({len(x) / cents:.1f} a centroid); "
                "--codebook-sample colbert samples as ColBERTv2 does, growing with the collection"
            )
        part = {"system": system, "dataset": dataset, "k": str(k)}
        with store.folder_writer(folder, Manifest.new("codebooks", part, config, stats={"vectors": len(x)})) as w:
            w.write_file(CODEBOOK_FILE, cb.to_bytes())
    return codebook_digest(store, folder)


def compressed_config(base: dict[str, Any], digest: str) -> dict[str, Any]:
    """A compressed passage folder's config: its encode config, and the codebook it was coded with (its sha256)."""
    return {**base, "inputs": {**base["inputs"], "codebook": digest}}


def make_codec(spec: str, codebook: Codebook | None, digest: str | None) -> Codec:
    """The codec of a storage choice (``codebook`` when it is trained)."""
    parse_store(spec)
    return Codec(spec, codebook.dim if codebook else 0, codebook, digest)
