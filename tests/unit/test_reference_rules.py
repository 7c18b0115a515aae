"""Each row of the parity table (docs/ARCHITECTURE.md): the reference code's (ielab/diffretriever @ 1689527)
behaviour is the default, the other behaviour a named option. One test per row: the default reproduces the
reference on a hand-built case where the option gives another number, and the option gives that number.

1-5: scoring, fusion and evaluation (scripts/evaluate_sweep.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffret.retrieval.evaluation import evaluate, run_from_table
from diffret.retrieval.search import Encodings, ScoreRules, SearchSettings, TopK, all_modes, run_table, search_pass
from diffret.retrieval.search.encodings import encodings_from_table
from diffret.retrieval.search.modes import fuse_minmax
from diffret.stages.evaluate import EvaluateConfig
from diffret.stages.runs import RetrievalConfig, cell_config
from diffret.stages.score import ScoreConfig


def enc(
    ids: list[str],
    slots: list[list[list[float]]],
    sparse: list[dict[int, float]] | None = None,
    rules: ScoreRules | None = None,
    factor: float = 1.0,
) -> Encodings:
    """Encodings of texts given as their slot vectors (and sparse {term: weight}), through the encodings table."""
    from diffret.retrieval.models.encoding import encoded_table
    from diffret.retrieval.models.readouts import Encoded

    sparse = sparse or [{} for _ in ids]
    encs = [
        Encoded(np.asarray(v, np.float16), np.array(list(s), np.int32), np.array(list(s.values()), np.float32))
        for v, s in zip(slots, sparse, strict=True)
    ]
    return encodings_from_table(encoded_table(ids, encs, len(slots[0][0])), rules=rules, sparse_factor=factor)


def top(q: Encodings, p: Encodings, mode: str, rules: ScoreRules, k: int = 10) -> dict[str, float]:
    tops, ids = search_pass({1: q}, [p], [mode], SearchSettings(topk=k, rules=rules))
    t = tops[(1, mode)]
    return {ids[i]: float(s) for i, s in zip(t.index[0], t.scores[0], strict=True) if i >= 0}


# ------------------------------------------------------------------------------------- 1. MaxSim
def test_1_maxsim_clamps_each_query_slot_at_zero_and_sums() -> None:
    """evaluate_sweep.py L327-337: S = sum_a max(0, max_b q_a . d_b). A query slot that every passage slot
    opposes adds 0, not its negative best; the query's slots are summed, not averaged."""
    q = enc(["q"], [[[1.0, 0.0], [0.0, 1.0]]])
    p = enc(
        ["m", "n"],
        [
            [[0.99, -0.141]],  # m: slot 1 best .99, slot 2 best -.141
            [[1.0, 0.0], [0.0, -1.0]],
        ],
    )  # n: slot 1 best 1, slot 2 best 0
    default = top(q, p, "multi_dense", ScoreRules())
    assert default == pytest.approx({"n": 1.0, "m": 0.99}, abs=1e-3)  # m: .99 + max(0, -.141)
    old = top(q, p, "multi_dense", ScoreRules(maxsim_clamp=False, maxsim_reduce="mean"))
    assert old == pytest.approx({"m": 0.4245, "n": 0.5}, abs=1e-3)  # (.99 - .141) / 2 < (1 + 0) / 2
    # the clamp changes the ranking: y's second query slot is opposed (-0.3), x's is orthogonal (0)
    q3 = enc(["q"], [[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    p3 = enc(["x", "y"], [[[0.8, 0.0, 0.6]], [[0.9, -0.3, 0.3162]]])
    assert list(top(q3, p3, "multi_dense", ScoreRules())) == ["y", "x"]  # .9 + 0 > .8 + 0
    assert list(top(q3, p3, "multi_dense", ScoreRules(maxsim_clamp=False))) == ["x", "y"]  # .8 > .9 - .3


# ------------------------------------------------------------------------------------- 2. single_dense
def test_2_single_dense_is_the_mean_of_normalised_slots_not_renormalised() -> None:
    """evaluate_sweep.py L670-672, L828-841: q_bar . d_bar, each the mean of the unit slots; a passage whose
    slots disagree has a shorter mean and scores lower than its direction alone would say."""
    q = enc(["q"], [[[1.0, 0.0]]])
    p = enc(["agree", "split"], [[[0.8, 0.6], [0.8, 0.6]], [[1.0, 1.0], [1.0, -1.0]]])
    default = top(q, p, "single_dense", ScoreRules())
    assert default == pytest.approx({"agree": 0.8, "split": 0.7071}, abs=1e-3) and list(default)[0] == "agree"
    renorm = ScoreRules(single_renorm=True)  # applied where the vectors are prepared (encodings_from_table)
    q, p = (
        enc(e.ids, [[v.tolist() for v in e.multi[i][e.mask[i]]] for i in range(len(e))], rules=renorm) for e in (q, p)
    )
    old = top(q, p, "single_dense", renorm)
    assert old == pytest.approx({"split": 1.0, "agree": 0.8}, abs=1e-3)  # the mean of split renormalised: (1, 0)
    assert list(old) == ["split", "agree"]


# ------------------------------------------------------------------------------------- 3. fusion
def test_3_fusion_counts_zero_score_sparse_documents_and_flat_runs_give_zero() -> None:
    """evaluate_sweep.py L449-471 and L431-441: the sparse run holds zero-score documents up to its depth, so
    its minimum is 0; (s - min) / max(max - min, 1e-9), so a run whose scores are all equal contributes 0."""
    dense = [[[1.0, 0.0]], [[0.8, 0.6]], [[0.6, 0.8]]]
    q = enc(["q"], [[[1.0, 0.0]]], [{7: 2.0}])
    p = enc(["a", "b", "c"], dense, [{7: 1.0}, {7: 2.0}, {}])  # c shares no term
    rules = ScoreRules()
    sparse = top(q, p, "sparse_max", rules)
    assert sparse == {"b": 4.0, "a": 2.0, "c": 0.0}  # c is in the run, at 0
    assert top(q, p, "sparse_max", ScoreRules(sparse_floor="positive")) == {"b": 4.0, "a": 2.0}

    def fused(r: ScoreRules) -> dict[str, float]:
        tops, ids = search_pass({1: q}, [p], ["single_dense", "sparse_max"], SearchSettings(topk=10, rules=r))
        t = all_modes(tops, 10, r)[(1, "fusion_single_sparse_max")]
        return {ids[i]: float(s) for i, s in zip(t.index[0], t.scores[0], strict=True) if i >= 0}

    # dense: a 1, b .8, c .6 -> 1, .5, 0; sparse: b 4, a 2, c 0 -> (min 0) b 1, a .5, c 0
    assert fused(rules) == pytest.approx({"a": 0.75, "b": 0.75, "c": 0.0}, abs=1e-3)
    # positive: sparse min over b, a (2) -> b 1, a 0; c missing
    assert fused(ScoreRules(sparse_floor="positive")) == pytest.approx({"b": 0.75, "a": 0.5, "c": 0.0}, abs=1e-3)
    flat = TopK(np.array([[3.0, 3.0]], np.float32), np.array([[0, 1]]))
    other = TopK(np.array([[2.0, 1.0]], np.float32), np.array([[1, 0]]))
    f = fuse_minmax(flat, other)
    assert dict(zip(f.index[0].tolist(), f.scores[0].tolist(), strict=True)) == {1: 0.5, 0: 0.0}
    g = fuse_minmax(flat, other, flat="one")
    assert dict(zip(g.index[0].tolist(), g.scores[0].tolist(), strict=True)) == {1: 1.0, 0: 0.5}


# ------------------------------------------------------------------------------------- 4. self hits
def test_4_a_document_with_the_query_id_is_kept_by_default() -> None:
    """The reference evaluator has no identical-id removal (BEIR's evaluator does): kept on ArguAna too."""
    assert not RetrievalConfig(dataset="arguana").ignore_ids()  # kept on arguana / quora too
    assert RetrievalConfig(dataset="arguana", self_hits="drop").ignore_ids()
    q = enc(["x1"], [[[1.0, 0.0]]])
    p = enc(["x1", "x2"], [[[1.0, 0.0]], [[0.6, 0.8]]])
    assert list(top(q, p, "single_dense", ScoreRules())) == ["x1", "x2"]
    tops, ids = search_pass({1: q}, [p], ["single_dense"], SearchSettings(topk=5, ignore_identical_ids=True))
    assert [ids[i] for i in tops[(1, "single_dense")].index[0] if i >= 0] == ["x2"]
    cfg = cell_config(
        system="s",
        dataset="arguana",
        corpus="arguana",
        split="test",
        kq=1,
        kp=1,
        mode="single_dense",
        topk=10,
        fusion_depth=10,
        ignore=False,
        inputs={},
        rules=ScoreRules(),
    )
    assert cfg["ignore_identical_ids"] is False and cfg["rules"] == {"single_renorm": False, "score_dtype": "float32"}


# ------------------------------------------------------------------------------------- 5. sparse arithmetic
def test_5_sparse_scores_are_products_of_the_stored_x100_integers() -> None:
    """evaluate_sweep.py L385-429: the x100 integers on both sides, so a score is 10^4 x sum w_q w_d, exact in
    float32: two documents whose integer sums tie, tie (float weights in steps of 0.01 need not)."""
    w = {1: 0.29, 2: 0.07}  # stored as multiples of 0.01 (the mask readout's quantised weights)
    q = {1: 0.07, 2: 0.29}
    p_sparse = [{1: 0.29}, {2: 0.07}]  # 7 x 29 = 29 x 7 = 203: a tie
    factor = ScoreRules().sparse_factor(True)
    assert factor == 100.0
    qe = enc(["q"], [[[1.0, 0.0]]], [q], factor=factor)
    pe = enc(["a", "b"], [[[1.0, 0.0]], [[1.0, 0.0]]], p_sparse, factor=factor)
    got = top(qe, pe, "sparse_max", ScoreRules())
    assert got == {"a": 203.0, "b": 203.0}  # exact integers
    unit = top(
        enc(["q"], [[[1.0, 0.0]]], [q]),
        enc(["a", "b"], [[[1.0, 0.0]]] * 2, p_sparse),
        "sparse_max",
        ScoreRules(sparse_scale="unit"),
    )
    assert unit == pytest.approx({"a": 0.0203, "b": 0.0203}) and set(w) == {1, 2}
    # bfloat16 arithmetic (the released evaluator): the product is rounded to 8 significant bits
    big = enc(["q"], [[[1.0, 0.0]]], [{3: 2.45}], factor=factor, rules=ScoreRules(score_dtype="bfloat16"))
    doc = enc(["d"], [[[1.0, 0.0]]], [{3: 1.0978}], factor=factor, rules=ScoreRules(score_dtype="bfloat16"))
    assert top(big, doc, "sparse_max", ScoreRules(score_dtype="bfloat16")) == {"d": 27008.0}  # 26950 -> 211 x 128
    exact = top(
        enc(["q"], [[[1.0, 0.0]]], [{3: 2.45}], factor=factor),
        enc(["d"], [[[1.0, 0.0]]], [{3: 1.0978}], factor=factor),
        "sparse_max",
        ScoreRules(),
    )
    assert exact == {"d": 26950.0}


def test_5_score_config_records_each_mode_s_rules() -> None:
    r = ScoreConfig(dataset="d").rules
    assert r == ScoreRules() and r.for_mode("fusion_multi_sparse_max", ("multi_dense", "sparse_max")) == {
        "maxsim_clamp": True,
        "maxsim_reduce": "sum",
        "score_dtype": "float32",
        "sparse_scale": "x100",
        "sparse_floor": "zero",
        "fusion_flat": "zero",
    }


# ------------------------------------------------------------------------------------- evaluation ties
def test_15_q1_p1_has_no_multi_dense_cells_unless_kept() -> None:
    """evaluate_sweep.py L687-694: ``enable_colbert = K > 1 or K_p > 1``: at q1-p1 no multi_dense and no fusion of
    it; ``q1p1_multi="keep"`` scores them."""
    from diffret.retrieval.search.modes import MODE_NAMES, cell_modes

    assert ScoreConfig(dataset="x").q1p1_multi == "skip"
    assert cell_modes(MODE_NAMES, 1, 1) == ["single_dense", "sparse_max", "fusion_single_sparse_max"]
    assert cell_modes(MODE_NAMES, 1, 2) == cell_modes(MODE_NAMES, 1, 1, "keep") == list(MODE_NAMES)


def test_evaluation_orders_ties_within_the_cut_as_pytrec_eval_does() -> None:
    """The reference passes its top 10 (its order decides which) to pytrec_eval, which orders tied documents
    by doc_id descending: a relevant document tied with an irrelevant one ranks by id, not by the stored rank."""
    top_k = TopK(np.array([[2.0, 1.0, 1.0]], np.float32), np.array([[0, 1, 2]]))
    table = run_table(top_k, ["q"], ["d0", "a-rel", "z-irr"])  # stored ranks: d0, a-rel, z-irr (ties by doc id)
    qrels = {"q": {"a-rel": 1}}
    assert EvaluateConfig().ties == "trec"
    run = run_from_table(table.sort_by([("query_id", "ascending"), ("rank", "ascending")]), order="score")
    trec = {r["measure"]: r["value"] for r in evaluate(qrels, run, ["mrr_10"], ranked=True).to_pylist()}
    assert trec["mrr_10"] == pytest.approx(1 / 3)  # z-irr before a-rel (doc_id descending)
    rank = {r["measure"]: r["value"] for r in evaluate(qrels, run_from_table(table), ["mrr_10"]).to_pylist()}
    assert rank["mrr_10"] == pytest.approx(1 / 2)  # ties rank: the stored order


def test_evaluation_cuts_at_each_measure_s_depth_in_run_order() -> None:
    """Which tied documents make a measure's depth is the run's choice (the reference's top 10 of its hits)."""
    scores = np.array([[1.0] * 12], np.float32)
    table = run_table(TopK(scores, np.arange(12)[None]), ["q"], [f"d{i:02d}" for i in range(12)])
    run = run_from_table(table, order="score")  # rows in rank order: d00 .. d11
    got = evaluate({"q": {"d11": 1}}, run, ["ndcg_cut_10", "recall_100"], ranked=True).to_pylist()
    values = {r["measure"]: r["value"] for r in got}
    assert values["ndcg_cut_10"] == 0.0 and values["recall_100"] == 1.0  # d11 is 12th in the run
    plain = {r["measure"]: r["value"] for r in evaluate({"q": {"d11": 1}}, run, ["ndcg_cut_10"]).to_pylist()}
    assert plain["ndcg_cut_10"] == 1.0  # pytrec_eval over the whole run would put d11 first (id descending)


def test_bfloat16_rounds_where_the_released_evaluator_does() -> None:
    rules = ScoreRules(score_dtype="bfloat16")
    q = enc(["q"], [[[1.0, 0.001]]], rules=rules)
    p = enc(["a", "b"], [[[1.0, 0.0]], [[1.0, 0.0005]]], rules=rules)
    got = top(q, p, "single_dense", rules)
    assert set(got.values()) == {1.0}  # cosines 0.9999995 and 1.0 both round to 1.0 in bfloat16
    exact = top(
        enc(["q"], [[[1.0, 0.001]]]), enc(["a", "b"], [[[1.0, 0.0]], [[1.0, 0.0005]]]), "single_dense", ScoreRules()
    )
    assert list(exact) == ["b", "a"] and len(set(exact.values())) == 2


# ------------------------------------------------------------------------------------- 6-8. encoding
# scripts/encode.py reads a fine-tuned model another way (its trained_* path) than a zero-shot one.
@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from tiny_models import tiny_backbone

    return tiny_backbone("bert", tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    from tiny_models import tiny_backbone

    return tiny_backbone("llama", tmp_path_factory.mktemp("llama"))


def _special_at(bb, slot: int):
    """A head that reads a special token (a stop) at mask slot ``slot``."""
    base, stop = bb.head, min(bb.stop_ids)

    def head(h: torch.Tensor) -> torch.Tensor:
        out = base(h)  # [K, V] of one text, or [B, K, V] of several
        if out.dim() >= 2 and out.shape[-2] > slot:
            out[..., slot, stop] = 1e4
        return out

    return head


def test_6_a_fine_tuned_mask_readout_keeps_all_k_slots(bert, monkeypatch) -> None:
    """diffretriever_trainable.py L1219-1233 and encode.py L414-448: no stop cut on the trained path; the
    zero-shot encoders cut at the first special token read (diffretriever_dream.py L589-633)."""
    from diffret.retrieval.models.readouts import ReadoutConfig, make_reader

    bb, tok = bert
    ids = [tok("cats purr in the garden", add_special_tokens=False)["input_ids"]]
    monkeypatch.setattr(bb, "head", _special_at(bb, 2))
    zero_shot = make_reader(bb, ReadoutConfig()).encode(ids, ["cats purr in the garden"], "query", 4)[0]
    assert zero_shot.dense.shape[0] == 2 and zero_shot.stopped  # cut at slot 2
    tuned = make_reader(bb, ReadoutConfig(finetuned="yes")).encode(ids, ["cats purr in the garden"], "query", 4)[0]
    assert tuned.dense.shape[0] == 4 and not tuned.stopped  # all K
    cut = make_reader(bb, ReadoutConfig(finetuned="yes", stop_cut=True)).encode(ids, ["cats purr"], "query", 4)[0]
    assert cut.dense.shape[0] == 2  # the option: the fine-tuned model cut too


def test_7_fine_tuned_sparse_keeps_256_per_slot_and_rounds() -> None:
    """encode.py L445-446 (run_encode.sh --sparse_topk 256): top 256 per slot, x100 rounded; the zero-shot
    encoders keep 128 and truncate (diffretriever_dream.py L497)."""
    from diffret.retrieval.models.readouts import ReadoutConfig
    from diffret.retrieval.models.sparse import per_position_sparse

    tuned, zero = ReadoutConfig().resolved(finetuned=True), ReadoutConfig().resolved(finetuned=False)
    assert (tuned.sparse_topk, tuned.sparse_quantise) == (256, "round")
    assert (zero.sparse_topk, zero.sparse_quantise) == (128, "truncate")
    logits = torch.full((1, 300), 0.5)
    logits[0, :200] = torch.linspace(1.0, 2.0, 200)  # log(1 + x): 0.693 .. 1.099
    ids = torch.arange(300)
    r_ids, r_w = per_position_sparse(ids, logits, tuned.sparse_topk, tuned.sparse_quantise)
    t_ids, t_w = per_position_sparse(ids, logits, zero.sparse_topk, zero.sparse_quantise)
    assert len(r_ids) == 256 and len(t_ids) == 128
    assert r_w[0] == pytest.approx(1.10) and t_w[0] == pytest.approx(1.09)  # log 3 = 1.0986: rounded / truncated
    old = ReadoutConfig(finetuned="yes", sparse_topk=128, sparse_quantise="truncate").resolved()
    assert (old.sparse_topk, old.sparse_quantise) == (128, "truncate")  # the option: the zero-shot path's


def test_6_7_the_path_follows_the_model(tmp_path) -> None:
    """A folder `diffret train` saved (or a reference checkpoint) is encoded on the trained path; the resolved
    settings are the system's, so the two paths are two systems."""
    import json

    from tiny_models import save_tiny_mlm

    from diffret.retrieval.models.backbones import BackboneConfig
    from diffret.stages.systems import EncodeSettings, encoder_slug

    base = save_tiny_mlm(tmp_path / "base")
    tuned = save_tiny_mlm(tmp_path / "tuned")
    (tuned / "_manifest.json").write_text(json.dumps({"stage": "models", "config": {"readout": {}}}))
    ref = save_tiny_mlm(tmp_path / "ref")
    (ref / "retriever_config.json").write_text("{}")
    zs, ft, rc = (EncodeSettings(backbone=BackboneConfig(model=str(p))) for p in (base, tuned, ref))
    assert zs.readout.finetuned == "no" and zs.readout.stop_cut is True
    assert ft.readout.finetuned == "yes" and ft.readout.stop_cut is False and ft.readout.sparse_topk == 256
    assert rc.readout.finetuned == "yes"
    forced = EncodeSettings(backbone=BackboneConfig(model=str(tuned)), readout={"finetuned": "no"})
    assert forced.readout.stop_cut is True and encoder_slug(forced) != encoder_slug(ft)


def test_8_max_length_is_run_encode_sh_s_256(bert) -> None:
    """run_encode.sh L77: --max_length 256 for every model, the prompt counted (encode.py's default: 512)."""
    from diffret.retrieval.models.readouts import DEFAULT_MAX_LENGTH, ReadoutConfig, make_reader
    from diffret.stages.encode import EncodeConfig
    from diffret.stages.tokenize import TokenizeConfig

    assert DEFAULT_MAX_LENGTH == 256
    assert EncodeConfig(dataset="d").max_length == 256 and TokenizeConfig(dataset="d").max_length == 256
    bb, tok = bert
    text = " ".join(["cats purr in the garden"] * 150)
    ids = [tok(text, add_special_tokens=False)["input_ids"]]
    assert len(ids[0]) > 600
    reader = make_reader(bb, ReadoutConfig())
    p = reader.pieces("passage", 4)
    e = reader.encode(ids, [text], "passage", 4)[0]
    assert e.n_tokens == 256 + 4 + len(p.closing)  # the prompt counted; the masks and the tail on top
    longer = make_reader(bb, ReadoutConfig(), 400).encode(ids, [text], "passage", 4)[0]
    assert longer.n_tokens == 400 + 4 + len(p.closing)  # the option (encode.py: 512; BERT holds 512 in all)


def test_11_fine_tuned_promptreps_encodes_exactly_k_slots(causal, monkeypatch) -> None:
    """promptreps_trainable.py L461-491: the trained model decodes K - 1 words with no stop at the quote; its
    sparse vector is the pooled one's top 256, rounded (encode.py L449-458)."""
    from diffret.retrieval.models.readouts import ReadoutConfig, make_reader

    bb, tok = causal
    (quote,) = tok('"', add_special_tokens=False)["input_ids"]
    base = bb.head
    calls = {"n": 0}

    def head(h: torch.Tensor) -> torch.Tensor:  # the closing quote predicted at the second step
        out = base(h)
        out[..., quote] = 1e4 if calls["n"] == 1 else -1e4
        calls["n"] += 1
        return out

    text = "cats purr in the garden"
    ids = [tok(text, add_special_tokens=False)["input_ids"]]
    monkeypatch.setattr(bb, "head", head)
    zero = make_reader(bb, ReadoutConfig(readout="promptreps")).encode(ids, [text], "query", 4)[0]
    assert zero.dense.shape[0] == 2 and zero.stopped
    calls["n"] = 0
    reader = make_reader(bb, ReadoutConfig(readout="promptreps", finetuned="yes"))
    assert (reader.cfg.promptreps_stop, reader.cfg.sparse, reader.cfg.sparse_topk) == ("none", "pooled", 256)
    tuned = reader.encode(ids, [text], "query", 4)[0]
    assert tuned.dense.shape[0] == 4 and not tuned.stopped
    assert np.allclose(tuned.sparse_weights * 100, np.round(tuned.sparse_weights * 100), atol=1e-3)


# ------------------------------------------------------------------------------------- 9-14. fine-tuning
def _groups(n: int = 8):
    from diffret.retrieval.data.training import Group

    words = "cats purr dogs bark tea coffee cocoa garden fox jumps lazy mailman".split()
    out = []
    for i in range(n):
        a, b = words[i % len(words)], words[(i + 3) % len(words)]
        negs = [{"docid": f"n{i}{j}", "title": "", "text": f"{words[(i + 5 + j) % len(words)]} tea"} for j in range(3)]
        out.append(Group(f"q{i}", f"{a} {b}", [{"docid": f"p{i}", "title": a, "text": f"{a} {b} {a}"}], negs))
    return out


def _trainer(tmp_path, readout: str = "diffretriever", arch: str = "bert", **kw):
    from tiny_models import tiny_backbone

    from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
    from diffret.retrieval.training.loop import Trainer, TrainSettings

    bb, _ = tiny_backbone(arch, tmp_path / arch, seed=0)
    for m in bb.model.modules():  # no dropout: a cached step must equal the plain one bit for bit
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    k = 1 if readout in ("diffembed", "repllama") else 2
    base = dict(adapter="full", kq=k, kp=k, n_negatives=2, q_max_len=8, p_max_len=12, lr=1e-3)
    return Trainer(make_reader(bb, ReadoutConfig(readout=readout)), _groups(), TrainSettings(**{**base, **kw}))


def test_9_cosine_schedule_with_ceil_warmup_from_zero() -> None:
    """train_diffretriever.py L579-582: HF's cosine schedule, warm-up ceil(0.06 T) starting at lr 0; ``schedule linear``
    warms up over floor(0.06 T) from 1 / (warm + 1) and decays linearly."""
    from diffret.retrieval.training.loop import TrainSettings

    s = TrainSettings().resolved("diffretriever")
    assert s.schedule == "cosine"
    f = [s.lr_factor(i, 100) for i in range(100)]
    assert f[0] == 0.0 and f[6] == pytest.approx(1.0) and f[5] == pytest.approx(5 / 6)  # ceil(6.0) = 6 warm-up steps
    assert f[53] == pytest.approx(0.5, abs=0.02)  # half-way through the decay: cos(pi / 2)
    old = TrainSettings(schedule="linear").resolved("diffretriever")
    g = [old.lr_factor(i, 100) for i in range(100)]
    assert g[0] == pytest.approx(1 / 7) and g[53] == pytest.approx(47 / 94)
    assert TrainSettings().resolved("diffembed").schedule == "hf_linear"  # the baselines' scripts


def test_10_global_batch_128_and_a_pool_of_32_queries(tmp_path) -> None:
    """Table 7: 8 queries x 16 passages per GPU, 4 GPUs gathered (a pool of 32 queries / 512 passages), 4 pools a
    step (128 queries); ``pool_size 8 global_batch 32``: pools of 8, 32 queries a step."""
    from diffret.retrieval.training.loop import TrainSettings, planned_steps

    s = TrainSettings().resolved("diffretriever")
    assert (s.pool_items(1), s.step_items(1), s.pool_items(4)) == (32, 128, 32)
    assert planned_steps(809, s) == (6, 6)
    old = TrainSettings(pool_size=8, global_batch=32).resolved("diffretriever")
    assert (old.pool_items(1), old.step_items(1)) == (8, 32) and planned_steps(809, old) == (25, 25)
    tr = _trainer(tmp_path, batch_size=2, pool_size=8, global_batch=8)
    (pool,) = tr.micro_batches(0)
    assert len(pool) == 8  # one pool of 8 queries, built from forward passes of 2


def test_10_gradient_caching_equals_one_pass(tmp_path) -> None:
    """A pool of 8 queries trained in chunks of 2 (gradient caching) gives the loss and gradients of one pass."""
    tr = _trainer(tmp_path, batch_size=2, pool_size=8, global_batch=8)
    x = tr.prepare(tr.micro_batches(0)[0], 0)
    tr.bb.model.train()
    parts = tr.cached_backward(x)
    cached = [p.grad.clone() for p in tr.params]
    tr.opt.zero_grad(set_to_none=True)
    loss, plain_parts = tr.micro_loss(x, 0)
    loss.backward()
    assert parts["loss"] == pytest.approx(plain_parts["loss"], abs=1e-5)
    for a, p in zip(cached, tr.params, strict=True):  # float32 sums in another order: relative 1e-5
        assert float((a - p.grad).abs().max()) <= 1e-5 * max(1.0, float(p.grad.abs().max())), p.shape
    assert sum(float(g.abs().sum()) for g in cached) > 0


def test_11_promptreps_trains_on_exactly_k_slots(tmp_path, monkeypatch) -> None:
    """promptreps_trainable.py L493-529: K - 1 words decoded with no stop, all K slots read; the paper trains it at
    N = 4 (``promptreps_decode stop``: stopped at the quote; ``promptreps_n 0``: the zero-shot N)."""
    from diffret.retrieval.training.loop import TrainSettings

    tr = _trainer(tmp_path, readout="promptreps", arch="llama", kq=4, kp=4)
    bb, tok = tr.bb, tr.bb.tokenizer
    (quote,) = tok('"', add_special_tokens=False)["input_ids"]
    base = bb.head
    monkeypatch.setattr(bb, "head", lambda h: base(h).index_fill(-1, torch.tensor([quote]), 1e4))  # always the quote
    ids = [tok("cats purr", add_special_tokens=False)["input_ids"]]
    fixed = tr._forward(ids, None, "query", 4)
    assert fixed.dense.shape[1] == 4 and bool(fixed.mask.all())
    tr.s = tr.s.model_copy(update={"promptreps_decode": "stop"})
    stopped = tr._forward(ids, None, "query", 4)
    assert int(stopped.mask.sum()) == 1  # the first slot predicts the quote: the words end there
    assert TrainSettings().promptreps_n == 4


def test_12_training_passages_join_title_and_text_with_a_space(tmp_path) -> None:
    """train_diffretriever.py L307-310: f"{title} {text}"; an empty text gives the title alone (encode.py L79-81
    too); ``train_title_sep '. '`` trains on the encoder's "title. text"."""
    from diffret.retrieval.data.collections import passage_text

    tr = _trainer(tmp_path)
    assert tr._text({"title": "Cats", "text": "They purr."}) == "Cats They purr."
    assert tr._text({"title": "Cats", "text": ""}) == "Cats" and passage_text("Cats", "") == "Cats"
    old = _trainer(tmp_path / "old", train_title_sep=". ")
    assert old._text({"title": "Cats", "text": "They purr."}) == "Cats. They purr."


def test_13_llada_lora_covers_its_vocabulary_head() -> None:
    """backbone_adapters.py L197-207: LLaDA's targets include ff_out, which matches its output head too; natively
    loaded that head is lm_head (``lora_head false``: not a target)."""
    from types import SimpleNamespace

    from diffret.retrieval.models.backbones import FAMILIES
    from diffret.retrieval.training.loop import lora_targets

    llada = SimpleNamespace(spec=FAMILIES["llada"], loader="native")
    assert "lm_head" in lora_targets(llada) and "lm_head" not in lora_targets(llada, head=False)
    assert "lm_head" not in lora_targets(SimpleNamespace(spec=FAMILIES["dream"], loader="native"))
    assert "ff_out" in lora_targets(SimpleNamespace(spec=FAMILIES["llada"], loader="remote"))


def test_13_a_wrapped_head_reads_the_logits(tmp_path) -> None:
    """With LoRA on the head, the backbone's logits go through the adapter (the head is bound again)."""
    tr = _trainer(tmp_path, arch="llama", adapter="lora", lora_head=True)
    assert "lora" in type(tr.bb.head).__module__.lower() or hasattr(tr.bb.head, "lora_A")
    assert any("lm_head" in n and p.requires_grad for n, p in tr.bb.model.named_parameters())


def test_14_the_baselines_train_as_their_released_scripts(tmp_path) -> None:
    """train_diffembed.py / train_repllama.py: tau 0.02, no gather, weight decay 0, HF linear schedule; DiffEmbed
    64 / 256 tokens in all (special tokens counted), the text only, 7 negatives; RepLLaMA "query: " + text
    tokenized as one string."""
    from diffret.retrieval.training.loop import TrainSettings

    s = TrainSettings().resolved("repllama")
    assert (s.tau, s.gather, s.weight_decay, s.n_negatives, s.q_max_len, s.p_max_len) == (0.02, "no", 0.0, 15, 32, 156)
    tr = _trainer(tmp_path, readout="diffembed", q_max_len=None, p_max_len=None, n_negatives=None)
    assert (tr.s.q_max_len, tr.s.p_max_len, tr.s.n_negatives, tr.s.tau) == (64, 256, 7, 0.02)
    assert tr._text({"title": "Cats", "text": "They purr."}) == "They purr."
    x = tr.prepare(tr.micro_batches(0)[0][:1], 0)
    counted, _ = tr.r.overhead("query", 1)
    assert counted >= 2 and all(len(q) <= 64 - counted for q in x.query_ids)  # [CLS] .. [SEP] counted in the 64
    uniform = _trainer(tmp_path / "u", readout="diffembed", tau=0.01, gather="yes", weight_decay=0.01, n_negatives=15)
    assert (uniform.s.tau, uniform.s.gather, uniform.s.n_negatives) == (0.01, "yes", 15)  # the options' values


def test_14_repllama_tokenizes_its_prefix_with_the_text(tmp_path) -> None:
    from tiny_models import tiny_backbone

    from diffret.retrieval.models.readouts import ReadoutConfig, make_reader

    bb, tok = tiny_backbone("qwen2", tmp_path / "q")  # byte-level BPE: "Ġwhat" merges across the prefix's space
    text = "what do cats do"
    ids = [tok(text, add_special_tokens=False)["input_ids"]]
    joined, _ = make_reader(bb, ReadoutConfig(readout="repllama"))._vectors(ids, "query", [text])
    apart, _ = make_reader(bb, ReadoutConfig(readout="repllama", repllama_prefix="separate"))._vectors(ids, "query")
    whole = tok(f"query: {text}", add_special_tokens=False)["input_ids"]
    assert whole == joined[0][len(joined[0]) - len(whole) - 1 : -1]
    assert joined[0] != apart[0]  # the tokenizer merges across the prefix's trailing space
