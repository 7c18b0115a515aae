"""The device check: diffret's GPU stages at Dream-7B shape and the encode / score benchmarks, in one call of the lent
GPU (docs/operations.md, "The device check"). Random weights (``--load-format random``): the numbers are speeds and
memory, never retrieval results.

    python benchmarks/device_prepare.py                       # here, once: .dev/ (wheels, a SciFact subset, tokenizers)
    python benchmarks/device_check.py --plan                  # the plan: each part's time budget, from the H100 rates
    python benchmarks/device_check.py --out OUT               # on the GPU (the tool call in docs/operations.md)
    python benchmarks/device_check.py --tiny --device cpu --dtype float32 --out /tmp/dc   # the same on a CPU

The plan is stated before anything runs: each part gets a time budget (``--budget NAME=SECONDS`` changes one), sized
from the rates measured on an H100 so that the parts sum to at most 540 s; sizes are cut to fit (passages, rows,
repeats), never parts. Each part runs in a process of its own (a session of its own) under its budget as a timeout:
an error in one (its traceback recorded), a crash, or a hang (its whole process tree killed at the budget) ends that
part alone and the next one runs; every subprocess a part starts (the CLI, pytest) has its own timeout too. A part
writes its figures as it measures them and OUT/device_check.json is written again (atomically) after every part, so
whatever fails, every figure measured before it is kept. The parts, in order:

1. ``stages``: the CLI (``python -m diffret.flows.cli``, ``--no-prefect``) on the SciFact subset with a Dream-7B-shaped
   random network in bfloat16: download (a local folder) -> tokenize -> encode (K 1 and 16, one Dask worker on the
   GPU) -> score (every mode) -> late (score's multi_dense top 100 re-scored at K_p = 4, which encodes the candidates)
   -> evaluate; each command's wall time and the GPU's peak memory in use (NVML: the whole device).
2. ``score``: ``search_pass`` on the stored encodings of part 1 (H = 3,584, K_q = K_p = 16, multi_dense; random
   vectors of the same shapes when part 1 left none), and on them tiled to ``--score-passages``, against a bare
   batched matmul + max + sum (the reference's MaxSim: each query slot's best clamped at 0) + top-k over the same
   tensors.
3. ``tests``: the unit tests that need a GPU (they skip without one): the readout's synchronisation check, SIDR's
   batch readout, scoring on CUDA.
4. ``encode_dream`` and 5. ``encode_llada``: ``encode_rows`` against a bare trunk loop over the same rows (the same
   bidirectional mask, padded on the device beforehand, the slots gathered and copied back once), at Dream-7B and
   LLaDA-8B shapes, 115- and 268-token rows, batch 32 and 128, K = 16, and K = 16 over K = 1 time; at the first batch,
   the code before (``.dev/before``, on the same network in the same process) for its speed and its encodings, byte
   for byte.

Every part records the peak GPU memory its own process allocated (``torch.cuda.max_memory_allocated``, reset when the
part starts; per case for the encode benchmark) and the device's peak memory in use while it ran (NVML, which counts
the subprocesses: the CLI's and pytest's); both None on a CPU.

Failure injection, for the tests of this script (tests/e2e/test_device_check_runs.py): ``--fail-part NAME`` raises an
error in that part right after its first figure is recorded; ``--hang-part NAME`` makes a process of that part hang
until its timeout kills it: in ``stages`` the command after the first (tokenize, once download's figure is recorded),
in ``tests`` the pytest run, in the others (which start no subprocess) the part's own process, as it starts.

The last lines printed are the summary tables; every number goes to OUT/device_check.json, each part's own figures
to OUT/part-NAME.json, the CLI's output to OUT/stages.log and pytest's to OUT/gpu_tests.log. ``python
benchmarks/scale_docs.py --device-check OUT/device_check.json`` renders docs/scale.md's GPU section from them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NLTK = REPO / "tests" / "unit" / "data" / "nltk_data"
SHAPES = {"dream": "dream-7b", "llada": "llada-8b"}
TINY = {"dream": None, "llada": None}  # --tiny: the tokenizer folders' own (tiny) shapes
HIDDEN = {"dream-7b": 3584, "llada-8b": 4096}
T0 = time.perf_counter()

PARTS = ("stages", "score", "tests", "encode_dream", "encode_llada")
# One call of the device tool: what the parts' budgets sum to at most (the call's own limit is 600 s; the wheels'
# install and this script's start take the rest).
CALL_S = 540
# Each part's budget (its timeout) on a GPU; --tiny: on a CPU, tiny shapes (the smoke test cuts the sizes further).
GPU_BUDGET = {"stages": 200, "score": 35, "tests": 55, "encode_dream": 105, "encode_llada": 105}
TINY_BUDGET = {"stages": 180, "score": 60, "tests": 90, "encode_dream": 60, "encode_llada": 60}
# The rates the plan is sized from, measured on an H100 in bfloat16 (random weights, Dream-7B shape): passages a
# second by row length, and a 7-8B random network built in 20-40 s (the slower end taken).
H100_DOCS_S = {115: 280.0, 268: 130.0}
PARAMS = {"dream": 7.62e9, "llada": 8.02e9}  # LLaDA-8B's rate: Dream-7B's scaled by the parameter count
BUILD_S = 40.0
START_S = 10.0  # a Python process importing torch and diffret (a part, a CLI command), assumed
FP32_TFLOPS = 50.0  # exact scoring is float32 (reference-faithful): an H100's float32 rate, assumed
HANG = [sys.executable, "-c", "import time\nwhile True:\n    time.sleep(60)"]


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def write_json(path: Path, data: Any) -> None:
    """``data`` as JSON at ``path``, atomically (a reader sees the old file or the new one, never half of one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def kill_tree(pid: int) -> None:
    """SIGKILL to the process ``pid`` (a session leader), its process group, and every process below it, those that
    started sessions of their own (a Dask worker, a CLI command) included."""
    below = []
    with contextlib.suppress(Exception):
        import psutil

        below = psutil.Process(pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in below:
        with contextlib.suppress(Exception):
            os.killpg(p.pid, signal.SIGKILL) if os.getpgid(p.pid) == p.pid else None
        with contextlib.suppress(Exception):
            p.kill()


class CommandTimeout(RuntimeError):
    pass


class InjectedFailure(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------------ the plan
def rate(tokens: int, family: str) -> float:
    """Passages a second on an H100 at ``tokens`` a row (the measured rates; between or beyond them, inversely with
    the length from the nearest), for ``family``'s network (scaled by its parameter count from Dream-7B's)."""
    near = min(H100_DOCS_S, key=lambda t: abs(t - tokens))
    return H100_DOCS_S[near] * near / tokens * PARAMS["dream"] / PARAMS[family]


def queries_in(data: Path) -> int:
    with contextlib.suppress(OSError):
        return sum(1 for _ in (data / "queries.jsonl").open())
    return 300  # SciFact's test queries


def make_plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each part: its budget (its timeout), what it runs at which sizes, and on a GPU the time the H100 rates give."""
    budget = {**(TINY_BUDGET if args.tiny else GPU_BUDGET), **args.budget}
    passages, queries = args.stage_passages, queries_in(args.data)
    r268, r115 = rate(268, "dream"), rate(115, "dream")
    est: dict[str, float] = {
        # 7 commands (download, tokenize, encode, systems, score, late, evaluate); encode: a Dask cluster, the
        # network, the passages at K 1 and 16 and the queries (short: the 115-token rate); late: the network
        # again and the candidates (at most the passages) at K_p = 4
        "stages": 7 * START_S
        + 2
        + 4
        + (10 + BUILD_S + 2 * (passages / r268 + queries / r115))
        + 5
        + (BUILD_S + passages / r268 + 2)
        + 2,
        # the vectors read and tiled, both scorers warmed up once and timed --repeats times at both sizes
        "score": START_S
        + 5
        + 2
        * 2
        * (1 + args.repeats)
        * 2
        * queries
        * 16
        * (args.score_passages + passages)
        * 16
        * HIDDEN["dream-7b"]
        / (FP32_TFLOPS * 1e12),
        "tests": START_S + 30,
    }
    for family in ("dream", "llada"):
        passes = len(args.batches) * 3 * (1 + args.repeats) + (2 if args.before_asked else 0)  # K16, K1, bare; before
        est[f"encode_{family}"] = (
            START_S + BUILD_S + 3 + sum(passes * args.rows / rate(t, family) for t in args.lengths)
        )
    shape = "tiny shapes" if args.tiny else "Dream-7B shape"
    runs = {
        "stages": f"download -> tokenize -> encode (K 1, 16) -> score -> late -> evaluate; {shape}, "
        f"{passages or 'all the'} passages, {queries} queries",
        "score": f"search_pass vs bare matmul + top-k; {queries} queries x {args.score_passages:,} passages, "
        f"K 16 x 16, best of {args.repeats}",
        "tests": "the GPU unit tests (pytest)",
        **{
            f"encode_{f}": f"{'tiny' if args.tiny else SHAPES[f]}: {args.rows} rows x "
            f"{', '.join(map(str, args.lengths))} tokens x batch {', '.join(map(str, args.batches))}, K 16 and 1, "
            f"best of {args.repeats}" + (", the code before" if args.before_asked else "")
            for f in ("dream", "llada")
        },
    }
    return [
        {
            "part": p,
            "budget_s": float(budget[p]),
            "estimate_s": None if args.tiny else round(est[p], 1),
            "runs": runs[p],
        }
        for p in PARTS
        if p in args.parts
    ]


def plan_table(plan: list[dict[str, Any]]) -> str:
    lines = [
        "| part | budget (s) | H100 estimate (s) | runs |",
        "|---|---:|---:|---|",
        *(f"| {p['part']} | {p['budget_s']:.0f} | {_s(p['estimate_s'])} | {p['runs']} |" for p in plan),
        f"| all | {sum(p['budget_s'] for p in plan):.0f} | "
        f"{_s(None if any(p['estimate_s'] is None for p in plan) else sum(p['estimate_s'] for p in plan))} | "
        f"at most {CALL_S} s in all |",
    ]
    return "\n".join(lines)


def _s(x: float | None) -> str:
    return "" if x is None else f"{x:.0f}"


# ---------------------------------------------------------------------------------------------- a part's process
class GpuMemory:
    """The device's memory in use (NVML: every process on it), sampled in a thread; ``peak_gib()`` since
    ``reset()``; None without NVML or a GPU."""

    def __init__(self) -> None:
        self.handle = None
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
        self._peak = self._all = 0
        if self.handle is not None:
            threading.Thread(target=self._run, daemon=True).start()

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self.handle).used) if self.handle is not None else 0

    def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                used = self.used()
                self._peak, self._all = max(self._peak, used), max(self._all, used)
            time.sleep(0.05)

    def reset(self) -> None:
        self._peak = self.used()

    def peak_gib(self, since_start: bool = False) -> float | None:
        """The peak since the last ``reset()`` (or since this began)."""
        peak = self._all if since_start else self._peak
        return round(peak / 2**30, 2) if self.handle is not None else None


def cuda_in_use(args: argparse.Namespace) -> bool:
    if args.device == "cpu" or "torch" not in sys.modules:
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def reset_cuda_peak(args: argparse.Namespace) -> None:
    if cuda_in_use(args):
        import torch

        torch.cuda.reset_peak_memory_stats()


def cuda_peak_gib(args: argparse.Namespace) -> float | None:
    """The peak memory this process allocated on the GPU since the last reset; None on a CPU."""
    if not cuda_in_use(args):
        return None
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


class Record:
    """A part's figures, written to its file (atomically) as each is measured, and the failures asked for."""

    def __init__(self, name: str, path: Path, args: argparse.Namespace) -> None:
        self.name, self.path, self.args = name, path, args
        self.data: dict[str, Any] = {"part": name, "status": "running", "rows": []}
        self.hang_next = name in args.hang_part and name == "tests"  # its pytest run hangs
        self.mem = GpuMemory()
        self.write()

    def write(self) -> None:
        write_json(self.path, self.data)

    def add(self, row: dict[str, Any]) -> None:
        self.data["rows"].append(row)
        self.write()
        if len(self.data["rows"]) == 1:
            if self.name in self.args.fail_part:
                raise InjectedFailure(f"an injected failure in part {self.name} (--fail-part)")
            if self.name in self.args.hang_part and self.name == "stages":
                self.hang_next = True  # the next command (tokenize) hangs

    def left_s(self) -> float:
        return self.args.part_deadline - time.perf_counter()


def run_command(
    rec: Record, what: str, cmd: list[str], logfile: Path, env: dict[str, str] | None = None
) -> tuple[int, float, str]:
    """``cmd`` in a session of its own, its output to ``logfile``, under the part's time left as its timeout: past it
    the command and everything it started are killed and CommandTimeout is raised."""
    if rec.hang_next:
        rec.hang_next = False
        cmd = HANG
    timeout = max(1.0, rec.left_s())
    t = time.perf_counter()
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        out = ""
        with contextlib.suppress(subprocess.TimeoutExpired):
            out, _ = p.communicate(timeout=10)
        with logfile.open("a") as f:
            f.write(f"\n$ {what}\n{out}\n[killed after {timeout:.0f} s]\n")
        raise CommandTimeout(f"{what} ran past its {timeout:.0f} s timeout: it and its processes were killed") from None
    with logfile.open("a") as f:
        f.write(f"\n$ {what}\n{out}")
    return p.returncode, time.perf_counter() - t, out


# ------------------------------------------------------------------------------------------------ 1. stages
def stages_part(args: argparse.Namespace, rec: Record) -> None:
    root = Path(args.store)  # not under OUT: only a few small files come back from there
    shutil.rmtree(root, ignore_errors=True)
    logfile = args.out / "stages.log"
    mem = rec.mem
    env = {
        **os.environ,
        "PREFECT_API_URL": "",
        "HF_HUB_OFFLINE": "1",
        "COLUMNS": "200",
        "NLTK_DATA": str(NLTK),
        "DIFFRET_ROOT": str(root),
    }
    source = args.data
    if args.stage_passages:  # a smaller collection: the judged passages first
        source = root.parent / "device-check-data"
        shutil.rmtree(source, ignore_errors=True)
        shutil.copytree(args.data, source)
        judged = {line.split("\t")[1] for line in (args.data / "qrels" / "test.tsv").read_text().splitlines()[1:]}
        docs = (args.data / "corpus.jsonl").read_text().splitlines()
        docs.sort(key=lambda d: json.loads(d)["_id"] not in judged)
        (source / "corpus.jsonl").write_text("\n".join(docs[: max(args.stage_passages, len(judged))]) + "\n")
    shape = [] if args.tiny else ["--shape", SHAPES["dream"]]
    model = ["--model", str(args.models / "dream"), "--load-format", "random", *shape]
    dev = ["--device", args.device]
    # fmt: off
    plan = [
        ("download", ["download", "scifact", "--source", str(source)]),
        ("tokenize", ["tokenize", "-d", "scifact", *model, "--max-length", "256"]),
        ("encode", ["encode", "-d", "scifact", *model, "--dtype", args.dtype, *dev, "--k", "1,16", "--max-length",
                    "256", "--batch-size", str(args.stage_batch), "--workers", str(args.stage_workers)]),
        ("score", ["score", "-d", "scifact", "SYSTEM", *dev]),
        ("late", ["late", "-d", "scifact", "SYSTEM", "--first-stage", "SYSTEM_SLUG", "--first-kq", "16", "--first-kp",
                  "16", "--first-mode", "multi_dense", "--kq", "16", "--kp", "4", "--mode", "multi_dense", "--depth",
                  "100", "--batch-size", str(args.stage_batch), *dev]),
        ("evaluate", ["evaluate"]),
    ]
    # fmt: on

    def cli(name: str, cmd: list[str]) -> tuple[float, str]:
        rc, seconds, out = run_command(
            rec, f"diffret {' '.join(cmd)}", [sys.executable, "-m", "diffret.flows.cli", *cmd], logfile, env
        )
        if rc != 0:
            raise RuntimeError(f"diffret {name} failed ({rc}): {out[-2000:]}")
        return seconds, out

    system = ""
    rec.data |= {"system": "", "root": str(root)}
    for name, cmd in plan:
        cmd = [system if c == "SYSTEM_SLUG" else c for c in cmd]
        cmd = [x for c in cmd for x in (["--system", system] if c == "SYSTEM" else [c])]
        mem.reset()
        seconds, stdout = cli(name, [*cmd, "--no-prefect"])
        if name == "encode":
            listing = json.loads(cli("systems", ["systems", "--format", "json"])[1])
            system = next(s["system"] for s in listing if s["kind"] == "encoder")
            assert system.startswith("random-"), system
            rec.data["system"] = system
        log(f"stage {name}: {seconds:.1f} s, GPU peak in use {mem.peak_gib()} GiB")
        rec.add(
            {
                "stage": name,
                "seconds": round(seconds, 2),
                "gpu_used_peak_gib": mem.peak_gib(),
                "line": stdout.strip().splitlines()[-1] if stdout.strip() else "",
            }
        )


# ------------------------------------------------------------------------------------------------ encode
def scifact_texts(data: Path) -> list[str]:
    from diffret.stages.readers import passage_text

    with open(data / "corpus.jsonl") as f:
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


def encode_part(args: argparse.Namespace, rec: Record, family: str) -> None:
    import torch

    from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
    from diffret.retrieval.models.readouts import ReadoutConfig, make_reader

    texts = scifact_texts(args.data)
    before = load_before(args.before_dir) if args.before else None
    shape = TINY[family] if args.tiny else SHAPES[family]
    t = time.perf_counter()
    bb = load_backbone(
        BackboneConfig(
            model=str(args.models / family), load_format="random", shape=shape, device=args.device, dtype=args.dtype
        )
    )
    sync(bb.device)
    n_params = sum(p.numel() for p in bb.model.parameters())
    rec.data |= {"model": family, "params": n_params, "build_s": round(time.perf_counter() - t, 1)}
    log(f"{family}: {n_params / 1e9:.2f}e9 parameters built on {bb.device} in {rec.data['build_s']} s")
    cfg = ReadoutConfig(content_filter="nltk")
    all_ids = bb.tokenizer(texts, add_special_tokens=False)["input_ids"]
    last = 0.0
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
            if 1.2 * last > rec.left_s():
                rec.add({"model": family, "tokens": target, "batch": batch, "skipped": "past the part's budget"})
                continue
            t = time.perf_counter()
            reset_cuda_peak(args)
            old = before_reader(before, bb, cfg, target - extra) if before and batch == args.batches[0] else None
            row = encode_case(bb, reader, old, rows, batch, args.repeats)
            rec.add({"model": family, "params": n_params, "tokens": target, **row, "gpu_peak_gib": cuda_peak_gib(args)})
            log(f"encode {rec.data['rows'][-1]}")
            last = time.perf_counter() - t
    del bb, reader, rows
    _BARE.clear()
    gc.collect()
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()


def load_before(folder: Path) -> Any:
    """The code before the readout's device path (``.dev/before``, what ``device_prepare.py`` extracted) as the
    package ``diffret_before``, beside this one: the same network read by both in one process."""
    if "diffret_before" in sys.modules:
        return sys.modules["diffret_before"]
    spec = importlib.util.spec_from_file_location(
        "diffret_before", folder / "diffret" / "__init__.py", submodule_search_locations=[str(folder / "diffret")]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["diffret_before"] = mod
    spec.loader.exec_module(mod)
    return mod


class Rows:
    """The rows of one length: ids, token ids (cut to fill the row), the content filter's ids (as stored)."""

    def __init__(self, ids: list[str], token_ids: list[list[int]], filtered: list[list[int]] | None):
        self.ids, self.token_ids, self.filtered = ids, token_ids, filtered


def encode_case(bb: Any, reader: Any, old: Any, rows: Rows, batch: int, repeats: int) -> dict[str, Any]:
    """One (rows, batch): diffret at K = 16 and K = 1, the bare trunk loop, and the code before when given."""
    from diffret.retrieval.models.encoding import encode_rows

    def diffret(k: int) -> Any:
        return encode_rows(
            reader, rows.ids, rows.token_ids, None, side="passage", k=k, batch_size=batch, filtered=rows.filtered
        )

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
                old, rows.ids, rows.token_ids, None, side="passage", k=16, batch_size=batch, filtered=rows.filtered
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


# ------------------------------------------------------------------------------------------------- 2. score
def synthetic_encodings(n: int, k: int, hidden: int, device: Any, seed: int) -> Any:
    """``n`` texts of ``k`` random unit vectors (the shapes part 1 would have stored)."""
    import torch

    from diffret.retrieval.search.encodings import Encodings

    g = torch.Generator(device="cpu").manual_seed(seed)
    multi = torch.nn.functional.normalize(torch.randn(n, k, hidden, generator=g), dim=-1).to(device)
    single = torch.nn.functional.normalize(multi.mean(1), dim=-1)
    return Encodings(
        [f"s{i}" for i in range(n)], multi, torch.ones(n, k, dtype=torch.bool, device=device), single, [], []
    )


def score_part(args: argparse.Namespace, rec: Record) -> None:
    import numpy as np
    import torch

    from diffret.retrieval.search import SearchSettings, search_pass
    from diffret.retrieval.search.encodings import Encodings

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    stored = stored_system(args.store)
    if stored:
        from diffret.stages.readers import read_encodings
        from diffret.storage import ArtifactStore
        from diffret.storage.layout import encodings_dir

        store = ArtifactStore(stored["root"])

        def read(side: str) -> Any:
            folder = encodings_dir(stored["system"], "scifact", side, 16)
            return read_encodings(store, folder, store.require_manifest(folder), device)

        q, p = read("query"), read("passage")
        rec.data["encodings"] = f"stored by the stages ({stored['system']})"
    else:  # the stages left none: random vectors of the shapes they would have stored
        hidden = 64 if args.tiny else HIDDEN[SHAPES["dream"]]
        q = synthetic_encodings(queries_in(args.data), 16, hidden, device, 0)
        n = sum(1 for _ in (args.data / "corpus.jsonl").open())
        p = synthetic_encodings(min(n, args.stage_passages or n), 16, hidden, device, 1)
        rec.data["encodings"] = "random (the stages left no encodings)"
    last = 0.0
    for tiles in sorted({1, max(1, args.score_passages // len(p.ids))}):
        if 1.2 * last * tiles > rec.left_s():
            rec.add({"passages": len(p.ids) * tiles, "skipped": "past the part's budget"})
            continue
        t = time.perf_counter()
        reset_cuda_peak(args)
        big = Encodings(
            [f"{t}:{i}" for t in range(tiles) for i in p.ids],
            p.multi.repeat(tiles, 1, 1),
            p.mask.repeat(tiles, 1),
            p.single.repeat(tiles, 1),
            [],
            [],
        )
        shard = 50_000
        blocks = [big.rows(s, s + shard) for s in range(0, len(big.ids), shard)]
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
            "gpu_peak_gib": cuda_peak_gib(args),
        }
        del big, blocks, res, ref
        last = (time.perf_counter() - t) / tiles
        log(f"score {row}")
        rec.add(row)


def stored_system(root: str) -> dict[str, Any] | None:
    """The encoder system the stages left in ``root`` with both sides encoded at K = 16, or None."""
    from diffret.stages.systems import list_systems
    from diffret.storage import ArtifactStore
    from diffret.storage.layout import encodings_dir

    if not Path(root).exists():
        return None
    with contextlib.suppress(Exception):
        store = ArtifactStore(root)
        for r, _ in list_systems(store):
            if r.kind == "encoder" and all(
                store.read_manifest(encodings_dir(r.system, "scifact", side, 16)) is not None
                for side in ("query", "passage")
            ):
                return {"system": r.system, "root": root}
    return None


# ------------------------------------------------------------------------------------------------- 3. tests
GPU_TESTS = [
    "tests/unit/test_readout_syncs.py",
    "tests/unit/test_sidr.py",
    "tests/unit/test_search.py",
    "tests/unit/test_block_budget.py",
]


def gpu_tests_part(args: argparse.Namespace, rec: Record) -> None:
    """The tests that run only where there is a GPU (each skips without one): their pytest summary line."""
    # fmt: off
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:randomly", "-p", "no:cacheprovider",
           "-o", "addopts=", *GPU_TESTS, "-k", "gpu or cuda"]
    # fmt: on
    logfile = args.out / "gpu_tests.log"
    rc, seconds, out = run_command(rec, "pytest " + " ".join(cmd[3:]), cmd, logfile)
    last = (out.strip().splitlines() or [""])[-1]
    log(f"GPU tests: {last}")
    tests = " ".join(Path(x).name for x in GPU_TESTS)
    rec.add({"tests": tests, "returncode": rc, "summary": last, "seconds": round(seconds, 1)})
    if rc != 0:
        raise RuntimeError(f"pytest exited {rc}: {last}")


# ------------------------------------------------------------------------------------------- a part's process
def part_main(args: argparse.Namespace) -> None:
    """One part, in the process the parent started for it: its figures to ``--part-file`` as they come, then its
    status (ok, or error with the exception and its traceback)."""
    name = args.run_part
    args.part_deadline = T0 + args.part_budget - max(2.0, 0.03 * args.part_budget)  # time to write what it has
    rec = Record(name, Path(args.part_file), args)
    if name in args.hang_part and name not in ("stages", "tests"):  # a part that starts no subprocess hangs itself
        log(f"part {name}: hanging until its timeout (--hang-part)")
        while True:
            time.sleep(60)
    with contextlib.suppress(Exception):
        reset_cuda_peak(args)
    try:
        if name == "stages":
            stages_part(args, rec)
        elif name == "score":
            score_part(args, rec)
        elif name == "tests":
            gpu_tests_part(args, rec)
        else:
            encode_part(args, rec, name.removeprefix("encode_"))
        rec.data["status"] = "ok"
    except BaseException as e:  # recorded; the parent runs the next part
        rec.data |= {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        log(f"part {name} failed: {type(e).__name__}: {e}")
    finally:
        if "torch" in sys.modules and args.device != "cpu":
            with contextlib.suppress(Exception):
                import torch

                if torch.cuda.is_available():
                    rec.data["device"] = torch.cuda.get_device_name(0)
        rec.data["gpu_peak_gib"] = cuda_peak_gib(args) if name in ("score", "encode_dream", "encode_llada") else None
        if name in ("score", "encode_dream", "encode_llada"):  # per case: the part's peak is the largest
            peaks = [r["gpu_peak_gib"] for r in rec.data["rows"] if r.get("gpu_peak_gib") is not None]
            rec.data["gpu_peak_gib"] = max(peaks, default=rec.data["gpu_peak_gib"])
        rec.data["gpu_used_peak_gib"] = rec.mem.peak_gib(since_start=True)
        rec.write()


# ------------------------------------------------------------------------------------------------ the parent
def run_part(name: str, budget: float, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Part ``name`` in a process (a session) of its own, killed with everything below it at ``budget`` seconds;
    what it recorded, with its status, time and budget."""
    path = args.out / f"part-{name}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    cmd += ["--run-part", name, "--part-file", str(path), "--part-budget", str(budget)]
    t = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    try:
        rc = p.wait(timeout=budget)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        rc = p.wait()
        timed_out = True
    data: dict[str, Any] = {"part": name, "status": "running", "rows": []}
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
    if timed_out:
        data |= {
            "status": "timeout",
            "error": f"the part ran past its {budget:.0f} s budget: it and every process it started were killed",
        }
    elif data.get("status") != "error" and (rc != 0 or data.get("status") != "ok"):
        data |= {
            "status": "error",
            "error": f"the part's process exited {rc} (signal {-rc})"
            if rc < 0
            else f"the part's process exited {rc} without its result",
        }
    data |= {"seconds": round(time.perf_counter() - t, 1), "budget_s": budget}
    if "gpu_peak_gib" not in data:  # killed before it wrote its own: the largest of its cases'
        data["gpu_peak_gib"] = max((r["gpu_peak_gib"] for r in data["rows"] if r.get("gpu_peak_gib")), default=None)
    data.setdefault("gpu_used_peak_gib", None)
    return data


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Versions and the device, without starting CUDA in this process (the parts use the GPU, not this one)."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d"), "device": "cpu"}
    for dist in ("torch", "transformers", "pydantic", "typing-extensions", "nltk", "dask"):
        with contextlib.suppress(PackageNotFoundError):
            env[dist] = version(dist)
    if args.device != "cpu":
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            env["device"] = name.decode() if isinstance(name, bytes) else name
    env["nltk_data"] = os.environ.get("NLTK_DATA")
    env["args"] = {k: v for k, v in vars(args).items() if k not in ("plan", "run_part", "part_file", "part_budget")}
    return env


def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


COLUMNS = {
    "stages": ["stage", "seconds", "gpu_used_peak_gib"],
    "score": ["queries", "passages", "hidden", "search_pass_s", "bare_s", "ratio", "top10_agreement", "gpu_peak_gib",
              "skipped"],
    "tests": ["tests", "returncode", "summary", "seconds"],
    "encode": ["model", "tokens", "batch", "diffret_docs_s", "bare_docs_s", "ratio", "k16_over_k1", "before_docs_s",
               "after_over_before", "same_bytes_as_before", "gpu_peak_gib", "skipped"],
}  # fmt: skip


def summary(result: dict[str, Any]) -> str:
    env = result["environment"]
    parts = result["parts"]
    out = [
        f"## device check: {env['device']}, {env['date']}, {result['seconds']} s; random weights, speeds only",
        "",
        table(
            [{**p, "part": n, "error": p.get("error", "")[:120]} for n, p in parts.items()],
            ["part", "status", "seconds", "budget_s", "gpu_peak_gib", "gpu_used_peak_gib", "error"],
        ),
    ]
    for name, p in parts.items():
        if p.get("rows"):
            out += ["", f"{name}:", table(p["rows"], COLUMNS[name.split("_")[0]])]
    return "\n".join(out)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/device-check"))
    ap.add_argument("--store", default=str(Path(tempfile.gettempdir()) / "device-check-store"))
    ap.add_argument("--dev", default=str(REPO / ".dev"), help="what device_prepare.py made (data, models, before)")
    ap.add_argument("--tiny", action="store_true", help="the tokenizer folders' own tiny shapes (a CPU run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}; they run in that order")
    ap.add_argument("--lengths", default="115,268")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--rows", type=int, default=256, help="rows a length (the encode parts)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs, the best kept (after one warm-up)")
    ap.add_argument("--stage-batch", type=int, default=64)
    ap.add_argument(
        "--stage-workers", type=int, default=1, help="the encode stage's local Dask workers (0: in its own process)"
    )
    ap.add_argument("--score-passages", type=int, default=50_000)
    ap.add_argument(
        "--stage-passages",
        type=int,
        default=500,
        help="the stages' corpus: the judged passages and others up to this many (0: the whole subset .dev carries)",
    )
    ap.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="a part's time budget (its timeout) instead of the plan's",
    )
    ap.add_argument("--plan", action="store_true", help="print the plan (each part's budget) and exit")
    ap.add_argument("--no-before", dest="before", action="store_false", help="skip the code before (.dev/before)")
    ap.add_argument("--fail-part", action="append", default=[], metavar="PART", help="inject an error (tests)")
    ap.add_argument("--hang-part", action="append", default=[], metavar="PART", help="inject a hang (tests)")
    ap.add_argument("--run-part", help=argparse.SUPPRESS)
    ap.add_argument("--part-file", help=argparse.SUPPRESS)
    ap.add_argument("--part-budget", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.fail_part = [p for x in args.fail_part for p in x.split(",") if p]
    args.hang_part = [p for x in args.hang_part for p in x.split(",") if p]
    budget = {}
    for item in args.budget:
        name, eq, secs = item.partition("=")
        if not eq or name not in PARTS:
            ap.error(f"--budget {item!r}: expected PART=SECONDS with PART one of {', '.join(PARTS)}")
        budget[name] = float(secs)
    args.budget = budget
    for p in [*args.parts, *args.fail_part, *args.hang_part]:
        if p not in PARTS:
            ap.error(f"unknown part {p!r}: the parts are {', '.join(PARTS)}")
    args.out, dev = Path(args.out), Path(args.dev)
    args.data, args.models, args.before_dir = dev / "data" / "scifact-sub", dev / "models", dev / "before"
    args.before_asked = args.before
    args.before = args.before and (args.before_dir / "diffret" / "__init__.py").exists()
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # the reference content filter's English tables: the carried copy, whatever the image sets (the parts and the
    # CLI inherit it)
    os.environ["NLTK_DATA"] = str(NLTK)
    args = parse(argv)
    if args.run_part:
        part_main(args)
        return
    plan = make_plan(args)
    if args.plan:
        print(plan_table(plan))
        return
    if not args.data.exists():
        raise SystemExit(
            f"{args.data} is missing: run `python benchmarks/device_prepare.py` first (on the machine with "
            "../shared), and carry .dev"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"environment": environment(args), "plan": plan, "parts": {}, "seconds": 0.0}
    log(f"device check on {result['environment']['device']}; the plan:\n{plan_table(plan)}")
    path = args.out / "device_check.json"
    write_json(path, result)
    try:
        for step in plan:
            log(f"part {step['part']}: budget {step['budget_s']:.0f} s")
            data = run_part(step["part"], step["budget_s"], args, argv)
            result["parts"][step["part"]] = data
            result["seconds"] = round(time.perf_counter() - T0, 1)
            write_json(path, result)
            log(
                f"part {step['part']}: {data['status']} in {data['seconds']} s"
                + (f" ({data['error']})" if data.get("error") else "")
            )
    finally:
        result["seconds"] = round(time.perf_counter() - T0, 1)
        write_json(path, result)
        print("\n" + summary(result), flush=True)


if __name__ == "__main__":
    main()
