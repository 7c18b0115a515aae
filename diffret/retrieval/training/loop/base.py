"""The task-independent half of training (:class:`Loop`, shared by the contrastive trainer and the rerankers):
the adapter (LoRA on the family's projections, or every weight), AdamW (sharded under DDP when asked), the
schedule, the seeded data order, gradient accumulation with prefetched inputs, resumable checkpoints."""

from __future__ import annotations

import io
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ...models.backbones import Backbone, BackboneError
from .distributed import average, join_process_group
from .settings import LoopSettings, planned_steps


def lora_targets(bb: Backbone, head: bool | None = None) -> tuple[str, ...]:
    """The module names LoRA wraps: the family's projections, and the vocabulary head when ``head`` (None: the
    family's reference default, LLaDA's: its reference targets' ``ff_out`` matches the head as well as the
    feed-forward output, backbone_adapters.py L197-207). LLaDA under its own code (``loader remote``) takes the
    reference's names as they are.

    >>> from types import SimpleNamespace as NS
    >>> from diffret.retrieval.models.backbones import FAMILIES
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
        raise BackboneError(
            f"{bb.name}: no linear lm_head to put LoRA on (lora_head); its linear modules: {', '.join(sorted(names))}"
        )
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


def trainable_count(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


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
        enable_checkpointing = getattr(bb.model, "gradient_checkpointing_enable", None)
        if settings.gradient_checkpointing and enable_checkpointing is not None:
            enable_checkpointing()
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
            raise ValueError(
                f"a step of {per_step} items must be whole pools of {self.pool}, and a pool shared "
                f"evenly by {self.world} process(es)"
            )
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
        average(self.params, parts, self.world)

    def run(
        self,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        checkpoint: Callable[[bytes], None] | None = None,
        every: int = 50,
    ) -> list[dict[str, Any]]:
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
            "step": self.step,
            "log": self.log,
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.opt.state_dict() if self.rank == 0 or not self.sharded else None,
            "scheduler": self.sched.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        }
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
