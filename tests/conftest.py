from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


SHARED = REPO.parent / "shared"
NLTK_DATA = Path(__file__).resolve().parent / "unit" / "data" / "nltk_data"  # a copy of ../shared/nltk_data
# The reference content filter reads NLTK's English data; tests (and the CLI subprocesses they start) find the
# vendored copy first and never try NLTK's downloader.
os.environ["NLTK_DATA"] = os.pathsep.join(p for p in (str(NLTK_DATA), os.environ.get("NLTK_DATA")) if p)

# ----------------------------------------------------------------------------------- parallel test workers
# `pytest` runs on pytest-xdist workers (pyproject.toml: -n auto, one per core up to DIFFRET_TEST_WORKERS or 4,
# --dist loadgroup). Each worker is a process of its own: it gets its own PREFECT_HOME (Prefect's database is a
# file: two workers' temporary servers must not migrate one file at once) and one thread for torch, OpenMP and
# BLAS, inherited by every subprocess it starts (the CLI, Prefect workers): two workers with two threads each
# would oversubscribe two cores, and tiny models are fastest on one thread anyway.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    if os.environ.get("PREFECT_HOME"):
        os.environ["PREFECT_HOME"] = str(Path(os.environ["PREFECT_HOME"]) / WORKER)
        Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
DURATIONS = Path(__file__).resolve().parent / "durations.json"  # seconds per group, from a recorded run
SLOW_GROUP_S = 30.0  # a group recorded at this many seconds or more is marked slow
# Trials that sample (tests/e2e/test_fault_trials.py's kill points) draw from one seed per session: new every run,
# printed in the header, inherited by the xdist workers (started after this runs); set it to replay a run.
FAULT_SEED = int(os.environ.setdefault("DIFFRET_FAULT_SEED", str(random.SystemRandom().randrange(2**31))))


def _seed_line() -> str:
    trials = os.environ.get("DIFFRET_FAULT_TRIALS") or "3"
    return f"sampled trials: DIFFRET_FAULT_SEED={FAULT_SEED} (set it to replay them), DIFFRET_FAULT_TRIALS={trials}"


def pytest_report_header(config: pytest.Config) -> str:
    return _seed_line()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    """The seed again at the end, where `pytest -q` (which prints no header) shows it too."""
    if not WORKER:
        terminalreporter.write_line(_seed_line())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core, at most DIFFRET_TEST_WORKERS (default 4: the e2e tests start their own
    subprocesses, and beyond a few workers memory, not cores, runs out first)."""
    cap = int(os.environ.get("DIFFRET_TEST_WORKERS") or 4)
    return max(1, min(cap, len(os.sched_getaffinity(0))))


# Modules that share a session fixture too costly to build twice: one group, so one worker runs them all (the
# Prefect server of `prefect_session`, the store of `stage_world`).
SHARED_GROUPS = {
    "tests/e2e/test_fault_trials.py": "prefect-server",
    "tests/e2e/test_prefect_deployment.py": "prefect-server",
    "tests/e2e/test_prefect_ui_browser.py": "prefect-server",
    "tests/unit/test_budget_stage.py": "stage-world",
    "tests/unit/test_stages_rerun.py": "stage-world",
    "tests/unit/test_stages_resume.py": "stage-world",
    "tests/unit/test_stages_systems.py": "stage-world",
    "tests/unit/test_stages_training.py": "stage-world",
}


def test_group(nodeid: str) -> str:
    """The unit of scheduling a test belongs to: its module, so that a module's fixtures are built once, on one
    worker (or the module's group in ``SHARED_GROUPS``)."""
    module = nodeid.split("::", 1)[0]
    return SHARED_GROUPS.get(module, module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    """xdist's scope scheduling with ``test_group`` as the scope, the groups in collection order (longest first,
    ``pytest_collection_modifyitems``). Each worker takes one group at a time (two at the start)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_group(nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The groups (``test_group``) run longest first, by the seconds recorded in tests/durations.json (an unknown
    group counts as 10 s), so that the last group to start is a short one and the workers finish together; a
    group's tests keep their order. Without xdist this is only an order: the tests do not depend on it. A group
    recorded at ``SLOW_GROUP_S`` or more is marked ``slow``."""
    try:
        recorded = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        recorded = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(test_group(item.nodeid), i)
    order = {id(item): i for i, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple:
        group = test_group(item.nodeid)
        return (-float(recorded.get(group, 10.0)), first[group], order[id(item)])

    items.sort(key=key)
    for item in items:  # `pytest -m "not slow"`: the fast loop leaves the groups recorded as slow
        if float(recorded.get(test_group(item.nodeid), 0.0)) >= SLOW_GROUP_S:
            item.add_marker(pytest.mark.slow)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write each test group's seconds (setup, call, teardown) to tests/durations.json",
    )


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    group = test_group(report.nodeid)
    _seconds[group] = _seconds.get(group, 0.0) + report.duration


def duplicate_modules() -> list[list[str]]:
    """The loaded modules of this checkout (the library, the tests) that share a file with another loaded module, in
    groups: every file has one module name, so this is empty (a root on the path, or a doctest imported by its file
    path, would load a module a second time, with its own caches and classes)."""
    seen: dict[str, list[str]] = {}
    root = str(REPO) + os.sep
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and os.path.realpath(file).startswith(root):
            seen.setdefault(os.path.realpath(file), []).append(name)
    return sorted(sorted(names) for names in seen.values() if len(names) > 1)


_worker_duplicates: list[list[str]] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ANN001
    """The controller collects each xdist worker's duplicate modules (``pytest_sessionfinish`` on the worker)."""
    _worker_duplicates.extend(getattr(node, "workeroutput", {}).get("duplicate_modules", []))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.getoption("--record-durations") and not WORKER and _seconds:
        DURATIONS.write_text(json.dumps({g: round(s, 1) for g, s in sorted(_seconds.items())}, indent=1) + "\n")
    # after the whole session (every worker's): no two loaded modules share a file, or the run fails
    duplicates = duplicate_modules()
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["duplicate_modules"] = duplicates
        return
    duplicates += _worker_duplicates
    if duplicates:
        sys.stderr.write(f"\nFAILED: modules loaded under two names (one file each): {duplicates}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread; several threads spin badly when the CPUs are shared (10x slower).
    A module uses it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def stage_world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every stage run once on a tiny store (tests/stage_world.py), built once per session for the modules of the
    ``stage-world`` group (``SHARED_GROUPS``); a test that changes the store changes a copy
    (``stage_world.copy_world``)."""
    from stage_world import build_world

    return build_world(tmp_path_factory.mktemp("stages"))


@pytest.fixture(scope="session")
def wheel_env(tmp_path_factory: pytest.TempPathFactory):
    """The wheel ``pip install .`` builds, installed into a fresh environment outside the checkout
    (tests/wheel_venv.py); built once per test process."""
    from wheel_venv import build_wheel_env

    return build_wheel_env(REPO, tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def prefect_session(tmp_path_factory: pytest.TempPathFactory):
    """One local Prefect server (its UI served) for every test of this session that needs one
    (tests/e2e/prefect_harness.py; those modules share the xdist group ``prefect-server``, so one worker starts it);
    a test takes its own view of it with the ``prefect_server`` fixture."""
    from prefect_harness import local_prefect_server  # tests/e2e, on the path once an e2e module is collected

    with local_prefect_server(tmp_path_factory.mktemp("prefect-server"), ui=True) as server:
        server.env["OMP_NUM_THREADS"] = "1"  # the workers and the flow runs they start
        server.env["HF_HUB_OFFLINE"] = "1"
        yield server


@pytest.fixture
def prefect_server(prefect_session, tmp_path: Path):
    """This test's view of the session's Prefect server: a work pool of its own, logs in ``tmp_path``."""
    return prefect_session.for_test(tmp_path)


@pytest.fixture
def shared_data() -> Path:
    """../shared/data beside the checkout; tests that need it skip cleanly when it is absent."""
    data = SHARED / "data"
    if not (data / "scifact" / "corpus.jsonl").exists():
        pytest.skip("../shared/data is not beside this checkout")
    return data


def write_beir(folder: Path, corpus: list[dict] | None, queries: list[dict], qrels: dict[str, list[tuple]]) -> Path:
    """A tiny collection in BEIR layout (corpus.jsonl, queries.jsonl, qrels/<split>.tsv)."""
    folder.mkdir(parents=True, exist_ok=True)
    if corpus is not None:
        (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (folder / "qrels").mkdir(exist_ok=True)
    for split, rows in qrels.items():
        body = "".join(f"{q}\t{d}\t{r}\n" for q, d, r in rows)
        (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + body)
    return folder


@pytest.fixture
def tiny_beir(tmp_path: Path) -> Path:
    corpus = [
        {"_id": "d1", "title": "Cats", "text": "cats purr"},
        {"_id": "d2", "title": "", "text": "dogs bark", "metadata": {"year": 2020}},
        {"_id": "d3", "title": "Empty", "text": ""},
    ]
    queries = [
        {"_id": "q1", "text": "what do cats do"},
        {"_id": "q2", "text": "barking"},
        {"_id": "q3", "text": "never judged"},
    ]
    qrels = {"test": [("q1", "d1", 1), ("q2", "d2", 2)], "train": [("q2", "d1", 0)]}
    return write_beir(tmp_path / "tiny", corpus, queries, qrels)


@pytest.fixture(scope="session", autouse=True)
def _repairs_named_as_commands() -> None:
    """The store's messages render a repair with the renderer installed; importing ``diffret.flows`` installs the
    command line's (``diffret <command> ...``). Some tests import it and some do not, so without this a test's
    messages would depend on which tests its worker ran before it (a test run alone got the bare ``<command> ...``).
    """
    import diffret.flows.repairs  # noqa: F401
