"""Dream and LLaDA against the reference encoder, token for token (../shared/fixtures/reference-parity).

`diffret encode` runs on the tiny random-weight checkpoints over the fixtures' scifact-mini, K in {1, 4, 16},
both sides; the stored encodings and the inputs diffret builds are compared with what the reference produced
(the fixture README's tolerances). Then batch-size invariance, padding included, and the whole grid through
`diffret run` and `diffret report` on the tiny Dream checkpoint. Skipped when ../shared is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import SHARED

from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
from diffret.retrieval.search.modes import MODE_NAMES
from diffret.stages.encode import reader_for
from diffret.stages.readers import encoding_manifest
from diffret.stages.systems import EncodeSettings, SystemRef, find_system
from diffret.storage import ArtifactStore
from diffret.storage.layout import encodings_dir, tokens_dir
from diffret.storage.sql import StoreSQL

pytestmark = pytest.mark.e2e

FIXTURES = SHARED / "fixtures" / "reference-parity"
MINI = FIXTURES / "scifact-mini"
MODELS = {fam: SHARED / "models" / f"tiny-{fam}-random" for fam in ("dream", "llada")}
KS = (1, 4, 16)
DIFFRET = [sys.executable, "-m", "diffret.flows.cli"]
ENV = {**os.environ, "COLUMNS": "200", "PREFECT_API_URL": "", "HF_HUB_OFFLINE": "1"}


def cli(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([*DIFFRET, *args], capture_output=True, text=True, env=ENV, timeout=1200)
    if p.returncode != 0:
        raise AssertionError(f"diffret {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def fixture(family: str, side: str, k: int) -> tuple[dict, dict]:
    path = FIXTURES / family / f"{side}-k{k}"
    return json.loads(path.with_suffix(".json").read_text()), dict(np.load(path.with_suffix(".npz")))


def unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.fixture(scope="module", params=sorted(MODELS))
def encoded(request, tmp_path_factory) -> dict:
    """The scifact-mini queries and passages encoded by `diffret encode` at K in {1, 4, 16} (batch 8)."""
    family = request.param
    model = MODELS[family]
    if not (FIXTURES / family / "meta.json").exists() or not (model / "config.json").exists():
        pytest.skip(f"../shared reference-parity fixtures or models/tiny-{family}-random are absent")
    root = tmp_path_factory.mktemp(f"parity-{family}") / "store"
    cli("download", "scifact-mini", "--source", str(MINI), "--root", str(root))
    cli(
        "encode",
        "-d",
        "scifact-mini",
        "--model",
        str(model),
        "--k",
        ",".join(map(str, KS)),
        "--batch-size",
        "8",
        "--max-length",
        "512",
        "--root",
        str(root),
    )  # fixtures: encode.py's default 512
    store = ArtifactStore(root)
    record = find_system(store, SystemRef(model=str(model)))
    settings = EncodeSettings.model_validate(record.settings | {"backbone": BackboneConfig(model=str(model))})
    return {"family": family, "store": store, "system": record.system, "settings": settings, "model": model}


def stored(enc: dict, side: str, k: int) -> dict[str, tuple[np.ndarray, dict[int, float], list[int]]]:
    store, stage = enc["store"], encodings_dir(enc["system"], "scifact-mini", side, k)
    t = store.read_table(stage, sorted(encoding_manifest(store, stage).files)[0])
    out = {}
    for row in t.to_pylist():
        dense = np.asarray(row["dense"], dtype=np.float32)
        out[row["id"]] = (dense, dict(zip(row["sparse_ids"], row["sparse_weights"], strict=True)), row["tokens"])
    assert len(encoding_manifest(store, stage).files) == 1
    return out


@pytest.mark.parametrize("side", ["query", "passage"])
@pytest.mark.parametrize("k", KS)
def test_prompt_ids_and_mask_positions_equal_the_reference(encoded, side, k):
    """The tokens stage's ids, wrapped by the readout as the encode stage does, are the reference's inputs."""
    fx, _ = fixture(encoded["family"], side, k)
    store = encoded["store"]
    reader = reader_for(encoded["settings"])
    man = store.read_manifest(tokens_dir(_tokens_slug(store, encoded), "scifact-mini", side))
    t = store.read_table(tokens_dir(_tokens_slug(store, encoded), "scifact-mini", side), sorted(man.files)[0])
    ids, toks, texts = (t.column(c).to_pylist() for c in ("id", "token_ids", "text"))
    assert sorted(ids) == sorted(fx)
    batch = reader._mask_batch(reader._fit(toks, side, k), side, k)
    for i, doc in enumerate(ids):
        keep = batch.attention_mask[i].bool()
        offset = int((~keep).sum())  # left padding
        assert texts[i] == fx[doc]["text"], doc
        assert batch.input_ids[i][keep].tolist() == fx[doc]["prompt_ids"], doc
        assert (batch.positions[i] - offset).tolist() == fx[doc]["positions"], doc


def _tokens_slug(store: ArtifactStore, enc: dict) -> str:
    m = store.read_manifest(encodings_dir(enc["system"], "scifact-mini", "query", KS[0]))
    return m.config["tokens"]


@pytest.mark.parametrize("side", ["query", "passage"])
@pytest.mark.parametrize("k", KS)
def test_dense_and_sparse_equal_the_reference(encoded, side, k):
    fx, vectors = fixture(encoded["family"], side, k)
    got = stored(encoded, side, k)
    assert set(got) == set(fx)
    for doc, rec in fx.items():
        dense, sparse, tokens = got[doc]
        ref = vectors[f"{doc}|fp32"]
        assert rec["stop_cutoff"] is None and dense.shape == ref.shape  # random weights: no special token read
        cos = (unit(dense) * unit(ref)).sum(-1)
        assert cos.min() >= 0.9999, (doc, cos.min())
        assert np.abs(unit(dense) - unit(ref)).max() <= 2e-3, doc  # diffret stores float16
        assert rec["decoded"] is None or tokens == rec["decoded"], doc
        want = {int(t): w for t, w in rec["sparse"].items()}
        assert set(sparse) == set(want), doc
        assert max((abs(sparse[t] - want[t]) for t in want), default=0.0) <= 0.01 + 1e-6, doc


def test_batch_size_one_equals_batch_size_eight(encoded):
    """Vectors do not depend on the batch (padding included): native loading honours the attention mask."""
    store = encoded["store"]
    reader = reader_for(encoded["settings"])
    tokens = _tokens_slug(store, encoded)
    for side in ("query", "passage"):
        folder = tokens_dir(tokens, "scifact-mini", side)
        t = store.read_table(folder, sorted(store.read_manifest(folder).files)[0])
        ids, toks, texts = (t.column(c).to_pylist()[:12] for c in ("id", "token_ids", "text"))
        assert len({len(x) for x in toks}) > 1  # the batch of 8 is padded
        k = 4
        batched = {}
        for s in range(0, len(ids), 8):
            for i, e in zip(ids[s : s + 8], reader.encode(toks[s : s + 8], texts[s : s + 8], side, k), strict=True):
                batched[i] = e
        for i, tk, tx in zip(ids, toks, texts, strict=True):
            alone = reader.encode([tk], [tx], side, k)[0]
            cos = (unit(alone.dense.astype(np.float32)) * unit(batched[i].dense.astype(np.float32))).sum(-1)
            assert cos.min() >= 0.9999, (side, i, cos.min())
            assert alone.sparse_ids.tolist() == batched[i].sparse_ids.tolist()
        # and the stored encodings (batch 8, length-sorted) hold these vectors
        kept = stored(encoded, side, k)
        for i in ids:
            cos = (unit(kept[i][0]) * unit(batched[i].dense.astype(np.float32))).sum(-1)
            assert cos.min() >= 0.9999, (side, i, cos.min())


@pytest.mark.parametrize("family", sorted(MODELS))
def test_bfloat16_stays_close_to_float32(family):
    """bf16 (the reference's and the paper's dtype) changes the vectors a little, not the inputs."""
    model = MODELS[family]
    if not (model / "config.json").exists():
        pytest.skip(f"../shared/models/tiny-{family}-random is absent")
    fx, vectors = fixture(family, "query", 4)
    out = {}
    for dtype in ("float32", "bfloat16"):
        bb = load_backbone(BackboneConfig(model=str(model), dtype=dtype))
        reader = make_reader(bb, ReadoutConfig(), 512)
        docs = sorted(fx)[:5]
        toks = [bb.tokenizer(fx[d]["text"], add_special_tokens=False)["input_ids"] for d in docs]
        out[dtype] = reader.encode(toks, [fx[d]["text"] for d in docs], "query", 4)
    for a, b in zip(out["float32"], out["bfloat16"], strict=True):
        assert (unit(a.dense.astype(np.float32)) * unit(b.dense.astype(np.float32))).sum(-1).min() > 0.99


def test_run_dream_whole_grid_and_report(tmp_path):
    """`diffret run` on the tiny Dream checkpoint: the 5 x 5 grid, every mode, BM25, the leaderboard and the report.
    The numbers are meaningless (random weights); the path is not."""
    model = MODELS["dream"]
    if not (model / "config.json").exists() or not (MINI / "corpus.jsonl").exists():
        pytest.skip("../shared/models/tiny-dream-random or the scifact-mini fixture is absent")
    root = tmp_path / "store"
    p = cli(
        "run",
        "--dataset",
        "scifact",
        "--source",
        str(MINI),
        "--model",
        str(model),
        "--batch-size",
        "16",
        "--root",
        str(root),
    )
    assert "NDCG@10" in p.stdout and "done in" in p.stderr, p.stdout + p.stderr
    store = ArtifactStore(root)
    system = find_system(store, SystemRef(model=str(model))).system
    for k in (1, 2, 4, 8, 16):
        for side in ("query", "passage"):
            assert store.read_manifest(encodings_dir(system, "scifact", side, k)) is not None
    with StoreSQL(store) as db:
        _, rows = db.query(
            f"select count(distinct (kq, kp)), count(distinct mode), count(*) from cells "
            f"where system = '{system}' and split = 'test'"
        )
    # every cell in every mode, but multi_dense and its fusion at q1-p1 (skipped, as the reference does)
    assert rows[0][0] == 25 and rows[0][1] == len(MODE_NAMES) and rows[0][2] == 25 * len(MODE_NAMES) - 2, rows
    cli("report", "--name", "tiny-dream", "--root", str(root))
    reports = list((root / "reports" / "report=tiny-dream").rglob("*.md"))
    assert reports and all(r.stat().st_size > 0 for r in reports)
