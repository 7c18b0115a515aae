"""Reranker training on a tiny in-test model (Qwen2 shape, byte-level BPE with a mask token): the losses by hand,
RankZephyr / plain / qrels-derived lists, the micro-batch's slots and targets (shuffled lists map back to the
teacher order, MDLM masks only what it should), the loss equals one computed from the full LM head, training
learns the lists, and a resumed run is bit-identical."""

from __future__ import annotations

import gzip
import json
import math
import re

import pytest
import torch
from tiny_models import tiny_backbone

from diffret.retrieval.rerank.rerankers import RerankError, make_reranker
from diffret.retrieval.rerank.training import (
    RankedList,
    RerankTrainer,
    RerankTrainSettings,
    listwise_ce,
    qrels_lists,
    ranknet,
    read_ranked_lists,
)

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "cats purr dogs bark tea coffee cocoa garden fox jumps lazy mailman".split()


def lists(n: int = 6, size: int = 4) -> list[RankedList]:
    out = []
    for i in range(n):
        a = WORDS[i % len(WORDS)]
        docs = [f"{a} {a} {a}"] + [f"{WORDS[(i + 3 + j) % len(WORDS)]} tea" for j in range(size - 1)]
        out.append(RankedList(f"q{i}", a, docs, [1.0] + [0.0] * (size - 1)))
    return out


@pytest.fixture()
def bb(tmp_path):
    return tiny_backbone("qwen2", tmp_path / "tiny", seed=0)[0]


def settings(**kw) -> RerankTrainSettings:
    base = {
        "adapter": "full",
        "batch_size": 3,
        "grad_accum": 1,
        "lr": 3e-3,
        "epochs": 1,
        "doc_tokens": 8,
        "list_size": 4,
    }
    return RerankTrainSettings(**{**base, **kw})


# --------------------------------------------------------------------------------------------- losses
def test_losses_by_hand() -> None:
    s = torch.tensor([2.0, 0.5, -1.0])
    z = sum(math.exp(v) for v in (2.0, 0.5, -1.0))
    assert float(listwise_ce(s, None)) == pytest.approx(-(2.0 - math.log(z)), abs=1e-6)
    # labels (2, 0, 1): target (2/3, 0, 1/3)
    want = -(2 / 3 * (2.0 - math.log(z)) + 1 / 3 * (-1.0 - math.log(z)))
    assert float(listwise_ce(s, torch.tensor([2.0, 0.0, 1.0]))) == pytest.approx(want, abs=1e-6)
    # RankNet without labels: pairs (0,1), (0,2), (1,2); with labels (0, 1, 0): (1,0), (1,2) only
    sp = lambda x: math.log1p(math.exp(x))  # noqa: E731
    assert float(ranknet(s, None)) == pytest.approx((sp(-1.5) + sp(-3.0) + sp(-1.5)) / 3, abs=1e-6)
    assert float(ranknet(s, torch.tensor([0.0, 1.0, 0.0]))) == pytest.approx((sp(1.5) + sp(-1.5)) / 2, abs=1e-6)


def test_settings_refuse_a_loss_that_does_not_train_the_method() -> None:
    assert RerankTrainSettings(method="logits_listwise").loss == "listwise_ce"
    assert RerankTrainSettings(method="permutation_sampling").loss == "mdlm"
    with pytest.raises(ValueError, match="does not train pointwise"):
        RerankTrainSettings(method="pointwise", loss="mdlm")
    with pytest.raises(ValueError, match="does not train permutation_assignment"):
        RerankTrainSettings(method="permutation_assignment", loss="ranknet")
    s = RerankTrainSettings()  # DiffuRank's: LoRA r 16 alpha 32 dropout 0, constant 1e-4, 3 epochs, 64 lists a step
    assert (s.lora_r, s.lora_alpha, s.lora_dropout, s.lr, s.weight_decay, s.epochs) == (16, 32, 0.0, 1e-4, 0.01, 3)
    assert s.batch_size * s.grad_accum == 64 and {s.lr_factor(i, 10) for i in range(10)} == {1.0}


# --------------------------------------------------------------------------------------------- sources
def test_rankzephyr_and_plain_lists_and_their_errors(tmp_path) -> None:
    human = (
        "I will provide you with 3 passages, each indicated by a numerical identifier [].\n"
        "[1] cats purr\n[2] dogs bark\n[3] tea time\nSearch Query: do dogs bark?.\nRank the 3 passages above."
    )
    rows = [
        {
            "id": "z1",
            "conversations": [
                {"from": "system", "value": "You are RankLLM"},
                {"from": "human", "value": human},
                {"from": "gpt", "value": "[2] > [3] > [1]"},
            ],
        },
        {"query": "q", "candidates": ["x", {"content": "y"}, {"passage": "z"}], "labels": [0, 2, 1]},
    ]
    f = tmp_path / "lists.jsonl.gz"
    with gzip.open(f, "wt") as out:
        out.write("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = list(read_ranked_lists(f))
    assert (got[0].query_id, got[0].query) == ("z1", "do dogs bark?")
    assert got[0].docs == ["dogs bark", "tea time", "cats purr"]
    assert got[0].labels is None
    assert (got[1].docs, got[1].labels) == (["x", "y", "z"], [0.0, 2.0, 1.0])
    bad = {
        "malformed JSON": "{oops",
        "neither 'conversations' nor 'query'": json.dumps({"text": "x"}),
        "names unknown or repeated": json.dumps({"query": "q", "candidates": ["a", "b"], "ranking": [1, 1]}),
        "2 labels for 3": json.dumps({"query": "q", "candidates": ["a", "b", "c"], "labels": [1, 0]}),
        "no '[i] passage' lines": json.dumps(
            {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "[1]"}]}
        ),
    }
    for why, line in bad.items():
        f = tmp_path / "bad.jsonl"
        f.write_text(json.dumps(rows[1]) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{re.escape(why)}"):
            list(read_ranked_lists(f))


def test_qrels_lists_put_the_relevant_first_then_the_run() -> None:
    text = {d: d.upper() for d in ("d1", "d2", "d3", "d4", "d5")}
    got, stats = qrels_lists(
        {"a": "qa", "b": "qb", "c": "qc"},
        {"a": {"d4": 1, "d2": 2, "d9": 1}, "b": {"d1": 0}, "c": {"d5": 1}},  # d9 is not in the corpus
        {"a": ["d1", "d2", "d3", "d4"], "b": ["d1", "d2"]},
        text,
        3,
    )
    assert [(g.query_id, g.docs, g.labels) for g in got] == [
        ("a", ["D2", "D4", "D1"], [2.0, 1.0, 0.0]),
        ("c", ["D5"], [1.0]),
    ]
    assert stats == {"lists": 2, "without_relevant": 1, "without_run": 1}


# --------------------------------------------------------------------------------------------- batches
def _full_head_score(bb, ids: list[int], slot: int, cols: list[int]) -> float:
    x = torch.tensor([ids])
    with torch.no_grad():
        lsm = torch.log_softmax(bb.logits(bb.hidden_states(x, torch.ones_like(x), bidirectional=True))[0, slot], -1)
    return float(lsm[cols[1]] - lsm[cols[0]])


@pytest.mark.parametrize("method", ["pointwise", "logits_listwise"])
@pytest.mark.parametrize("loss", ["listwise_ce", "ranknet"])
def test_score_losses_equal_the_full_heads_in_teacher_order(bb, method: str, loss: str) -> None:
    tr = RerankTrainer(bb, lists(3), settings(method=method, loss=loss))
    x = tr.prepare(tr.items, step=0)
    scores = [
        _full_head_score(bb, ids, slot, tr.cols) for ids, pos in zip(x.rows, x.positions, strict=True) for slot in pos
    ]
    want = []
    for (idx, labels), ls in zip(x.lists, tr.items, strict=True):
        s = torch.tensor([scores[i] for i in idx], dtype=torch.float64)
        fn = listwise_ce if loss == "listwise_ce" else ranknet
        want.append(float(fn(s, torch.tensor(labels, dtype=torch.float64))))
        if method == "logits_listwise":  # slot idx[t] is the slot of the document of teacher rank t
            text = tr.builder.tok.decode(x.rows[len(want) - 1])
            shown = sorted(range(len(ls.docs)), key=lambda t: text.index(f": {ls.docs[t]}"))
            first = min(idx)
            assert [idx[t] - first for t in range(len(ls.docs))] == [shown.index(t) for t in range(len(ls.docs))]
    tr.bb.model.eval()
    with torch.no_grad():
        got, _ = tr.micro_loss(x, 0)
    assert float(got) == pytest.approx(sum(want) / len(want), abs=1e-4)
    tr.close()


def test_listwise_order_is_shuffled_per_step_and_query(bb) -> None:
    tr = RerankTrainer(bb, lists(6, size=6), settings(method="logits_listwise", list_size=6))
    orders = {tuple(tr.prepare([ls], step).lists[0][0]) for ls in tr.items[:2] for step in range(4)}
    assert len(orders) > 1
    assert tr.prepare(tr.items[:2], 3).lists == tr.prepare(tr.items[:2], 3).lists  # a function of the step
    tr.close()


@pytest.mark.parametrize("masking", ["docid", "random"])
def test_mdlm_masks_identifier_slots_or_the_answer_and_targets_the_teacher_permutation(bb, masking: str) -> None:
    tr = RerankTrainer(bb, lists(6, size=5), settings(method="permutation_assignment", list_size=5, masking=masking))
    ident = tr.reranker.window_ids(5)
    enc = tr.builder.listwise("q", ["x"] * 5, ident)
    from_end = [len(enc.ids) - s for s in enc.slots]  # the answer does not depend on the documents
    extra = 0
    for step in range(6):
        x = tr.prepare(tr.items, step)
        for ls, ids, pos, tgt, w in zip(tr.items, x.rows, x.positions, x.targets, x.weights, strict=True):
            slots = [len(ids) - e for e in from_end]
            answer = list(range(slots[0], len(ids)))
            assert pos and all(ids[p] == bb.mask_id for p in pos) and set(pos) <= set(answer)
            full = list(ids)
            for p, t in zip(pos, tgt, strict=True):
                full[p] = t
            if masking == "docid":
                assert set(pos) <= set(slots) and set(tgt) <= set(tr.cols)
                assert w * len(slots) >= 1.0 - 1e-9  # 1 / (t x answer length), t <= 1
            else:
                extra += len(set(pos) - set(slots))
                assert w * len(answer) >= 1.0 - 1e-9
            # the filled answer is the teacher order: slot r holds the identifier the rank-r doc is shown under
            shown = dict(re.findall(r"\[([A-T])\] ([^\n]*)", tr.builder.tok.decode(full)))
            assert [shown[tr.builder.tok.decode([full[s]]).strip()] for s in slots] == ls.docs
    if masking == "random":
        assert extra > 0  # separators / closing tokens are masked too
    tr.close()


# --------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("method", ["pointwise", "logits_listwise", "permutation_assignment"])
def test_training_learns_the_lists(bb, method: str) -> None:
    train = lists(6)
    items = [(ls.query, [(f"d{j}", d) for j, d in enumerate(ls.docs)]) for ls in train]
    items = [(q, list(reversed(docs))) for q, docs in items]  # the relevant document last

    def mrr() -> float:
        out = make_reranker(method, bb, window=4, step=2, doc_tokens=8).rerank(items)
        return sum(1 / (1 + [d for d, _ in r].index("d0")) for r in out) / len(out)

    before = mrr()
    lr = 1e-2 if method == "logits_listwise" else 3e-3
    tr = RerankTrainer(bb, train, settings(method=method, epochs=25, batch_size=6, lr=lr))
    log = tr.run()
    tr.close()
    losses = [r["loss"] for r in log]
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5
    if method == "pointwise":  # the listwise prompts need more steps than a unit test takes to rank perfectly
        assert mrr() == 1.0 > before


def test_a_resumed_run_is_bit_identical(tmp_path) -> None:
    def make() -> RerankTrainer:
        s = settings(method="logits_listwise", adapter="lora", lora_r=4, max_steps=4, batch_size=2)
        return RerankTrainer(tiny_backbone("qwen2", tmp_path / "m", seed=0)[0], lists(6), s)

    whole = make()
    whole.run()
    half = make()
    saved: list[bytes] = []
    half.run(checkpoint=saved.append, every=2)
    resumed = make()
    resumed.load_state(saved[0])
    assert resumed.step == 2
    resumed.run()
    for a, b in zip(whole.params, resumed.params, strict=True):
        assert torch.equal(a, b)
    assert [r["loss"] for r in whole.log] == [r["loss"] for r in resumed.log]
    for t in (whole, half, resumed):
        t.close()


def test_bad_training_input_fails_before_training(bb) -> None:
    with pytest.raises(RerankError, match="no ranked list with two or more"):
        RerankTrainer(bb, [RankedList("q", "q", ["only one"])], settings())
    with pytest.raises(RerankError, match="needs as many identifiers"):
        RerankTrainer(bb, lists(), settings(method="permutation_sampling", list_size=30))
    with pytest.raises(RerankError, match="exceeds"):
        RerankTrainer(bb, lists(), settings(method="logits_listwise", doc_tokens=400, list_size=20))
