"""Readouts on tiny random models (BERT, ModernBERT, Qwen2, Llama) with tokenizers built here; nothing is downloaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import ARCHS, CAUSAL_ARCHS, TEXTS, tiny_backbone, tiny_model, word_chat_tokenizer

from diffret.retrieval.models.backbones import (
    Backbone,
    BackboneConfig,
    BackboneError,
    bidirectional_mask,
    detect_family,
)
from diffret.retrieval.models.readouts import Encoded, Readout, ReadoutConfig, make_reader
from diffret.retrieval.models.sparse import (
    ContentFilter,
    content_words,
    per_position_sparse,
    pooled_weights,
    topk_sparse,
)

MLM_ARCHS = tuple(a for a in ARCHS if a not in CAUSAL_ARCHS)
SIDES = ("left", "right")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def backbones(tmp_path_factory) -> dict[str, tuple[Backbone, object]]:
    folder = tmp_path_factory.mktemp("tok")
    return {arch: tiny_backbone(arch, folder / arch) for arch in ARCHS}


def ids_of(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def encode(bb: Backbone, texts: list[str], k: int = 4, side: str = "query", max_length: int = 256,
           **cfg) -> list[Encoded]:  # fmt: skip
    reader = make_reader(bb, ReadoutConfig(**cfg), max_length)
    return reader.encode([ids_of(bb.tokenizer, t) for t in texts], texts, side, k)


def sparse_dict(e: Encoded) -> dict[int, float]:
    return dict(zip(e.sparse_ids.tolist(), e.sparse_weights.tolist(), strict=True))


def assert_same_encoding(a: Encoded, b: Encoded, atol: float = 1e-2, rtol: float = 1e-3) -> None:
    assert a.dense.shape == b.dense.shape
    np.testing.assert_allclose(a.dense.astype(np.float32), b.dense.astype(np.float32), atol=atol)
    if a.sparse_ids is None:
        assert b.sparse_ids is None
        return
    da, db = sparse_dict(a), sparse_dict(b)
    for i in set(da) | set(db):  # a weight at the zero threshold may be kept on one side only
        np.testing.assert_allclose(da.get(i, 0.0), db.get(i, 0.0), rtol=rtol, atol=1e-5, err_msg=f"vocab id {i}")
    strong = [i for i, w in da.items() if w > 1e-3]
    assert set(strong) <= set(db)


def no_quote_head(reader: Readout):
    """A head that never predicts a quote token (so PromptReps runs to its cap)."""
    head = reader.bb.head
    quote = sorted(reader.stop_tokens())

    def patched(h: torch.Tensor) -> torch.Tensor:
        out = head(h).clone()
        out[..., quote] = -1e4
        return out

    return patched


# ------------------------------------------------------------------------------------------------------ 1. shapes
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 4])
def test_mask_readout_shapes(backbones, arch, k):
    bb, tok = backbones[arch]
    texts = [TEXTS["short"], TEXTS["query"], TEXTS["long"]]
    reader = make_reader(bb, ReadoutConfig(sparse_topk=5, stop_cut=False))
    out = reader.encode([ids_of(tok, t) for t in texts], texts, "query", k)
    p = reader.pieces("query", k)
    filt = ContentFilter(tok)
    assert len(out) == len(texts)
    for e, text in zip(out, texts, strict=True):
        assert e.dense.shape == (k, bb.hidden_size) and e.dense.dtype == np.float16
        assert np.isfinite(e.dense).all()
        assert e.sparse_ids.dtype == np.int32 and e.sparse_weights.dtype == np.float32
        # the top 5 of every slot, pooled: at most 5 K terms
        assert e.sparse_ids.shape == e.sparse_weights.shape and len(e.sparse_ids) <= 5 * k
        assert (np.diff(e.sparse_weights) <= 0).all() and (e.sparse_weights > 0).all()
        assert np.allclose(e.sparse_weights * 100, np.round(e.sparse_weights * 100), atol=1e-3)  # multiples of 0.01
        assert set(e.sparse_ids.tolist()) <= set(filt.allowed_ids(text))
        assert len(set(e.sparse_ids.tolist())) == len(e.sparse_ids)
        assert e.n_tokens == len(p.prefix) + len(ids_of(tok, text)) + len(p.suffix) + k + len(p.closing)
        assert e.stopped is False and e.tokens.shape == (k,) and e.tokens.dtype == np.int32
    assert len(out[-1].sparse_ids) >= 5  # the long text has many content words; random logits favour some


@pytest.mark.parametrize("arch", ["bert", "qwen2"])
def test_sparse_topk_keeps_the_heaviest(backbones, arch):
    """``sparse="pooled"`` (diffret 0.1): the top k of the pooled vector, unrounded."""
    bb, _ = backbones[arch]
    cfg = dict(k=4, sparse="pooled", stop_cut=False)
    full = encode(bb, [TEXTS["long"]], sparse_topk=1000, **cfg)[0]
    top3 = encode(bb, [TEXTS["long"]], sparse_topk=3, **cfg)[0]
    assert len(full.sparse_ids) > 3
    np.testing.assert_array_equal(top3.sparse_ids, full.sparse_ids[:3])
    np.testing.assert_allclose(top3.sparse_weights, full.sparse_weights[:3])
    unfiltered = encode(bb, [TEXTS["short"]], k=2, sparse_topk=7, content_filter="none", sparse="pooled")[0]
    assert len(unfiltered.sparse_ids) == 7  # the whole vocabulary competes: random logits are positive somewhere


def test_per_position_sparse_by_hand():
    """The reference's sparse vector: per slot log(1 + ReLU), top-k, x100 truncated; max over slots."""
    ids = torch.tensor([3, 5, 8])
    logits = torch.tensor([[0.5, 2.0, -1.0], [1.5, 0.1, 0.7]])  # [K = 2, 3 candidates]
    got_ids, got_w = per_position_sparse(ids, logits, topk=1)
    # slot 0 keeps 5 (log 3 = 1.0986 -> 1.09); slot 1 keeps 3 (log 2.5 = 0.9163 -> 0.91)
    assert got_ids.tolist() == [5, 3] and np.allclose(got_w, [1.09, 0.91])
    got_ids, got_w = per_position_sparse(ids, logits, topk=2)
    # slot 0 adds 3 (log 1.5 = 0.405 -> 0.40), max with slot 1's 0.91; slot 1 adds 8 (log 1.7 = 0.530 -> 0.53)
    assert {i: round(float(w), 4) for i, w in zip(got_ids, got_w, strict=True)} == {5: 1.09, 3: 0.91, 8: 0.53}
    got_ids, got_w = per_position_sparse(ids, logits, topk=2, quantise="none")
    assert np.allclose(sorted(got_w), sorted(np.log1p([2.0, 1.5, 0.7])), atol=1e-2)  # bf16 storage
    assert per_position_sparse(torch.tensor([], dtype=torch.long), logits[:, :0])[0].size == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_diffembed_and_repllama_shapes(backbones, arch):
    bb, _ = backbones[arch]
    texts = [TEXTS["short"], TEXTS["long"]]
    readouts = ["diffembed"] + (["repllama"] if arch in CAUSAL_ARCHS else [])
    for readout in readouts:
        out = encode(bb, texts, k=1, readout=readout)
        for e in out:
            assert e.dense.shape == (1, bb.hidden_size) and e.dense.dtype == np.float16
            assert np.isfinite(e.dense).all() and e.sparse_ids is None and e.n_tokens > 0
        with pytest.raises(ValueError, match="K = 1"):
            encode(bb, texts, k=2, readout=readout)


@pytest.mark.parametrize("readout", ["diffretriever", "promptreps", "diffembed", "repllama"])
@pytest.mark.parametrize("k", [0, -1])
def test_non_positive_k_raises(backbones, readout, k):
    bb, _ = backbones["llama"]
    with pytest.raises(ValueError, match="positive"):
        encode(bb, [TEXTS["short"]], k=k, readout=readout)


def test_empty_batch(backbones):
    bb, _ = backbones["bert"]
    assert make_reader(bb, ReadoutConfig()).encode([], [], "query", 4) == []


@pytest.mark.parametrize("readout", ["diffretriever", "diffembed"])
def test_long_text_is_cut_to_the_model_positions(backbones, readout):
    bb, tok = backbones["bert"]
    limit = bb.model.config.max_position_embeddings
    text = " ".join([TEXTS["long"]] * 30)
    assert len(ids_of(tok, text)) > limit
    k = 4 if readout == "diffretriever" else 1
    e = encode(bb, [text, TEXTS["short"]], k=k, readout=readout, max_length=4096)[0]
    assert e.n_tokens == limit and e.dense.shape == (k, bb.hidden_size) and np.isfinite(e.dense).all()


# -------------------------------------------------------------------------------------------- 2. mask positions
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("padding_side", SIDES)
@pytest.mark.parametrize("side", ["query", "passage"])
def test_mask_positions(backbones, arch, padding_side, side):
    bb, tok = backbones[arch]
    k = 4
    reader = make_reader(bb, ReadoutConfig(padding_side=padding_side))
    texts = [TEXTS["long"], TEXTS["short"], TEXTS["query"]]
    token_ids = [ids_of(tok, t) for t in texts]
    b = reader._mask_batch(token_ids, side, k)
    p = reader.pieces(side, k)
    width = b.input_ids.shape[1]
    assert b.positions.shape == (len(texts), k)
    for i, t in enumerate(token_ids):
        row = list(p.prefix) + t + list(p.suffix) + [bb.mask_id] * k + list(p.closing)
        assert b.lengths[i] == len(row)
        start = width - len(row) if padding_side == "left" else 0
        assert b.input_ids[i, start : start + len(row)].tolist() == row
        assert b.attention_mask[i].tolist() == [int(start <= j < start + len(row)) for j in range(width)]
        pos = b.positions[i].tolist()
        assert pos == list(range(pos[0], pos[0] + k))
        assert b.input_ids[i, pos].tolist() == [bb.mask_id] * k
        assert int((b.input_ids[i] == bb.mask_id).sum()) == k  # nowhere else
        after = b.input_ids[i, pos[-1] + 1 : pos[-1] + 1 + len(p.closing)].tolist()
        assert after == list(p.closing)
        before = b.input_ids[i, pos[0] - len(p.suffix) : pos[0]].tolist()
        assert before == list(p.suffix)
        if padding_side == "left":
            assert pos[-1] + len(p.closing) == width - 1  # the closing ends the row
    # the pieces look as intended: the suffix ends with the opening quote, the closing starts with the closing one
    assert tok.decode([p.suffix[-1]]).strip() == '"' and tok.decode([p.closing[0]]).strip() == '"'
    if arch in CAUSAL_ARCHS:
        assert p.closing[1] == tok.convert_tokens_to_ids("<|im_end|>")
        assert p.closing[-1] == tok.eos_token_id
    else:
        assert p.prefix[0] == tok.cls_token_id and p.closing[-1] == tok.sep_token_id


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_pieces_have_no_unknown_tokens(backbones, arch):
    bb, tok = backbones[arch]
    reader = make_reader(bb, ReadoutConfig())
    for side in ("query", "passage"):
        for k in (1, 4):
            p = reader.pieces(side, k)
            for piece in (p.prefix, p.suffix, p.closing):
                assert tok.unk_token_id is None or tok.unk_token_id not in piece
    for text in TEXTS.values():
        assert tok.unk_token_id is None or tok.unk_token_id not in ids_of(tok, text)


# ------------------------------------------------------------------------------------------ 3. padding invariance
@pytest.fixture(scope="module")
def sharp_backbones(tmp_path_factory) -> dict[str, tuple[Backbone, object]]:
    """The tiny backbones with their LM head's output scaled 30x. A random head is near uniform: its slots'
    confidences tie to 1e-6, so with S > 1 the unmasking order (and so the vectors) would be decided by the last
    bits of a padded or unpadded sum, not by the readout."""
    folder = tmp_path_factory.mktemp("sharp")
    out = {}
    for arch in ARCHS:
        bb, tok = tiny_backbone(arch, folder / arch)
        last = max((m for m in bb.model.modules() if isinstance(m, torch.nn.Linear)), key=lambda m: m.out_features)
        with torch.no_grad():
            last.weight.mul_(30)
            if last.bias is not None:
                last.bias.mul_(30)
        out[arch] = (bb, tok)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("padding_side", SIDES)
@pytest.mark.parametrize("steps", [1, 2])
def test_mask_readout_padding_invariance(backbones, sharp_backbones, arch, padding_side, steps):
    bb, _ = (backbones if steps == 1 else sharp_backbones)[arch]
    cfg = dict(padding_side=padding_side, denoise_steps=steps)
    alone = encode(bb, [TEXTS["short"]], **cfg)[0]
    first = encode(bb, [TEXTS["short"], TEXTS["long"]], **cfg)
    last = encode(bb, [TEXTS["long"], TEXTS["short"]], **cfg)
    assert_same_encoding(alone, first[0])
    assert_same_encoding(alone, last[1])
    assert_same_encoding(first[1], last[0])
    assert_same_encoding(first[1], encode(bb, [TEXTS["long"]], **cfg)[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_left_and_right_padding_agree(backbones, arch):
    bb, _ = backbones[arch]
    texts = [TEXTS["short"], TEXTS["long"], TEXTS["query"]]
    for readout in ["diffretriever", "diffembed"] + (["repllama"] if arch in CAUSAL_ARCHS else []):
        k = 4 if readout == "diffretriever" else 1
        left = encode(bb, texts, k=k, readout=readout, padding_side="left")
        right = encode(bb, texts, k=k, readout=readout, padding_side="right")
        for a, b in zip(left, right, strict=True):
            assert_same_encoding(a, b)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("padding_side", SIDES)
def test_single_vector_readouts_padding_invariance(backbones, arch, padding_side):
    bb, _ = backbones[arch]
    for readout in ["diffembed"] + (["repllama"] if arch in CAUSAL_ARCHS else []):
        cfg = dict(k=1, readout=readout, padding_side=padding_side)
        alone = encode(bb, [TEXTS["short"]], **cfg)[0]
        batch = encode(bb, [TEXTS["long"], TEXTS["short"]], **cfg)
        assert_same_encoding(alone, batch[1])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bidirectional", [True, False])
def test_hidden_states_left_padding_matches_right(backbones, arch, bidirectional):
    """Backbone.hidden_states: the real tokens' states do not depend on the padding side (an all-pad row too)."""
    bb, tok = backbones[arch]
    rows = [ids_of(tok, TEXTS["long"]), ids_of(tok, TEXTS["short"]), []]
    width = max(len(r) for r in rows)
    states = {}
    with torch.inference_mode():
        for side in SIDES:
            ids = torch.full((len(rows), width), bb.pad_id)
            att = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
                ids[i, cols], att[i, cols] = torch.tensor(r, dtype=torch.long), 1
            hidden = bb.hidden_states(ids, att, bidirectional=bidirectional)
            assert hidden.shape == (len(rows), width, bb.hidden_size)
            states[side] = [hidden[i, att[i].bool()] for i in range(len(rows))]
    for left, right in zip(states["left"], states["right"], strict=True):
        torch.testing.assert_close(left, right, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- 4. LM head at the mask positions
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("padding_side", SIDES)
def test_head_at_positions_equals_full_model(backbones, arch, padding_side):
    bb, tok = backbones[arch]
    reader = make_reader(bb, ReadoutConfig(padding_side=padding_side, stop_cut=False))
    texts = [TEXTS["short"], TEXTS["long"]]
    b = reader._mask_batch([ids_of(tok, t) for t in texts], "query", 4)
    rows = torch.arange(len(texts))[:, None]
    causal = arch in CAUSAL_ARCHS
    pos_ids = (b.attention_mask.cumsum(-1) - 1).clamp(min=0)  # real tokens numbered from 0, whatever the padding
    with torch.inference_mode():
        # under the model's own attention (causal for Qwen2 / Llama)
        hidden = bb.hidden_states(b.input_ids, b.attention_mask, bidirectional=not causal)
        assert hidden.shape == (*b.input_ids.shape, bb.hidden_size)
        selected = bb.logits(hidden[rows, b.positions])
        full = bb.model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos_ids).logits
        assert selected.shape == (len(texts), 4, len(tok))
        torch.testing.assert_close(selected, full[rows, b.positions], atol=1e-5, rtol=1e-5)
        if causal:  # and read bidirectionally: the same 4D mask and positions through the whole model
            mask = bidirectional_mask(b.attention_mask, bb.dtype)
            full = bb.model(input_ids=b.input_ids, attention_mask=mask, position_ids=pos_ids).logits
            hidden = bb.hidden_states(b.input_ids, b.attention_mask, bidirectional=True)
            torch.testing.assert_close(bb.logits(hidden[rows, b.positions]), full[rows, b.positions])
    # the reader's sparse vectors are the full model's logits, filtered, cut per slot and pooled
    out = reader.encode([ids_of(tok, t) for t in texts], texts, "query", 4)
    filt = ContentFilter(tok)
    for i, e in enumerate(out):
        allowed = torch.tensor([a for a in filt.allowed_ids(texts[i]) if a != bb.mask_id])
        ids, w = per_position_sparse(allowed, full[i, b.positions[i]][:, allowed], 128)
        np.testing.assert_array_equal(e.sparse_ids, ids)
        np.testing.assert_allclose(e.sparse_weights, w, rtol=1e-5, atol=1e-6)


def test_pooled_weights_is_max_of_log1p_relu():
    logits = torch.tensor([[[-1.0, 0.5, 3.0], [2.0, -0.1, 1.0]]])
    expected = torch.log1p(torch.tensor([[2.0, 0.5, 3.0]]))
    torch.testing.assert_close(pooled_weights(logits), expected)
    ids, w = topk_sparse(torch.tensor([0.0, 0.2, 0.9, 0.5]), [0, 1, 3], 2)
    assert ids.tolist() == [3, 1] and np.allclose(w, [0.5, 0.2])
    ids, w = topk_sparse(torch.tensor([0.0, 0.2]), [], 2)
    assert ids.size == 0 and w.size == 0


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_causal_architecture_is_read_bidirectionally(backbones, arch):
    """The mask states see the closing tokens after them through the 4D mask, and only then."""
    bb, tok = backbones[arch]
    reader = make_reader(bb, ReadoutConfig())
    b = reader._mask_batch([ids_of(tok, TEXTS["query"])], "query", 4)
    changed = b.input_ids.clone()
    last = b.positions[0, -1]
    changed[0, last + 1] = tok.convert_tokens_to_ids("cats")  # a token after every mask
    with torch.inference_mode():
        for bidirectional in (True, False):
            h1 = bb.hidden_states(b.input_ids, b.attention_mask, bidirectional=bidirectional)[0, b.positions[0]]
            h2 = bb.hidden_states(changed, b.attention_mask, bidirectional=bidirectional)[0, b.positions[0]]
            assert (not torch.allclose(h1, h2, atol=1e-6)) == bidirectional


# ------------------------------------------------------------------------------------------------ 5. determinism
@pytest.mark.parametrize("arch", ARCHS)
def test_deterministic(backbones, arch):
    bb, _ = backbones[arch]
    texts = [TEXTS["short"], TEXTS["long"]]
    readouts = ["diffretriever", "diffembed"] + (["promptreps", "repllama"] if arch in CAUSAL_ARCHS else [])
    for readout in readouts:
        k = 1 if readout in ("diffembed", "repllama") else 4
        a, b = encode(bb, texts, k=k, readout=readout), encode(bb, texts, k=k, readout=readout)
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x.dense, y.dense)
            if x.sparse_ids is not None:
                np.testing.assert_array_equal(x.sparse_ids, y.sparse_ids)
                np.testing.assert_array_equal(x.sparse_weights, y.sparse_weights)
            assert (x.n_tokens, x.stopped) == (y.n_tokens, y.stopped)


# ------------------------------------------------------------------------------------------- 6. denoise steps S
@pytest.mark.parametrize("arch", ARCHS)
def test_denoise_steps(backbones, arch):
    bb, tok = backbones[arch]
    k = 4
    texts = [TEXTS["short"], TEXTS["query"]]
    plain = encode(bb, texts, k=k, stop_cut=False)
    for steps in (2, k):
        out = encode(bb, texts, k=k, denoise_steps=steps, stop_cut=False)
        for e, p in zip(out, plain, strict=True):
            assert e.dense.shape == p.dense.shape and e.dense.dtype == np.float16
            assert e.sparse_ids.dtype == np.int32 and (np.diff(e.sparse_weights) <= 0).all()
            assert e.n_tokens == p.n_tokens
    # S = 1 through the denoising loop is the plain readout
    reader = make_reader(bb, ReadoutConfig(denoise_steps=1, stop_cut=False))
    b = reader._mask_batch([ids_of(tok, t) for t in texts], "query", k)
    with torch.inference_mode():
        h, logits, _ = reader._denoise(b, k, 1)
    for i, p in enumerate(plain):
        np.testing.assert_array_equal(h[i].numpy().astype(np.float16), p.dense)
    # at S = 2 the first pass is the plain one: the reference's schedule reveals max(1, int(4 (1 - t1 / t0)))
    # masks first (t = linspace(1, 1e-3, 3)), the most confident by negative entropy; they keep their plain states
    with torch.inference_mode():
        h2, _, _ = reader._denoise(b, k, 2)
    t = torch.linspace(1, 1e-3, 3)
    take = max(1, int(k * (1 - float(t[1] / t[0]))))
    probs = logits.softmax(-1)
    conf = (probs * torch.log(probs + 1e-10)).sum(-1)
    for i, p in enumerate(plain):
        first = torch.topk(conf[i], take).indices
        np.testing.assert_array_equal(h2[i, first].numpy().astype(np.float16), p.dense[first.numpy()])
        later = sorted(set(range(k)) - set(first.tolist()))
        assert not np.array_equal(h2[i, later].numpy().astype(np.float16), p.dense[later])


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
    """The token that ends the words: the single-token quote (reference), or for diffret 0.1's rule any token with
    a quote (Qwen2: the space-quote BPE token)."""
    if stop == "reference":
        (q,) = tok('"', add_special_tokens=False)["input_ids"]
        return q
    return tok.convert_tokens_to_ids('Ġ"' if arch == "qwen2" else '"')


# (stop rule, decoding step of the quote, representatives kept): the reference keeps the slot that predicts the
# quote; diffret 0.1 drops it (unless it is the first)
STOPS = [("quote_in_token", 0, 1), ("quote_in_token", 1, 1), ("quote_in_token", 2, 2), ("quote_in_token", 4, 4),
         ("reference", 0, 1), ("reference", 1, 2), ("reference", 4, 5)]  # fmt: skip


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
        assert torch.allclose(entropy.double(), want_h, atol=1e-4) and torch.allclose(maxprob.double(), want_p,
                                                                                      atol=1e-5)  # fmt: skip
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
    plain = encode_rows(reader, ["a", "b", "c"], ids, texts, "query", 4, 2)
    stats = encode_rows(reader, ["a", "b", "c"], ids, texts, "query", 4, 2, head_stats=True)
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
