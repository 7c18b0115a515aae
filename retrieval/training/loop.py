"""A resumable contrastive training loop over Tevatron groups (paper section 3.4, Table 7 defaults).

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` groups; each micro-batch's pool is its
positives, hard negatives and the other queries' passages (in-batch negatives). AdamW, linear warm-up over
``warmup_ratio`` of the steps then linear decay, gradient clipping. Adapters: peft LoRA on the family's
attention and feed-forward projections (``FamilySpec.lora_targets``), or ``full`` (every weight).

A checkpoint holds the trainable weights, the optimizer, the scheduler, every RNG state and the step (the
data order is a function of the seed and the epoch), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import io
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, Field

from ..data.collections import TITLE_SEP, passage_text
from ..data.training import Group, sample_fill
from ..models.backbones import Backbone, BackboneError
from ..models.encoding import quiet_length_warning
from ..models.readouts import MaskReadout, Readout
from .objective import contrastive_loss, sparse_vectors


class TrainSettings(BaseModel):
    """Everything that changes a training run's result (its hash names the trained model)."""

    kq: int = Field(default=4, ge=1, description="Query masks K_q during training.")
    kp: int = Field(default=4, ge=1, description="Passage masks K_p during training.")
    adapter: Literal["lora", "full"] = Field(default="lora", description="lora (peft) or full (every weight).")
    lora_r: int = Field(default=16, ge=1)
    lora_alpha: int = Field(default=64, ge=1)
    lora_dropout: float = Field(default=0.05, ge=0.0)
    lr: float = Field(default=1e-4, gt=0)
    warmup_ratio: float = Field(default=0.06, ge=0.0, le=1.0)
    weight_decay: float = Field(default=0.01, ge=0.0)
    grad_clip: float = Field(default=1.0, gt=0)
    epochs: float = Field(default=1.0, gt=0)
    batch_size: int = Field(default=8, ge=1, description="Groups per micro-batch (the in-batch pool).")
    grad_accum: int = Field(default=4, ge=1, description="Micro-batches per optimizer step.")
    q_max_len: int = Field(default=32, ge=1, description="Query text tokens (before the prompt).")
    p_max_len: int = Field(default=156, ge=1, description="Passage text tokens (before the prompt).")
    n_negatives: int = Field(default=15, ge=0, description="Hard negatives per group.")
    tau: float = Field(default=0.01, gt=0, description="Temperature of the dense InfoNCE.")
    sparse_loss: bool = Field(default=True, description="Add the sparse InfoNCE (no temperature).")
    gradient_checkpointing: bool = Field(default=False)
    seed: int = Field(default=0)
    max_steps: int | None = Field(default=None, ge=1, description="Stop after this many steps (default: epochs).")


def planned_steps(n_groups: int, s: TrainSettings) -> tuple[int, int]:
    """(optimizer steps per epoch, steps in all) for ``n_groups`` groups.

    >>> planned_steps(809, TrainSettings(epochs=3))   # 32 groups a step
    (25, 75)
    """
    per_epoch = max(1, n_groups // (s.batch_size * s.grad_accum))
    return per_epoch, s.max_steps or max(1, math.ceil(per_epoch * s.epochs))


def lora_wrap(bb: Backbone, s: TrainSettings) -> Any:
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


def trainable_count(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


class Trainer:
    """Trains a mask readout's backbone on groups; ``run`` resumes from a checkpoint when given one."""

    def __init__(self, reader: Readout, groups: Sequence[Group], settings: TrainSettings, title_sep: str = TITLE_SEP):
        if not isinstance(reader, MaskReadout):
            raise ValueError(f"training covers the diffretriever readout so far, not {reader.name}")
        if not groups:
            raise ValueError("no training groups")
        self.r, self.s, self.groups, self.sep = reader, settings, list(groups), title_sep
        bb = reader.bb
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
        self.steps_per_epoch, self.steps = planned_steps(len(self.groups), settings)
        self.opt = torch.optim.AdamW(self.params, lr=settings.lr, weight_decay=settings.weight_decay)
        warm = int(self.steps * settings.warmup_ratio)

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / (warm + 1)
            return max(0.0, (self.steps - step) / max(1, self.steps - warm))

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        self.step = 0
        self.log: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------------------ data
    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.s.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.groups), generator=g).tolist()

    def micro_batches(self, step: int) -> list[list[Group]]:
        """The groups of optimizer step ``step`` (a function of the seed and the step only)."""
        per_step = self.s.batch_size * self.s.grad_accum
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)[within * per_step : (within + 1) * per_step]
        chosen = [self.groups[i] for i in order]
        return [chosen[i : i + self.s.batch_size] for i in range(0, len(chosen), self.s.batch_size)]

    def _passages(self, g: Group, step: int) -> list[str]:
        rng = random.Random(f"{self.s.seed}:{step}:{g.query_id}")
        pos = rng.choice(g.positives)
        negs = sample_fill(rng, g.negatives, self.s.n_negatives)
        return [passage_text(p["title"], p["text"], self.sep) for p in [pos, *negs]]

    def _ids(self, texts: list[str], limit: int) -> list[list[int]]:
        quiet_length_warning(self.r.bb.tokenizer)
        ids = self.r.bb.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [list(t[:limit]) for t in ids]

    def _allowed(self, texts: list[str], vocab: int) -> torch.Tensor | None:
        if self.r.filter is None:
            return None
        out = torch.zeros(len(texts), vocab, dtype=torch.bool, device=self.r.bb.device)
        for i, t in enumerate(texts):
            ids = [j for j in self.r.filter.allowed_ids(t) if j < vocab]
            out[i, ids] = True
        return out

    # ------------------------------------------------------------------------------------------ steps
    def micro_loss(self, groups: list[Group], step: int) -> tuple[torch.Tensor, dict[str, float]]:
        s = self.s
        queries = [g.query for g in groups]
        passages = [t for g in groups for t in self._passages(g, step)]
        group = len(passages) // len(groups)
        qh, ql = self.r.train_forward(self._ids(queries, s.q_max_len), "query", s.kq)
        ph, pl = self.r.train_forward(self._ids(passages, s.p_max_len), "passage", s.kp)
        qm = torch.ones(qh.shape[:2], dtype=torch.bool, device=qh.device)
        pm = torch.ones(ph.shape[:2], dtype=torch.bool, device=ph.device)
        qs = ps = None
        if s.sparse_loss:
            qs = sparse_vectors(ql, self._allowed(queries, ql.shape[-1]))
            ps = sparse_vectors(pl, self._allowed(passages, pl.shape[-1]))
        return contrastive_loss(qh, qm, ph, pm, group, s.tau, qs, ps)

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.r.bb.model.train()
        self.opt.zero_grad(set_to_none=True)
        parts: dict[str, float] = {}
        batches = self.micro_batches(self.step)
        for mb in batches:
            loss, p = self.micro_loss(mb, self.step)
            (loss / len(batches)).backward()
            for k, v in p.items():
                parts[k] = parts.get(k, 0.0) + v / len(batches)
        torch.nn.utils.clip_grad_norm_(self.params, self.s.grad_clip)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.step += 1
        n = sum(len(mb) for mb in batches)
        row = {"step": self.step, "lr": lr, **parts, "samples_per_s": n / max(time.perf_counter() - t0, 1e-9)}
        self.log.append(row)
        return row

    def run(self, on_step: Callable[[dict[str, Any]], None] | None = None,
            checkpoint: Callable[[bytes], None] | None = None, every: int = 50) -> list[dict[str, Any]]:  # fmt: skip
        """Train to the last step, calling ``checkpoint(bytes)`` every ``every`` steps (and at the end)."""
        while self.step < self.steps:
            row = self.train_step()
            if on_step:
                on_step(row)
            if checkpoint and (self.step % every == 0 or self.step == self.steps):
                checkpoint(self.state_bytes())
        self.r.bb.model.eval()
        return self.log

    # ------------------------------------------------------------------------------------------ state
    def state_bytes(self) -> bytes:
        state = {
            "step": self.step, "log": self.log,
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        }  # fmt: skip
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
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.step, self.log = int(state["step"]), list(state["log"])

    def merged_model(self) -> torch.nn.Module:
        """The trained model with any adapter merged into its weights (a plain transformers model)."""
        self.r.bb.model.eval()
        return self.peft.merge_and_unload() if self.peft is not None else self.r.bb.model
