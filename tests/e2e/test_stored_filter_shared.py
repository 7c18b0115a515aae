"""Encoding stays byte for byte what it was, on the reference-parity scifact-mini (50 passages, 20 queries) with
splade-tiny and the random-weight tiny Dream and LLaDA checkpoints (their real tokenizers), the reference readout
(nltk filter, stop cut, per-slot top-128):
- the content filter stored at tokenize time gives the encodings of filtering while encoding;
- the encodings equal those recorded before encoding was sped up (data/scifact_mini_encodings_sha256.json:
  sha256 of each shard's rows, by the code of commit 6832dc8, one thread on this CPU kind; another CPU or torch
  build may round differently: then record them again, knowingly, with the code of that commit).
Skips when ../shared's fixture or models are absent."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import SHARED

from retrieval.models.backbones import BackboneConfig
from stages import execute, stages
from stages.encode import EncodeConfig
from stages.ingest import DownloadConfig

MINI = SHARED / "fixtures" / "reference-parity" / "scifact-mini"
MODELS = ["splade-tiny-mlm", "tiny-dream-random", "tiny-llada-random"]

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]


def encodings(root: Path) -> dict[str, object]:
    return {str(p.relative_to(root)): pq.read_table(p) for p in sorted(root.glob("encodings/**/shard=*.parquet"))}


@pytest.mark.parametrize("name", MODELS)
def test_stored_filter_encodes_byte_identical(name: str, tmp_path: Path) -> None:
    model = SHARED / "models" / name
    if not (MINI / "corpus.jsonl").exists() or not (model / "config.json").exists():
        pytest.skip(f"../shared/fixtures/reference-parity/scifact-mini or ../shared/models/{name} is absent")
    out = {}
    for how in ("stored", "while-encoding"):
        root = tmp_path / how
        execute(stages()["download"], DownloadConfig(name="mini", source=str(MINI), root=str(root)), log=print)
        cfg = EncodeConfig(dataset="mini", k=[1, 4, 16], backbone=BackboneConfig(model=str(model)), max_length=128,
                           shard_size=20, batch_size=8, root=str(root))  # fmt: skip
        tok = cfg.tokenize_config()
        assert tok.content_filter == "nltk"
        execute(stages()["tokenize"], tok if how == "stored" else tok.model_copy(update={"content_filter": "none"}),
                log=print)  # fmt: skip
        assert (root / "filters").exists() == (how == "stored")
        execute(stages()["encode"], cfg, log=print)
        out[how] = encodings(root)
    assert list(out["stored"]) == list(out["while-encoding"]) and len(out["stored"]) == 3 * (1 + 3)
    for shard, table in out["stored"].items():
        assert table.equals(out["while-encoding"][shard]), shard


def test_encodings_equal_those_recorded_before_the_speed_up(tmp_path: Path) -> None:
    recorded = json.loads((Path(__file__).parent / "data" / "scifact_mini_encodings_sha256.json").read_text())
    got = {}
    for name in MODELS:
        model = SHARED / "models" / name
        if not (MINI / "corpus.jsonl").exists() or not (model / "config.json").exists():
            pytest.skip(f"../shared/fixtures/reference-parity/scifact-mini or ../shared/models/{name} is absent")
        root = tmp_path / name
        execute(stages()["download"], DownloadConfig(name="mini", source=str(MINI), root=str(root)), log=print)
        cfg = EncodeConfig(dataset="mini", k=[1, 4, 16], backbone=BackboneConfig(model=str(model)), max_length=128,
                           shard_size=20, batch_size=8, root=str(root))  # fmt: skip
        execute(stages()["tokenize"], cfg.tokenize_config(), log=print)
        execute(stages()["encode"], cfg, log=print)
        for p, table in encodings(root).items():
            rel = "/".join(x for x in Path(p).parts if not x.startswith("system="))
            digest = hashlib.sha256(json.dumps(table.to_pydict(), sort_keys=True).encode()).hexdigest()
            got[f"{name}/{rel}"] = digest
    assert got == recorded
