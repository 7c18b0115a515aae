"""PromptReps on a real instruct LM (../shared/models/smollm2-135m-instruct-gguf; skipped when absent)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SHARED

SMOL = SHARED / "models" / "smollm2-135m-instruct-gguf"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
N = 20


@pytest.fixture(scope="module")
def smol_reader():
    if not (SMOL / GGUF).exists():
        pytest.skip("../shared/models/smollm2-135m-instruct-gguf is absent")
    pytest.importorskip("gguf")
    import transformers

    from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
    from diffret.retrieval.models.readouts import ReadoutConfig, make_reader

    transformers.utils.logging.disable_progress_bar()
    bb = load_backbone(BackboneConfig(model=str(SMOL), gguf_file=GGUF))
    return make_reader(bb, ReadoutConfig(readout="promptreps"))


@pytest.mark.e2e
def test_promptreps_on_20_scifact_queries(smol_reader, shared_data, capsys):
    bb = smol_reader.bb
    assert bb.family == "causal" and bb.has_chat_template
    queries = [json.loads(line)["text"] for line in (shared_data / "scifact" / "queries.jsonl").open()][:20]
    ids = [bb.tokenizer(q, add_special_tokens=False)["input_ids"] for q in queries]
    out = smol_reader.encode(ids, queries, "query", N)
    reps = [o.dense.shape[0] for o in out]
    assert all(1 <= n <= N for n in reps)
    assert all(o.dense.shape[1] == bb.hidden_size for o in out)
    stopped = [o.stopped for o in out]
    # a text that stopped at the quote has fewer than N representatives; one that did not ran to the cap
    assert all(n < N or not s for n, s in zip(reps, stopped, strict=True))
    assert all(n == N for n, s in zip(reps, stopped, strict=True) if not s)
    assert any(stopped)
    with capsys.disabled():
        print(f"\npromptreps smollm2-135m, N={N}: {sum(stopped)}/20 stopped at the closing quote; reps {reps}")

    # the number of representatives follows greedy generation (HF generate) up to the stop token: the reference
    # keeps the slot that predicts the quote (or a special token)
    p = smol_reader.pieces("query", N)
    stop = smol_reader.stop_tokens()
    for i in [j for j, s in enumerate(stopped) if s][:2]:
        x = torch.tensor([list(p.prefix) + ids[i] + list(p.suffix)])
        gen = bb.model.generate(x, max_new_tokens=N, do_sample=False)[0, x.shape[1] :].tolist()
        first_stop = next(t for t, tok in enumerate(gen) if tok in stop)
        assert reps[i] == first_stop + 1
