"""Make, on this machine, what the device check (benchmarks/device_check.py) carries to the lent GPU, under .dev/
(ignored by git; the tool call's ``carry``): the pinned wheels of the Python packages the GPU image lacks, a SciFact
subset, the tiny Dream and LLaDA folders without their weights (their real tokenizers: the check builds random
networks of the published shapes), and this repository at the commit before the readout's device path (the check
compares its encodings and speed with it). Then it says what the call carries, against the 64 MiB limit.

    python benchmarks/device_prepare.py [--shared ../shared] [--passages 2000] [--before REV]
    python benchmarks/device_prepare.py --check-imports   # then the tiny check on this CPU, importing only what the
                                                          # GPU image has (its package list) and .dev/whl

LanceDB (its wheels are about 75 MB each) does not fit the carry: ``index`` stays on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEV = REPO / ".dev"
LIMIT = 64 << 20  # what one call of the device tool carries: the working tree and the carried paths
REFUSE = 60 << 20  # refused above this: the working tree grows between preparing and the call
BEFORE_REV = "b34a492"  # the last commit whose mask readout read values back from the device step by step

# The packages the stages' CLI imports on the GPU image besides what the image has (found with --check-imports), at
# the versions this repository is tested with; pure Python or manylinux wheels for CPython 3.12.
WHEELS = [
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "duckdb==2.0.1",
    "pytrec-eval-terrier==0.5.11",
    "nltk==3.10.4",
    "dask==2026.8.0",
    "distributed==2026.8.0",
    "partd==1.4.2",
    "locket==1.0.0",
    "tblib==3.2.2",
    "zict==3.0.0",
    "tornado==6.6.1",
    "typer==0.29.2",
    "click==8.5.1",  # the image has typer and click, at versions the CLI was not tried with
    "typing-extensions==4.16.0",  # pydantic 2.14.4 requires >= 4.16; the image's version is not known
]
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]

# The GPU image's Python packages (.library/device/KINDS.md, read on a machine running it on 2026-11-17).
IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
humanize huggingface-hub hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers
toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp""".split()
# what this machine needs and the image does not (the image lists every package it holds): huggingface-hub here
# imports httpx2 (and its requirements), the image's 1.33 imports httpx; dask imports importlib_metadata below Python
# 3.12 (this machine's Python is 3.11, the image's 3.12)
LOCAL_ONLY = {"httpx2", "importlib-metadata"}
TOKENIZER_SKIP = (".safetensors", ".bin", ".gguf")  # the folders travel without their weights


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheels(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *(x for p in PLATFORMS for x in ("--platform", p)),
        "-d",
        str(dest),
        *WHEELS,
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "PIP_CONSTRAINT": ""})
    got = {norm(p.name.split("-")[0]) for p in dest.glob("*.whl")}
    missing = sorted(norm(w.split("==")[0]) for w in WHEELS if norm(w.split("==")[0]) not in got)
    if missing:
        raise SystemExit(f"no wheel downloaded for {missing}")


def scifact(shared: Path, dest: Path, n: int) -> dict[str, int]:
    """The test queries, their judgments and a corpus of ``n`` passages holding every judged one."""
    src = shared / "data" / "scifact"
    qrels = [line.rstrip("\n").split("\t") for line in (src / "qrels" / "test.tsv").read_text().splitlines()[1:]]
    judged = {d for _, d, _ in qrels}
    queries = {q for q, _, _ in qrels}
    corpus = [json.loads(line) for line in (src / "corpus.jsonl").read_text().splitlines()]
    keep = [d for d in corpus if d["_id"] in judged]
    keep += [d for d in corpus if d["_id"] not in judged][: max(0, n - len(keep))]
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "qrels").mkdir(parents=True)
    (dest / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in keep))
    qs = [json.loads(line) for line in (src / "queries.jsonl").read_text().splitlines()]
    (dest / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qs if q["_id"] in queries))
    shutil.copy(src / "qrels" / "test.tsv", dest / "qrels" / "test.tsv")
    return {"passages": len(keep), "queries": len(queries), "judgments": len(qrels)}


def model_folders(shared: Path, dest: Path) -> None:
    for name, folder in (("dream", "tiny-dream-random"), ("llada", "tiny-llada-random")):
        shutil.rmtree(dest / name, ignore_errors=True)
        shutil.copytree(
            shared / "models" / folder,
            dest / name,
            ignore=lambda _d, files: [f for f in files if f.endswith(TOKENIZER_SKIP)],
        )


def before(rev: str, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def carried_bytes() -> tuple[int, int]:
    """(bytes of the working tree that travels: tracked and untracked-not-ignored files; bytes of .dev)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    tree = sum((REPO / p.decode()).lstat().st_size for p in listed if p and (REPO / p.decode()).exists())
    dev = sum(p.lstat().st_size for p in DEV.rglob("*") if p.is_file() or p.is_symlink())
    return tree, dev


def check_carry(tree: int, dev: int) -> None:
    """Print what a call carries (the working tree and .dev); refuse above 60 MiB, short of the tool's 64 MiB.

    >>> check_carry(3 << 20, 50 << 20)
    the working tree 3.00 MiB + .dev 50.00 MiB: a call carries 53.00 MiB of the 60 MiB allowed (the tool's: 64)
    """
    print(
        f"the working tree {tree / 2**20:.2f} MiB + .dev {dev / 2**20:.2f} MiB: a call carries "
        f"{(tree + dev) / 2**20:.2f} MiB of the {REFUSE >> 20} MiB allowed (the tool's: {LIMIT >> 20})"
    )
    if tree + dev > REFUSE:
        raise SystemExit(
            f"{(tree + dev) / 2**20:.2f} MiB is over the {REFUSE >> 20} MiB allowed a call (the tool's limit: "
            f"{LIMIT >> 20} MiB): carry less (fewer --passages, a wheel left out)"
        )


def requirements(names: set[str]) -> set[str]:
    """``names`` and what they require, transitively, as installed here (extras left out)."""
    from importlib.metadata import PackageNotFoundError, requires

    seen, todo = set(), [norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            with contextlib.suppress(PackageNotFoundError):
                todo += [
                    norm(re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0])
                    for r in requires(name) or []
                    if "extra ==" not in r
                ]
    return seen


def check_imports() -> None:
    """The tiny device check on this CPU with every package the GPU image lacks made unimportable, except the wheels
    carried: what the CLI path needs beyond the image, found before any GPU time is spent."""
    from importlib.metadata import packages_distributions

    carried = {norm(w.split("==")[0]) for w in WHEELS}
    allowed = {norm(n) for n in IMAGE} | carried | requirements(LOCAL_ONLY)
    blocked = sorted(
        mod
        for mod, dists in packages_distributions().items()
        if not any(norm(d) in allowed for d in dists)
        and mod not in sys.stdlib_module_names
        and mod != "diffret"
        and not mod.startswith("_")
    )
    with tempfile.TemporaryDirectory() as sim:
        Path(sim, "sitecustomize.py").write_text(
            "import importlib.abc, sys\n"
            f"BLOCKED = frozenset({blocked!r})\n"
            "class _Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.partition('.')[0] in BLOCKED:\n"
            "            raise ModuleNotFoundError(f'No module named {name!r} (not on the GPU image)', name=name)\n"
            "sys.meta_path.insert(0, _Block())\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([sim, str(REPO)])}
        cmd = [
            sys.executable,
            str(REPO / "benchmarks" / "device_check.py"),
            "--tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--out",
            str(Path(tempfile.gettempdir()) / "device-check-imports"),
            "--stage-passages",
            "200",
            "--rows",
            "16",
            "--lengths",
            "115",
            "--batches",
            "8",
            "--repeats",
            "1",
            "--score-passages",
            "1",
        ]
        print(f"{len(blocked)} modules blocked (not on the image, not carried); running {' '.join(cmd[1:])}")
        subprocess.run(cmd, check=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=str(REPO.parent / "shared"))
    ap.add_argument("--passages", type=int, default=2000)
    ap.add_argument("--before", default=BEFORE_REV, help="the revision the encodings and speed are compared with")
    ap.add_argument("--check-imports", action="store_true")
    ap.add_argument("--skip-wheels", action="store_true")
    args = ap.parse_args()
    shared = Path(args.shared)
    if not args.skip_wheels:
        wheels(DEV / "whl")
    info = scifact(shared, DEV / "data" / "scifact-sub", args.passages)
    model_folders(shared, DEV / "models")
    before(args.before, DEV / "before")
    tree, dev = carried_bytes()
    sizes = {p.name: p.stat().st_size for p in sorted((DEV / "whl").glob("*.whl"))}
    for name, size in sizes.items():
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(f"wheels {sum(sizes.values()) / 2**20:.2f} MiB; SciFact subset {info}")
    check_carry(tree, dev)
    if args.check_imports:
        check_imports()


if __name__ == "__main__":
    main()
