"""A resumable contrastive training loop over Tevatron groups (paper section 3.4, Table 7 defaults).

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` groups; each micro-batch's pool is its
positives, hard negatives and the other queries' passages (in-batch negatives). AdamW, linear warm-up over
``warmup_ratio`` of the steps then linear decay, gradient clipping. Adapters: peft LoRA on the family's
attention and feed-forward projections (``FamilySpec.lora_targets``), or ``full`` (every weight).

A checkpoint holds the trainable weights, the optimizer, the scheduler, every RNG state and the step (the
data order is a function of the seed and the epoch), so a resumed run continues bit for bit.

Distributed data parallel: launched by ``torchrun`` or ``accelerate launch`` (``WORLD_SIZE`` > 1 in the
environment), the trainer joins the process group (gloo on CPU, nccl on CUDA). The global batch is
``batch_size x grad_accum x world size`` groups; each micro-batch's groups are split across the processes,
the pool (queries, positives, hard negatives) is gathered from every process with gradients flowing back to
their owners, and the gradients are averaged once per optimizer step, so W processes compute the same loss
and the same update as one process with a W times larger micro-batch. ``shard_optimizer`` keeps each
process's share of the AdamW state only (PyTorch's ``ZeroRedundancyOptimizer``, ZeRO stage 1: 8 bytes per
trainable parameter divided by W; what full fine-tuning of a 7-8B model needs); checkpoints hold the
consolidated state, so a sharded run resumes as it was.
"""

from __future__ import annotations

import io
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, Field

from ..data.collections import passage_text
from ..data.training import Group, sample_fill
from ..fields import like
from ..models.backbones import PASSAGE_ENCODER, Backbone, BackboneError
from ..models.encoding import quiet_length_warning
from ..models.readouts import Readout
from .negatives import RetrievedNegatives, sparse_rows
from .objective import contrastive_loss, sidr_loss, sparse_vectors, topk_own


class LoopSettings(BaseModel):
    """The optimisation settings every training task shares (the contrastive trainer, the rerankers)."""

    adapter: Literal["lora", "full"] = Field(
        default="lora",
        description="Train LoRA adapters (peft) or every weight (full).",
        json_schema_extra={"cli": {"switch": {"--full": "full"}}},
    )
    lora_r: int = Field(default=16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(default=64, ge=1, description="LoRA scaling alpha.")
    lora_dropout: float = Field(default=0.05, ge=0.0, description="Dropout on the LoRA layers' input.")
    lr: float = Field(default=1e-4, gt=0, description="Peak learning rate (AdamW).")
    warmup_ratio: float = Field(default=0.06, ge=0.0, le=1.0, description="Share of the steps spent warming up.")
    weight_decay: float = Field(default=0.01, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, gt=0, description="Gradient norm clipping.")
    epochs: float = Field(default=1.0, gt=0, description="Passes over the training set (fractions allowed).")
    batch_size: int = Field(default=8, ge=1, description="Items per micro-batch (groups; lists for rerankers).")
    grad_accum: int = Field(default=4, ge=1, description="Micro-batches per optimizer step.")
    gradient_checkpointing: bool = Field(default=False, description="Recompute activations in the backward pass "
                                         "(less memory, ~30% more time).")  # fmt: skip
    shard_optimizer: bool = Field(default=False, description="Under DDP, shard the AdamW state across the "
                                  "processes (PyTorch's ZeroRedundancyOptimizer, ZeRO stage 1).")  # fmt: skip
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="auto: bf16 mixed precision on CUDA, fp32 on CPU (Table 7); or either one."
    )
    seed: int = Field(default=0, description="Seed of the data order, sampling and initialisation.")
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
    left at None / `auto` take the readout's reference value, which the model's hash records.
    diffret 0.1's settings are all reachable by value: ``schedule linear``, ``pool_size 8 global_batch 32``,
    ``promptreps_decode stop``, ``promptreps_n 0``, ``train_title_sep '. '``, ``lora_head false``.
    """

    adapter: Literal["lora", "full"] | None = like(LoopSettings, "adapter", default=None, description="Train LoRA "
                                                   "adapters (peft) or every weight (full); default: lora (sidr: "
                                                   "full).")  # fmt: skip
    lr: float | None = like(LoopSettings, "lr", default=None, description="Peak learning rate (AdamW; default: "
                            "1e-4; sidr: 2e-5).")  # fmt: skip
    warmup_ratio: float | None = like(LoopSettings, "warmup_ratio", default=None, description="Share of the steps "
                                      "spent warming up (default: 0.06; sidr: one epoch).")  # fmt: skip
    grad_clip: float | None = like(LoopSettings, "grad_clip", default=None, description="Gradient norm clipping "
                                   "(default: 1.0; sidr: 2.0).")  # fmt: skip
    epochs: float | None = like(LoopSettings, "epochs", default=None, description="Passes over the training set "
                                "(fractions allowed; default: 1; sidr: 40).")  # fmt: skip
    kq: int | None = Field(default=None, ge=1, description="Query masks K_q during training (default: the budget "
                           "the base model's zero-shot train split selected; PromptReps: promptreps_n).")  # fmt: skip
    kp: int | None = Field(default=None, ge=1, description="Passage masks K_p during training (default: as K_q).")
    batch_size: int = Field(default=8, ge=1, description="Groups per forward pass (memory); a larger pool is built "
                            "by gradient caching.")  # fmt: skip
    pool_size: int | None = Field(default=None, ge=1, description="Queries whose passages form one InfoNCE pool (in-"
                                  "batch negatives), over every process (default: 32, Table 7's 8 per GPU x 4 GPUs "
                                  "gathered; baselines: 8 per process). Beyond batch_size: gradient caching.")
    global_batch: int | None = Field(default=None, ge=1, description="Queries per optimizer step (default: 128, as "
                                     "the reference; a multiple of the pool). None with grad_accum: batch_size x "
                                     "grad_accum x processes (diffret 0.1).")  # fmt: skip
    weight_decay: float | None = Field(default=None, ge=0.0, description="AdamW weight decay (default: 0.01; the "
                                       "baselines' scripts: 0).")  # fmt: skip
    schedule: Schedule = Field(default="auto", description="cosine (HF, warm-up ceil(ratio x steps) from 0: the "
                               "reference's), hf_linear (the baselines' scripts), linear (diffret 0.1); auto: the "
                               "readout's reference.")  # fmt: skip
    gather: Literal["auto", "yes", "no"] = Field(default="auto", description="Pool the processes' passages (the "
                                                 "reference's DiffRetriever / PromptReps; the baselines do not).")
    q_max_len: int | None = Field(default=None, ge=1, description="Query tokens (default: 32 text tokens; DiffEmbed "
                                  "64, RepLLaMA 32, in all, special tokens and prefix included).")  # fmt: skip
    p_max_len: int | None = Field(default=None, ge=1, description="Passage tokens (default: 156 text tokens; "
                                  "DiffEmbed 256, RepLLaMA 156, in all).")  # fmt: skip
    n_negatives: int | None = Field(default=None, ge=0, description="Hard negatives per group (default: 15; "
                                    "DiffEmbed 7).")  # fmt: skip
    tau: float | None = Field(default=None, gt=0, description="Temperature of the dense InfoNCE (default: 0.01; the "
                              "baselines: 0.02).")  # fmt: skip
    sparse_loss: bool = Field(default=True, description="Add the sparse InfoNCE (no temperature).")
    train_title_sep: str | None = Field(default=None, description="A training passage is title + this + text (default:"
                                        " ' ', the reference trainer's; an empty text: the title alone); the baselines"
                                        " read the text only.")  # fmt: skip
    promptreps_decode: Literal["fixed", "stop"] = Field(default="fixed", description="PromptReps: decode exactly K - "
                                                        "1 words and read all K slots (the reference's trainer), or "
                                                        "stop at the closing quote (diffret 0.1).")  # fmt: skip
    promptreps_n: int = Field(default=4, ge=0, description="PromptReps: the cap N trained at when kq / kp are not "
                              "given (the paper's fine-tuning: 4; 0: the zero-shot selection, diffret 0.1).")
    lora_head: bool | None = Field(default=None, description="LoRA on the vocabulary head too (default: LLaDA, whose "
                                   "reference targets' ff_out matches its head).")  # fmt: skip
    retrieved_negatives: int | None = Field(default=None, ge=1, description="SIDR: draw each step's negatives from "
                                            "the top N of a beta search by the current query encoder over the "
                                            "training corpus's bag-of-tokens index, judged-relevant passages "
                                            "dropped (SIDR's in-training retrieval: N 20-100); default: the training "
                                            "set's stored negatives.")  # fmt: skip
    encoders: Literal["shared", "separate"] | None = Field(default=None, description="SIDR: one encoder for queries "
                                                           "and passages (shared), or a passage encoder of its own "
                                                           "trained beside the query encoder and saved in the model "
                                                           "folder's passage_encoder/ (separate: SIDR's, the "
                                                           "default; full fine-tuning only).")  # fmt: skip

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
                "adapter": "full", "lr": 2e-5, "warmup_ratio": min(1.0, 1.0 / epochs), "grad_clip": 2.0,
                "epochs": epochs, "kq": 1, "kp": 1, "weight_decay": 0.0, "pool_size": 128, "global_batch": 128,
                "n_negatives": 1, "q_max_len": 128, "p_max_len": 256, "train_title_sep": " ", "tau": 1.0,
                "encoders": "separate",
            }  # fmt: skip
            update = {k: v for k, v in pick.items() if getattr(self, k) is None}
            update.update(schedule="hf_linear" if self.schedule == "auto" else self.schedule,
                          gather="yes" if self.gather == "auto" else self.gather)  # fmt: skip
            return self.model_copy(update=update)
        base = readout in BASELINES
        loop = LoopSettings()
        pick = {
            "adapter": loop.adapter, "lr": loop.lr, "warmup_ratio": loop.warmup_ratio, "grad_clip": loop.grad_clip,
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
        update: dict[str, Any] = {k: v for k, v in pick.items() if getattr(self, k) is None}
        if self.schedule == "auto":
            update["schedule"] = "hf_linear" if base else "cosine"
        if self.gather == "auto":
            update["gather"] = "no" if base else "yes"
        return self.model_copy(update=update)

    def lr_factor(self, step: int, steps: int) -> float:
        """The schedule's multiplier (``schedule``; ``linear`` is LoopSettings' diffret 0.1 schedule)."""
        kind = "cosine" if self.schedule == "auto" else self.schedule
        if kind == "linear":
            return super().lr_factor(step, steps)
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
    return {"h": h, "i": first("intermediate_size", "mlp_hidden_size", "n_inner") or 4 * h, "layers": layers,
            "vocab": vocab}  # fmt: skip


def training_memory(raw: dict[str, Any], s: TrainSettings, sparse: bool, bf16: bool, world: int = 1,
                    weight_bytes: int = 4) -> dict[str, int] | None:  # fmt: skip
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
    per_token = layers * h * act + (8 * h + 3 * inter) * act if s.gradient_checkpointing else \
        layers * (8 * h + 3 * inter) * act  # fmt: skip
    params = layers * (4 * h * h + 3 * h * inter) + vocab * h
    slots = chunk * kq + chunk * per_group * kp
    pool_texts = pool * (1 + per_group) * world if s.gather == "yes" else pool * (1 + per_group)
    return {
        "weights": params * weight_bytes + (params * 12 if s.adapter == "full" else 0),
        "activations": tokens * per_token,
        "head": slots * vocab * 4 * 3 if sparse and s.sparse_loss else 0,  # logits, their pooled max, gradients
        "pool": pool_texts * ((vocab if sparse and s.sparse_loss else 0) + max(kq, kp) * h) * 4 * 2,
    }


def lora_targets(bb: Backbone, head: bool | None = None) -> tuple[str, ...]:
    """The module names LoRA wraps: the family's projections, and the vocabulary head when ``head`` (None: the
    family's reference default, LLaDA's: its reference targets' ``ff_out`` matches the head as well as the
    feed-forward output, backbone_adapters.py L197-207). LLaDA under its own code (``loader remote``) takes the
    reference's names as they are.

    >>> from types import SimpleNamespace as NS
    >>> from retrieval.models.backbones import FAMILIES
    >>> lora_targets(NS(spec=FAMILIES["llada"], loader="native"))[-1], "lm_head" in lora_targets(NS(
    ...     spec=FAMILIES["dream"], loader="native"))
    ('lm_head', False)
    """
    spec = bb.spec
    if getattr(bb, "loader", "native") == "remote" and spec.remote_lora_targets:
        return spec.remote_lora_targets
    if head is None:
        head = spec.lora_head
    return spec.lora_targets + (("lm_head",) if head else ())


def lora_wrap(bb: Backbone, s: LoopSettings) -> Any:
    """Inject LoRA layers into the backbone (in place) on its family's projections (:func:`lora_targets`); the peft
    model. The backbone's head is bound again afterwards, so that a wrapped head is the one reading logits."""
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, m in bb.model.named_modules() if isinstance(m, torch.nn.Linear)}
    wanted = lora_targets(bb, getattr(s, "lora_head", None))
    if getattr(s, "lora_head", None) and "lm_head" in wanted and "lm_head" not in names:
        raise BackboneError(f"{bb.name}: no linear lm_head to put LoRA on (lora_head); its linear modules: "
                            f"{', '.join(sorted(names))}")  # fmt: skip
    targets = [t for t in wanted if t in names]
    if not targets:
        raise BackboneError(
            f"{bb.name}: no LoRA targets of the {bb.family} family ({', '.join(bb.spec.lora_targets) or 'none'}) "
            f"among its linear modules ({', '.join(sorted(names))}); use --full or add them to the family"
        )
    cfg = LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout, target_modules=targets)
    peft = get_peft_model(bb.model, cfg)
    bb.rebind_head()
    return peft


def world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) unless a launcher (torchrun, accelerate) started several.

    >>> world() if "WORLD_SIZE" not in __import__("os").environ else (0, 1)
    (0, 1)
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def join_process_group(device: torch.device | str) -> tuple[int, int]:
    """Join the launcher's process group when ``WORLD_SIZE`` > 1 (gloo on CPU, nccl on CUDA); (rank, world)."""
    rank, size = world()
    dist = torch.distributed
    if size > 1 and not dist.is_initialized():
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return world()


class _Gather(torch.autograd.Function):
    """All-gather along dim 0 (equal shapes) whose backward returns each process the gradient of its own
    slice, summed over every process's loss (an all-reduce, which every backend has). Not PyTorch's
    ``torch.distributed.nn.functional.all_gather``: under gloo its gradients did not match one process (the
    2-process test's second-step loss was off by 1.8)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        dist = torch.distributed
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n]


def gather(x: torch.Tensor | None, size: int) -> torch.Tensor | None:
    """``x`` from every process concatenated along dim 0, differentiable (itself when ``size`` is 1)."""
    return x if x is None or size == 1 else _Gather.apply(x)


def trainable_count(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


@dataclass
class Prepared:
    """One micro-batch's inputs: token ids, the group size, the content words' vocabulary ids (sparse loss), and
    the texts (RepLLaMA tokenizes its prefix and the text as one string)."""

    query_ids: list[list[int]]
    passage_ids: list[list[int]]
    group: int
    query_allowed: list[list[int]] | None = None
    passage_allowed: list[list[int]] | None = None
    query_texts: list[str] | None = None
    passage_texts: list[str] | None = None
    groups: list[Group] | None = None  # the groups themselves (retrieved negatives need their ids)
    retrieved: bool = False  # the negatives were retrieved (:meth:`Trainer.retrieve`)

    def chunk(self, start: int, end: int) -> Prepared:
        """Groups ``start:end`` (their queries and their passages)."""
        g = self.group

        def cut(xs: list | None, n: int = 1) -> list | None:
            return None if xs is None else xs[start * n : end * n]

        return Prepared(cut(self.query_ids), cut(self.passage_ids, g), g, cut(self.query_allowed),  # type: ignore[arg-type]
                        cut(self.passage_allowed, g), cut(self.query_texts), cut(self.passage_texts, g),
                        cut(self.groups), self.retrieved)  # fmt: skip


class RandContext:
    """The RNG states (CPU, and CUDA where used) at creation, restored on entry: a forward pass run again under it
    draws the same dropout masks (gradient caching's second pass)."""

    def __init__(self, device: torch.device):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def __enter__(self) -> None:
        self._saved = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda is not None else None)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self._saved[0])
        if self._saved[1] is not None:
            torch.cuda.set_rng_state(self._saved[1], self.device)


class Loop:
    """The task-independent half of training: the adapter (peft LoRA or every weight), AdamW (sharded under DDP
    when asked), the schedule, the seeded data order, gradient accumulation with prefetched inputs, DDP
    gradient averaging, resumable checkpoints. A task subclasses it with :meth:`prepare` (a micro-batch's CPU
    work, run on a prefetch thread) and :meth:`micro_loss` (the forward pass and the loss).
    ``items`` are the training units one micro-batch takes ``batch_size`` of (groups, ranked lists)."""

    def __init__(self, bb: Backbone, items: Sequence[Any], settings: LoopSettings):
        if not items:
            raise ValueError("no training items")
        self.bb, self.s, self.items = bb, settings, list(items)
        torch.manual_seed(settings.seed)
        if settings.adapter == "lora":
            self.peft = lora_wrap(bb, settings)
        else:
            self.peft = None
            for p in bb.model.parameters():
                p.requires_grad_(True)
        if settings.gradient_checkpointing and hasattr(bb.model, "gradient_checkpointing_enable"):
            bb.model.gradient_checkpointing_enable()
        self.params = [p for p in bb.model.parameters() if p.requires_grad]
        self.trainable, self.total = trainable_count(bb.model)
        self.rank, self.world = join_process_group(bb.device)
        auto_bf16 = settings.precision == "auto" and bb.device.type == "cuda"
        self.bf16 = settings.precision == "bfloat16" or auto_bf16  # autocast; the weights stay as loaded
        if self.world > 1:  # the same initial weights everywhere, then each process its own dropout stream
            torch.manual_seed(settings.seed * 1_000_003 + self.rank)
        self.steps_per_epoch, self.steps = planned_steps(len(self.items), settings, self.world)
        self.pool, per_step = settings.pool_items(self.world), settings.step_items(self.world)
        if self.pool % self.world or per_step % self.pool:
            raise ValueError(f"a step of {per_step} items must be whole pools of {self.pool}, and a pool shared "
                             f"evenly by {self.world} process(es)")  # fmt: skip
        self.share = self.pool // self.world  # this process's items of each pool
        self.sharded = settings.shard_optimizer and self.world > 1
        if self.sharded:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                self.params, optimizer_class=torch.optim.AdamW, lr=settings.lr, weight_decay=settings.weight_decay
            )
        else:
            self.opt = torch.optim.AdamW(self.params, lr=settings.lr, weight_decay=settings.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda step: settings.lr_factor(step, self.steps))
        self.step = 0
        self.log: list[dict[str, Any]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="diffret-train-inputs")
        self._ahead: tuple[int, Future[list[Any]]] | None = None

    # ------------------------------------------------------------------------------------------ the task
    def prepare(self, items: list[Any], step: int) -> Any:
        """A micro-batch's inputs (CPU work only); a function of the items and the step."""
        raise NotImplementedError

    def micro_loss(self, prepared: Any, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """(the micro-batch's loss, its logged parts) for inputs from :meth:`prepare`."""
        raise NotImplementedError

    @staticmethod
    def samples(prepared: Any) -> int:
        """The samples in a prepared micro-batch (for samples/s)."""
        return len(prepared)

    # ------------------------------------------------------------------------------------------ data
    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.s.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.items), generator=g).tolist()

    def micro_batches(self, step: int) -> list[list[Any]]:
        """This process's items of optimizer step ``step`` (a function of the seed and the step only): the step's
        pools (``pool_items`` over every process each), this rank's slice of each."""
        per_step, pool, share = self.s.step_items(self.world), self.pool, self.share
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)[within * per_step : (within + 1) * per_step]
        chosen = [self.items[i] for i in order]
        glob = [chosen[i : i + pool] for i in range(0, len(chosen), pool)]
        return [mb[self.rank * share : (self.rank + 1) * share] for mb in glob]

    def micro_backward(self, prepared: Any, step: int, n: int) -> dict[str, float]:
        """Backpropagate one of a step's ``n`` micro-batches (its loss / n); its logged parts."""
        loss, parts = self.micro_loss(prepared, step)
        (loss / n).backward()
        return parts

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.bb.model.train()
        self.opt.zero_grad(set_to_none=True)
        parts: dict[str, float] = {}
        batches = self._inputs(self.step)
        for mb in batches:
            p = self.micro_backward(mb, self.step, len(batches))
            for k, v in p.items():
                parts[k] = parts.get(k, 0.0) + v / len(batches)
        if self.world > 1:
            self._average(parts)
        torch.nn.utils.clip_grad_norm_(self.params, self.s.grad_clip)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.step += 1
        n = sum(self.samples(mb) for mb in batches) * self.world
        row = {"step": self.step, "lr": lr, **parts, "samples_per_s": n / max(time.perf_counter() - t0, 1e-9)}
        self.log.append(row)
        return row

    def _inputs(self, step: int) -> list[Any]:
        """Step ``step``'s prepared micro-batches (prefetched when the previous step asked for them), and the
        next step's started on the prefetch thread, so that tokenising overlaps the model's work."""
        ahead = self._ahead
        batches = ahead[1].result() if ahead is not None and ahead[0] == step else None
        if batches is None:
            batches = [self.prepare(mb, step) for mb in self.micro_batches(step)]
        nxt = step + 1
        if nxt < self.steps:
            self._ahead = (nxt, self._pool.submit(lambda: [self.prepare(mb, nxt) for mb in self.micro_batches(nxt)]))
        return batches

    def _average(self, parts: dict[str, float]) -> None:
        """Average the gradients (one flat all-reduce per step, as DDP under no_sync) and the logged parts."""
        dist = torch.distributed
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        i = 0
        for p, g in zip(self.params, grads, strict=True):
            p.grad = flat[i : i + g.numel()].view_as(g)
            i += g.numel()
        keys = sorted(parts)
        vals = torch.tensor([parts[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(vals)
        parts.update({k: float(v) / self.world for k, v in zip(keys, vals, strict=True)})

    def run(self, on_step: Callable[[dict[str, Any]], None] | None = None,
            checkpoint: Callable[[bytes], None] | None = None, every: int = 50) -> list[dict[str, Any]]:  # fmt: skip
        """Train to the last step, calling ``checkpoint(bytes)`` every ``every`` steps (and at the end); under
        DDP every process must call ``run`` (the state gathers every process's RNG), one passes ``checkpoint``."""
        while self.step < self.steps:
            row = self.train_step()
            if on_step:
                on_step(row)
            if self.step % every == 0 or self.step == self.steps:
                state = self.state_bytes() if checkpoint or self.world > 1 else b""  # collective under DDP
                if checkpoint:
                    checkpoint(state)
        self.bb.model.eval()
        return self.log

    # ------------------------------------------------------------------------------------------ state
    def state_bytes(self) -> bytes:
        """The resumable state (collective under DDP: every process calls it; rank 0's is the complete one)."""
        if self.sharded:  # gather the optimizer shards on rank 0 (the others' state is never written)
            self.opt.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        state = {
            "step": self.step, "log": self.log,
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.opt.state_dict() if self.rank == 0 or not self.sharded else None,
            "scheduler": self.sched.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        }  # fmt: skip
        if self.world > 1:  # every process's RNG states, so that each resumes its own stream
            rngs: list[Any] = [None] * self.world
            torch.distributed.all_gather_object(rngs, state["rng"])
            state["rng"] = {"ranks": rngs}
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def load_state(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), weights_only=False)
        if len(state["params"]) != len(self.params):
            raise ValueError("the checkpoint was written by another model or adapter")
        with torch.no_grad():
            for p, v in zip(self.params, state["params"], strict=True):
                p.copy_(v)
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        rng = state["rng"]
        if "ranks" in rng:
            if len(rng["ranks"]) != self.world:
                raise ValueError(f"the checkpoint was written by {len(rng['ranks'])} processes, not {self.world}")
            rng = rng["ranks"][self.rank]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        self.step, self.log = int(state["step"]), list(state["log"])

    def close(self) -> None:
        """Stop the prefetch thread; leave the process group (after every process has finished), if joined."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    def extra_models(self) -> dict[str, torch.nn.Module]:
        """Models trained beside the main one, saved in sub-folders of its folder (by sub-folder); taken off it."""
        return {}

    def merged_model(self) -> torch.nn.Module:
        """The trained model with any adapter merged into its weights (a plain transformers model)."""
        self.bb.model.eval()
        return self.peft.merge_and_unload() if self.peft is not None else self.bb.model


class Trainer(Loop):
    """Contrastive training of a readout's backbone on groups (every readout: the mask readout, S > 1
    included, PromptReps, DiffEmbed, RepLLaMA); ``run`` resumes from a checkpoint when given one.

    Settings left at None / ``auto`` take the readout's reference values (:meth:`TrainSettings.resolved`). A pool
    larger than ``batch_size`` groups per process is trained by gradient caching (GradCache, Gao et al. 2021, as
    Tevatron offers it): the pool is encoded in chunks of ``batch_size`` without gradients, the loss over the
    whole pool gives the gradient of every representation, then each chunk is encoded again with gradients (the
    same dropout masks) and backpropagates its representations' gradients. Loss and gradients equal one pass over
    the whole pool; memory is one chunk's activations plus the pool's representations.
    """

    def __init__(self, reader: Readout, groups: Sequence[Group], settings: TrainSettings,
                 negatives: RetrievedNegatives | None = None):  # fmt: skip
        if not groups:
            raise ValueError("no training groups")
        if (negatives is not None) != (settings.retrieved_negatives is not None):
            raise ValueError("retrieved negatives need both the setting (its depth) and the bag-of-tokens index")
        if negatives is not None and reader.name != "sidr":
            raise ValueError(f"retrieved negatives are SIDR's in-training retrieval: train --readout sidr (got "
                             f"{reader.name})")  # fmt: skip
        settings = settings.resolved(reader.name)  # SIDR's sets K = 1 (one vector per text)
        if settings.kq is None or settings.kp is None:
            raise ValueError("training needs a budget: give kq and kp (the train stage takes the zero-shot selection)")
        reader.check_k([settings.kq])
        reader.check_k([settings.kp])
        if settings.encoders == "separate":  # before the loop collects the parameters: the optimizer takes both
            if reader.name != "sidr" or settings.adapter != "full":
                raise ValueError("separate query and passage encoders are SIDR's: --readout sidr with full fine-tuning"
                                 f" (got {reader.name}, {settings.adapter})")  # fmt: skip
            reader.separate()  # type: ignore[attr-defined]
        elif settings.encoders == "shared" and reader.name == "sidr" and reader.passage_bb is not None:  # type: ignore[attr-defined]
            raise ValueError("this model has a separately trained passage encoder; train it with separate encoders")
        self.r = reader
        self.baseline = reader.name in BASELINES
        self.sidr = reader.name == "sidr"  # SIDR's semi-parametric objective (objective.sidr_loss)
        self.negatives = negatives
        super().__init__(reader.bb, groups, settings)
        self.s: TrainSettings = settings
        for side, k in (("query", settings.kq), ("passage", settings.kp)):
            reader.pieces(side, k)  # the prompt's tokens, before the prefetch thread shares the tokenizer

    @staticmethod
    def samples(prepared: Prepared) -> int:  # type: ignore[override]
        return len(prepared.query_ids)

    def extra_models(self) -> dict[str, torch.nn.Module]:
        """SIDR's separately trained passage encoder (``passage_encoder/``), taken off the query model."""
        twin = self.r.detach_passage_encoder() if self.sidr else None  # type: ignore[attr-defined]
        return {} if twin is None else {PASSAGE_ENCODER: twin.eval()}

    def _text(self, p: dict[str, Any]) -> str:
        """A training passage as the reference's trainers build it: title + sep + text (the title alone without a
        text; train_diffretriever.py L307-310), the text alone for the baselines (train_diffembed.py L73-82)."""
        if self.baseline:
            return p["text"]
        return passage_text(p["title"], p["text"], self.s.train_title_sep if self.s.train_title_sep is not None
                            else " ")  # fmt: skip

    def _passages(self, g: Group, step: int) -> list[str]:
        rng = random.Random(f"{self.s.seed}:{step}:{g.query_id}")
        pos = rng.choice(g.positives)
        negs = sample_fill(rng, g.negatives, int(self.s.n_negatives or 0))
        return [self._text(p) for p in [pos, *negs]]

    def _limit(self, side: str, k: int, n: int) -> int:
        """Text tokens kept: ``n``, or for the baselines ``n`` in all (their scripts count special tokens and
        RepLLaMA's prefix)."""
        if not self.baseline:
            return n
        counted, extra = self.r.overhead(side, k)
        return max(1, n - counted - extra)

    def _ids(self, texts: list[str], limit: int) -> list[list[int]]:
        quiet_length_warning(self.r.bb.tokenizer)
        ids = self.r.bb.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [list(t[:limit]) for t in ids]

    def _allowed(self, allowed: list[list[int]] | None, vocab: int) -> torch.Tensor | None:
        if allowed is None:
            return None
        out = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=self.r.bb.device)
        for i, ids in enumerate(allowed):
            out[i, [j for j in ids if j < vocab]] = True
        return out

    def prepare(self, groups: list[Group], step: int) -> Prepared:  # type: ignore[override]
        """A micro-batch's inputs (CPU work only: sampling, tokenisation, the content filter); a function of
        the groups and the step, so :meth:`train_step` prepares the next step's on a thread meanwhile."""
        s = self.s
        queries = [g.query for g in groups]
        passages = [t for g in groups for t in self._passages(g, step)]
        filt = self.r.filter if s.sparse_loss else None
        return Prepared(
            self._ids(queries, self._limit("query", s.kq, int(s.q_max_len))),  # type: ignore[arg-type]
            self._ids(passages, self._limit("passage", s.kp, int(s.p_max_len))),  # type: ignore[arg-type]
            len(passages) // len(groups),
            [filt.allowed_ids(t) for t in queries] if filt else None,
            [filt.allowed_ids(t) for t in passages] if filt else None,
            queries, passages, list(groups),
        )  # fmt: skip

    def _forward(self, ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> Any:
        kw: dict[str, Any] = {}
        if self.r.name == "promptreps":
            kw["stop"] = "none" if self.s.promptreps_decode == "fixed" else "reference"
        if self.r.name == "repllama":
            kw["texts"] = texts
        return self.r.train_forward(ids, side, k, **kw)

    def _reps(self, x: Prepared) -> tuple[torch.Tensor, ...]:
        """(query dense, mask, sparse, passage dense, mask, sparse) of a micro-batch, with gradients; SIDR: (query
        vector, its bag of tokens, None, passage vector, its bag of tokens, None)."""
        s = self.s
        if self.sidr:
            with torch.autocast(self.r.bb.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                qv, qb = self.r.train_vectors(x.query_ids, "query")  # type: ignore[attr-defined]
                pv, pb = self.r.train_vectors(x.passage_ids, "passage")  # type: ignore[attr-defined]
            return qv, qb, None, pv, pb, None  # type: ignore[return-value]
        with torch.autocast(self.r.bb.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            q = self._forward(x.query_ids, x.query_texts, "query", s.kq)  # type: ignore[arg-type]
            p = self._forward(x.passage_ids, x.passage_texts, "passage", s.kp)  # type: ignore[arg-type]
        qs = ps = None
        if s.sparse_loss and q.logits is not None and p.logits is not None:
            qs = sparse_vectors(q.logits, self._allowed(x.query_allowed, q.logits.shape[-1]), q.mask)
            ps = sparse_vectors(p.logits, self._allowed(x.passage_allowed, p.logits.shape[-1]), p.mask)
        return q.dense, q.mask, qs, p.dense, p.mask, ps

    def _loss(self, reps: tuple[torch.Tensor, ...], group: int) -> tuple[torch.Tensor, dict[str, float]]:
        """InfoNCE of this rank's queries against the pool (every rank's passages when ``gather``)."""
        qd, qm, qs, pd, pm, ps = reps
        pool = self.world if self.s.gather == "yes" else 1
        if self.sidr:  # qm / pm: the bags of tokens
            offset = self.rank * qd.shape[0] if pool > 1 else 0
            topk = int(self.r.cfg.sparse_topk or 768)
            return sidr_loss(qd, qm, gather(pd, pool), gather(pm, pool), group, topk, offset)  # type: ignore[arg-type]
        ph, ps = gather(pd, pool), gather(ps, pool)
        pm = pm if pool == 1 else gather(pm.float(), pool) > 0.5
        offset = self.rank * qd.shape[0] if pool > 1 else 0
        return contrastive_loss(qd, qm, ph, pm, group, float(self.s.tau), qs, ps, offset=offset)  # type: ignore[arg-type]

    def micro_loss(  # type: ignore[override]
        self, groups: list[Group] | Prepared, step: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        x = self._ready(groups if isinstance(groups, Prepared) else self.prepare(groups, step), step)
        return self._loss(self._reps(x), x.group)

    def _ready(self, x: Prepared, step: int) -> Prepared:
        """The micro-batch as trained: with retrieved negatives, each group's negatives replaced by passages the
        current query encoder retrieves (:meth:`retrieve`)."""
        return x if self.negatives is None or x.retrieved else self.retrieve(x, step)

    def retrieve(self, x: Prepared, step: int) -> Prepared:
        """SIDR's in-training retrieval: the queries encoded by the current model (eval mode, no gradients), their
        top-k plus own tokens searched over the fixed bag-of-tokens index, and each group's negatives drawn from
        the top ``retrieved_negatives`` without its judged-relevant passages (seeded by step and query)."""
        assert self.negatives is not None and x.groups is not None
        model = self.r.bb.model
        was = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.autocast(self.r.bb.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                qv, qb = self.r.train_vectors(x.query_ids, "query")  # type: ignore[attr-defined]
        finally:
            model.train(was)
        queries = sparse_rows(topk_own(qv.float(), qb, int(self.r.cfg.sparse_topk or 768)))
        relevant = [{str(p["docid"]) for p in g.positives} for g in x.groups]
        rngs = [random.Random(f"{self.s.seed}:{step}:{g.query_id}:retrieved") for g in x.groups]
        picks = self.negatives.draw(queries, relevant, x.group - 1, rngs)
        ids, texts = list(x.passage_ids), list(x.passage_texts or [])
        limit = self._limit("passage", int(self.s.kp or 1), int(self.s.p_max_len))  # type: ignore[arg-type]
        for i, got in enumerate(picks):
            if got:
                new = [self._text(p) for p in got]
                a, b = i * x.group + 1, (i + 1) * x.group
                ids[a:b], texts[a:b] = self._ids(new, limit), new
        return replace(x, passage_ids=ids, passage_texts=texts or None, retrieved=True)

    def micro_backward(self, prepared: Any, step: int, n: int) -> dict[str, float]:  # type: ignore[override]
        """One pool's loss / n backpropagated: in one pass when this process's share fits ``batch_size`` groups,
        else by gradient caching (:meth:`cached_backward`)."""
        x = self._ready(prepared if isinstance(prepared, Prepared) else self.prepare(prepared, step), step)
        if len(x.query_ids) <= self.s.batch_size:
            return super().micro_backward(x, step, n)
        return self.cached_backward(x, n)

    def cached_backward(self, x: Prepared, n: int = 1) -> dict[str, float]:
        """Gradient caching over chunks of ``batch_size`` groups: the same loss and gradients as one pass."""
        b, dev = self.s.batch_size, self.r.bb.device
        chunks = [x.chunk(i, min(i + b, len(x.query_ids))) for i in range(0, len(x.query_ids), b)]
        states, parts_of = [], []
        with torch.no_grad():
            for c in chunks:
                states.append(RandContext(dev))
                parts_of.append(self._reps(c))
        leaves = []
        for j in range(6):  # every representation of the pool, a leaf that collects its gradient
            got = [r[j] for r in parts_of]
            leaves.append(None if got[0] is None else torch.cat(got).detach().requires_grad_(j not in (1, 4)))
        loss, parts = self._loss(tuple(leaves), x.group)  # type: ignore[arg-type]
        (loss / n).backward()
        start = [0, 0]
        for c, state in zip(chunks, states, strict=True):
            with state:
                reps = self._reps(c)
            surrogate = torch.zeros((), device=dev)
            for j, rep in enumerate(reps):
                if rep is None or j in (1, 4):
                    continue
                side = 0 if j < 3 else 1
                grad = leaves[j].grad[start[side] : start[side] + rep.shape[0]]  # type: ignore[union-attr]
                surrogate = surrogate + (rep.float() * grad.float()).sum()
            surrogate.backward()
            start = [start[0] + len(c.query_ids), start[1] + len(c.passage_ids)]
        return parts
