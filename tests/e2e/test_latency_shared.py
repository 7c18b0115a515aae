"""The latency stage on ../shared's real checkpoints: SmolLM2-135M read both ways (PromptReps, sequential, and the
mask readout, one bidirectional pass; the same weights) and the random-weight tiny Dream: rows in the store for
every length and budget with the slots read, the report's Figure 3 panels and ratio table, and a repeated run
doing nothing (the timings themselves are figures for docs/, not assertions). Skips when the checkpoints are
absent."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SHARED

from diffret.retrieval.models.backbones import BackboneConfig
from diffret.stages import execute, stages
from diffret.stages.latency import LatencyConfig
from diffret.storage import ArtifactStore
from diffret.storage.sql import StoreSQL

SMOL = SHARED / "models" / "smollm2-135m-instruct-gguf"
DREAM = SHARED / "models" / "tiny-dream-random"

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]


def test_one_checkpoint_both_ways_and_tiny_dream(tmp_path: Path) -> None:
    if not (SMOL / "SmolLM2-135M-Instruct.Q4_1.gguf").exists() or not (DREAM / "config.json").exists():
        pytest.skip("../shared/models/smollm2-135m-instruct-gguf or tiny-dream-random is absent")
    root = str(tmp_path / "store")
    backbone = BackboneConfig(model=str(SMOL), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", mask_token="<|im_start|>")
    smol = LatencyConfig(
        root=root,
        backbone=backbone,
        readout={"readout": "promptreps"},
        both_ways=True,
        lengths=[16, 64],
        k=[1, 4, 16],
        search_sizes=[100, 1000, 10000],
        search_k=["1x1", "2x4"],
        search_queries=4,
        topk=10,
        repeats=1,
        warmup=1,
    )
    res = execute(stages()["latency"], smol, log=print)
    assert res.done == 3  # PromptReps encode + search, the mask readout's encode
    dream = LatencyConfig(
        root=root, backbone=BackboneConfig(model=str(DREAM)), lengths=[16, 64], k=[1, 16], kinds=["encode"], repeats=1
    )
    execute(stages()["latency"], dream, log=print)
    assert execute(stages()["latency"], smol, log=print).done == 0  # nothing new
    with StoreSQL(ArtifactStore(root)) as db:
        _, enc = db.query("SELECT model, readout, family, length, k, median_ms, slots FROM encode_latency")
        _, srch = db.query("SELECT DISTINCT docs FROM search_latency")
    got = {(m.split("/")[-1], r, n, k): (fam, s) for m, r, fam, n, k, _, s in enc}
    for n in (16, 64):
        for k in (1, 4, 16):  # one checkpoint, both readouts, every length and budget; tiny Dream's mask readout
            assert got[(SMOL.name, "diffretriever", n, k)][1] <= k and got[(SMOL.name, "promptreps", n, k)][1] <= k
        assert got[(SMOL.name, "promptreps", n, 1)][1] == 1  # N = 1 decodes one slot
        assert got[(DREAM.name, "diffretriever", n, 16)][0] == "dream"
    assert sorted(d for (d,) in srch) == [100, 1000, 10000]
    rep = execute(stages()["report"], stages()["report"].config(root=root, name="latency"), log=print)
    folder = Path(rep.details["folder"])
    for fig in ("fig3_encode_latency.png", "fig3_search_latency.png", "ar_over_one_pass.csv"):
        assert (folder / fig).stat().st_size > 100, fig
