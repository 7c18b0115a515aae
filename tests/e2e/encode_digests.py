"""Encode the reference-parity scifact-mini with splade-tiny and the tiny Dream and LLaDA checkpoints (K 1, 4, 16,
128 tokens, shards of 20, batches of 8, one thread) into OUT and print the sha256 of each shard's rows as JSON.

Run by tests/e2e/test_stored_filter_shared.py with the code on ``sys.path`` (this checkout's, or that of the commit
before encoding was sped up, unpacked from git): the same script on the same machine, so the two can be compared
byte for byte. Usage: ``python encode_digests.py SHARED OUT``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def main(shared: Path, out: Path) -> dict[str, str]:
    import pyarrow.parquet as pq
    import torch

    from diffret.retrieval.models.backbones import BackboneConfig
    from diffret.stages import execute, stages
    from diffret.stages.download import DownloadConfig
    from diffret.stages.encode import EncodeConfig

    torch.set_num_threads(1)
    mini = shared / "fixtures" / "reference-parity" / "scifact-mini"
    got = {}
    for name in ("splade-tiny-mlm", "tiny-dream-random", "tiny-llada-random"):
        root = out / name
        quiet = lambda *_: None  # noqa: E731
        execute(stages()["download"], DownloadConfig(name="mini", source=str(mini), root=str(root)), log=quiet)
        cfg = EncodeConfig(
            dataset="mini",
            k=[1, 4, 16],
            backbone=BackboneConfig(model=str(shared / "models" / name)),
            max_length=128,
            shard_size=20,
            batch_size=8,
            root=str(root),
        )
        execute(stages()["tokenize"], cfg.tokenize_config(), log=quiet)
        execute(stages()["encode"], cfg, log=quiet)
        for p in sorted(root.glob("encodings/**/shard=*.parquet")):
            rel = "/".join(x for x in p.relative_to(root).parts if not x.startswith("system="))
            rows = json.dumps(pq.read_table(p).to_pydict(), sort_keys=True).encode()
            got[f"{name}/{rel}"] = hashlib.sha256(rows).hexdigest()
    return got


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2])), sort_keys=True))
