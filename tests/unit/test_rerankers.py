"""DiffuRank's rerankers on a tiny in-test model (Qwen2 shape, byte-level BPE with a mask token, ChatML):
scores from the masked slots equal the full LM head's there, batching does not change them, every listwise
method returns a permutation, and bad prompts / windows fail before any work."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import tiny_backbone

from diffret.retrieval.rerank.rerankers import RERANKERS, RerankError, make_reranker

ITEMS = [
    ("what do cats do", [("d1", "cats purr softly"), ("d2", "dogs bark loudly"), ("d3", "the warm garden")]),
    (
        "dogs",
        [
            ("e1", "a lazy dog"),
            ("e2", "tea and coffee"),
            ("e3", "dogs bark"),
            ("e4", "the quick brown fox"),
            ("e5", "cocoa drink"),
        ],
    ),
]


@pytest.fixture(scope="module")
def bb(tmp_path_factory: pytest.TempPathFactory):
    return tiny_backbone("qwen2", tmp_path_factory.mktemp("tiny"))[0]


def test_pointwise_score_is_the_full_heads_p1_over_p0_plus_p1(bb) -> None:
    r = make_reranker("pointwise", bb, batch_size=3)
    out = r.rerank(ITEMS)
    for (q, docs), ranked in zip(ITEMS, out, strict=True):
        got = dict(ranked)
        for doc_id, text in docs:
            enc = r.builder.pointwise(q, text)
            ids = torch.tensor([enc.ids])
            with torch.no_grad():  # every position through the LM head, one prompt alone (no padding)
                logits = bb.logits(bb.hidden_states(ids, torch.ones_like(ids), bidirectional=True))[0]
            p = torch.softmax(logits[enc.slots[0]].double(), -1)
            p0, p1 = p[r.cols[0]].item(), p[r.cols[1]].item()
            assert got[doc_id] == pytest.approx(p1 / (p0 + p1), abs=1e-5)
        assert [s for _, s in ranked] == sorted((s for _, s in ranked), reverse=True)


@pytest.mark.parametrize("name", list(RERANKERS))
def test_every_method_returns_each_querys_candidates_reordered_and_batching_does_not_matter(bb, name: str) -> None:
    docs = [(f"p{i}", f"passage {i} about cats and dogs " * (1 + i % 3)) for i in range(13)]
    items = [*ITEMS, ("cats", docs)]
    one = make_reranker(name, bb, window=5, step=2, batch_size=1, steps=3, doc_tokens=16).rerank(items)
    many = make_reranker(name, bb, window=5, step=2, batch_size=8, steps=3, doc_tokens=16).rerank(items)
    for (_, cand), a, b in zip(items, one, many, strict=True):
        assert sorted(d for d, _ in a) == sorted(d for d, _ in cand)
        assert [d for d, _ in a] == [d for d, _ in b]  # padding with other prompts changes nothing
        assert np.allclose([s for _, s in a], [s for _, s in b], atol=1e-5)


def test_windows_and_passes_are_counted(bb) -> None:
    docs = [(f"p{i}", f"text {i}") for i in range(25)]
    r = make_reranker("permutation_sampling", bb, window=20, step=10, steps=4, doc_tokens=4)
    r.rerank([("q", docs)])
    # RankGPT's windows over 25 candidates: only (5, 25); 4 steps, the constrained and the unconstrained decoding
    # in the same passes
    assert (r.stats.windows, r.stats.forward_passes) == (1, 4)
    assert 0 <= r.stats.invalid_without_constraint <= 1
    a = make_reranker("permutation_assignment", bb, window=20, step=10, doc_tokens=4)
    a.rerank([("q", docs)])
    assert (a.stats.windows, a.stats.forward_passes) == (1, 1)


def test_identifiers_must_be_single_tokens(bb, tmp_path: Path) -> None:
    prompt = tmp_path / "p.yaml"
    prompt.write_text(
        'system: ""\nuser: "{query} {documents} {n}"\ndocument: "[{id}] {text}"\nassistant: "{slots}"\n'
        'slot: "{slot}"\nslot_separator: "\\n"\nidentifiers: [' + ", ".join(f"zq{i}xw" for i in range(20)) + "]\n"
    )
    with pytest.raises(RerankError, match="is not a single token"):
        make_reranker("permutation_assignment", bb, prompt=str(prompt), doc_tokens=4)
    with pytest.raises(RerankError, match="needs as many identifiers"):
        make_reranker("permutation_assignment", bb, window=21, doc_tokens=4)
    with pytest.raises(RerankError, match="unknown reranker"):
        make_reranker("listwise_magic", bb)


def test_a_window_beyond_the_context_is_refused_before_any_work(bb) -> None:
    assert bb.model.config.max_position_embeddings == 512
    with pytest.raises(RerankError, match=r"exceeds .* context of 512"):
        make_reranker("logits_listwise", bb, window=20, doc_tokens=64)
    make_reranker("logits_listwise", bb, window=2, doc_tokens=16)  # fits


def test_lockstep_sampling_equals_decoding_each_window_alone(bb) -> None:
    from diffret.retrieval.rerank.algorithms import constrained_permutation
    from diffret.retrieval.rerank.rerankers import Encoded, slot_logits

    r = make_reranker("permutation_sampling", bb, window=6, step=3, steps=3, doc_tokens=8, batch_size=4)
    windows = [(q, [t for _, t in docs]) for q, docs in ITEMS] + [("cats", [f"cat {i} " * i for i in range(1, 7)])]
    got = r.rank_windows(windows)
    for (q, docs), perm in zip(windows, got, strict=True):
        row = r.builder.listwise(q, docs, r.window_ids(len(docs)))

        def alone(state, row=row, n=len(docs)):
            ids = [
                r.cols[s] if s is not None else t for t, s in zip([row.ids[p] for p in row.slots], state, strict=True)
            ]
            full = list(row.ids)
            for p, t in zip(row.slots, ids, strict=True):
                full[p] = t
            return slot_logits(bb, [Encoded(full, row.slots)], r.cols[:n])[0]

        assert perm == constrained_permutation(alone, len(docs), 3)
