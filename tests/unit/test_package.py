"""diffret installs one import name: the wheel built from this checkout holds one top-level package, `diffret`
(its real subfolders flows, stages, storage, ..., with their data files), the code imports itself only through it,
and every file has one module name: the repository root is not an import path of an install, so `import storage`
fails outside the checkout, and no two loaded modules share a file (a second name would load a module twice)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile

from conftest import REPO, duplicate_modules

OLD_NAMES = ("flows", "tasks", "stages", "storage", "queries", "retrieval")


def test_the_wheel_holds_every_module_and_installs_outside_the_checkout(wheel_env) -> None:
    """``pip install .``'s wheel holds every module of the package (found, not listed: a folder added later is in
    it), one top-level package with its data files and the console script; installed into a fresh environment
    outside the checkout, every module imports from it."""
    names = zipfile.ZipFile(wheel_env.wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"diffret"}, top
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "diffret").rglob("*.py")}
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
    for folder in ("diffret", "tests", "benchmarks", "examples"):
        for path in (REPO / folder).rglob("*.py"):
            for m in pattern.finditer(path.read_text()) if path.name != "test_package.py" else ():
                found.append(f"{path.relative_to(REPO)}: {m.group(0).strip()}")
    assert found == []
    assert pattern.search("x = 'import os, time, stages.encode as enc'") and not pattern.search("import os, time")
    assert pattern.search("  >>> from storage import X") and not pattern.search(">>> from diffret.storage import X")


def test_only_diffret_is_importable_from_the_install_and_every_file_has_one_name(tmp_path) -> None:
    """The environment's own install (CI: `pip install -e ".[dev]"` in a fresh venv), run outside the checkout with no
    PYTHONPATH: the design card's top-level names do not import, every module of diffret does, each from its file under
    diffret/, and no two of the modules loaded share a file. The root folders hold no Python code."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    for name in (*OLD_NAMES, "tasks"):
        p = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, env=env, capture_output=True)
        assert p.returncode != 0 and b"No module named" in p.stderr, (name, p.stderr[-500:])
    modules = sorted(
        p.relative_to(REPO).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
        for p in (REPO / "diffret").rglob("*.py")
    )
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps({k: getattr(v, '__file__', None) for k, v in list(sys.modules.items())}))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    files = json.loads(p.stdout.splitlines()[-1])
    for m in modules:
        assert os.path.realpath(files[m]).startswith(str(REPO / "diffret") + os.sep), (m, files[m])
    seen: dict[str, list[str]] = {}
    for name, f in files.items():
        if f and os.path.realpath(f).startswith(str(REPO) + os.sep):  # this checkout's (a library may alias its own)
            seen.setdefault(os.path.realpath(f), []).append(name)
    assert [names for names in seen.values() if len(names) > 1] == []
    for folder in OLD_NAMES:
        assert not list((REPO / folder).rglob("*.py")), f"{folder}/ at the root holds Python code: a second name"
        assert (REPO / "diffret" / folder).is_dir() and not (REPO / "diffret" / folder).is_symlink()


def test_no_two_modules_loaded_in_this_process_share_a_file() -> None:
    """What the session hook (tests/conftest.py) checks after every test of every worker, here at this point: a
    module imported under two names (the root on the path, a doctest imported by its path) would show."""
    import diffret.storage.sql  # noqa: F401  (some library modules are loaded in any case)

    assert duplicate_modules() == []
