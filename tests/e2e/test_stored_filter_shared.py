"""Encoding stays byte for byte what it was, on the reference-parity scifact-mini (50 passages, 20 queries) with
splade-tiny and the random-weight tiny Dream and LLaDA checkpoints (their real tokenizers), the reference readout
(nltk filter, stop cut, per-slot top-128):
- the content filter stored at tokenize time gives the encodings of filtering while encoding;
- the encodings equal, byte for byte, those of the code before encoding was sped up (commit 6832dc8), on this
  machine: the sha256 of each shard's rows (encode_digests.py, one thread) recorded by that code per platform
  (torch version and the CPU instructions it dispatches to, data/scifact_mini_encodings_sha256.json: another CPU
  kind rounds differently), or, for a platform not recorded, computed here by that commit's code unpacked from
  this clone's git history (its digests are printed, to be recorded).
Skips when ../shared's fixture or models are absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, SHARED

from diffret.retrieval.models.backbones import BackboneConfig
from diffret.stages import execute, stages
from diffret.stages.download import DownloadConfig
from diffret.stages.encode import EncodeConfig

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
        cfg = EncodeConfig(
            dataset="mini",
            k=[1, 4, 16],
            backbone=BackboneConfig(model=str(model)),
            max_length=128,
            shard_size=20,
            batch_size=8,
            root=str(root),
        )
        tok = cfg.tokenize_config()
        assert tok.content_filter == "nltk"
        execute(
            stages()["tokenize"],
            tok if how == "stored" else tok.model_copy(update={"content_filter": "none"}),
            log=print,
        )
        assert (root / "filters").exists() == (how == "stored")
        execute(stages()["encode"], cfg, log=print)
        out[how] = encodings(root)
    assert list(out["stored"]) == list(out["while-encoding"]) and len(out["stored"]) == 3 * (1 + 3)
    for shard, table in out["stored"].items():
        assert table.equals(out["while-encoding"][shard]), shard


SPEED_UP = "6832dc8"  # the last commit before encoding was sped up
RECORDED = Path(__file__).parent / "data" / "scifact_mini_encodings_sha256.json"


def platform() -> str:
    """What decides float rounding here: the torch build, the transformers release (its model code: a new release
    may compute the same layers in another order) and the CPU instructions torch's kernels dispatch to."""
    import torch
    import transformers

    cpu = torch.backends.cpu.get_cpu_capability()
    return f"torch {torch.__version__}, transformers {transformers.__version__}, cpu {cpu}"


def digests(code: Path, out: Path) -> dict[str, str]:
    """encode_digests.py run with ``code`` first on the path (a fresh process: one thread, nothing cached)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "encode_digests.py"), str(SHARED), str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=code,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def reference(tmp_path: Path) -> dict[str, str]:
    """The digests of the code before the speed-up on this platform: recorded, else computed from git history."""
    recorded = json.loads(RECORDED.read_text())
    if platform() in recorded:
        return recorded[platform()]
    old = tmp_path / "before-speed-up"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", SPEED_UP], capture_output=True, timeout=300)
    if archive.returncode != 0:
        pytest.skip(f"{platform()} has no recorded digests and commit {SPEED_UP} is not in this clone's history")
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True, timeout=300)
    got = digests(old, tmp_path / "old-store")
    print(f"to record for {platform()!r} in {RECORDED.name}:\n{json.dumps(got, indent=1, sort_keys=True)}")
    return got


def test_encodings_equal_those_of_the_code_before_the_speed_up(tmp_path: Path) -> None:
    for name in MODELS:
        if not (MINI / "corpus.jsonl").exists() or not (SHARED / "models" / name / "config.json").exists():
            pytest.skip(f"../shared/fixtures/reference-parity/scifact-mini or ../shared/models/{name} is absent")
    got = digests(REPO, tmp_path / "store")
    assert len(got) == 3 * 12  # 3 models x (1 query shard + 3 passage shards) x 3 K
    assert got == reference(tmp_path)
