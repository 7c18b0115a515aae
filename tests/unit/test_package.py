"""diffret installs one import name: the wheel built from this checkout holds one top-level package, `diffret`
(the repository's folders flows, stages, storage, ... mapped as its subpackages, with their data files), and
the code imports itself only through it (a second top-level name would load a module twice)."""

from __future__ import annotations

import re
import zipfile

from conftest import REPO

OLD_NAMES = ("flows", "tasks", "stages", "storage", "queries", "retrieval")


def test_the_wheel_holds_every_module_and_installs_outside_the_checkout(wheel_env) -> None:
    """``pip install .``'s wheel holds every module of the package (found, not listed: a folder added later is in
    it), one top-level package with its data files and the console script; installed into a fresh environment
    outside the checkout, every module imports from it."""
    names = zipfile.ZipFile(wheel_env.wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"diffret"}, top
    sources = {f"diffret/{p.relative_to(REPO).as_posix()}" for f in OLD_NAMES for p in (REPO / f).rglob("*.py")}
    sources |= {f"diffret/{p.name}" for p in (REPO / "diffret").glob("*.py")}
    assert len(sources) > 120 and sources - set(names) == set(), sorted(sources - set(names))
    for path in (
        "diffret/queries/30_results.sql",
        "diffret/retrieval/models/prompts/few_words.yaml",
        "diffret/retrieval/rerank/prompts/logits_listwise.yaml",
    ):
        assert path in names, path
    entry = zipfile.ZipFile(wheel_env.wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "diffret = diffret.flows.cli:main" in entry
    modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in sources)
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "import diffret\n"
        "print(len(sys.modules), diffret.__file__)\n"
    )
    p = wheel_env.run(code, cwd=REPO)  # from the checkout's root: -P keeps it off the path
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-1] == str(wheel_env.site / "diffret" / "__init__.py")


def test_the_code_imports_itself_through_diffret_only() -> None:
    names = "|".join(OLD_NAMES)
    # `from stages...`, `import diffret.stages...`, and old names in an import list (`import os, stages.encode as e`),
    # at a line's start, inside a string (the preludes of subprocesses) or in a docstring's example (`>>> from ...`)
    pattern = re.compile(
        rf"(?:^|\\n|[;\"']|>>> )\s*(?:from ({names})[. ]|import (?:[\w.]+(?: as \w+)?, )*({names})\b)", re.M
    )
    found = []
    for folder in (*OLD_NAMES, "diffret", "tests", "benchmarks", "examples"):
        for path in (REPO / folder).rglob("*.py"):
            for m in pattern.finditer(path.read_text()) if path.name != "test_package.py" else ():
                found.append(f"{path.relative_to(REPO)}: {m.group(0).strip()}")
    assert found == []
    assert pattern.search("x = 'import os, time, stages.encode as enc'") and not pattern.search("import os, time")
    assert pattern.search("  >>> from storage import X") and not pattern.search(">>> from diffret.storage import X")
