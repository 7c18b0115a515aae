"""The training objective and loop on tiny in-test models: the loss falls, a resumed run is bit-identical, LoRA
wraps the family's projections (or refuses, naming the modules it found)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TEXTS, tiny_backbone

from retrieval.data.training import Group
from retrieval.models.backbones import BackboneError
from retrieval.models.readouts import ReadoutConfig, make_reader
from retrieval.training.loop import Trainer, TrainSettings
from retrieval.training.objective import contrastive_loss, maxsim_matrix, sparse_vectors

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
    settings = TrainSettings(adapter=adapter, kq=2, kp=2, batch_size=4, grad_accum=2, n_negatives=2, lr=1e-3,
                             warmup_ratio=0.0, epochs=4, q_max_len=8, p_max_len=12, **kw)  # fmt: skip
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
    from retrieval.models import backbones

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
    [("diffembed", "bert", 1, {}, "auto"), ("repllama", "qwen2", 1, {}, "auto"),
     ("promptreps", "qwen2", 4, {}, "auto"), ("diffretriever", "bert", 4, {"denoise_steps": 2}, "auto"),
     ("diffretriever", "qwen2", 2, {}, "bfloat16")],
)  # fmt: skip
def test_every_readout_trains(tmp_path, readout, arch, k, extra, precision):
    """DiffEmbed and RepLLaMA (one vector, dense loss only), PromptReps (decoded words, dense + sparse) and the
    S-step mask readout all train: the loss falls (also under bf16 autocast, the GPU default)."""
    bb, _ = tiny_backbone(arch, tmp_path / arch, seed=0)
    reader = make_reader(bb, ReadoutConfig(readout=readout, **extra), 512)
    settings = TrainSettings(adapter="full", kq=k, kp=k, batch_size=4, grad_accum=2, n_negatives=2, lr=1e-3,
                             warmup_ratio=0.0, epochs=4, q_max_len=8, p_max_len=12, precision=precision)  # fmt: skip
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
