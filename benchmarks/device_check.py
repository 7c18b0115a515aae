"""The device check: diffret's GPU stages at Dream-7B shape and the encode / score benchmarks, in one call of the lent
GPU (docs/operations.md, "The device check"). Random weights (``--load-format random``): the numbers are speeds and
memory, never retrieval results.

    python benchmarks/device_prepare.py                       # here, once: .dev/ (wheels, a SciFact subset, tokenizers)
    python benchmarks/device_check.py --out OUT               # on the GPU (the tool call in docs/operations.md)
    python benchmarks/device_check.py --tiny --out /tmp/dc    # the same end to end on a CPU, tiny shapes, in minutes

Parts, each timed on its own, run as stages, score, tests, encode (``--parts``; no part or case starts past
``--deadline-s``, and the tables say which were left out):

1. ``stages``: the CLI (``python -m diffret.flows.cli``, ``--no-prefect``) on the SciFact subset with a Dream-7B-shaped
   random network in bfloat16: download (a local folder) -> tokenize -> encode (K 1 and 16, one Dask worker on the
   GPU) -> score (every mode) -> late (score's multi_dense top 100 re-scored at K_p = 4, which encodes the candidates)
   -> evaluate; each command's wall time and the GPU's peak memory in use (NVML, the whole device, sampled every
   50 ms).
2. ``encode``: ``encode_rows`` against a bare trunk loop over the same rows (the same bidirectional mask, padded on
   the device beforehand, the slots gathered and copied back once), Dream-7B and LLaDA-8B shapes, 115- and 268-token
   rows, batch 32 and 128, K = 16, and K = 16 over K = 1 time; at batch 32, the code before (``.dev/before``, on the
   same network in the same process) for its speed and its encodings, byte for byte.
3. ``score``: ``search_pass`` on the stored encodings of part 1 (H = 3,584, K_q = K_p = 16, multi_dense), and on them
   tiled to ``--score-passages``, against a bare batched matmul + max + sum (the reference's MaxSim: each query slot's
   best clamped at 0) + top-k over the same tensors.
4. ``tests``: the unit tests that need a GPU (they skip without one): the readout's synchronisation check, SIDR's
   batch readout, scoring on CUDA.

The last lines printed are the summary table; every number goes to OUT/device_check.json and the logs to OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEV = REPO / ".dev"
DATA = DEV / "data" / "scifact-sub"
MODELS = DEV / "models"
BEFORE = DEV / "before"
NLTK = REPO / "tests" / "unit" / "data" / "nltk_data"
SHAPES = {"dream": "dream-7b", "llada": "llada-8b"}
TINY = {"dream": None, "llada": None}  # --tiny: the tokenizer folders' own (tiny) shapes
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- GPU memory
class GpuMemory:
    """The device's memory in use (NVML: every process on it), sampled in a thread; ``peak()`` since ``reset()``."""

    def __init__(self) -> None:
        self.handle = None
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
        self._peak = 0
        self._stop = threading.Event()
        if self.handle is not None:
            threading.Thread(target=self._run, daemon=True).start()

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self.handle).used) if self.handle is not None else 0

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self._peak = max(self._peak, self.used())
            time.sleep(0.05)

    def reset(self) -> None:
        self._peak = self.used()

    def peak_gib(self) -> float | None:
        return round(self._peak / 2**30, 2) if self.handle is not None else None


# ------------------------------------------------------------------------------------------------ 1. stages
def cli(args: list[str], logfile: Path, env: dict[str, str]) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "diffret.flows.cli", *args], capture_output=True, text=True, env=env, cwd=REPO
    )
    with logfile.open("a") as f:
        f.write(f"\n$ diffret {' '.join(args)}\n{p.stdout}{p.stderr}")
    if p.returncode != 0:
        raise RuntimeError(f"diffret {args[0]} failed ({p.returncode}): {(p.stdout + p.stderr)[-2000:]}")
    return time.perf_counter() - t, p.stdout


def stages_part(args: argparse.Namespace, out: Path, mem: GpuMemory) -> dict[str, Any]:
    root = Path(args.store)  # not under OUT: only a few small files come back from there
    shutil.rmtree(root, ignore_errors=True)
    logfile = out / "stages.log"
    env = {
        **os.environ,
        "PREFECT_API_URL": "",
        "HF_HUB_OFFLINE": "1",
        "COLUMNS": "200",
        "NLTK_DATA": str(NLTK),
        "DIFFRET_ROOT": str(root),
    }
    source = DATA
    if args.stage_passages:  # a smaller collection: the judged passages first
        source = root.parent / "device-check-data"
        shutil.rmtree(source, ignore_errors=True)
        shutil.copytree(DATA, source)
        judged = {line.split("\t")[1] for line in (DATA / "qrels" / "test.tsv").read_text().splitlines()[1:]}
        docs = (DATA / "corpus.jsonl").read_text().splitlines()
        docs.sort(key=lambda d: json.loads(d)["_id"] not in judged)
        (source / "corpus.jsonl").write_text("\n".join(docs[: max(args.stage_passages, len(judged))]) + "\n")
    shape = [] if args.tiny else ["--shape", SHAPES["dream"]]
    model = ["--model", str(MODELS / "dream"), "--load-format", "random", *shape]
    dev = ["--device", args.device]
    common = ["--no-prefect"]
    # fmt: off
    plan = [
        ("download", ["download", "scifact", "--source", str(source)]),
        ("tokenize", ["tokenize", "-d", "scifact", *model, "--max-length", "256"]),
        ("encode", ["encode", "-d", "scifact", *model, "--dtype", args.dtype, *dev, "--k", "1,16", "--max-length",
                    "256", "--batch-size", str(args.stage_batch), "--workers", "1"]),
        ("score", ["score", "-d", "scifact", "SYSTEM", *dev]),
        ("late", ["late", "-d", "scifact", "SYSTEM", "--first-stage", "SYSTEM_SLUG", "--first-kq", "16", "--first-kp",
                  "16", "--first-mode", "multi_dense", "--kq", "16", "--kp", "4", "--mode", "multi_dense", "--depth",
                  "100", "--batch-size", str(args.stage_batch), *dev]),
        ("evaluate", ["evaluate"]),
    ]
    # fmt: on
    rows, system = [], ""
    for name, cmd in plan:
        if time.perf_counter() - T0 > args.deadline_s:
            rows.append({"stage": name, "skipped": "past the deadline"})
            continue
        cmd = [system if c == "SYSTEM_SLUG" else c for c in cmd]
        cmd = [x for c in cmd for x in (["--system", system] if c == "SYSTEM" else [c])]
        mem.reset()
        seconds, stdout = cli([*cmd, *common], logfile, env)
        rows.append(
            {
                "stage": name,
                "seconds": round(seconds, 2),
                "gpu_peak_gib": mem.peak_gib(),
                "line": stdout.strip().splitlines()[-1] if stdout.strip() else "",
            }
        )
        log(f"stage {name}: {seconds:.1f} s, GPU peak {mem.peak_gib()} GiB")
        if name == "encode":
            listing = json.loads(cli(["systems", "--format", "json"], logfile, env)[1])
            system = next(s["system"] for s in listing if s["kind"] == "encoder")
            assert system.startswith("random-"), system
    return {"system": system, "root": str(root), "rows": rows}


# ------------------------------------------------------------------------------------------------ 2. encode
def load_before() -> Any:
    """The code before the readout's device path (``.dev/before``, what ``device_prepare.py`` extracted) as the
    package ``diffret_before``, beside this one: the same network read by both in one process."""
    if "diffret_before" in sys.modules:
        return sys.modules["diffret_before"]
    spec = importlib.util.spec_from_file_location(
        "diffret_before", BEFORE / "diffret" / "__init__.py", submodule_search_locations=[str(BEFORE / "diffret")]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["diffret_before"] = mod
    spec.loader.exec_module(mod)
    return mod


def scifact_texts() -> list[str]:
    from diffret.stages.readers import passage_text

    with open(DATA / "corpus.jsonl") as f:
        return [passage_text(d.get("title", ""), d["text"]) for d in map(json.loads, f)]


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any, device: Any, repeats: int) -> tuple[float, Any]:
    """The best of ``repeats`` runs (after one warm-up run outside the timing)."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def encode_part(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
    from diffret.retrieval.models.readouts import ReadoutConfig, make_reader

    texts = scifact_texts()
    before = load_before() if args.before else None
    rows_out: list[dict[str, Any]] = []
    for family in args.families:
        if time.perf_counter() - T0 > args.deadline_s:
            rows_out.append({"model": family, "skipped": "past the deadline"})
            continue
        shape = TINY[family] if args.tiny else SHAPES[family]
        t = time.perf_counter()
        bb = load_backbone(
            BackboneConfig(
                model=str(MODELS / family), load_format="random", shape=shape, device=args.device, dtype=args.dtype
            )
        )
        sync(bb.device)
        n_params = sum(p.numel() for p in bb.model.parameters())
        log(f"{family}: {n_params / 1e9:.2f}e9 parameters built on {bb.device} in {time.perf_counter() - t:.1f} s")
        cfg = ReadoutConfig(content_filter="nltk")
        all_ids = bb.tokenizer(texts, add_special_tokens=False)["input_ids"]
        for target in args.lengths:
            counted, extra = make_reader(bb, cfg).overhead("passage", 16)
            reader = make_reader(bb, cfg, target - extra)  # a full text makes a row of `target` tokens at K = 16
            room = target - extra - counted
            keep = [i for i, ids in enumerate(all_ids) if len(ids) >= room][: args.rows]
            rows = Rows(
                [str(i) for i in range(len(keep))],
                [all_ids[i][:room] for i in keep],
                reader.filter.allowed_many([texts[i] for i in keep]) if reader.filter is not None else None,
            )
            for batch in args.batches:
                if time.perf_counter() - T0 > args.deadline_s:
                    rows_out.append({"model": family, "tokens": target, "batch": batch, "skipped": "past the deadline"})
                    continue
                old = before_reader(before, bb, cfg, target - extra) if before and batch == args.batches[0] else None
                row = encode_case(bb, reader, old, before, rows, batch, args.repeats)
                rows_out.append({"model": family, "params": n_params, "tokens": target, **row})
                log(f"encode {rows_out[-1]}")
        del bb, reader, rows  # the network is freed before the next one is built
        _BARE.clear()
        gc.collect()
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    return {"rows": rows_out}


class Rows:
    """The rows of one length: ids, token ids (cut to fill the row), the content filter's ids (as stored)."""

    def __init__(self, ids: list[str], token_ids: list[list[int]], filtered: list[list[int]] | None):
        self.ids, self.token_ids, self.filtered = ids, token_ids, filtered


def encode_case(bb: Any, reader: Any, old: Any, before: Any, rows: Rows, batch: int, repeats: int) -> dict[str, Any]:
    """One (rows, batch): diffret at K = 16 and K = 1, the bare trunk loop, and the code before when given."""
    from diffret.retrieval.models.encoding import encode_rows

    def diffret(k: int) -> Any:
        return encode_rows(reader, rows.ids, rows.token_ids, None, "passage", k, batch, filtered=rows.filtered)

    n = len(rows.ids)
    t16, table = timed(lambda: diffret(16), bb.device, repeats)
    t1, _ = timed(lambda: diffret(1), bb.device, repeats)
    tb, _ = timed(lambda: bare(bb, reader, rows.token_ids, batch), bb.device, repeats)
    row = {
        "rows": n,
        "batch": batch,
        "diffret_docs_s": round(n / t16, 2),
        "bare_docs_s": round(n / tb, 2),
        "ratio": round(tb / t16, 3),
        "k16_over_k1": round(t16 / t1, 3),
    }
    if old is not None:
        encoding = importlib.import_module("diffret_before.retrieval.models.encoding")
        t_old, old_table = timed(
            lambda: encoding.encode_rows(
                old, rows.ids, rows.token_ids, None, "passage", 16, batch, filtered=rows.filtered
            ),
            bb.device,
            1,
        )
        row |= {
            "before_docs_s": round(n / t_old, 2),
            "after_over_before": round(t_old / t16, 3),
            "same_bytes_as_before": bool(table.equals(old_table)),
        }
    return row


def before_reader(before: Any, bb: Any, cfg: Any, max_length: int) -> Any:
    """The code before's mask readout over the same network and tokenizer."""
    bbs = importlib.import_module("diffret_before.retrieval.models.backbones")
    readouts = importlib.import_module("diffret_before.retrieval.models.readouts")
    old_bb = bbs.Backbone(bb.model, bb.tokenizer, bb.family, name=bb.name)
    old_bb.source = bb.source
    return readouts.make_reader(old_bb, readouts.ReadoutConfig(**cfg.model_dump()), max_length)


def bare(bb: Any, reader: Any, token_ids: list[list[int]], batch: int) -> list[Any]:
    """The trunk alone over the rows encode reads at K = 16 (length-sorted, padded on the device beforehand): the
    slots gathered, cast to float16 and copied back, one wait at the end."""
    import torch

    order = sorted(range(len(token_ids)), key=lambda i: -len(token_ids[i]))
    key = (id(reader), batch)
    if key not in _BARE:
        _BARE.clear()
        _BARE[key] = [
            reader._mask_batch([token_ids[i] for i in order[s : s + batch]], "passage", 16)
            for s in range(0, len(order), batch)
        ]
    out = []
    with torch.inference_mode():
        for b in _BARE[key]:
            hidden = bb.hidden_states(b.input_ids, b.attention_mask, bidirectional=True)
            h = hidden[torch.arange(len(b.lengths), device=hidden.device)[:, None], b.positions].to(torch.float16)
            host = torch.empty(h.shape, dtype=h.dtype, pin_memory=h.is_cuda)
            out.append(host.copy_(h, non_blocking=h.is_cuda))
    return out


_BARE: dict[Any, Any] = {}


# ------------------------------------------------------------------------------------------------- 3. score
def score_part(args: argparse.Namespace, stages: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    from diffret.retrieval.search import SearchSettings, search_pass
    from diffret.retrieval.search.encodings import Encodings
    from diffret.stages.readers import read_encodings
    from diffret.storage import ArtifactStore
    from diffret.storage.layout import encodings_dir

    store = ArtifactStore(stages["root"])
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))

    def read(side: str) -> Any:
        folder = encodings_dir(stages["system"], "scifact", side, 16)
        return read_encodings(store, folder, store.require_manifest(folder), device)

    q, p = read("query"), read("passage")
    rows = []
    for tiles in sorted({1, max(1, args.score_passages // len(p.ids))}):
        if time.perf_counter() - T0 > args.deadline_s:
            rows.append({"passages": len(p.ids) * tiles, "skipped": "past the deadline"})
            continue
        multi = p.multi.repeat(tiles, 1, 1)
        mask = p.mask.repeat(tiles, 1)
        big = Encodings(
            [f"{t}:{i}" for t in range(tiles) for i in p.ids], multi, mask, p.single.repeat(tiles, 1), [], []
        )
        shard = 50_000
        blocks = [
            Encodings(
                big.ids[s : s + shard],
                big.multi[s : s + shard],
                big.mask[s : s + shard],
                big.single[s : s + shard],
                [],
                [],
            )
            for s in range(0, len(big.ids), shard)
        ]
        t_ours, (res, _) = timed(
            lambda b=blocks: search_pass({16: q}, iter(b), ["multi_dense"], SearchSettings(topk=1000)),
            device,
            args.repeats,
        )
        qm, pm = q.multi, big.multi
        chunk = max(1, (1 << 28) // (qm.shape[0] * qm.shape[1] * pm.shape[1]))

        def reference(qm: Any = qm, pm: Any = pm, chunk: int = chunk) -> Any:  # matmul, max, mean (sum), top-k
            scores = torch.cat(
                [
                    torch.einsum("qih,njh->qinj", qm, pm[s : s + chunk]).amax(-1).clamp(min=0).sum(1)
                    for s in range(0, len(pm), chunk)
                ],
                1,
            )
            return torch.topk(scores, min(1000, scores.shape[1]), dim=1)

        t_ref, ref = timed(reference, device, args.repeats)
        ours = res[(16, "multi_dense")]
        agree = float(
            np.mean(
                [
                    len(set(a[:10].tolist()) & set(b[:10].tolist())) / 10
                    for a, b in zip(ours.index, ref.indices.cpu(), strict=True)
                ]
            )
        )
        row = {
            "queries": len(q.ids),
            "passages": len(big.ids),
            "kq": 16,
            "kp": 16,
            "hidden": int(qm.shape[-1]),
            "search_pass_s": round(t_ours, 4),
            "bare_s": round(t_ref, 4),
            "ratio": round(t_ref / t_ours, 3),
            "top10_agreement": round(agree, 3),
        }
        rows.append(row)
        log(f"score {row}")
    return {"rows": rows}


GPU_TESTS = [
    "tests/unit/test_readout_syncs.py",
    "tests/unit/test_sidr.py",
    "tests/unit/test_search.py",
    "tests/unit/test_block_budget.py",
]


def gpu_tests_part(out: Path) -> dict[str, Any]:
    """The tests that run only where there is a GPU (each skips without one): their pytest summary line."""
    t = time.perf_counter()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            *GPU_TESTS,
            "-k",
            "gpu or cuda",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    (out / "gpu_tests.log").write_text(p.stdout + p.stderr)
    last = (p.stdout.strip().splitlines() or [""])[-1]
    log(f"GPU tests: {last}")
    return {
        "rows": [
            {
                "tests": " ".join(Path(x).name for x in GPU_TESTS),
                "returncode": p.returncode,
                "summary": last,
                "seconds": round(time.perf_counter() - t, 1),
            }
        ]
    }


def stored_system(root: str) -> dict[str, Any] | None:
    """The encoder system a previous run's stages left in ``root`` (score alone: ``--parts score``)."""
    from diffret.stages.systems import list_systems
    from diffret.storage import ArtifactStore

    if not Path(root).exists():
        return None
    found = [r.system for r, _ in list_systems(ArtifactStore(root)) if r.kind == "encoder"]
    return {"system": found[0], "root": root} if found else None


# ---------------------------------------------------------------------------------------------------- main
def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/device-check"))
    ap.add_argument("--store", default=str(Path(tempfile.gettempdir()) / "device-check-store"))
    ap.add_argument("--tiny", action="store_true", help="the tokenizer folders' own tiny shapes (a CPU run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--parts", default="stages,score,tests,encode")
    ap.add_argument("--families", default="dream,llada")
    ap.add_argument("--lengths", default="115,268")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--rows", type=int, default=384, help="rows a length (encode part)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs, the best kept (after one warm-up)")
    ap.add_argument("--stage-batch", type=int, default=64)
    ap.add_argument("--score-passages", type=int, default=50_000)
    ap.add_argument(
        "--stage-passages",
        type=int,
        default=0,
        help="the stages' corpus: the judged passages and others up to this many (0: the whole subset .dev carries)",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="no part or case starts after this many seconds (default: 380 on a GPU, none with --tiny)",
    )
    ap.add_argument("--no-before", dest="before", action="store_false", help="skip the code before (.dev/before)")
    args = ap.parse_args()
    args.families = args.families.split(",")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.before = args.before and (BEFORE / "diffret" / "__init__.py").exists()
    if args.deadline_s is None:
        args.deadline_s = float("inf") if args.tiny else 380.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NLTK_DATA", str(NLTK))  # the reference content filter's English tables (encode part)
    if not DATA.exists():
        raise SystemExit(
            f"{DATA} is missing: run `python benchmarks/device_prepare.py` first (on the machine with "
            "../shared), and carry .dev"
        )
    import torch

    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
    }
    with contextlib.suppress(ImportError):
        import transformers

        env["transformers"] = transformers.__version__
    log(f"device check on {env['device']} (torch {env['torch']}, transformers {env.get('transformers')})")
    mem = GpuMemory()
    result: dict[str, Any] = {"environment": env}
    parts = args.parts.split(",")
    try:
        if "stages" in parts:
            result["stages"] = stages_part(args, out, mem)
        if "score" in parts:
            stored = result.get("stages") or stored_system(args.store)  # alone: over the store the stages left
            if stored:
                result["score"] = score_part(args, stored)
        if "tests" in parts and time.perf_counter() - T0 <= args.deadline_s:
            result["tests"] = gpu_tests_part(out)
        if "encode" in parts:
            result["encode"] = encode_part(args, out)
    finally:
        result["seconds"] = round(time.perf_counter() - T0, 1)
        (out / "device_check.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"\n## device check: {env['device']}, {env['date']}, {result['seconds']} s; random weights, speeds only")
        if "stages" in result:
            print("\n" + table(result["stages"]["rows"], ["stage", "seconds", "gpu_peak_gib", "skipped"]))
        if "score" in result:
            print(
                "\n"
                + table(
                    result["score"]["rows"],
                    ["queries", "passages", "hidden", "search_pass_s", "bare_s", "ratio", "top10_agreement", "skipped"],
                )
            )
        if "encode" in result:
            print(
                "\n"
                + table(
                    result["encode"]["rows"],
                    [
                        "model",
                        "tokens",
                        "batch",
                        "diffret_docs_s",
                        "bare_docs_s",
                        "ratio",
                        "k16_over_k1",
                        "before_docs_s",
                        "after_over_before",
                        "same_bytes_as_before",
                        "skipped",
                    ],
                )
            )
        if "tests" in result:
            print("\n" + table(result["tests"]["rows"], ["tests", "returncode", "summary", "seconds"]))


if __name__ == "__main__":
    main()
