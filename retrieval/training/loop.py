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
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, Field

from ..data.collections import TITLE_SEP, passage_text
from ..data.training import Group, sample_fill
from ..models.backbones import Backbone, BackboneError
from ..models.encoding import quiet_length_warning
from ..models.readouts import Readout
from .objective import contrastive_loss, sparse_vectors


class LoopSettings(BaseModel):
    """The optimisation settings every training task shares (the contrastive trainer, the rerankers)."""

    adapter: Literal["lora", "full"] = Field(default="lora", description="lora (peft) or full (every weight).")
    lora_r: int = Field(default=16, ge=1)
    lora_alpha: int = Field(default=64, ge=1)
    lora_dropout: float = Field(default=0.05, ge=0.0)
    lr: float = Field(default=1e-4, gt=0)
    warmup_ratio: float = Field(default=0.06, ge=0.0, le=1.0)
    weight_decay: float = Field(default=0.01, ge=0.0)
    grad_clip: float = Field(default=1.0, gt=0)
    epochs: float = Field(default=1.0, gt=0)
    batch_size: int = Field(default=8, ge=1, description="Items per micro-batch (groups; lists for rerankers).")
    grad_accum: int = Field(default=4, ge=1, description="Micro-batches per optimizer step.")
    gradient_checkpointing: bool = Field(default=False)
    shard_optimizer: bool = Field(default=False, description="Under DDP, shard the AdamW state across the "
                                  "processes (PyTorch's ZeroRedundancyOptimizer, ZeRO stage 1).")  # fmt: skip
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="auto: bf16 mixed precision on CUDA, fp32 on CPU (Table 7); or either one."
    )
    seed: int = Field(default=0)
    max_steps: int | None = Field(default=None, ge=1, description="Stop after this many steps (default: epochs).")

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


class TrainSettings(LoopSettings):
    """Everything that changes a contrastive training run's result (its hash names the trained model)."""

    kq: int | None = Field(default=None, ge=1, description="Query masks K_q during training (default: the budget "
                           "the base model's zero-shot train split selected).")  # fmt: skip
    kp: int | None = Field(default=None, ge=1, description="Passage masks K_p during training (default: as K_q).")
    batch_size: int = Field(default=8, ge=1, description="Groups per micro-batch (the in-batch pool).")
    q_max_len: int = Field(default=32, ge=1, description="Query text tokens (before the prompt).")
    p_max_len: int = Field(default=156, ge=1, description="Passage text tokens (before the prompt).")
    n_negatives: int = Field(default=15, ge=0, description="Hard negatives per group.")
    tau: float = Field(default=0.01, gt=0, description="Temperature of the dense InfoNCE.")
    sparse_loss: bool = Field(default=True, description="Add the sparse InfoNCE (no temperature).")


def planned_steps(n_groups: int, s: LoopSettings, world: int = 1) -> tuple[int, int]:
    """(optimizer steps per epoch, steps in all) for ``n_groups`` groups on ``world`` processes.

    >>> planned_steps(809, TrainSettings(epochs=3))   # 32 groups a step
    (25, 75)
    >>> planned_steps(809, TrainSettings(epochs=3), world=2)   # 64 groups a step
    (12, 36)
    """
    per_epoch = max(1, n_groups // (s.batch_size * s.grad_accum * world))
    return per_epoch, s.max_steps or max(1, math.ceil(per_epoch * s.epochs))


def lora_wrap(bb: Backbone, s: LoopSettings) -> Any:
    """Inject LoRA layers into the backbone (in place) on its family's projections; the peft model."""
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, m in bb.model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = [t for t in bb.spec.lora_targets if t in names]
    if not targets:
        raise BackboneError(
            f"{bb.name}: no LoRA targets of the {bb.family} family ({', '.join(bb.spec.lora_targets) or 'none'}) "
            f"among its linear modules ({', '.join(sorted(names))}); use --full or add them to the family"
        )
    cfg = LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout, target_modules=targets)
    return get_peft_model(bb.model, cfg)


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
    """One micro-batch's inputs: token ids, the group size, the content words' vocabulary ids (sparse loss)."""

    query_ids: list[list[int]]
    passage_ids: list[list[int]]
    group: int
    query_allowed: list[list[int]] | None = None
    passage_allowed: list[list[int]] | None = None


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
        """This process's items of optimizer step ``step`` (a function of the seed and the step only): the
        step's ``grad_accum`` global micro-batches of ``batch_size x world`` items, this rank's slice of each."""
        b = self.s.batch_size
        per_step = b * self.s.grad_accum * self.world
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)[within * per_step : (within + 1) * per_step]
        chosen = [self.items[i] for i in order]
        glob = [chosen[i : i + b * self.world] for i in range(0, len(chosen), b * self.world)]
        return [mb[self.rank * b : (self.rank + 1) * b] for mb in glob]

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.bb.model.train()
        self.opt.zero_grad(set_to_none=True)
        parts: dict[str, float] = {}
        batches = self._inputs(self.step)
        for mb in batches:
            loss, p = self.micro_loss(mb, self.step)
            (loss / len(batches)).backward()
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

    def merged_model(self) -> torch.nn.Module:
        """The trained model with any adapter merged into its weights (a plain transformers model)."""
        self.bb.model.eval()
        return self.peft.merge_and_unload() if self.peft is not None else self.bb.model


class Trainer(Loop):
    """Contrastive training of a readout's backbone on groups (every readout: the mask readout, S > 1
    included, PromptReps, DiffEmbed, RepLLaMA); ``run`` resumes from a checkpoint when given one."""

    def __init__(self, reader: Readout, groups: Sequence[Group], settings: TrainSettings, title_sep: str = TITLE_SEP):
        if not groups:
            raise ValueError("no training groups")
        if settings.kq is None or settings.kp is None:
            raise ValueError("training needs a budget: give kq and kp (the train stage takes the zero-shot selection)")
        reader.check_k([settings.kq])
        reader.check_k([settings.kp])
        self.r, self.sep = reader, title_sep
        super().__init__(reader.bb, groups, settings)
        self.s: TrainSettings = settings
        for side, k in (("query", settings.kq), ("passage", settings.kp)):
            reader.pieces(side, k)  # the prompt's tokens, before the prefetch thread shares the tokenizer

    @staticmethod
    def samples(prepared: Prepared) -> int:  # type: ignore[override]
        return len(prepared.query_ids)

    def _passages(self, g: Group, step: int) -> list[str]:
        rng = random.Random(f"{self.s.seed}:{step}:{g.query_id}")
        pos = rng.choice(g.positives)
        negs = sample_fill(rng, g.negatives, self.s.n_negatives)
        return [passage_text(p["title"], p["text"], self.sep) for p in [pos, *negs]]

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
            self._ids(queries, s.q_max_len), self._ids(passages, s.p_max_len), len(passages) // len(groups),
            [filt.allowed_ids(t) for t in queries] if filt else None,
            [filt.allowed_ids(t) for t in passages] if filt else None,
        )  # fmt: skip

    def micro_loss(  # type: ignore[override]
        self, groups: list[Group] | Prepared, step: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        s = self.s
        x = groups if isinstance(groups, Prepared) else self.prepare(groups, step)
        with torch.autocast(self.r.bb.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            q = self.r.train_forward(x.query_ids, "query", s.kq)
            p = self.r.train_forward(x.passage_ids, "passage", s.kp)
        group = x.group
        qs = ps = None
        if s.sparse_loss and q.logits is not None and p.logits is not None:
            qs = sparse_vectors(q.logits, self._allowed(x.query_allowed, q.logits.shape[-1]), q.mask)
            ps = sparse_vectors(p.logits, self._allowed(x.passage_allowed, p.logits.shape[-1]), p.mask)
        # this rank's queries against every rank's pool
        ph, ps = gather(p.dense, self.world), gather(ps, self.world)
        pm = p.mask if self.world == 1 else gather(p.mask.float(), self.world) > 0.5
        offset = self.rank * len(x.query_ids)
        return contrastive_loss(q.dense, q.mask, ph, pm, group, s.tau, qs, ps, offset=offset)
