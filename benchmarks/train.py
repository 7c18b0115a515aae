"""Training throughput and memory, in one process on the same model, groups and batch:

1. the Trainer (tokenises every step, samples negatives, content filter for the sparse side, LoRA or full,
   clipping, scheduler) vs a bare hand-written PyTorch loop over the same inputs tokenised ahead
   (trunk forward, LM head at the masks, the same InfoNCE, backward, AdamW)   target >= 0.9x
2. the activation memory of a training micro-batch (bytes the forward keeps for backward) with and without
   gradient checkpointing, and on a GPU the step's CUDA peak

    python benchmarks/train.py [--model ../shared/models/splade-tiny-mlm] [--steps 8] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import transformers

from diffret.retrieval.data.training import Group
from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
from diffret.retrieval.training.loop import Trainer, TrainSettings
from diffret.retrieval.training.objective import contrastive_loss, sparse_vectors

REPO = Path(__file__).resolve().parents[1]
SCIFACT = REPO.parent / "shared" / "data" / "scifact"


def scifact_groups(n: int, negatives: int, seed: int = 0) -> list[Group]:
    """Train queries with their judged passages and random negatives (enough for timing)."""
    corpus = {}
    with open(SCIFACT / "corpus.jsonl") as f:
        for line in f:
            d = json.loads(line)
            corpus[d["_id"]] = {"docid": d["_id"], "title": d.get("title", ""), "text": d["text"]}
    queries = {}
    with open(SCIFACT / "queries.jsonl") as f:
        for line in f:
            d = json.loads(line)
            queries[d["_id"]] = d["text"]
    pos: dict[str, list[str]] = {}
    with open(SCIFACT / "qrels" / "train.tsv") as f:
        next(f)
        for line in f:
            q, d, s = line.split("\t")
            if int(s) > 0 and d in corpus:
                pos.setdefault(q, []).append(d)
    rng = random.Random(seed)
    ids = sorted(corpus)
    out = []
    for q in sorted(pos)[:n]:
        negs = [corpus[d] for d in rng.sample(ids, negatives)]
        out.append(Group(q, queries[q], [corpus[d] for d in pos[q]], negs))
    return out


def settings(args: argparse.Namespace, **kw) -> TrainSettings:
    return TrainSettings(
        adapter=args.adapter,
        kq=args.k,
        kp=args.k,
        batch_size=args.batch_size,
        pool_size=args.batch_size,
        global_batch=args.batch_size,
        n_negatives=args.negatives,
        lr=1e-4,
        warmup_ratio=0.0,
        max_steps=1_000_000,
        p_max_len=args.p_max_len,
        q_max_len=32,
        **kw,
    )


def make_trainer(args: argparse.Namespace, groups: list[Group], **kw) -> Trainer:
    torch.manual_seed(0)
    bb = load_backbone(BackboneConfig(model=args.model, device=args.device))
    return Trainer(make_reader(bb, ReadoutConfig()), groups, settings(args, **kw))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bare_loop(tr: Trainer, steps: int) -> float:
    """The same batches, tokenised and padded ahead; a plain loop: seconds for ``steps`` steps."""
    r, s = tr.r, tr.s
    batches = []
    vocab = r.bb.model.config.vocab_size
    for step in range(steps):
        (mb,) = tr.micro_batches(step)
        x = tr.prepare(mb, step)
        qb = r._mask_batch(r._fit(x.query_ids, "query", s.kq), "query", s.kq)
        pb = r._mask_batch(r._fit(x.passage_ids, "passage", s.kp), "passage", s.kp)
        allowed = (tr._allowed(x.query_allowed, vocab), tr._allowed(x.passage_allowed, vocab))
        batches.append((qb, pb, allowed, x.group))
    model = r.bb.model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    sync(r.bb.device)
    t0 = time.perf_counter()
    for qb, pb, (qa, pa), group in batches:
        reps = []
        for b in (qb, pb):  # the trunk, then the LM head at the masks only
            hidden = model.base_model(input_ids=b.input_ids, attention_mask=b.attention_mask).last_hidden_state
            h = hidden[torch.arange(b.input_ids.shape[0])[:, None], b.positions]
            reps.append((h, r.bb.logits(h)))
        (qh, ql), (ph, pl) = reps
        qm = torch.ones(qh.shape[:2], dtype=torch.bool)
        pm = torch.ones(ph.shape[:2], dtype=torch.bool)
        loss, _ = contrastive_loss(
            qh, qm, ph, pm, group, tau=s.tau, q_sparse=sparse_vectors(ql, qa), p_sparse=sparse_vectors(pl, pa)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    sync(r.bb.device)
    return time.perf_counter() - t0


def trainer_loop(tr: Trainer, steps: int) -> float:
    sync(tr.r.bb.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        tr.train_step()
    sync(tr.r.bb.device)
    return time.perf_counter() - t0


def step_memory(args: argparse.Namespace, groups: list[Group], checkpointing: bool) -> tuple[int, int | None]:
    """(bytes the forward keeps for backward, CUDA peak bytes of the step or None) for one training micro-batch.
    The saved-tensor count is exact on any device: it is what gradient checkpointing trades for recomputation."""
    tr = make_trainer(args, groups, gradient_checkpointing=checkpointing)
    dev = tr.r.bb.device
    (mb,) = tr.micro_batches(0)
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            seen[(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())] = t.untyped_storage().nbytes()
        return t

    tr.r.bb.model.train()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = tr.micro_loss(mb, 0)
    loss.backward()
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else None
    return sum(seen.values()), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "splade-tiny-mlm"))
    ap.add_argument("--adapter", default="full", choices=["full", "lora"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--negatives", type=int, default=7)
    ap.add_argument("--p-max-len", type=int, default=156)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=2, help="Alternating timed rounds; the best of each is kept.")
    args = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()

    groups = scifact_groups(args.batch_size * (args.steps + 1), args.negatives)
    tr = make_trainer(args, groups)
    print(
        f"model {args.model} ({args.adapter}) on {tr.r.bb.device}; batch {args.batch_size} groups x "
        f"(1 + {args.negatives}) passages, K = {args.k}, passages <= {args.p_max_len} tokens, "
        f"{args.steps} steps"
    )
    tr.train_step()  # warm-up
    bare = make_trainer(args, groups)
    bare_loop(bare, 1)  # warm-up
    t_trainer = t_bare = float("inf")
    for _ in range(args.repeats):  # alternating, so that a busy machine slows both alike
        t_trainer = min(t_trainer, trainer_loop(tr, args.steps))
        t_bare = min(t_bare, bare_loop(bare, args.steps))
    n = args.steps * args.batch_size
    print(f"{'Trainer':28s} {n / t_trainer:8.2f} samples/s")
    print(
        f"{'bare PyTorch loop':28s} {n / t_bare:8.2f} samples/s  Trainer/bare {t_bare / t_trainer:.2f}x (target >= 0.9)"
    )
    (off, peak_off), (on, peak_on) = (step_memory(args, groups, flag) for flag in (False, True))
    print(
        f"{'activations kept':28s} {off / 2**20:8.1f} MiB without gradient checkpointing, {on / 2**20:.1f} MiB "
        f"with it ({100 * (1 - on / off):.0f}% saved)"
    )
    if peak_off is not None and peak_on is not None:
        print(f"{'CUDA peak of a step':28s} {peak_off / 2**20:8.1f} MiB without, {peak_on / 2**20:.1f} MiB with")


if __name__ == "__main__":
    main()
