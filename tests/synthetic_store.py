"""A store whose encodings are synthetic vectors at any width (no model runs): the encode-less stages (compress,
index, score, late) read it as they read an encoder's.

The collection is real store data (download and tokenize of a BEIR folder with the in-test tiny BERT's tokenizer);
the encodings are written where and as `diffret encode` writes them (the same folders, configs and shard names, the
system registered), with vectors from a low-rank plus noise model instead of a model's:

    x = U (s * (a z_p + b e)) + n,      U: a random orthonormal [H, r] basis,  s_i = c i^-alpha (i = 1..r),

z_p a passage's topic (shared by its K vectors and by the queries judged relevant to it), e a vector's own part,
n isotropic noise; ``c`` makes the low-rank part carry ``signal`` of a vector's expected squared norm (the rest is
noise). Sparse vectors: ``sparse_terms`` ids a text from a Zipf vocabulary, weights in steps of 0.01, heaviest
first (the reference's stored form). Query i is relevant to passage ``i * n_passages // n_queries``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from conftest import write_beir
from tiny_models import save_tiny_mlm

from diffret.retrieval.models.backbones import BackboneConfig
from diffret.stages import execute, stages
from diffret.stages.download import DownloadConfig
from diffret.stages.encode import EncodeConfig, encodings_config
from diffret.stages.readers import tokens_manifest
from diffret.stages.systems import encoder_record, register, tokens_slug, weights_of
from diffret.storage import ArtifactStore
from diffret.storage.layout import encodings_dir, encodings_schema, tokens_dir

WORDS = (
    "cats purr dogs bark tea coffee cocoa garden fox jumps lazy mailman retrieval words query quick brown warm "
    "softly loudly"
).split()


@dataclass
class Spectrum:
    """The vectors' model (module docstring): rank, power-law exponent, the low-rank share of the energy, and how
    much of a vector is its passage's topic (``a``) against its own part (``b``; a^2 + b^2 = 1)."""

    rank: int = 256
    alpha: float = 0.5
    signal: float = 0.8
    topic: float = 0.8
    query_noise: float = 1.0  # a query vector's own part, relative to a passage vector's

    def singular_values(self) -> np.ndarray:
        s = np.arange(1, self.rank + 1, dtype=np.float64) ** -self.alpha
        return s * np.sqrt(self.signal / (s**2).sum())


@dataclass
class Synthetic:
    """What :func:`build` made: the store root, the system's slug, its encode config and the vectors' model."""

    root: str
    system: str
    encode: EncodeConfig
    spectrum: Spectrum
    hidden: int
    n_passages: int
    n_queries: int
    stats: dict[str, Any] = field(default_factory=dict)


class _Vectors:
    """Deterministic vectors of one store: the basis once, then passages / queries shard by shard."""

    def __init__(self, hidden: int, spectrum: Spectrum, n_passages: int, seed: int):
        rng = np.random.default_rng([seed, 0])
        r = min(spectrum.rank, hidden)
        q, _ = np.linalg.qr(rng.standard_normal((hidden, r)))
        self.basis = q.T.astype(np.float32)  # [r, H]
        self.s = spectrum.singular_values()[:r].astype(np.float32)
        self.sp, self.hidden, self.seed, self.n = spectrum, hidden, seed, n_passages
        b = np.sqrt(1 - spectrum.topic**2)
        self.a, self.b = spectrum.topic, b
        self.noise = np.float32(np.sqrt((1 - spectrum.signal) / hidden))

    def topics(self, passages: np.ndarray) -> np.ndarray:
        """Each passage's topic z_p (regenerated from the passage's index: any shard, any order)."""
        return np.stack(
            [np.random.default_rng([self.seed, 1, int(p)]).standard_normal(len(self.s)) for p in passages]
        ).astype(np.float32)

    def vectors(self, passages: np.ndarray, k: int, tag: int, own: float = 1.0) -> np.ndarray:
        """[len(passages), k, H] float32 vectors around the passages' topics (``tag`` seeds their own parts)."""
        rng = np.random.default_rng([self.seed, 2, tag, k])
        z = self.topics(passages)[:, None, :] * self.a + own * self.b * rng.standard_normal(
            (len(passages), k, len(self.s)), dtype=np.float32
        )
        x = (z * self.s) @ self.basis
        x += self.noise * rng.standard_normal(x.shape, dtype=np.float32)
        return x


def _sparse(rng: np.random.Generator, n: int, terms: int, vocab: int) -> tuple[pa.Array, pa.Array]:
    ranks = np.minimum(rng.zipf(1.3, size=(n, terms * 2)), vocab) - 1
    ids, weights = [], []
    for row in ranks:
        u = np.unique(row)[:terms].astype(np.int32)
        w = np.sort(np.floor(rng.uniform(0.01, 3.0, len(u)) * 100) / 100)[::-1].astype(np.float32)
        ids.append(u)
        weights.append(w)
    return pa.array(ids, pa.list_(pa.int32())), pa.array(weights, pa.list_(pa.float32()))


def _shard(ids: list[str], x: np.ndarray, sparse: tuple[pa.Array, pa.Array], n_tokens: int) -> pa.Table:
    n, k, h = x.shape
    inner = pa.FixedSizeListArray.from_arrays(pa.array(x.astype(np.float16).reshape(-1)), h)
    dense = pa.ListArray.from_arrays(pa.array(np.arange(0, n * k + 1, k, dtype=np.int32)), inner)
    tokens = pa.ListArray.from_arrays(
        pa.array(np.arange(0, n * k + 1, k, dtype=np.int32)), pa.array(np.full(n * k, 5, np.int32))
    )
    cols = {
        "id": pa.array(ids, pa.string()),
        "n_reps": pa.array(np.full(n, k, np.int16)),
        "dense": dense,
        "sparse_ids": sparse[0],
        "sparse_weights": sparse[1],
        "n_tokens": pa.array(np.full(n, n_tokens, np.int32)),
        "stopped": pa.array([False] * n),
        "tokens": tokens,
    }
    return pa.table(cols, schema=encodings_schema(h))


def build(
    base: Path,
    n_passages: int,
    hidden: int,
    kps: list[int],
    kqs: list[int],
    n_queries: int = 20,
    shard_size: int = 1000,
    spectrum: Spectrum | None = None,
    seed: int = 0,
    sparse_terms: int = 128,
    sparse_vocab: int = 30_000,
    model: Path | None = None,
    train: bool = False,
    dev: int = 0,
    log: Any = None,
) -> Synthetic:
    """A store under ``base``/store with dataset ``synth`` (``n_passages`` passages, ``n_queries`` test queries) and
    one encoder system whose passage encodings at each K_p of ``kps`` and query encodings at each K_q of ``kqs`` are
    synthetic vectors of width ``hidden`` (module docstring). ``model``: the tokenizer's folder (default: the
    in-test tiny BERT, saved under ``base``); ``train``: every second query is judged in a train split instead;
    ``dev``: the first ``dev`` queries are also judged in a dev split (a smaller check)."""
    spectrum = spectrum or Spectrum()
    log = log or (lambda _: None)
    root = str(base / "store")
    model = model or save_tiny_mlm(base / "model")
    rng = np.random.default_rng([seed, 3])
    corpus = [
        {
            "_id": f"p{i}",
            "title": WORDS[i % len(WORDS)],
            "text": " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), 8)),
        }
        for i in range(n_passages)
    ]
    queries = [
        {"_id": f"q{i}", "text": " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), 4))} for i in range(n_queries)
    ]
    judged = [(f"q{i}", f"p{i * n_passages // n_queries}", 1) for i in range(n_queries)]
    qrels = {"test": judged[::2], "train": judged[1::2]} if train else {"test": judged}
    if dev:
        qrels["dev"] = judged[:dev]
    beir = write_beir(base / "synth", corpus, queries, qrels)
    execute(stages()["download"], DownloadConfig(name="synth", source=str(beir), root=root), log=log)
    bb = BackboneConfig(model=str(model))
    enc = EncodeConfig(
        root=root, dataset="synth", k=sorted(set(kps) | set(kqs)), backbone=bb, max_length=64, shard_size=shard_size
    )
    execute(stages()["tokenize"], enc.tokenize_config(), log=log)
    settings = enc.settings()
    record = encoder_record(settings)
    store = ArtifactStore(root)
    register(store, record, weights_of(bb))
    tokens = tokens_slug(bb, enc.max_length, enc.title_sep)
    gen = _Vectors(hidden, spectrum, n_passages, seed)
    position = {f"p{i}": i for i in range(n_passages)}
    target = {f"q{i}": i * n_passages // n_queries for i in range(n_queries)}
    for side, ks in (("passage", kps), ("query", kqs)):
        t_folder = tokens_dir(tokens, "synth", side)
        t_man = tokens_manifest(store, t_folder, "tokenize first")
        for k in ks:
            folder = encodings_dir(record.system, "synth", side, k)
            part = {"system": record.system, "dataset": "synth", "side": side, "k": str(k)}
            m, done = store.open_sharded(
                folder, "encodings", part, encodings_config(settings, tokens, t_man.config_hash, k)
            )
            for i, name in enumerate(sorted(t_man.files)):
                if name in done:
                    continue
                ids = store.read_table(t_folder, name, columns=["id"]).column("id").to_pylist()
                where = np.array([position[x] if side == "passage" else target[x] for x in ids])
                tag = i if side == "passage" else 10_000 + i
                x = gen.vectors(where, k, tag, 1.0 if side == "passage" else spectrum.query_noise)
                srng = np.random.default_rng([seed, 4, tag, k])
                table = _shard(ids, x, _sparse(srng, len(ids), sparse_terms, sparse_vocab), 24)
                store.record_shard(folder, name, store.write_shard(folder, name, table), m.config_hash)
                log(f"{side} K={k} {name}: {len(ids):,} texts")
            store.compact_shards(folder)
    return Synthetic(
        root, record.system, enc, spectrum, hidden, n_passages, n_queries, {"singular_values": gen.s.tolist()}
    )
