"""Exact scoring at MS MARCO scale under one byte budget: peak RSS against the budget, and speed against the
implementation it replaced (HEAD 504d8ff, kept below as ``legacy_search_pass``) in the same process.

    python benchmarks/scale_scoring.py rss                 # peak RSS at 3 budgets (one child process each)
    python benchmarks/scale_scoring.py speed               # new vs legacy on the same data, rankings compared
    python benchmarks/scale_scoring.py msmarco             # MS MARCO's size: 1M passages x K_p 16 x H 128
    python benchmarks/scale_scoring.py child --modes single_dense --docs 100000 --budget-mb 64   # one run

Passages are synthetic and streamed: block ``i`` is generated from seed (seed, i) when it is scored and
dropped after, so the corpus is never held (1M x 16 x 128 float32 would be 8 GB). Vectors are unit-norm
Gaussian (a passage's drawn from a pool of 65,536, which is cheap to stream); sparse vectors draw their
terms from a Zipf(1.2) vocabulary of 150k ids, about 10 terms per query and 60 per passage (the
content-word filter keeps a text's own words), a passage's term list from a pool of 8,192, fresh weights.

Each RSS figure is the peak resident set (VmHWM) of a fresh child process. The ``dry`` run does
everything but score (queries, the passage stream, the top-k state and its result), so scored peak minus
dry peak is what scoring itself holds: it stays under the budget.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffret.retrieval.search import Encodings, SearchSettings, search_pass  # noqa: E402
from diffret.retrieval.search.encodings import SparseFlat  # noqa: E402
from diffret.retrieval.search.scoring import NEG, RunningTopK, TopK, Workspace, maxsim  # noqa: E402

VOCAB = 150_000


# ------------------------------------------------------------------------------------------- data
def _sparse(rng: np.random.Generator, n: int, mean_nnz: int) -> SparseFlat:
    lengths = np.clip(rng.poisson(mean_nnz, n), 1, 4 * mean_nnz)
    docs = np.repeat(np.arange(n, dtype=np.int64), lengths)
    ids = (rng.zipf(1.2, len(docs)) - 1) % VOCAB
    pairs = np.unique(docs * VOCAB + ids)  # a text's terms once each, sorted
    docs, ids = pairs // VOCAB, pairs % VOCAB
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(docs, minlength=n), out=offsets[1:])
    return SparseFlat(offsets, ids, (rng.random(len(ids), dtype=np.float32) * 2 + 0.05).astype(np.float32))


POOL = 1 << 16  # passage blocks draw their vectors and term lists from pools: generating 1M x 16 x 128 fresh
_pools: dict[tuple, tuple[np.ndarray, SparseFlat]] = {}  # Gaussians costs more than scoring them on 2 cores


def _pool(h: int, nnz: int, seed: int) -> tuple[np.ndarray, SparseFlat]:
    if (h, nnz, seed) not in _pools:
        rng = np.random.default_rng([seed, 1 << 30])
        v = rng.standard_normal((POOL, h), dtype=np.float32)
        v /= np.linalg.norm(v, axis=-1, keepdims=True)
        _pools[(h, nnz, seed)] = (v, _sparse(rng, POOL // 8, nnz) if nnz else None)
    return _pools[(h, nnz, seed)]


def _encodings(ids: list[str], x: np.ndarray, sp: SparseFlat | None) -> Encodings:
    n, k, _ = x.shape
    if sp is None:
        sp = SparseFlat(np.zeros(n + 1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
    t = torch.from_numpy(x)
    mean = t.mean(1)
    lists_i = np.split(sp.ids, sp.offsets[1:-1]) if n else []
    lists_w = np.split(sp.weights, sp.offsets[1:-1]) if n else []
    return Encodings(
        ids, t, torch.ones(n, k, dtype=torch.bool), mean / mean.norm(dim=-1, keepdim=True), lists_i, lists_w, sp
    )


def synthetic(n: int, k: int, h: int, seed: tuple[int, ...], prefix: str, nnz: int) -> Encodings:
    """Fresh texts (the queries): unit Gaussian vectors, Zipf terms."""
    rng = np.random.default_rng(list(seed))
    x = rng.standard_normal((n, k, h), dtype=np.float32)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    sp = _sparse(rng, n, nnz) if nnz else None
    return _encodings([f"{prefix}{seed[-1]}-{i}" for i in range(n)], x, sp)


def pooled(n: int, k: int, h: int, seed: tuple[int, int], prefix: str, nnz: int) -> Encodings:
    """Passages: each of the k vectors drawn from a pool of 65,536 unit Gaussians, each term list from a
    pool of 8,192 Zipf lists with fresh weights (so scores rarely tie)."""
    rng = np.random.default_rng(list(seed))
    vecs, sparse_pool = _pool(h, nnz, seed[0])
    x = vecs[rng.integers(0, POOL, size=(n, k))]
    sp = None
    if nnz:
        pick = rng.integers(0, len(sparse_pool), size=n)
        lengths = np.diff(sparse_pool.offsets)[pick]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        src = np.repeat(sparse_pool.offsets[pick] - offsets[:-1], lengths) + np.arange(offsets[-1])
        weights = rng.random(len(src), dtype=np.float32) * 2 + 0.05
        sp = SparseFlat(offsets, sparse_pool.ids[src], weights.astype(np.float32))
    return _encodings([f"{prefix}{seed[-1]}-{i}" for i in range(n)], x, sp)


def stream(docs: int, shard: int, kp: int, h: int, seed: int, nnz: int) -> Iterator[Encodings]:
    for i, s in enumerate(range(0, docs, shard)):
        yield pooled(min(shard, docs - s), kp, h, (seed, i), "d", nnz)


# --------------------------------------------------------------------- legacy (HEAD 504d8ff, verbatim logic)
class LegacyTopK:
    def __init__(self, n_queries: int, k: int, device: torch.device):
        self.k = k
        self.scores = torch.full((n_queries, 0), NEG, device=device)
        self.index = torch.zeros((n_queries, 0), dtype=torch.long, device=device)

    def update(self, scores: torch.Tensor, offset: int) -> None:
        idx = torch.arange(offset, offset + scores.shape[1], device=scores.device).expand_as(scores)
        allsc = torch.cat([self.scores, scores], 1)
        allix = torch.cat([self.index, idx], 1)
        kk = min(self.k, allsc.shape[1])
        best, pos = torch.topk(allsc, kk, dim=1)
        self.scores, self.index = best, torch.gather(allix, 1, pos)

    def result(self) -> TopK:
        s = self.scores.float().cpu().numpy()
        ix = self.index.cpu().numpy().astype(np.int64)
        ix[~np.isfinite(s)] = -1
        return TopK(s, ix)


class LegacySparseQueries:
    def __init__(self, sparse_ids: list[np.ndarray], sparse_weights: list[np.ndarray], device: torch.device):
        allids = np.concatenate([x for x in sparse_ids] + [np.zeros(0, np.int64)])
        self.vocab = np.unique(allids)
        mat = torch.zeros(max(len(self.vocab), 1), len(sparse_ids), device=device)
        for j, (ids, w) in enumerate(zip(sparse_ids, sparse_weights, strict=True)):
            if len(ids):
                rows = torch.from_numpy(np.searchsorted(self.vocab, ids)).to(device)
                mat[rows, j] = torch.from_numpy(w).to(device)
        self.matrix = mat

    def scores(self, sparse_ids: list[np.ndarray], sparse_weights: list[np.ndarray]) -> torch.Tensor:
        device = self.matrix.device
        crow = [0]
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        for ids, w in zip(sparse_ids, sparse_weights, strict=True):
            if len(ids) and len(self.vocab):
                pos = np.searchsorted(self.vocab, ids)
                pos_c = np.minimum(pos, len(self.vocab) - 1)
                keep = self.vocab[pos_c] == ids
                order = np.argsort(pos_c[keep], kind="stable")
                cols.append(pos_c[keep][order])
                vals.append(w[keep][order])
                crow.append(crow[-1] + int(keep.sum()))
            else:
                crow.append(crow[-1])
        n = len(sparse_ids)
        if crow[-1] == 0:
            return torch.zeros(self.matrix.shape[1], n, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            csr = torch.sparse_csr_tensor(
                torch.tensor(crow, dtype=torch.int64),
                torch.from_numpy(np.concatenate(cols).astype(np.int64)),
                torch.from_numpy(np.concatenate(vals).astype(np.float32)),
                size=(n, self.matrix.shape[0]),
                check_invariants=False,
            ).to(device)
        return (csr @ self.matrix).T


def legacy_search_pass(
    queries: dict[int, Encodings],
    passages,
    modes: list[str],
    topk: int,  # noqa: ANN001
    chunk_elems: int = 1 << 26,
    query_block: int = 512,
):  # noqa: ANN201
    """HEAD's search_pass: [Q, N] blocks bounded by the passage side only (no self-hit removal here)."""
    device = next(iter(queries.values())).multi.device
    tops = {(kq, m): LegacyTopK(len(q), topk, device) for kq, q in queries.items() for m in modes}
    prepared = {
        kq: LegacySparseQueries(q.sparse_ids, q.sparse_weights, device)
        for kq, q in queries.items()
        if "sparse_max" in modes
    }
    ws = Workspace()
    doc_ids: list[str] = []
    for block in passages:
        offset = len(doc_ids)
        doc_ids.extend(block.ids)
        kp = block.multi.shape[1]
        widest = max(min(len(q), query_block) * q.multi.shape[1] for q in queries.values())
        step = max(1, chunk_elems // max(1, widest * kp))
        for s in range(0, len(block), step):
            p = block.rows(s, min(s + step, len(block)))
            for kq, q in queries.items():
                for mode in modes:
                    if mode == "single_dense":
                        sc = q.single @ p.single.T
                    elif mode == "multi_dense":
                        b = query_block
                        sc = torch.cat(
                            [
                                maxsim(q.multi[i : i + b], q.mask[i : i + b], p.multi, p.mask, workspace=ws)
                                for i in range(0, len(q), b)
                            ],
                            0,
                        )
                    else:
                        sc = prepared[kq].scores(p.sparse_ids, p.sparse_weights)
                        sc = sc.masked_fill(sc <= 0, NEG)
                    tops[(kq, mode)].update(sc, offset + s)
    return {key: t.result() for key, t in tops.items()}, doc_ids


# ------------------------------------------------------------------------------------------- runs
def _rss() -> tuple[int, int]:
    """(current, peak) resident set of this process, bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


def child(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads) if args.threads else None
    modes = args.modes.split(",")
    nnz = 60 if "sparse_max" in modes else 0
    queries = {args.kq: synthetic(args.queries, args.kq, args.hidden, (args.seed, 10**6), "q", nnz // 6)}
    rss0 = _rss()[0]
    t0 = time.perf_counter()
    passages = stream(args.docs, args.shard, args.kp, args.hidden, args.seed, nnz)
    if args.impl == "dry":  # everything but the scoring: the stream, the top-k state and its result
        tops = {m: RunningTopK(args.queries, args.topk, torch.device("cpu")) for m in modes}
        doc_ids = [x for b in passages for x in b.ids]  # search_pass keeps the passage ids too
        for t in tops.values():
            t.columns = len(doc_ids)
        res = {(args.kq, m): t.result() for m, t in tops.items()}
    elif args.impl == "legacy":
        res, _ = legacy_search_pass(queries, passages, modes, args.topk)
    else:
        settings = SearchSettings(topk=args.topk, block_bytes=int(args.budget_mb * (1 << 20)))
        res, _ = search_pass(queries, passages, modes, settings)
    secs = time.perf_counter() - t0
    cur, peak = _rss()
    digest = {m: int(np.int64(res[(args.kq, m)].index[:, :10].astype(np.int64).sum())) for m in modes}
    return {
        "impl": args.impl,
        "budget_mb": args.budget_mb,
        "modes": modes,
        "docs": args.docs,
        "queries": args.queries,
        "kq": args.kq,
        "kp": args.kp,
        "hidden": args.hidden,
        "shard": args.shard,
        "topk": args.topk,
        "seconds": round(secs, 1),
        "rss_start_mb": rss0 >> 20,
        "peak_rss_mb": peak >> 20,
        "top10_index_sum": digest,
        "threads": torch.get_num_threads(),
    }


def run_child(**kw: object) -> dict:
    cmd = [sys.executable, __file__, "child"]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rec = json.loads(out.strip().splitlines()[-1])
    print(json.dumps(rec), flush=True)
    return rec


def bench_rss(args: argparse.Namespace) -> None:
    base = dict(
        modes=args.modes,
        docs=args.docs,
        queries=args.queries,
        kq=args.kq,
        kp=args.kp,
        hidden=args.hidden,
        shard=args.shard,
        topk=args.topk,
    )
    dry = run_child(impl="dry", **base)
    rows = []
    for mb in args.budgets:
        rec = run_child(impl="new", budget_mb=mb, **base)
        rows.append((mb, rec["peak_rss_mb"], rec["peak_rss_mb"] - dry["peak_rss_mb"], rec["seconds"]))
    print(
        f"\npeak RSS, {args.docs:,} passages x K_p {args.kp} x H {args.hidden} (blocks of {args.shard:,}), "
        f"{args.queries:,} queries x K_q {args.kq}, top-{args.topk}, modes {args.modes}"
    )
    print(f"  no scoring (dry)        peak {dry['peak_rss_mb']:6d} MB")
    for mb, peak, extra, secs in rows:
        print(f"  budget {mb:6.0f} MB        peak {peak:6d} MB   scoring adds {extra:5d} MB   {secs:7.1f} s")
    if args.legacy:
        rec = run_child(impl="legacy", **base)
        print(
            f"  legacy (HEAD)           peak {rec['peak_rss_mb']:6d} MB   scoring adds "
            f"{rec['peak_rss_mb'] - dry['peak_rss_mb']:5d} MB   {rec['seconds']:7.1f} s"
        )


def bench_speed(args: argparse.Namespace) -> None:
    """New vs legacy in this process on the same in-memory blocks; top-k rankings compared row by row."""
    # fmt: off
    cases = [("single_dense", 7000, 1, 50_000, 16), ("sparse_max", 7000, 16, 50_000, 16),
             ("multi_dense", 128, 8, 20_000, 8)]
    # fmt: on
    threads = torch.get_num_threads()
    print(f"speed, {threads} threads, top-{args.topk}, blocks of {args.shard:,} passages, H {args.hidden}")
    for mode, nq, kq, docs, kp in cases:
        nnz = 60 if mode == "sparse_max" else 0
        q = {kq: synthetic(nq, kq, args.hidden, (args.seed, 10**6), "q", nnz // 6)}
        blocks = list(stream(docs, args.shard, kp, args.hidden, args.seed, nnz))
        times = {}
        for name, fn in (
            ("legacy", lambda: legacy_search_pass(q, iter(blocks), [mode], args.topk)),  # noqa: B023
            ("new", lambda: search_pass(q, iter(blocks), [mode], SearchSettings(topk=args.topk))),  # noqa: B023
        ):
            t0 = time.perf_counter()
            res, _ = fn()
            times[name] = (time.perf_counter() - t0, res[(kq, mode)])
        (t_old, a), (t_new, b) = times["legacy"], times["new"]
        same, cut = _compare(a, b)
        sa, sb = np.sort(a.scores, 1), np.sort(b.scores, 1)
        both = np.isfinite(sa) & np.isfinite(sb)
        close = np.abs(np.where(both, sa, 0) - np.where(both, sb, 0)).max(initial=0.0)
        print(
            f"  {mode:13s} {nq:5d} q x K_q {kq:2d}, {docs:7,d} p x K_p {kp:2d}: legacy {t_old:7.2f} s  "
            f"new {t_new:7.2f} s  ratio {t_old / t_new:5.2f}x  identical runs {same:.4f} of queries "
            f"(+{cut:.4f} differing only in which tied documents make the cut)  max |score diff| {close:.1e}",
            flush=True,
        )


def _compare(a: TopK, b: TopK) -> tuple[float, float]:
    """Share of queries whose runs are identical once ranked as run_table ranks them (score, then document),
    and share differing only among documents tied at the top-k cut (the legacy cut is arbitrary there)."""
    same = cut = 0
    for sa, ia, sb, ib in zip(a.scores, a.index, b.scores, b.index, strict=True):
        oa, ob = np.lexsort((ia, -sa)), np.lexsort((ib, -sb))
        if np.array_equal(ia[oa], ib[ob]) and np.array_equal(sa[oa], sb[ob]):
            same += 1
        elif np.array_equal(sa[oa], sb[ob]):
            low = sa[oa][-1]
            cut += set(ia[sa > low].tolist()) == set(ib[sb > low].tolist())
    return same / len(a.index), cut / len(a.index)


def bench_msmarco(args: argparse.Namespace) -> None:
    """1M passages x K_p 16 x H 128 streamed; 7k queries where the 2 cores allow it."""
    for modes, nq, kq in (("single_dense,sparse_max", 7000, 16), ("multi_dense", args.multi_queries, 16)):
        base = dict(modes=modes, docs=1_000_000, queries=nq, kq=kq, kp=16, hidden=128, shard=10_000, topk=1000)
        dry = run_child(impl="dry", **base)
        rec = run_child(impl="new", budget_mb=args.budget, **base)
        print(
            f"1M x K_p 16 x H 128, {nq:,} queries x K_q {kq}, {modes}: budget {args.budget} MB, peak RSS "
            f"{rec['peak_rss_mb']} MB (dry {dry['peak_rss_mb']} MB: scoring adds "
            f"{rec['peak_rss_mb'] - dry['peak_rss_mb']} MB), {rec['seconds']:.0f} s",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["rss", "speed", "msmarco", "child"])
    ap.add_argument("--impl", default="new", choices=["new", "legacy", "dry"])
    ap.add_argument("--modes", default="single_dense,sparse_max")
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=7000)
    ap.add_argument("--kq", type=int, default=16)
    ap.add_argument("--kp", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--shard", type=int, default=10_000, help="passages per streamed block")
    ap.add_argument("--topk", type=int, default=1000)
    ap.add_argument("--budget-mb", type=float, default=256)
    ap.add_argument("--budgets", type=float, nargs="*", default=[64, 256, 1024])
    ap.add_argument("--budget", type=float, default=256, help="msmarco: the budget (MB)")
    ap.add_argument("--multi-queries", type=int, default=64, help="msmarco: queries of the multi_dense run")
    ap.add_argument("--legacy", action="store_true", help="rss: also the legacy implementation's peak")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.what == "child":
        print(json.dumps(child(args)))
    else:
        {"rss": bench_rss, "speed": bench_speed, "msmarco": bench_msmarco}[args.what](args)


if __name__ == "__main__":
    main()
