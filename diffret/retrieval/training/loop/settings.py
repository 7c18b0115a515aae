"""What a training run is told: the optimisation settings every training task shares (:class:`LoopSettings`), the
contrastive trainer's (:class:`TrainSettings`, resolved per readout to the reference trainers'), the learning-rate
schedules, the planned steps and the memory a step needs (estimated before anything is loaded)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field

from ...fields import SEED_MAX, Settings, like


class LoopSettings(Settings):
    """The optimisation settings every training task shares (the contrastive trainer, the rerankers)."""

    adapter: Literal["lora", "full"] = Field(
        default="lora",
        description="Train LoRA adapters (peft) or every weight (full).",
        json_schema_extra={"cli": {"switch": {"--full": "full"}}},
    )
    lora_r: int = Field(default=16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(default=64, ge=1, description="LoRA scaling alpha.")
    lora_dropout: float = Field(default=0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA layers' input.")
    lr: float = Field(default=1e-4, gt=0, description="Peak learning rate (AdamW).")
    warmup_ratio: float = Field(default=0.06, ge=0.0, le=1.0, description="Share of the steps spent warming up.")
    weight_decay: float = Field(default=0.01, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, gt=0, description="Gradient norm clipping.")
    epochs: float = Field(default=1.0, gt=0, description="Passes over the training set (fractions allowed).")
    batch_size: int = Field(default=8, ge=1, description="Items per micro-batch (groups; lists for rerankers).")
    grad_accum: int = Field(default=4, ge=1, description="Micro-batches per optimizer step.")
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass (less memory, ~30% more time)."
    )
    shard_optimizer: bool = Field(
        default=False,
        description="Under DDP, shard the AdamW state across the "
        "processes (PyTorch's ZeroRedundancyOptimizer, ZeRO stage 1).",
    )
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="auto: bf16 mixed precision on CUDA, fp32 on CPU (Table 7); or either one."
    )
    seed: int = Field(default=0, ge=0, le=SEED_MAX, description="Seed of the data order, sampling and initialisation.")
    max_steps: int | None = Field(default=None, ge=1, description="Stop after this many steps (default: epochs).")

    def step_items(self, world: int = 1) -> int:
        """Items per optimizer step over every process: ``batch_size x grad_accum x world``."""
        return self.batch_size * self.grad_accum * world

    def pool_items(self, world: int = 1) -> int:
        """Items of one micro-batch over every process (each process holds ``batch_size``)."""
        return self.batch_size * world

    def lr_factor(self, step: int, steps: int) -> float:
        """The learning rate's multiplier at ``step`` of ``steps``: linear warm-up over ``warmup_ratio`` of the
        steps, then linear decay to 0 (subclasses may hold it constant).

        >>> [round(LoopSettings(warmup_ratio=0.25).lr_factor(s, 8), 3) for s in range(8)]
        [0.333, 0.667, 1.0, 0.833, 0.667, 0.5, 0.333, 0.167]
        """
        warm = int(steps * self.warmup_ratio)
        if step < warm:
            return (step + 1) / (warm + 1)
        return max(0.0, (steps - step) / max(1, steps - warm))


Schedule = Literal["auto", "cosine", "hf_linear", "linear"]
BASELINES = ("diffembed", "repllama")  # the re-trained single-vector baselines (scripts/train_diffembed.py, ...)


def hf_lr_factor(step: int, steps: int, warmup_ratio: float, kind: str) -> float:
    """transformers' schedules as the reference's Trainer builds them: warm-up over ceil(warmup_ratio x steps)
    steps from 0 (the first update runs at lr 0), then cosine (``get_cosine_schedule_with_warmup``, half a cycle)
    or linear decay to 0.

    >>> [round(hf_lr_factor(s, 10, 0.06, "cosine"), 3) for s in (0, 1, 2, 5, 9)]
    [0.0, 1.0, 0.97, 0.587, 0.03]
    >>> [round(hf_lr_factor(s, 10, 0.06, "hf_linear"), 3) for s in (0, 1, 2, 9)]
    [0.0, 1.0, 0.889, 0.111]
    """
    warm = math.ceil(steps * warmup_ratio)
    if step < warm:
        return step / max(1, warm)
    progress = (step - warm) / max(1, steps - warm)
    if kind == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return max(0.0, (steps - step) / max(1, steps - warm))


class TrainSettings(LoopSettings):
    """Everything that changes a contrastive training run's result (its hash names the trained model).

    The defaults are the reference trainers' (ielab/diffretriever: scripts/train_diffretriever.py with the paper's
    Table 7, train_promptreps.py, and the re-trained baselines' train_diffembed.py / train_repllama.py); settings
    left at None / `auto` take the readout's reference value, which the model's hash records. Each default is the
    reference's choice (docs/ARCHITECTURE.md, parity table); the other values are options: ``schedule linear`` (a
    linear warm-up from lr / (w + 1), then linear decay), ``pool_size 8 global_batch 32`` (one device's pools of 8,
    32 queries a step), ``promptreps_decode stop``, ``promptreps_n 0`` (the zero-shot N), ``train_title_sep '. '``,
    ``lora_head false``.
    """

    # The six settings below are None until resolved() picks the readout's reference value: wider than LoopSettings'
    # by design (a TrainSettings reaches a Loop resolved), hence the one ignore each.
    adapter: Literal["lora", "full"] | None = like(  # type: ignore[assignment]
        LoopSettings,
        "adapter",
        default=None,
        description="Train LoRA adapters (peft) or every weight (full); default: lora (sidr: full).",
    )
    lr: float | None = like(  # type: ignore[assignment]
        LoopSettings, "lr", default=None, description="Peak learning rate (AdamW; default: 1e-4; sidr: 2e-5)."
    )
    warmup_ratio: float | None = like(  # type: ignore[assignment]
        LoopSettings,
        "warmup_ratio",
        default=None,
        description="Share of the steps spent warming up (default: 0.06; sidr: one epoch).",
    )
    grad_clip: float | None = like(  # type: ignore[assignment]
        LoopSettings, "grad_clip", default=None, description="Gradient norm clipping (default: 1.0; sidr: 2.0)."
    )
    epochs: float | None = like(  # type: ignore[assignment]
        LoopSettings,
        "epochs",
        default=None,
        description="Passes over the training set (fractions allowed; default: 1; sidr: 40).",
    )
    kq: int | None = Field(
        default=None,
        ge=1,
        description="Query masks K_q during training (default: the budget "
        "the base model's zero-shot train split selected; PromptReps: promptreps_n).",
    )
    kp: int | None = Field(default=None, ge=1, description="Passage masks K_p during training (default: as K_q).")
    batch_size: int = Field(
        default=8, ge=1, description="Groups per forward pass (memory); a larger pool is built by gradient caching."
    )
    pool_size: int | None = Field(
        default=None,
        ge=1,
        description="Queries whose passages form one InfoNCE pool (in-"
        "batch negatives), over every process (default: 32, Table 7's 8 per GPU x 4 GPUs "
        "gathered; baselines: 8 per process). Beyond batch_size: gradient caching.",
    )
    global_batch: int | None = Field(
        default=None,
        ge=1,
        description="Queries per optimizer step (default: 128, as "
        "the reference; a multiple of the pool). None with grad_accum: batch_size x "
        "grad_accum x processes.",
    )
    weight_decay: float | None = Field(  # type: ignore[assignment]
        default=None, ge=0.0, description="AdamW weight decay (default: 0.01; the baselines' scripts: 0)."
    )
    schedule: Schedule = Field(
        default="auto",
        description="cosine (HF, warm-up ceil(ratio x steps) from 0: the "
        "reference's), hf_linear (the baselines' scripts), linear (warm-up, decay); auto: the "
        "readout's reference.",
    )
    gather: Literal["auto", "yes", "no"] = Field(
        default="auto",
        description="Pool the processes' passages (the reference's DiffRetriever / PromptReps; the baselines do not).",
    )
    q_max_len: int | None = Field(
        default=None,
        ge=1,
        description="Query tokens (default: 32 text tokens; DiffEmbed "
        "64, RepLLaMA 32, in all, special tokens and prefix included).",
    )
    p_max_len: int | None = Field(
        default=None,
        ge=1,
        description="Passage tokens (default: 156 text tokens; DiffEmbed 256, RepLLaMA 156, in all).",
    )
    n_negatives: int | None = Field(
        default=None, ge=0, description="Hard negatives per group (default: 15; DiffEmbed 7)."
    )
    tau: float | None = Field(
        default=None, gt=0, description="Temperature of the dense InfoNCE (default: 0.01; the baselines: 0.02)."
    )
    sparse_loss: bool = Field(default=True, description="Add the sparse InfoNCE (no temperature).")
    train_title_sep: str | None = Field(
        default=None,
        description="A training passage is title + this + text (default:"
        " ' ', the reference trainer's; an empty text: the title alone); the baselines"
        " read the text only.",
    )
    promptreps_decode: Literal["fixed", "stop"] = Field(
        default="fixed",
        description="PromptReps: decode exactly K - "
        "1 words and read all K slots (the reference's trainer), or "
        "stop at the closing quote.",
    )
    promptreps_n: int = Field(
        default=4,
        ge=0,
        description="PromptReps: the cap N trained at when kq / kp are not "
        "given (the paper's fine-tuning: 4; 0: the zero-shot selection).",
    )
    lora_head: bool | None = Field(
        default=None,
        description="LoRA on the vocabulary head too (default: LLaDA, whose "
        "reference targets' ff_out matches its head).",
    )
    retrieved_negatives: int | None = Field(
        default=None,
        ge=1,
        description="SIDR: draw each step's negatives from "
        "the top N of a beta search by the current query encoder over the "
        "training corpus's bag-of-tokens index, judged-relevant passages "
        "dropped (SIDR's in-training retrieval: N 20-100); default: the training "
        "set's stored negatives.",
    )
    encoders: Literal["shared", "separate"] | None = Field(
        default=None,
        description="SIDR: one encoder for queries "
        "and passages (shared), or a passage encoder of its own "
        "trained beside the query encoder and saved in the model "
        "folder's passage_encoder/ (separate: SIDR's, the "
        "default; full fine-tuning only).",
    )

    def recorded(self) -> dict[str, Any]:
        """The settings as a trained model's hash records them: a setting added later is left out while it is off,
        so the models trained before it keep their names.

        >>> "retrieved_negatives" in TrainSettings().recorded(), TrainSettings(retrieved_negatives=50).recorded()[
        ...     "retrieved_negatives"]
        (False, 50)
        """
        out = self.model_dump()
        for name in ("retrieved_negatives", "encoders"):
            if out[name] is None:
                del out[name]
        return out

    def resolved(self, readout: str) -> TrainSettings:
        """Every None / ``auto`` setting replaced by ``readout``'s reference value.

        >>> s = TrainSettings().resolved("diffretriever")
        >>> (s.tau, s.weight_decay, s.schedule, s.gather, s.pool_size, s.global_batch, s.n_negatives)
        (0.01, 0.01, 'cosine', 'yes', 32, 128, 15)
        >>> s = TrainSettings().resolved("sidr")   # SIDR's: full fine-tuning, one warm-up epoch, linear decay
        >>> (s.adapter, s.lr, s.epochs, s.warmup_ratio, s.grad_clip, s.schedule, s.n_negatives, s.weight_decay)
        ('full', 2e-05, 40.0, 0.025, 2.0, 'hf_linear', 1, 0.0)
        >>> s = TrainSettings().resolved("diffembed")
        >>> (s.tau, s.weight_decay, s.schedule, s.gather, s.pool_size, s.n_negatives, s.q_max_len, s.p_max_len)
        (0.02, 0.0, 'hf_linear', 'no', 8, 7, 64, 256)
        """
        if readout == "sidr":  # SIDR's (jzhoubu/sidr): batch 128 gathered, 1 hard negative, query 128, passage 256
            epochs = self.epochs or 40.0
            pick: dict[str, Any] = {
                "adapter": "full",
                "lr": 2e-5,
                "warmup_ratio": min(1.0, 1.0 / epochs),
                "grad_clip": 2.0,
                "epochs": epochs,
                "kq": 1,
                "kp": 1,
                "weight_decay": 0.0,
                "pool_size": 128,
                "global_batch": 128,
                "n_negatives": 1,
                "q_max_len": 128,
                "p_max_len": 256,
                "train_title_sep": " ",
                "tau": 1.0,
                "encoders": "separate",
            }
            update: dict[str, Any] = {k: v for k, v in pick.items() if getattr(self, k) is None}
            update.update(
                schedule="hf_linear" if self.schedule == "auto" else self.schedule,
                gather="yes" if self.gather == "auto" else self.gather,
            )
            return self.model_copy(update=update)
        base = readout in BASELINES
        loop = LoopSettings()
        pick = {
            "adapter": loop.adapter,
            "lr": loop.lr,
            "warmup_ratio": loop.warmup_ratio,
            "grad_clip": loop.grad_clip,
            "epochs": loop.epochs,
            "tau": 0.02 if base else 0.01,
            "weight_decay": 0.0 if base else 0.01,
            "pool_size": 8 if base else 32,
            "global_batch": 128,
            "n_negatives": 7 if readout == "diffembed" else 15,
            "q_max_len": 64 if readout == "diffembed" else 32,
            "p_max_len": 256 if readout == "diffembed" else 156,
            "train_title_sep": " ",
        }
        update = {k: v for k, v in pick.items() if getattr(self, k) is None}
        if self.schedule == "auto":
            update["schedule"] = "hf_linear" if base else "cosine"
        if self.gather == "auto":
            update["gather"] = "no" if base else "yes"
        return self.model_copy(update=update)

    def lr_factor(self, step: int, steps: int) -> float:
        """The schedule's multiplier (``schedule``; ``linear`` is LoopSettings' warm-up then linear decay)."""
        kind = "cosine" if self.schedule == "auto" else self.schedule
        if kind == "linear":
            return super().lr_factor(step, steps)
        assert self.warmup_ratio is not None, "lr_factor needs resolved settings (TrainSettings.resolved)"
        return hf_lr_factor(step, steps, self.warmup_ratio, kind)

    def step_items(self, world: int = 1) -> int:
        """Groups per optimizer step: ``global_batch``, or batch_size x grad_accum x processes without it."""
        return self.global_batch or super().step_items(world)

    def pool_items(self, world: int = 1) -> int:
        """Groups per InfoNCE pool over all processes (each process holds pool_items / world of them)."""
        if self.pool_size is None:
            return super().pool_items(world)
        return self.pool_size * (world if self.gather == "no" else 1)


def planned_steps(n_groups: int, s: LoopSettings, world: int = 1) -> tuple[int, int]:
    """(optimizer steps per epoch, steps in all) for ``n_groups`` groups on ``world`` processes (a last partial
    step is dropped).

    >>> planned_steps(809, TrainSettings(epochs=3).resolved("diffretriever"))   # 128 groups a step
    (6, 18)
    >>> planned_steps(809, LoopSettings(epochs=3), world=2)   # 8 x 4 x 2 = 64 items a step
    (12, 36)
    """
    per_epoch = max(1, n_groups // s.step_items(world))
    return per_epoch, s.max_steps or max(1, math.ceil(per_epoch * s.epochs))


def _dims(raw: dict[str, Any]) -> dict[str, int] | None:
    """Hidden size, feed-forward width, layers and vocabulary of a model's config.json (its names for them across
    families: BERT / Qwen2 / Llama, OLMo-style LLaDA, GPT-2); None when they are not all there."""

    def first(*keys: str) -> int | None:
        return next((int(raw[k]) for k in keys if isinstance(raw.get(k), int)), None)

    h = first("hidden_size", "d_model", "n_embd")
    layers = first("num_hidden_layers", "n_layers", "n_layer")
    vocab = first("vocab_size", "embedding_size")
    if not (h and layers and vocab):
        return None
    return {
        "h": h,
        "i": first("intermediate_size", "mlp_hidden_size", "n_inner") or 4 * h,
        "layers": layers,
        "vocab": vocab,
    }


def training_memory(
    raw: dict[str, Any], s: TrainSettings, sparse: bool, bf16: bool, world: int = 1, weight_bytes: int = 4
) -> dict[str, int] | None:
    """What one process's training step needs at its peak, estimated from the model's config.json before anything
    is loaded (bytes by part; None when the config lacks the sizes): the weights (and, for full fine-tuning, their
    gradients and AdamW's two moments), the activations of one forward pass over ``batch_size`` groups (a query and
    1 + ``n_negatives`` passages each, at their token limits plus the K slots: per token and layer ~8 hidden-size
    and 3 feed-forward-width values, the layer inputs alone under gradient checkpointing), the LM head's logits at
    the K slots (with the sparse loss) and the pool's representations kept for the loss. A lower estimate: the
    prompt's tokens, attention scores and the allocator's slack come on top.

    >>> cfg = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 30522}
    >>> s = TrainSettings(adapter="full", kq=4, kp=4, n_negatives=1000).resolved("diffretriever")
    >>> round(sum(training_memory(cfg, s, sparse=True, bf16=False).values()) / 2**30)   # the README's model, 1000
    43
    >>> round(sum(training_memory(cfg, s.model_copy(update={"n_negatives": 15}), True, False).values()) / 2**30, 1)
    0.8
    """
    d = _dims(raw)
    if d is None:
        return None
    h, inter, layers, vocab = d["h"], d["i"], d["layers"], d["vocab"]
    kq, kp = int(s.kq or 1), int(s.kp or 1)
    per_group = 1 + int(s.n_negatives or 0)
    pool = max(1, s.pool_items(world) // (1 if s.gather == "no" else world))  # this process's groups of a pool
    chunk = min(int(s.batch_size), pool)
    tokens = chunk * (int(s.q_max_len or 32) + kq) + chunk * per_group * (int(s.p_max_len or 156) + kp)
    act = 2 if bf16 else 4
    per_token = (
        layers * h * act + (8 * h + 3 * inter) * act if s.gradient_checkpointing else layers * (8 * h + 3 * inter) * act
    )
    params = layers * (4 * h * h + 3 * h * inter) + vocab * h
    slots = chunk * kq + chunk * per_group * kp
    pool_texts = pool * (1 + per_group) * world if s.gather == "yes" else pool * (1 + per_group)
    return {
        "weights": params * weight_bytes + (params * 12 if s.adapter == "full" else 0),
        "activations": tokens * per_token,
        "head": slots * vocab * 4 * 3 if sparse and s.sparse_loss else 0,  # logits, their pooled max, gradients
        "pool": pool_texts * ((vocab if sparse and s.sparse_loss else 0) + max(kq, kp) * h) * 4 * 2,
    }
