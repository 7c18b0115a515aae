"""Search benchmarks: exact MaxSim throughput against plain einsum references, and LanceDB ANN against exact.

    python benchmarks/search.py                       # exact part (synthetic, in-process ratios)
    python benchmarks/search.py --lance 100000        # + LanceDB IVF_PQ vs exact at 100k docs
    python benchmarks/search.py --lance 100000 1000000
    python benchmarks/search.py --device cuda --docs 1000000   # pipeline and torch references on the GPU

Exact part: ``retrieval.search.search_pass`` (multi_dense, running top-1000 over shards) against two
references run in the same process on the same data:
  - numpy: ``np.einsum('qih,njh->qinj')`` per document chunk, max over j, mean over i, argpartition top-k;
  - torch: the same einsum in torch (which maps it to batched matmuls).
  - a per-query loop: the same einsum one query at a time (how a plain evaluation script scores).
The ratio is reference time / pipeline time (higher is better); all give identical top-10s (checked).
The LanceDB part runs ``benchmarks/search_lance.py`` (build, IVF_PQ index, over-fetch + exact re-rank).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffret.retrieval.search import Encodings, SearchSettings, search_pass  # noqa: E402


def synthetic(n: int, k: int, h: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, k, h)).astype(np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def as_encodings(x: np.ndarray, prefix: str, device: str = "cpu") -> Encodings:
    t = torch.from_numpy(x).to(device)
    mean = t.mean(1)
    return Encodings(
        [f"{prefix}{i}" for i in range(len(x))],
        t,
        torch.ones(x.shape[:2], dtype=torch.bool, device=device),
        mean / mean.norm(dim=-1, keepdim=True),
        [np.zeros(0, np.int64)] * len(x),
        [np.zeros(0, np.float32)] * len(x),
    )


def ref_numpy(q: np.ndarray, p: np.ndarray, topk: int, chunk: int) -> np.ndarray:
    scores = np.concatenate(
        [
            np.einsum("qih,njh->qinj", q, p[s : s + chunk], optimize=True).max(-1).mean(1)
            for s in range(0, len(p), chunk)
        ],
        axis=1,
    )
    part = np.argpartition(-scores, topk - 1, axis=1)[:, :topk]
    order = np.argsort(-np.take_along_axis(scores, part, 1), axis=1, kind="stable")
    return np.take_along_axis(part, order, 1)


def ref_torch(q: np.ndarray, p: np.ndarray, topk: int, chunk: int, device: str = "cpu") -> np.ndarray:
    qt, pt = torch.from_numpy(q).to(device), torch.from_numpy(p).to(device)
    scores = torch.cat(
        [torch.einsum("qih,njh->qinj", qt, pt[s : s + chunk]).amax(-1).mean(1) for s in range(0, len(pt), chunk)], 1
    )
    return torch.topk(scores, topk, dim=1).indices.cpu().numpy()


def ref_per_query(q: np.ndarray, p: np.ndarray, topk: int, chunk: int, device: str = "cpu") -> np.ndarray:
    """The plain script: one query at a time, einsum over every document, then top-k."""
    pt = torch.from_numpy(p).to(device)
    out = []
    for qi in torch.from_numpy(q).to(device):
        s = torch.cat(
            [torch.einsum("ih,njh->inj", qi, pt[c : c + chunk]).amax(-1).mean(0) for c in range(0, len(pt), chunk)]
        )
        out.append(torch.topk(s, topk).indices.cpu().numpy())
    return np.stack(out)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_exact(
    docs: int, queries: int, kq: int, kp: int, hidden: int, topk: int, shard: int, device: str = "cpu"
) -> None:
    q = synthetic(queries, kq, hidden, 1)
    p = synthetic(docs, kp, hidden, 2)
    qe = {kq: as_encodings(q, "q", device)}
    blocks = [as_encodings(p[s : s + shard], "d", device) for s in range(0, docs, shard)]
    chunk = max(1, (1 << 26) // (queries * kq * kp))  # the same similarity-matrix budget for the references

    def timed(fn):  # noqa: ANN001, ANN202
        fn()  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        return time.perf_counter() - t0, out

    t_ours, (res, ids) = timed(lambda: search_pass(qe, iter(blocks), ["multi_dense"], SearchSettings(topk=topk)))
    ours = res[(kq, "multi_dense")].index
    t_np, top_np = timed(lambda: ref_numpy(q, p, topk, chunk))
    t_torch, top_torch = timed(lambda: ref_torch(q, p, topk, chunk, device))
    t_loop, top_loop = timed(lambda: ref_per_query(q, p, topk, chunk * queries, device))
    same_l = np.mean([len(set(a[:10]) & set(b[:10])) / 10 for a, b in zip(ours, top_loop, strict=True)])
    same = np.mean([len(set(a[:10]) & set(b[:10])) / 10 for a, b in zip(ours, top_np, strict=True)])
    same_t = np.mean([len(set(a[:10]) & set(b[:10])) / 10 for a, b in zip(ours, top_torch, strict=True)])
    print(
        f"exact MaxSim: {docs:,} docs x K_p={kp}, {queries} queries x K_q={kq}, H={hidden}, top-{topk}, "
        f"{torch.get_num_threads()} threads" + (f", {torch.cuda.get_device_name(device)}" if device != "cpu" else "")
    )
    pairs = docs * queries / t_ours / 1e6
    print(f"  pipeline search_pass   {t_ours:8.3f} s   {queries / t_ours:10.1f} queries/s   {pairs:8.1f} M pairs/s")
    print(f"  numpy einsum reference {t_np:8.3f} s   ratio {t_np / t_ours:6.2f}x   top-10 agreement {same:.3f}  (CPU)")
    print(f"  torch einsum reference {t_torch:8.3f} s   ratio {t_torch / t_ours:6.2f}x   top-10 agreement {same_t:.3f}")
    print(f"  per-query einsum loop  {t_loop:8.3f} s   ratio {t_loop / t_ours:6.2f}x   top-10 agreement {same_l:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--kq", type=int, default=8)
    ap.add_argument("--kp", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--topk", type=int, default=1000)
    ap.add_argument("--shard", type=int, default=10_000, help="documents per encoding shard")
    ap.add_argument("--lance", type=int, nargs="*", default=[], help="also run LanceDB vs exact at these sizes")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (the pipeline and the torch references)")
    args = ap.parse_args()
    bench_exact(args.docs, args.queries, args.kq, args.kp, args.hidden, args.topk, args.shard, args.device)
    if args.lance:
        import subprocess

        here = Path(__file__).resolve().parent
        subprocess.run([sys.executable, str(here / "search_lance.py"), "--docs", *map(str, args.lance)], check=True)


if __name__ == "__main__":
    main()
