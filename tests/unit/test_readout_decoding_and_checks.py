"""Readouts on tiny random models (BERT, ModernBERT, Qwen2, Llama): PromptReps decoding, clear errors, the content
filter, the head read a vocabulary block at a time, batched sparse readout; nothing is downloaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from readout_helpers import MLM_ARCHS, assert_same_encoding, ids_of, no_quote_head
from tiny_models import ARCHS, CAUSAL_ARCHS, TEXTS, tiny_backbone, tiny_model, word_chat_tokenizer

from diffret.retrieval.models.backbones import (
    Backbone,
    BackboneConfig,
    BackboneError,
    detect_family,
)
from diffret.retrieval.models.readouts import Readout, ReadoutConfig, make_reader
from diffret.retrieval.models.sparse import (
    ContentFilter,
    content_words,
    per_position_sparse,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def backbones(tmp_path_factory) -> dict[str, tuple[Backbone, object]]:
    folder = tmp_path_factory.mktemp("tok")
    return {arch: tiny_backbone(arch, folder / arch) for arch in ARCHS}


# ---------------------------------------------------------------------------------------------- 7. PromptReps
def forced_head(reader: Readout, token: int, at_step: int, rows: list[int] | None = None):
    """A head that predicts ``token`` at decoding step ``at_step`` (for ``rows``) and never a quote otherwise."""
    base = no_quote_head(reader)
    calls = {"n": 0}

    def head(h: torch.Tensor) -> torch.Tensor:
        out = base(h)
        if calls["n"] == at_step:
            sel = list(range(out.shape[0])) if rows is None else rows
            out[sel, token] = 1e4
        calls["n"] += 1
        return out

    return head


def quote_token(arch: str, tok, stop: str = "quote_in_token") -> int:
    """The token that ends the words: the single-token quote (reference), or for the quote_in_token rule any token
    with a quote (Qwen2: the space-quote BPE token)."""
    if stop == "reference":
        (q,) = tok('"', add_special_tokens=False)["input_ids"]
        return q
    return tok.convert_tokens_to_ids('Ġ"' if arch == "qwen2" else '"')


# (stop rule, decoding step of the quote, representatives kept): the reference keeps the slot that predicts the
# quote; quote_in_token drops it (unless it is the first)
# fmt: off
STOPS = [("quote_in_token", 0, 1), ("quote_in_token", 1, 1), ("quote_in_token", 2, 2), ("quote_in_token", 4, 4),
         ("reference", 0, 1), ("reference", 1, 2), ("reference", 4, 5)]
# fmt: on


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
@pytest.mark.parametrize("stop,at_step,expected", STOPS)
def test_promptreps_stops_at_the_quote(backbones, arch, stop, at_step, expected, monkeypatch):
    bb, tok = backbones[arch]
    reader = make_reader(bb, ReadoutConfig(readout="promptreps", promptreps_stop=stop))
    q = quote_token(arch, tok, stop)
    assert q in reader.stop_tokens()
    monkeypatch.setattr(bb, "head", forced_head(reader, q, at_step))
    e = reader.encode([ids_of(tok, TEXTS["query"])], [TEXTS["query"]], "query", 6)[0]
    assert e.stopped is True
    assert e.dense.shape == (expected, bb.hidden_size)
    assert (np.diff(e.sparse_weights) <= 0).all()


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
@pytest.mark.parametrize("k", [1, 3])
def test_promptreps_runs_to_the_cap_without_a_quote(backbones, arch, k, monkeypatch):
    bb, tok = backbones[arch]
    reader = make_reader(bb, ReadoutConfig(readout="promptreps"))
    monkeypatch.setattr(bb, "head", no_quote_head(reader))
    texts = [TEXTS["short"], TEXTS["long"]]
    out = reader.encode([ids_of(tok, t) for t in texts], texts, "query", k)
    p = reader.pieces("query", k)
    for e, text in zip(out, texts, strict=True):
        assert e.stopped is False and e.dense.shape == (k, bb.hidden_size) and e.dense.dtype == np.float16
        assert e.n_tokens == len(p.prefix) + len(ids_of(tok, text)) + len(p.suffix)
        assert set(e.sparse_ids.tolist()) <= set(ContentFilter(tok).allowed_ids(text))


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
@pytest.mark.parametrize("stop", ["reference", "quote_in_token"])
def test_promptreps_quote_through_the_lm_head(tmp_path, arch, stop):
    """A model whose LM head always prefers the quote: one representative, stopped."""
    bb, tok = tiny_backbone(arch, tmp_path)
    reader = make_reader(bb, ReadoutConfig(readout="promptreps", promptreps_stop=stop))
    lm = bb.model.lm_head
    biased = torch.nn.Linear(lm.in_features, lm.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(lm.weight)
        biased.bias.zero_()
        biased.bias[quote_token(arch, tok, stop)] = 100.0
    bb.model.lm_head = biased
    bb.head = biased
    out = reader.encode([ids_of(tok, t) for t in TEXTS.values()], list(TEXTS.values()), "query", 5)
    for e in out:
        assert e.stopped is True and e.dense.shape == (1, bb.hidden_size)


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
@pytest.mark.parametrize("stop,kept", [("reference", 3), ("quote_in_token", 2)])
def test_promptreps_batch_rows_stop_independently(backbones, arch, stop, kept, monkeypatch):
    bb, tok = backbones[arch]
    k = 4
    reader = make_reader(bb, ReadoutConfig(readout="promptreps", promptreps_stop=stop))
    texts = [TEXTS["long"], TEXTS["short"]]
    token_ids = [ids_of(tok, t) for t in texts]
    monkeypatch.setattr(bb, "head", forced_head(reader, quote_token(arch, tok, stop), at_step=2, rows=[0]))
    batch = reader.encode(token_ids, texts, "query", k)
    assert (batch[0].stopped, batch[0].dense.shape[0]) == (True, kept)
    assert (batch[1].stopped, batch[1].dense.shape[0]) == (False, k)
    monkeypatch.setattr(bb, "head", no_quote_head(reader))
    alone = reader.encode(token_ids[1:], texts[1:], "query", k)[0]
    assert_same_encoding(alone, batch[1])  # left padding and a neighbour do not change the decoding
    long_alone = reader.encode(token_ids[:1], texts[:1], "query", k)[0]
    np.testing.assert_allclose(long_alone.dense[:kept].astype(np.float32), batch[0].dense.astype(np.float32), atol=1e-2)


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_promptreps_kv_cache_matches_full_forward(backbones, arch, monkeypatch):
    """Each representative is the last hidden state of prompt + the greedy tokens so far (no cache)."""
    bb, tok = backbones[arch]
    k = 3
    reader = make_reader(bb, ReadoutConfig(readout="promptreps"))
    monkeypatch.setattr(bb, "head", no_quote_head(reader))
    p = reader.pieces("query", k)
    row = list(p.prefix) + ids_of(tok, TEXTS["query"]) + list(p.suffix)
    e = reader.encode([row[len(p.prefix) : len(row) - len(p.suffix)]], [TEXTS["query"]], "query", k)[0]
    with torch.inference_mode():
        for step in range(k):
            ids = torch.tensor([row])
            h = bb.hidden_states(ids, torch.ones_like(ids), bidirectional=False)[0, -1]
            np.testing.assert_allclose(e.dense[step].astype(np.float32), h.numpy(), atol=1e-2)
            row.append(int(bb.head(h).argmax()))


# ------------------------------------------------------------------------------------------------ 8. clear errors
def test_unknown_family_in_config():
    with pytest.raises(ValueError, match="family\n  Input should be 'auto', 'mlm', 'dream', 'llada' or 'causal'"):
        BackboneConfig(model="some/model", family="nope")
    assert BackboneConfig(model="some/model", family="causal").family == "causal"


def test_unknown_family_in_backbone(backbones):
    bb, tok = backbones["bert"]
    with pytest.raises(BackboneError, match="unknown backbone family 'nope'"):
        Backbone(bb.model, tok, "nope")


@pytest.mark.parametrize("arch", ARCHS)
def test_detect_family(backbones, arch, monkeypatch):
    bb, _ = backbones[arch]
    monkeypatch.setattr(bb.model.config, "architectures", [bb.model.__class__.__name__])
    assert detect_family(bb.model.config) == ("causal" if arch in CAUSAL_ARCHS else "mlm")


def test_masked_readout_without_mask_token():
    tok = word_chat_tokenizer(mask=False)
    assert tok.mask_token_id is None
    bb = Backbone(tiny_model("llama", tok), tok, "causal", name="tiny-llama-nomask")
    with pytest.raises(BackboneError, match="mask token"):
        make_reader(bb, ReadoutConfig())
    with pytest.raises(BackboneError, match="mask token"):
        make_reader(Backbone(bb.model, tok, "causal", mask_token="<|nope|>"), ReadoutConfig())
    # the readouts that need no mask work on it
    reader = make_reader(bb, ReadoutConfig(readout="promptreps"))
    assert reader.encode([ids_of(tok, "cats purr")], ["cats purr"], "query", 2)[0].dense.shape[0] >= 1
    assert make_reader(bb, ReadoutConfig(readout="repllama")).encode([ids_of(tok, "cats")], None, "query", 1)


@pytest.mark.parametrize("arch", MLM_ARCHS)
@pytest.mark.parametrize("readout", ["promptreps", "repllama"])
def test_causal_readouts_on_mlm_raise(backbones, arch, readout):
    bb, _ = backbones[arch]
    with pytest.raises(BackboneError, match=f"{readout} readout needs a causal LM"):
        make_reader(bb, ReadoutConfig(readout=readout))


def test_unknown_side_raises(backbones):
    bb, tok = backbones["bert"]
    with pytest.raises(ValueError, match="unknown side"):
        make_reader(bb, ReadoutConfig()).encode([ids_of(tok, "cats")], None, "document", 1)


# -------------------------------------------------------------------------------------------- 9. content filter
def test_content_words():
    assert content_words("The cats, and THE dogs! What do cats do?") == ["cats", "dogs"]
    assert content_words("... !!! the a an") == []
    assert content_words("tea, coffee and cocoa: which drink is best?") == ["tea", "coffee", "cocoa", "drink", "best"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["nltk", "regex"])
def test_content_filter_ids(backbones, arch, kind):
    _, tok = backbones[arch]
    filt = ContentFilter(tok, kind)
    allowed = set(filt.allowed_ids("The cats, and the dogs!"))
    for word in ("cats", "dogs"):
        assert set(ids_of(tok, word)) <= allowed  # each word tokenized alone (the reference's)
        if kind == "regex":
            assert set(ids_of(tok, " " + word)) <= allowed  # BPE: the space-prefixed form too
    checked = 0
    for word in ("the", "and", ",", "!"):
        for piece in (word, " " + word):
            ids = ids_of(tok, piece)
            if len(ids) == 1:  # a whole-word token (a BPE fragment like "d" may also belong to "dogs")
                assert ids[0] not in allowed, piece
                checked += 1
    assert checked >= 4
    assert not allowed & set(tok.all_special_ids)
    assert filt.allowed_ids("the and , !") == []


def test_tokenize_records_full_length_and_cuts_without_a_warning(capfd) -> None:
    from transformers.utils import logging as hf_logging

    from diffret.retrieval.models.encoding import tokenize_texts

    tok = word_chat_tokenizer()
    tok.model_max_length = 8
    long = " ".join(["cats"] * 20)
    before = hf_logging.get_verbosity()
    capfd.readouterr()
    t = tokenize_texts(tok, [long, "cats purr"], max_length=8)
    assert t.column("n_tokens").to_pylist() == [20, 2]
    assert t.column("truncated").to_pylist() == [True, False]
    assert [len(x) for x in t.column("token_ids").to_pylist()] == [8, 2]
    # transformers' "longer than the specified maximum" warning would mislead: the model never sees it
    assert "longer than the specified maximum" not in capfd.readouterr().err
    assert hf_logging.get_verbosity() == before  # the caller's verbosity is restored


@pytest.mark.parametrize("arch", ARCHS)
def test_the_head_read_a_block_at_a_time_is_the_full_head_bit_for_bit(backbones, arch, monkeypatch):
    from diffret.retrieval.models.backbones import backbone as bb_module  # the module whose read_head reads it

    bb, tok = backbones[arch]
    assert bb.projection() is not None  # BERT's transform + decoder, ModernBERT's, an lm_head
    monkeypatch.setattr(bb_module, "VOCAB_BLOCK_BYTES", 1)  # blocks of 32 ids: several
    assert type(bb).read_head.__globals__ is vars(bb_module)  # the patched global is the one read_head reads
    h = torch.randn(5, 3, bb.hidden_size, generator=torch.Generator().manual_seed(1))
    full = bb.logits(h).float()
    cols = torch.tensor([len(tok) - 1, 3, 70, 0, 3])  # unsorted, repeated, across blocks
    with torch.inference_mode():
        top, at = bb.read_head(h, cols)
        assert torch.equal(top, full.argmax(-1)) and torch.equal(at, full[..., cols])
        top1, at1 = bb.read_head(h[:1, :1], cols)  # one row: the matrix-vector path
    full1 = bb.logits(h[:1, :1]).float()
    assert torch.equal(top1, full1.argmax(-1)) and torch.equal(at1, full1[..., cols])


@pytest.mark.parametrize("arch", ARCHS)
def test_the_heads_entropy_and_max_probability_over_blocks_equal_the_full_softmaxs(backbones, arch, monkeypatch):
    from diffret.retrieval.models.backbones import backbone as bb_module  # the module whose read_head reads it

    bb, tok = backbones[arch]
    h = 4 * torch.randn(4, 2, bb.hidden_size, generator=torch.Generator().manual_seed(2))
    logp = torch.log_softmax(bb.logits(h).float().double(), -1)
    want_h, want_p = -(logp.exp() * logp).sum(-1), logp.max(-1).values.exp()
    cols = torch.tensor([5, 1])
    for block_bytes in (1, bb_module.VOCAB_BLOCK_BYTES):  # many blocks, one block
        monkeypatch.setattr(bb_module, "VOCAB_BLOCK_BYTES", block_bytes)
        with torch.inference_mode():
            top, at, entropy, maxprob = bb.read_head(h, cols, stats=True)
            plain = bb.read_head(h, cols)
        assert torch.equal(top, plain[0]) and torch.equal(at, plain[1])  # stats change nothing else
        assert torch.allclose(entropy.double(), want_h, atol=1e-4) and torch.allclose(
            maxprob.double(), want_p, atol=1e-5
        )
    monkeypatch.setattr(bb, "_projection", None)  # the full head's path (a GPU, a custom head)
    _, _, entropy, maxprob = bb.read_head(h, cols, stats=True)
    assert torch.allclose(entropy.double(), want_h, atol=1e-4) and torch.allclose(maxprob.double(), want_p, atol=1e-5)


@pytest.mark.parametrize("arch", ["bert", "qwen2"])
@pytest.mark.parametrize("steps", [1, 2])
def test_head_stats_are_the_softmax_at_each_mask_and_change_no_other_column(backbones, arch, steps):
    from diffret.retrieval.models.encoding import encode_rows

    bb, tok = backbones[arch]
    reader = make_reader(bb, ReadoutConfig(stop_cut=True, denoise_steps=steps))
    texts = [TEXTS["short"], TEXTS["query"], TEXTS["long"]]
    ids = [ids_of(tok, t) for t in texts]
    plain = encode_rows(reader, ["a", "b", "c"], ids, texts, side="query", k=4, batch_size=2)
    stats = encode_rows(reader, ["a", "b", "c"], ids, texts, side="query", k=4, batch_size=2, head_stats=True)
    assert "slot_entropy" not in plain.column_names  # off: the shard is as before
    assert stats.select(plain.column_names).equals(plain)
    ent, top = stats.column("slot_entropy").to_pylist(), stats.column("slot_maxprob").to_pylist()
    assert [len(e) for e in ent] == [4, 4, 4]  # every K slot, also those the stop cut drops
    if steps == 1:  # the head at the mask positions of the batch as the readout pads it
        b = reader._mask_batch(ids, "query", 4)
        with torch.inference_mode():
            hidden = bb.hidden_states(b.input_ids, b.attention_mask, bidirectional=True)
            logp = torch.log_softmax(bb.logits(hidden[torch.arange(3)[:, None], b.positions]).double(), -1)
        np.testing.assert_allclose(ent, -(logp.exp() * logp).sum(-1).numpy(), atol=1e-3)
        np.testing.assert_allclose(top, logp.max(-1).values.exp().numpy(), atol=1e-4)
    assert all(0 < p <= 1 for row in top for p in row) and all(e >= 0 for row in ent for e in row)


def test_read_head_ties_go_to_the_first_id_and_other_heads_take_the_full_head(backbones, monkeypatch):
    from diffret.retrieval.models.backbones import backbone as bb_module  # the module whose read_head reads it

    bb, tok = tiny_backbone("llama", __import__("pathlib").Path("/nonexistent"), seed=3)
    with torch.no_grad():  # ids 5 and 70 (another block) are the only non-zero rows, equal: argmax keeps 5
        w = bb.model.lm_head.weight
        w[70] = w[5]
        w[[i for i in range(len(w)) if i not in (5, 70)]] = 0
    monkeypatch.setattr(bb_module, "VOCAB_BLOCK_BYTES", 1)
    h = w[5].expand(2, 2, -1)  # logit of 5 (and 70) positive, every other one zero
    with torch.inference_mode():
        top, _ = bb.read_head(h, torch.tensor([1]))
    full = bb.logits(h)
    assert (top == 5).all() and torch.equal(top, full.argmax(-1))
    bb.head = lambda x: bb.model.lm_head(x) * 2  # a custom head: no projection, the full head is read
    bb._projection = False
    assert bb.projection() is None
    with torch.inference_mode():
        top, at = bb.read_head(h, torch.tensor([4, 2]))
    assert torch.equal(at, (full * 2)[..., [4, 2]])


@pytest.mark.parametrize("quantise", ["truncate", "round", "none"])
def test_batched_sparse_is_each_text_alone(quantise):
    from diffret.retrieval.models.sparse import per_position_sparse_batch

    g = torch.Generator().manual_seed(0)
    sizes, k = [0, 3, 200, 17], 4
    ids = torch.full((len(sizes), max(sizes)), -1)
    logits = torch.randn(len(sizes), k, max(sizes), generator=g) * 3
    for j, n in enumerate(sizes):
        ids[j, :n] = torch.randperm(1000, generator=g)[:n].sort().values
    slots = torch.tensor([4, 1, 3, 4])
    got = per_position_sparse_batch(ids, logits, slots, 128, quantise)
    for j, n in enumerate(sizes):
        want = per_position_sparse(ids[j, :n], logits[j, : slots[j], :n], 128, quantise)
        np.testing.assert_array_equal(got[j][0], want[0])
        np.testing.assert_array_equal(got[j][1], want[1])
