"""The wheel a user gets from ``pip install .``, installed into a fresh virtual environment outside the checkout:
built from a copy of the sources, installed without its dependencies (they come from the test's own environment
through a path file, so nothing is downloaded), and run from a folder where the checkout is not importable."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

SKIP = (".git", "build", "dist", "*.egg-info", "__pycache__", ".ruff_cache", ".pytest_cache", "diffret-store")


@dataclass
class WheelEnv:
    wheel: Path
    python: Path  # the fresh environment's interpreter
    site: Path  # where the wheel's files were installed

    def run(self, code: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
        """``code`` in the fresh environment, with ``-P``: the working folder is not put on the import path, so
        ``import diffret`` finds the installed wheel even when ``cwd`` is the checkout (and PYTHONPATH is dropped)."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        return subprocess.run(
            [str(self.python), "-P", "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )


def build_wheel_env(repo: Path, tmp: Path) -> WheelEnv:
    src = tmp / "src"  # a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(repo, src, symlinks=True, ignore=shutil.ignore_patterns(*SKIP))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    wheel = next((tmp / "dist").glob("diffret-*.whl"))
    env = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    target = next((env / "lib").glob("python*/site-packages"))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-compile",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    # the dependencies: this environment's site-packages as plain path entries, after the wheel's own folder (a path
    # file adds no path files of its own, so this environment's editable diffret stays out)
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (target / "zz_test_dependencies.pth").write_text("".join(f"{p}\n" for p in deps))
    return WheelEnv(wheel=wheel, python=env / "bin" / "python", site=target)
