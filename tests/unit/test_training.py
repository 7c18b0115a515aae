"""The training objective and loop on tiny in-test models: the loss falls, a resumed run is bit-identical, LoRA
wraps the family's projections (or refuses, naming the modules it found)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import TEXTS, tiny_backbone

from diffret.retrieval.data.training import Group
from diffret.retrieval.models.backbones import BackboneError
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
from diffret.retrieval.training.loop import Trainer, TrainSettings
from diffret.retrieval.training.objective import contrastive_loss, maxsim_matrix, sparse_vectors

pytestmark = pytest.mark.usefixtures("one_thread")


WORDS = "cats purr dogs bark tea coffee cocoa garden fox jumps lazy mailman".split()


def groups(n: int = 8) -> list[Group]:
    out = []
    for i in range(n):
        a, b = WORDS[i % len(WORDS)], WORDS[(i + 3) % len(WORDS)]
        pos = {"docid": f"p{i}", "title": a, "text": f"{a} {b} {a}"}
        negs = [{"docid": f"n{i}{j}", "title": "", "text": f"{WORDS[(i + 5 + j) % len(WORDS)]} tea"} for j in range(3)]
        out.append(Group(f"q{i}", f"{a} {b}", [pos], negs))
    return out


def trainer(tmp_path, adapter: str = "full", arch: str = "bert", **kw) -> Trainer:
    bb, _ = tiny_backbone(arch, tmp_path / arch, seed=0)
    reader = make_reader(bb, ReadoutConfig(), 512)
    settings = TrainSettings(
        adapter=adapter,
        kq=2,
        kp=2,
        batch_size=4,
        grad_accum=2,
        n_negatives=2,
        lr=1e-3,
        warmup_ratio=0.0,
        epochs=4,
        q_max_len=8,
        p_max_len=12,
        **kw,
    )
    return Trainer(reader, groups(), settings)


def test_maxsim_and_loss_by_hand():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # one query, 2 slots
    p = torch.tensor([[[1.0, 0.0], [0.0, 2.0]], [[1.0, 1.0], [-1.0, 0.0]]])
    pm = torch.tensor([[True, True], [True, False]])  # the second passage's second slot is padding
    s = maxsim_matrix(q, torch.ones(1, 2, dtype=torch.bool), p, pm)
    assert torch.allclose(s, torch.tensor([[1.0, 2**-0.5]]))  # (1 + 1) / 2; (0.707 + 0.707) / 2
    loss, parts = contrastive_loss(q, torch.ones(1, 2, dtype=torch.bool), p, pm, group=2, tau=0.01)
    assert parts["loss"] == pytest.approx(float(torch.log1p(torch.exp(torch.tensor((2**-0.5 - 1) / 0.01)))), abs=1e-6)
    w = sparse_vectors(torch.tensor([[[-1.0, 2.0], [3.0, -5.0]]]), torch.tensor([[True, False]]))
    assert torch.allclose(w, torch.tensor([[float(torch.log1p(torch.tensor(3.0))), 0.0]]))


def test_full_training_lowers_the_loss(tmp_path):
    tr = trainer(tmp_path)
    assert tr.steps == 4 * 1 and tr.trainable == tr.total
    log = tr.run()
    assert len(log) == 4 and log[-1]["loss"] < log[0]["loss"]
    assert {"dense", "sparse", "lr", "samples_per_s"} <= set(log[0])


def test_resume_is_bit_identical(tmp_path):
    straight = trainer(tmp_path / "a")
    straight.run()
    first = trainer(tmp_path / "b")
    for _ in range(2):
        first.train_step()
    state = first.state_bytes()
    torch.manual_seed(123)  # the killed process's RNG state is gone; the checkpoint restores it
    resumed = trainer(tmp_path / "c")
    resumed.load_state(state)
    assert resumed.step == 2
    resumed.run()
    for a, b in zip(straight.params, resumed.params, strict=True):
        assert torch.equal(a, b)
    assert [r["loss"] for r in straight.log] == [r["loss"] for r in resumed.log]


@pytest.mark.parametrize("arch", ["bert", "qwen2"])
def test_lora_trains_a_small_fraction(tmp_path, arch):
    tr = trainer(tmp_path, adapter="lora", arch=arch, max_steps=2)
    assert 0 < tr.trainable < tr.total
    names = {n for n, p in tr.r.bb.model.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names)
    tr.run()
    merged = tr.merged_model()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    out = make_reader(tr.r.bb, ReadoutConfig(), 512).encode([[5, 6, 7]], [TEXTS["short"]], "query", 2)
    assert out[0].dense.shape[0] >= 1


def test_lora_on_unknown_modules_is_refused(tmp_path, monkeypatch):
    from diffret.retrieval.models import backbones

    bb, _ = tiny_backbone("bert", tmp_path / "bert", seed=0)
    spec = backbones.FamilySpec("mlm", "AutoModelForMaskedLM", bidirectional=True, lora_targets=("nope_proj",))
    bb.spec = spec
    with pytest.raises(BackboneError, match="no LoRA targets.*query"):
        Trainer(make_reader(bb, ReadoutConfig(), 512), groups(), TrainSettings(adapter="lora", kq=1, kp=1))


def test_single_vector_readouts_train_at_k_1_only(tmp_path):
    bb, _ = tiny_backbone("bert", tmp_path / "bert", seed=0)
    with pytest.raises(ValueError, match="one vector per text"):
        Trainer(make_reader(bb, ReadoutConfig(readout="diffembed"), 512), groups(), TrainSettings(kq=2, kp=1))


@pytest.mark.parametrize(
    ("readout", "arch", "k", "extra", "precision"),
    [
        ("diffembed", "bert", 1, {}, "auto"),
        ("repllama", "qwen2", 1, {}, "auto"),
        ("promptreps", "qwen2", 4, {}, "auto"),
        ("diffretriever", "bert", 4, {"denoise_steps": 2}, "auto"),
        ("diffretriever", "qwen2", 2, {}, "bfloat16"),
    ],
)
def test_every_readout_trains(tmp_path, readout, arch, k, extra, precision):
    """DiffEmbed and RepLLaMA (one vector, dense loss only), PromptReps (decoded words, dense + sparse) and the
    S-step mask readout all train: the loss falls (also under bf16 autocast, the GPU default)."""
    bb, _ = tiny_backbone(arch, tmp_path / arch, seed=0)
    reader = make_reader(bb, ReadoutConfig(readout=readout, **extra), 512)
    settings = TrainSettings(
        adapter="full",
        kq=k,
        kp=k,
        batch_size=4,
        grad_accum=2,
        n_negatives=2,
        lr=1e-3,
        warmup_ratio=0.0,
        epochs=4,
        q_max_len=8,
        p_max_len=12,
        precision=precision,
    )
    tr = Trainer(reader, groups(), settings)

    def held_loss() -> float:  # on a fixed batch, without dropout
        tr.r.bb.model.eval()
        with torch.no_grad():
            return tr.micro_loss(groups()[:4], 0)[1]["loss"]

    before = held_loss()
    log = tr.run()
    assert held_loss() < before
    assert ("sparse" in log[0]) == (readout in ("promptreps", "diffretriever"))


def test_promptreps_training_reads_the_states_decoding_reads(tmp_path):
    """One causal pass over the prompt and the greedily decoded words gives the KV-cached decoding's states."""
    bb, _ = tiny_backbone("qwen2", tmp_path / "qwen2", seed=0)
    reader = make_reader(bb, ReadoutConfig(readout="promptreps"), 512)
    ids = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    enc = reader.encode(ids, None, "query", 4)
    with torch.no_grad():
        rep = reader.train_forward(ids, "query", 4)
    for i, e in enumerate(enc):
        n = e.dense.shape[0]
        assert int(rep.mask[i].sum()) == n
        assert torch.allclose(rep.dense[i, :n], torch.from_numpy(e.dense).float(), atol=2e-3)


def test_s_step_training_takes_gradients_at_the_final_step_only(tmp_path):
    """S = 2, K = 4: the slot revealed at step 1 is frozen (no gradient); the 3 revealed at step 2 carry one."""
    bb, _ = tiny_backbone("bert", tmp_path / "bert", seed=0)
    reader = make_reader(bb, ReadoutConfig(denoise_steps=2, stop_cut=False), 512)
    rep = reader.train_forward([[5, 6, 7, 8]], "query", 4)
    enc = reader.encode([[5, 6, 7, 8]], None, "query", 4)[0]
    assert torch.allclose(rep.dense[0], torch.from_numpy(enc.dense).float(), atol=2e-3)  # the same states
    params = [p for p in bb.model.parameters() if p.requires_grad]
    with_grad = []
    for j in range(4):
        grads = torch.autograd.grad(rep.dense[0, j].sum(), params, retain_graph=True, allow_unused=True)
        with_grad.append(any(g is not None and bool(g.abs().sum() > 0) for g in grads))
    assert sorted(with_grad) == [False, True, True, True]


def sidr_trainer(tmp_path, **kw) -> Trainer:
    bb, _ = tiny_backbone("bert", tmp_path / "bert", seed=0)
    for m in bb.model.modules():  # no dropout: a cached step must equal the plain one
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    reader = make_reader(bb, ReadoutConfig(readout="sidr", sparse_topk=20), 512)
    settings = TrainSettings(
        **{
            "lr": 1e-3,
            "warmup_ratio": 0.0,
            "epochs": 4,
            "pool_size": 4,
            "global_batch": 8,
            "batch_size": 4,
            "q_max_len": 8,
            "p_max_len": 12,
            **kw,
        }
    )
    return Trainer(reader, groups(), settings)


def test_sidr_objective_is_the_four_symmetric_terms_and_trains(tmp_path):
    """``--readout sidr`` trains with SIDR's objective (its own defaults: full fine-tuning, 1 hard negative) and
    the loss on a fixed batch falls; the loss is 1/4 of the four symmetric InfoNCE terms, recomputed here."""
    from diffret.retrieval.training.objective import symmetric_nce, topk_own

    tr = sidr_trainer(tmp_path)
    assert tr.s.adapter == "full" and tr.s.n_negatives == 1 and tr.trainable == tr.total
    x = tr.prepare(groups()[:4], 0)
    tr.bb.model.eval()
    with torch.no_grad():
        qv, qb, _, pv, pb, _ = tr._reps(x)
        loss, parts = tr.micro_loss(x, 0)
    t = torch.arange(4) * 2
    want = (
        symmetric_nce(topk_own(qv, qb, 20), pv, t)
        + symmetric_nce(qv, topk_own(pv, pb, 20), t)
        + symmetric_nce(qb, pv, t)
        + symmetric_nce(qv, pb, t)
    ) / 4
    assert float(loss) == pytest.approx(float(want), rel=1e-5) and set(parts) == {"topk", "bot", "loss"}
    assert set(qb[0].nonzero().flatten().tolist()) == set(x.query_ids[0]) - set(tr.r.bb.tokenizer.all_special_ids)
    before = float(loss)
    tr.run()
    tr.bb.model.eval()
    with torch.no_grad():
        assert tr.micro_loss(x, 0)[1]["loss"] < before


def test_sidr_gradient_caching_equals_one_pass(tmp_path):
    tr = sidr_trainer(tmp_path, batch_size=2, pool_size=8, global_batch=8)
    x = tr.prepare(tr.micro_batches(0)[0], 0)
    tr.bb.model.train()
    parts = tr.cached_backward(x)
    cached = [None if p.grad is None else p.grad.clone() for p in tr.params]  # the MLM head is unused here
    tr.opt.zero_grad(set_to_none=True)
    loss, plain = tr.micro_loss(x, 0)
    loss.backward()
    assert parts["loss"] == pytest.approx(plain["loss"], abs=1e-5)
    assert sum(a is not None for a in cached) > 0
    for a, p in zip(cached, tr.params, strict=True):
        assert (a is None) == (p.grad is None), p.shape
        if a is not None:
            assert float((a - p.grad).abs().max()) <= 1e-4 * max(1.0, float(p.grad.abs().max())), p.shape


def retrieved(tr: Trainer, depth: int = 3):
    """A bag-of-tokens index over every passage of ``groups()`` (the tiny backbone's tokens)."""
    import pyarrow as pa

    from diffret.retrieval.search.bot import bag_of_tokens, binary_flat
    from diffret.retrieval.training.negatives import RetrievedNegatives

    docs = list({p["docid"]: p for g in groups() for p in [*g.positives, *g.negatives]}.values())
    ids = tr.r.bb.tokenizer([tr._text(p) for p in docs], add_special_tokens=False)["input_ids"]
    bags = binary_flat(bag_of_tokens(pa.array(ids, pa.list_(pa.int32())), tr.r.bb.tokenizer.all_special_ids))
    return RetrievedNegatives(bags, [p["docid"] for p in docs], lambda rows: [docs[i] for i in rows], depth)


def test_sidr_retrieved_negatives_come_from_the_current_encoders_beta_search(tmp_path):
    """``retrieved_negatives``: each group's negative is drawn from the top of a beta search by the current query
    encoder over the fixed bag-of-tokens index, never one of its judged positives, the same for the same seed and
    step; the step then trains on them. Without the index (or with another readout) it is refused."""
    from diffret.retrieval.search.bot import beta_search
    from diffret.retrieval.training.negatives import sparse_rows
    from diffret.retrieval.training.objective import topk_own

    base = sidr_trainer(tmp_path)
    s = base.s.model_copy(update={"retrieved_negatives": 3})
    with pytest.raises(ValueError, match="bag-of-tokens index"):
        Trainer(base.r, groups(), s)
    neg = retrieved(base)
    tr = Trainer(base.r, groups(), s, neg)
    x = tr.prepare(groups()[:4], 0)
    got = tr.retrieve(x, 0)
    assert got.retrieved and tr._ready(got, 0) is got  # retrieved once per micro-batch
    assert got.query_ids == x.query_ids and got.passage_ids[0::2] == x.passage_ids[0::2]  # positives kept
    tr.bb.model.eval()
    with torch.no_grad():
        qv, qb = tr.r.train_vectors(x.query_ids, "query")
    top = beta_search(sparse_rows(topk_own(qv, qb, 20)), [neg.bags], len(neg.bags))
    for i, g in enumerate(groups()[:4]):
        allowed = [
            j
            for j, s in zip(top.index[i], top.scores[i], strict=True)
            if s > 0 and neg.doc_ids[j] != g.positives[0]["docid"]
        ][:3]
        assert got.passage_texts[2 * i + 1] in {tr._text(p) for p in neg.passages(allowed)}
    assert tr.retrieve(x, 0).passage_texts == got.passage_texts  # seeded by step and query
    assert (neg.drawn, neg.fallback) == (8, 0)
    rows = tr.run()
    assert all(math.isfinite(r["loss"]) for r in rows) and {"topk", "bot"} <= set(rows[0])
    bb, _ = tiny_backbone("bert", tmp_path / "b2", seed=0)
    with pytest.raises(ValueError, match="readout sidr"):
        Trainer(make_reader(bb, ReadoutConfig(), 512), groups(), TrainSettings(kq=1, kp=1, retrieved_negatives=3), neg)


def test_sidr_retrieved_negatives_and_separate_encoders_resume_bit_identical(tmp_path):
    """A killed SIDR run (two encoders, retrieved negatives) resumes to the same weights and losses."""

    def make(where):
        base = sidr_trainer(where, max_steps=4, encoders="shared")  # a fresh model; the trainer below separates it
        s = base.s.model_copy(update={"retrieved_negatives": 3, "encoders": "separate"})
        return Trainer(base.r, groups(), s, retrieved(base))

    straight = make(tmp_path / "a")
    assert len(straight.params) == 2 * len(list(straight.r.passage_bb.model.parameters()))  # both encoders train
    straight.run()
    first = make(tmp_path / "b")
    for _ in range(2):
        first.train_step()
    state = first.state_bytes()
    torch.manual_seed(123)
    resumed = make(tmp_path / "c")
    resumed.load_state(state)
    resumed.run()
    for a, b in zip(straight.params, resumed.params, strict=True):
        assert torch.equal(a, b)
    assert [r["loss"] for r in straight.log] == [r["loss"] for r in resumed.log]
    twin = straight.extra_models()["passage_encoder"]
    assert not any(n.startswith("diffret_") for n, _ in straight.r.bb.model.named_parameters())  # taken off
    assert any(not torch.equal(a, b) for a, b in zip(twin.parameters(), straight.r.bb.model.parameters(), strict=True))
