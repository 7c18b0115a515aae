"""diffret installs one import name: the wheel built from this checkout holds one top-level package, `diffret`
(the repository's folders flows, stages, storage, ... mapped as its subpackages, with their data files), and
the code imports itself only through it (a second top-level name would load a module twice)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO

OLD_NAMES = ("flows", "tasks", "stages", "storage", "queries", "retrieval")


def test_the_wheel_installs_one_top_level_package_with_its_data(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info beside the sources
    skip = (".git", "build", "dist", "*.egg-info", "__pycache__", ".ruff_cache", ".pytest_cache", "diffret-store")
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*skip))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("diffret-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"diffret"}, top
    for path in ("diffret/__init__.py", "diffret/api.py", "diffret/flows/cli.py", "diffret/stages/score.py",
                 "diffret/storage/store.py", "diffret/retrieval/models/backbones/loading.py",
                 "diffret/queries/30_results.sql",
                 "diffret/retrieval/models/prompts/few_words.yaml",
                 "diffret/retrieval/rerank/prompts/logits_listwise.yaml"):  # fmt: skip
        assert path in names, path
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "diffret = diffret.flows.cli:main" in entry


def test_the_code_imports_itself_through_diffret_only() -> None:
    names = "|".join(OLD_NAMES)
    # `from stages...`, `import diffret.stages...`, and old names in an import list (`import os, stages.encode as e`),
    # at a line's start or inside a string (the preludes of subprocesses)
    pattern = re.compile(rf"(?:^|\\n|[;\"'])\s*(?:from ({names})[. ]|import (?:[\w.]+(?: as \w+)?, )*({names})\b)",
                         re.M)
    found = []
    for folder in (*OLD_NAMES, "diffret", "tests", "benchmarks", "examples"):
        for path in (REPO / folder).rglob("*.py"):
            for m in pattern.finditer(path.read_text()) if path.name != "test_package.py" else ():
                found.append(f"{path.relative_to(REPO)}: {m.group(0).strip()}")
    assert found == []
    assert pattern.search("x = 'import os, time, stages.encode as enc'") and not pattern.search("import os, time")
