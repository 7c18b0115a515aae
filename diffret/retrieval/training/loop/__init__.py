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

The package's modules, each importing only those above it:

- ``settings``: :class:`LoopSettings`, :class:`TrainSettings` (resolved per readout), the schedules, the planned
  steps, the memory estimate.
- ``distributed``: rank and world, the process group, the differentiable gather, the gradients' average.
- ``gradcache``: gradient caching (:class:`RandContext`, :func:`cached_backward`).
- ``base``: :class:`Loop`, the task-independent half (LoRA or full, AdamW, the data order, checkpoints).
- ``contrastive``: the contrastive :class:`Trainer` and its micro-batch (:class:`Prepared`).

Every public name is importable from ``retrieval.training.loop``; a private helper from the module that defines
it.
"""

from .base import Loop, lora_targets, lora_wrap, trainable_count
from .contrastive import Prepared, Trainer
from .distributed import average, gather, join_process_group, world
from .gradcache import RandContext, cached_backward
from .settings import BASELINES, LoopSettings, Schedule, TrainSettings, hf_lr_factor, planned_steps, training_memory

__all__ = [
    "BASELINES",
    "Loop",
    "LoopSettings",
    "Prepared",
    "RandContext",
    "Schedule",
    "TrainSettings",
    "Trainer",
    "average",
    "cached_backward",
    "gather",
    "hf_lr_factor",
    "join_process_group",
    "lora_targets",
    "lora_wrap",
    "planned_steps",
    "trainable_count",
    "training_memory",
    "world",
]
