"""Fine-tuning a real instruct LM, in small: SmolLM2-135M (../shared, GGUF) trained with
LoRA through the PromptReps readout (sequential decoding) and through the mask readout under bidirectional
attention lowers its training loss. Six SciFact passages, each with its title as the query and the next
passage as the hard negative, four epochs: the loss over the last epoch is below the first's (seeded, CPU,
so the check is deterministic). The 40-step runs and their SciFact figures are in the README."""

from __future__ import annotations

import json

import pytest
from conftest import SHARED

SMOL = SHARED / "models" / "smollm2-135m-instruct-gguf"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _groups(shared_data, n: int = 6):
    from diffret.retrieval.data.training import Group

    docs = []
    with (shared_data / "scifact" / "corpus.jsonl").open() as f:
        for line in f:
            d = json.loads(line)
            if d.get("title") and len(d.get("text", "")) > 200:
                docs.append({"docid": d["_id"], "title": "", "text": d["text"]})
                docs[-1]["query"] = d["title"]
            if len(docs) == n:
                break
    keys = ("docid", "title", "text")
    return [
        Group(f"q{i}", d["query"], [{k: d[k] for k in keys}], [{k: docs[(i + 1) % n][k] for k in keys}])
        for i, d in enumerate(docs)
    ]


@pytest.fixture(scope="module")
def smol():
    """SmolLM2 loaded from its GGUF file once (de-quantising it and converting its tokenizer is most of the time)."""
    if not (SMOL / GGUF).exists():
        pytest.skip("../shared/models/smollm2-135m-instruct-gguf is absent")
    pytest.importorskip("gguf")
    import transformers

    from diffret.retrieval.models.backbones import BackboneConfig, load_backbone

    transformers.utils.logging.disable_progress_bar()
    return load_backbone(BackboneConfig(model=str(SMOL), gguf_file=GGUF))


@pytest.mark.e2e
@pytest.mark.parametrize("readout", ["promptreps", "diffretriever"])
def test_lora_training_lowers_the_loss(shared_data, smol, readout):
    import copy

    from diffret.retrieval.models.backbones import Backbone
    from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
    from diffret.retrieval.training.loop import Trainer, TrainSettings

    mask = "<empty_output>" if readout == "diffretriever" else None
    # a copy of the loaded weights each time (LoRA wraps them in place), with the readout's mask token
    bb = Backbone(copy.deepcopy(smol.model), smol.tokenizer, smol.family, mask, None, smol.name, smol.loader)
    bb.source = smol.source.model_copy(update={"mask_token": mask})
    reader = make_reader(bb, ReadoutConfig(readout=readout, content_filter="regex"), 128)
    settings = TrainSettings(
        kq=2,
        kp=2,
        batch_size=3,
        pool_size=3,
        global_batch=3,
        n_negatives=1,
        q_max_len=16,
        p_max_len=24,
        lr=1e-3,
        warmup_ratio=0.0,
        epochs=4,
        schedule="linear",
    )
    tr = Trainer(reader, _groups(shared_data), settings)
    try:
        assert 0 < tr.trainable < 0.05 * tr.total  # LoRA: a few percent of the weights
        log = tr.run()
    finally:
        tr.close()
    assert len(log) == 8  # 6 groups / 3 a step x 4 epochs
    first, last = (sum(r["loss"] for r in log[i : i + 2]) / 2 for i in (0, 6))
    print(f"\nsmollm2 {readout}:", [(round(r["dense"], 3), round(r["sparse"], 3)) for r in log])
    assert last < first
