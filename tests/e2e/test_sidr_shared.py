"""SIDR's pipelines through the CLI on the reference-parity mini collection (50 SciFact passages, 20 queries) with
the real checkpoints in ../shared/models (skipped when absent): splade-tiny as a SIDR encoder (bag of tokens, beta,
late) and the tiny Dream checkpoint's DiffRetriever multi_dense re-scoring BM25's and the bag of tokens' top m,
which must equal the full-corpus run on those passages while encoding only them."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_harness import run, sql
from conftest import SHARED

MINI = SHARED / "fixtures" / "reference-parity" / "scifact-mini"
SPLADE = SHARED / "models" / "splade-tiny-mlm"
DREAM = SHARED / "models" / "tiny-dream-random"


@pytest.fixture
def mini(tmp_path) -> Path:
    if not (MINI / "corpus.jsonl").exists() or not (SPLADE / "model.safetensors").exists():
        pytest.skip("../shared fixtures or models are absent")
    root = tmp_path / "store"
    run("download", "mini", "--source", str(MINI), "--root", str(root))
    run("bm25", "-d", "mini", "--root", str(root))
    return root


def _late_matches_full(root: Path, system: str, m: int, mode: str = "multi_dense") -> None:
    late = sql(
        root,
        f"select query_id, doc_id, score from runs where system = '{system}' and mode = "
        f"'late_{mode}_m{m}' order by query_id, rank",
    )
    full = sql(
        root,
        f"select query_id, doc_id, score from runs where system = '{system}' and mode = '{mode}' "
        "and kq = 1 and kp = 1 order by query_id, rank",
    )
    assert late
    for q in {r["query_id"] for r in late}:
        mine = [(r["doc_id"], r["score"]) for r in late if r["query_id"] == q]
        docs = {d for d, _ in mine}
        want = [(r["doc_id"], r["score"]) for r in full if r["query_id"] == q and r["doc_id"] in docs]
        assert [d for d, _ in mine] == [d for d, _ in want], q
        assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for (_, a), (_, b) in zip(mine, want, strict=True)), q


@pytest.mark.e2e
def test_splade_tiny_through_bot_beta_and_late(mini: Path) -> None:
    root, m = str(mini), str(SPLADE)
    run(
        "encode",
        "-d",
        "mini",
        "--model",
        m,
        "--readout",
        "sidr",
        "--sidr-head",
        "lm",
        "--sidr-act",
        "log1p_relu",
        "--k",
        "1",
        "--root",
        root,
    )
    p = run("bot", "-d", "mini", "--model", m, "--root", root)
    assert "50 passages" in p.stdout + p.stderr
    run("beta", "-d", "mini", "--model", m, "--readout", "sidr", "--root", root)
    (system,) = [r["system"] for r in sql(mini, "select system from systems where readout = 'sidr'")]
    run("score", "-d", "mini", "--system", system, "--kq", "1", "--kp", "1", "--mode", "sparse_max", "--root", root)
    run(
        "late",
        "-d",
        "mini",
        "--system",
        system,
        "--mode",
        "sparse_max",
        "--depth",
        "5,50",
        "--first-stage",
        system,
        "--first-kq",
        "1",
        "--first-kp",
        "0",
        "--first-mode",
        "beta",
        "--root",
        root,
    )
    _late_matches_full(mini, system, 50, "sparse_max")
    run("evaluate", "--root", root)
    got = {r["mode"]: r["ndcg_10"] for r in sql(mini, f"select mode, ndcg_10 from cells where system = '{system}'")}
    assert got["late_sparse_max_m50"] == pytest.approx(got["sparse_max"], abs=1e-9)  # m = corpus: the full run
    # bad input: m <= 0 and a readout without sparse vectors, in one line each, nothing written
    bad = run("late", "-d", "mini", "--system", system, "--depth", "0", "--root", root, check=False)
    assert bad.returncode == 2 and "m must be positive" in bad.stdout + bad.stderr


@pytest.mark.e2e
def test_tiny_dream_late_rescoring_encodes_only_the_candidates(mini: Path) -> None:
    if not (DREAM / "config.json").exists():
        pytest.skip("../shared/models/tiny-dream-random is absent")
    root, d = str(mini), str(DREAM)
    run("encode", "-d", "mini", "--model", d, "--side", "query", "--k", "1", "--root", root)
    run("tokenize", "-d", "mini", "--side", "passage", "--model", d, "--root", root)  # no model: token ids only
    (system,) = [r["system"] for r in sql(mini, "select system from systems where kind = 'encoder'")]
    run("late", "-d", "mini", "--system", system, "--depth", "3", "--kp", "1", "--root", root)  # BM25's top 3
    run("late", "-d", "mini", "--system", system, "--depth", "3,10", "--kp", "1", "--root", root)
    cost = {r["m"]: r for r in sql(mini, "select m, passages_needed, encoded_by_run from late_runs")}
    assert cost[3]["encoded_by_run"] == cost[3]["passages_needed"] < 50
    assert cost[10]["encoded_by_run"] == cost[10]["passages_needed"] - cost[3]["passages_needed"]
    # the bag of tokens as first stage: Dream's own K-mask sparse queries over the passages' bags
    run("bot", "-d", "mini", "--model", d, "--root", root)
    run("beta", "-d", "mini", "--system", system, "--root", root)
    run(
        "late",
        "-d",
        "mini",
        "--system",
        system,
        "--depth",
        "5",
        "--kp",
        "1",
        "--first-stage",
        system,
        "--first-kq",
        "1",
        "--first-kp",
        "0",
        "--first-mode",
        "beta",
        "--root",
        root,
        "--force",
    )
    run("encode", "-d", "mini", "--model", d, "--side", "passage", "--k", "1", "--root", root)
    run(
        "score",
        "-d",
        "mini",
        "--system",
        system,
        "--kq",
        "1",
        "--kp",
        "1",
        "--mode",
        "multi_dense",
        "--q1p1-multi",
        "keep",
        "--root",
        root,
    )
    _late_matches_full(mini, system, 3)
    _late_matches_full(mini, system, 5)


def test_the_batch_readout_gives_splade_tiny_the_per_text_vectors_byte_for_byte() -> None:
    """SIDR's head over a batch at once (padding left out) gives the vectors of the per-text head product
    it replaced, byte for byte, on 24 of the passages (batches of 8, both heads; benchmarks/encode.py --readout sidr
    times the two)."""
    if not (MINI / "corpus.jsonl").exists() or not (SPLADE / "model.safetensors").exists():
        pytest.skip("../shared fixtures or models are absent")
    import json

    import torch

    from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
    from diffret.retrieval.models.encoding import encode_rows
    from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
    from diffret.stages.readers import passage_text

    docs = [json.loads(line) for line in (MINI / "corpus.jsonl").read_text().splitlines() if line][:24]
    texts = [passage_text(d.get("title", ""), d["text"]) for d in docs]
    bb = load_backbone(BackboneConfig(model=str(SPLADE), device="cpu"))
    token_ids = bb.tokenizer(texts, add_special_tokens=False)["input_ids"]
    for head, act in (("official", "elu1p"), ("lm", "log1p_relu")):
        reader = make_reader(bb, ReadoutConfig(readout="sidr", sidr_head=head, sidr_act=act), 256)
        batched = encode_rows(reader, [d["_id"] for d in docs], token_ids, texts, side="passage", k=1, batch_size=8)
        reader.batch_weights = lambda hidden, att, side_bb=None, r=reader: torch.stack(  # the per-text product
            [r.weights(hidden[i][att[i].bool()], side_bb) for i in range(len(hidden))]
        )
        per_text = encode_rows(reader, [d["_id"] for d in docs], token_ids, texts, side="passage", k=1, batch_size=8)
        assert batched.equals(per_text), head
