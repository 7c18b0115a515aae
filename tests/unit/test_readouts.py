"""Readouts on tiny random models (BERT, ModernBERT, Qwen2, Llama) with tokenizers built here; nothing is downloaded:
shapes, mask positions, padding invariance, the LM head at the masks, determinism, denoising steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from readout_helpers import SIDES, assert_same_encoding, encode, ids_of
from tiny_models import ARCHS, CAUSAL_ARCHS, TEXTS, tiny_backbone

from diffret.retrieval.models.backbones import (
    Backbone,
    bidirectional_mask,
)
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
from diffret.retrieval.models.sparse import (
    ContentFilter,
    per_position_sparse,
    pooled_weights,
    topk_sparse,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def backbones(tmp_path_factory) -> dict[str, tuple[Backbone, object]]:
    folder = tmp_path_factory.mktemp("tok")
    return {arch: tiny_backbone(arch, folder / arch) for arch in ARCHS}


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
    """``sparse="pooled"``: the top k of the pooled vector, unrounded."""
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
