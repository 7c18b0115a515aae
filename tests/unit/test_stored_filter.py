"""The sparse content-word filter computed once per text, at tokenize time (filters/), and read by every K pass:
the same encodings as filtering while encoding, the filter called once per text over a whole grid, and a
filters/ folder of other tokens (or none) never used."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import write_beir
from tiny_models import save_tiny_mlm

from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.models.sparse import ContentFilter
from diffret.stages import execute, stages
from diffret.stages.base import Context, Plan
from diffret.stages.download import DownloadConfig
from diffret.stages.encode import EncodeConfig
from diffret.stages.systems import tokenizer_of
from diffret.storage import ArtifactStore

WORDS = "cats purr dogs bark tea coffee cocoa garden fox jumps over the lazy mailman".split()
CORPUS = [{"_id": f"d{i}", "title": WORDS[i], "text": " ".join(WORDS[i : i + 5]) + "."} for i in range(10)]
QUERIES = [{"_id": f"q{i}", "text": f"where do the {WORDS[i]} go?"} for i in range(4)]
GRID = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("filter")
    beir = write_beir(base / "tiny", CORPUS, QUERIES, {"test": [("q0", "d0", 1)]})
    return {"beir": beir, "model": save_tiny_mlm(base / "model")}


def encode(tiny: dict, root: Path, **readout: str) -> EncodeConfig:
    execute(stages()["download"], DownloadConfig(name="tiny", source=str(tiny["beir"]), root=str(root)), log=print)
    return EncodeConfig(
        dataset="tiny",
        k=GRID,
        backbone=BackboneConfig(model=str(tiny["model"])),
        max_length=48,
        shard_size=4,
        batch_size=3,
        readout=readout,
        root=str(root),
    )


def run_encode(cfg: EncodeConfig, with_filter: bool = True) -> None:
    tok = cfg.tokenize_config()
    execute(stages()["tokenize"], tok if with_filter else tok.model_copy(update={"content_filter": "none"}), log=print)
    execute(stages()["encode"], cfg, log=print)


def shards(root: Path, folder: str) -> dict[str, object]:
    return {str(p.relative_to(root)): pq.read_table(p) for p in sorted(root.glob(f"{folder}/**/shard=*.parquet"))}


@pytest.mark.parametrize("kind", ["nltk", "regex"])
def test_the_grid_reads_the_filter_stored_once_per_text(tiny: dict, tmp_path: Path, monkeypatch, kind: str) -> None:
    calls: list[str] = []
    words = ContentFilter.words
    monkeypatch.setattr(ContentFilter, "words", lambda self, text: calls.append(text) or words(self, text))
    cfg = encode(tiny, tmp_path / "stored", content_filter=kind)
    assert cfg.tokenize_config().content_filter == kind  # the encode flow asks tokenize for its readout's filter
    run_encode(cfg)
    assert sorted(calls) == sorted(
        [f"{d['title']}. {d['text']}" for d in CORPUS] + [q["text"] for q in QUERIES]
    )  # once per text over the five K passes of both sides
    stored = shards(tmp_path / "stored", "filters")
    assert len(stored) == 1 + 3 and all(f"filter={kind}" in name for name in stored)  # queries: 1, passages: 3
    flt = ContentFilter(tokenizer_of(cfg.backbone), kind)
    first = next(t for name, t in stored.items() if "side=passage" in name and "shard=00000" in name)
    assert first.column("allowed_ids").to_pylist()[0] == flt.allowed_ids(f"{CORPUS[0]['title']}. {CORPUS[0]['text']}")

    calls.clear()
    run_encode(encode(tiny, tmp_path / "on-the-fly", content_filter=kind), with_filter=False)
    assert len(calls) == len(GRID) * (len(CORPUS) + len(QUERIES))  # what every K pass did before
    assert not (tmp_path / "on-the-fly" / "filters").exists()
    a, b = shards(tmp_path / "stored", "encodings"), shards(tmp_path / "on-the-fly", "encodings")
    assert list(a) == list(b) and len(a) == len(GRID) * 4
    for name in a:  # byte for byte the same encodings
        assert a[name].equals(b[name]), name


def test_no_filter_no_folder_and_other_tokens_are_not_read(tiny: dict, tmp_path: Path) -> None:
    cfg = encode(tiny, tmp_path, readout="diffembed")
    assert cfg.tokenize_config().content_filter == "none"  # a readout without a sparse vector filters nothing
    sidr = encode(tiny, tmp_path, readout="sidr")
    assert sidr.tokenize_config().content_filter == "none"  # SIDR keeps every token

    cfg = encode(tiny, tmp_path)  # the reference readout: nltk
    run_encode(cfg)
    shutil.rmtree(tmp_path / "encodings")  # to be encoded again: what does the plan read?
    plan = plan_encode(cfg)
    assert len(plan.units) == len(GRID) * 4 and all("filter=nltk" in (u.filter_folder or "") for u in plan.units)
    # a filter folder made from other tokens (its input hash differs) is not read: encode filters the texts itself
    folder = next((tmp_path / "filters").glob("*/*/side=query/filter=nltk"))
    manifest = (folder / "_manifest.json").read_text().replace('"tokens": "', '"tokens": "0')
    (folder / "_manifest.json").write_text(manifest)
    plan = plan_encode(cfg)
    assert all((u.filter_folder is None) == (u.side == "query") for u in plan.units)


def plan_encode(cfg: EncodeConfig) -> Plan:
    ctx = Context(ArtifactStore(cfg.root), log=print)
    with ctx.held:
        return stages()["encode"].plan(cfg, ctx)


def test_a_word_pool_gives_the_ids_of_one_process(tiny: dict, monkeypatch) -> None:
    from diffret.retrieval.models import sparse

    texts = [f"{d['title']}. {d['text']} The {d['title']}'s fox, again!" for d in CORPUS] * 3
    tok = tokenizer_of(BackboneConfig(model=str(tiny["model"])))
    monkeypatch.setattr(sparse, "POOL_MIN_TEXTS", 10)
    monkeypatch.setattr(sparse, "WORD_CHUNK", 7)  # several chunks, in order
    for kind in ("nltk", "regex"):
        alone = ContentFilter(tok, kind).allowed_many(texts)
        with sparse.word_pool(2, len(texts)) as pool:
            assert pool is not None
            assert ContentFilter(tok, kind).allowed_many(texts, pool) == alone
    with sparse.word_pool(1, 10**6) as pool:
        assert pool is None  # one worker: this process
