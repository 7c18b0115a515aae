"""Gradient caching: one optimizer step over a pool of 128 queries x 16 passages (the reference's run_train.sh
pool on four GPUs; Table 7's is 32 queries) on one device, in one forward pass against chunks of --batch-size
queries with cached representation gradients. Each variant runs in its own process (peak memory is per process):
its step's peak memory above what the process held before the step (RSS high-water mark on CPU, CUDA peak on a
GPU), its time and its loss (equal in both).

    python benchmarks/gradcache.py [--model ../shared/models/splade-tiny-mlm] [--pool 128] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from train import scifact_groups

    from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
    from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
    from diffret.retrieval.training.loop import Trainer, TrainSettings

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    bb = load_backbone(BackboneConfig(model=args.model, device=args.device))
    for m in bb.model.modules():  # no dropout: both variants compute the same loss
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    groups = scifact_groups(args.pool, 15)
    chunk = args.pool if args.variant == "plain" else args.batch_size
    s = TrainSettings(
        adapter="full",
        kq=args.k,
        kp=args.k,
        batch_size=chunk,
        pool_size=args.pool,
        global_batch=args.pool,
        n_negatives=15,
        max_steps=1,
    )
    tr = Trainer(make_reader(bb, ReadoutConfig()), groups, s)
    x = tr.prepare(tr.micro_batches(0)[0], 0)
    dev = bb.device
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    rss = _kib("VmRSS")
    tr.bb.model.train()
    t0 = time.perf_counter()
    parts = tr.micro_backward(x, 0, 1)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    out = {
        "variant": args.variant,
        "seconds": seconds,
        "loss": parts["loss"],
        "rss_peak_mib": (_kib("VmHWM") - rss) / 2**20,
        "passages": len(x.passage_ids),
    }
    if dev.type == "cuda":
        out["cuda_peak_mib"] = (torch.cuda.max_memory_allocated(dev) - before) / 2**20
        out["device"] = torch.cuda.get_device_name(dev)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "splade-tiny-mlm"))
    ap.add_argument("--pool", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", choices=["plain", "cached"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        return child(args)
    rows = {}
    for variant in ("plain", "cached"):
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            variant,
            "--model",
            args.model,
            "--pool",
            str(args.pool),
            "--batch-size",
            str(args.batch_size),
            "--k",
            str(args.k),
            "--device",
            args.device,
            "--threads",
            str(args.threads),
        ]
        env = {**os.environ, "NLTK_DATA": os.environ.get("NLTK_DATA") or str(REPO.parent / "shared" / "nltk_data")}
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
        if p.returncode:
            raise SystemExit(f"{variant} failed:\n{p.stderr[-3000:]}")
        rows[variant] = json.loads(p.stdout.strip().splitlines()[-1])
    plain, cached = rows["plain"], rows["cached"]
    print(f"pool {args.pool} queries x 16 passages ({plain['passages']} passages), K = {args.k}, {args.model}")
    for r in (plain, cached):
        cuda = f", CUDA peak {r['cuda_peak_mib']:.0f} MiB" if "cuda_peak_mib" in r else ""
        print(
            f"{r['variant']:7s} step {r['seconds']:7.2f} s  loss {r['loss']:.6f}  peak +{r['rss_peak_mib']:.0f} MiB "
            f"RSS{cuda}"
        )
    key = "cuda_peak_mib" if "cuda_peak_mib" in plain else "rss_peak_mib"
    print(
        f"cached / plain: memory {cached[key] / plain[key]:.2f}x, time {cached['seconds'] / plain['seconds']:.2f}x, "
        f"|loss difference| {abs(cached['loss'] - plain['loss']):.2e}"
    )


if __name__ == "__main__":
    main()
