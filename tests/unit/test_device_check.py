"""The device check's plan and the docs it renders, without running it (tests/e2e/test_device_check_runs.py runs it):
the plan fits one call of the lent GPU at the rates measured on an H100, docs/operations.md shows the plan the script
makes, and docs/scale.md's GPU section and MS MARCO projection are rendered between their markers from the device
check's JSON (a fixture shaped as the script writes it; its figures are made up, not measurements), leaving the rest
of the page as it is. docs/scale.md as committed is the rendering of no GPU figures."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def load(name: str) -> ModuleType:
    """benchmarks/NAME.py as the module ``NAME`` (the folder is not put on the path: its names are common ones)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


device_check, device_prepare, scale_docs = load("device_check"), load("device_prepare"), load("scale_docs")

FIXTURE = Path(__file__).resolve().parent / "data" / "device_check_fixture.json"


def gpu_plan() -> list[dict]:
    return device_check.make_plan(device_check.parse([]))


def test_the_plan_fits_one_call_at_the_h100_rates() -> None:
    plan = gpu_plan()
    assert [p["part"] for p in plan] == list(device_check.PARTS)
    assert sum(p["budget_s"] for p in plan) <= device_check.CALL_S == 540
    for p in plan:  # each part's estimate from the H100 rates is within its budget
        assert 0 < p["estimate_s"] <= p["budget_s"], p
    # both families at 115 and 268 tokens, batch 32 and 128, K 16 and 1; the stages at Dream-7B shape
    for family in ("dream-7b", "llada-8b"):
        runs = next(p["runs"] for p in plan if p["runs"].startswith(family))
        assert "115, 268 tokens x batch 32, 128, K 16 and 1" in runs, runs
    assert "download -> tokenize -> encode" in plan[0]["runs"] and "Dream-7B shape" in plan[0]["runs"]
    # the rates: Dream-7B 268 tokens 130 passages/s, 115 tokens 280; LLaDA-8B's slower by its parameter count
    assert device_check.rate(268, "dream") == 130 and device_check.rate(115, "dream") == 280
    assert device_check.rate(115, "llada") < 280
    # a budget given replaces the plan's; a part unknown or badly written is refused
    args = device_check.parse(["--budget", "score=12"])
    assert next(p for p in device_check.make_plan(args) if p["part"] == "score")["budget_s"] == 12
    for bad in (["--budget", "scores=3"], ["--budget", "score"], ["--fail-part", "nope"]):
        with pytest.raises(SystemExit):
            device_check.parse(bad)


def test_operations_shows_the_plan_the_script_makes() -> None:
    text = (REPO / "docs" / "operations.md").read_text()
    assert device_check.plan_table(gpu_plan()) in text
    assert "timeout_s=570" in text and "device_check.py --plan" in text


def render(check: dict | None) -> str:
    return scale_docs.render_section(check, scale_docs.scale_results())


def cells(section: str, first: str) -> list[list[str]]:
    """The rows of the tables in ``section`` whose first cell is ``first``, split into cells."""
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith(f"| {first} |")
    ]


def test_the_gpu_section_and_projection_render_from_the_device_checks_json(tmp_path: Path) -> None:
    check = json.loads(FIXTURE.read_text())
    section = render(check)
    assert section.startswith(scale_docs.BEGIN) and section.endswith(scale_docs.END)
    assert "Awaiting the GPU run" not in section and "NVIDIA H100 80GB HBM3" in section
    # every part's status, time, budget and peaks, in their columns
    for name, p in check["parts"].items():
        row = cells(section, name)[0]  # the parts table comes first
        want = [p[k] for k in ("status", "seconds", "budget_s", "gpu_peak_gib", "gpu_used_peak_gib")]
        assert row[1:6] == [scale_docs._cell(v) for v in want], row
    assert "InjectedFailure" not in section and cells(section, "encode_llada")[0][1] == "timeout"
    # the encode rows: model, tokens, batch, then diffret's and the bare loop's docs/s
    dream = [r for r in check["parts"]["encode_dream"]["rows"] if r["tokens"] == 115 and r["batch"] == 128][0]
    row = next(r for r in cells(section, "dream") if r[1:3] == ["115", "128"])
    assert row[3:7] == [f"{dream['diffret_docs_s']:,.0f}", f"{dream['bare_docs_s']:,.0f}", f"{dream['ratio']:.2f}",
                        f"{dream['k16_over_k1']:.2f}"], row  # fmt: skip
    # the projection takes the measured rates: the best 115-token docs/s, and search_pass's TFLOP/s
    best = max(
        (r for r in check["parts"]["encode_dream"]["rows"] if r["tokens"] == 115), key=lambda r: r["diffret_docs_s"]
    )
    (grid,) = [r for r in cells(section, "encode, whole grid (5 passage passes)")]
    hours = scale_docs.MSMARCO_PASSAGES * 5 / best["diffret_docs_s"] / 3600
    assert grid[2] == f"{hours:.1f} h" and grid[3] == f"{hours / 8:.1f} h", grid
    assert f"/ {best['diffret_docs_s']:,.0f} per s (*measured*: Dream-7B shape, 115-token rows, batch" in grid[4]
    s = max(check["parts"]["score"]["rows"], key=lambda r: r["passages"])
    tflops = 2 * s["queries"] * 16 * s["passages"] * 16 * s["hidden"] / s["search_pass_s"] / 1e12
    (score,) = cells(section, "score, whole grid")
    assert f"at {tflops:,.0f} TFLOP/s (*measured*" in score[4], score
    assert "*assumed*" not in section and "**Measured on a GPU**: the encode and score rates" in section
    # into the page: only what lies between the markers changes, and rendering again changes nothing
    doc, kept = tmp_path / "scale.md", tmp_path / "results" / "device_check.json"
    before = (REPO / "docs" / "scale.md").read_text()
    doc.write_text(before)
    scale_docs.main(["--device-check", str(FIXTURE), "--doc", str(doc), "--keep", str(kept)])
    once = doc.read_text()
    assert once == scale_docs.replace_section(before, section) != before
    assert once.split(scale_docs.BEGIN)[0] == before.split(scale_docs.BEGIN)[0]
    assert once.split(scale_docs.END)[1] == before.split(scale_docs.END)[1]
    assert json.loads(kept.read_text()) == check  # the figures' source kept beside the results
    scale_docs.main(["--device-check", str(kept), "--doc", str(doc), "--keep", str(kept)])
    assert doc.read_text() == once
    # a part that measured nothing leaves its rate assumed
    partial = json.loads(FIXTURE.read_text())
    partial["parts"]["score"]["rows"] = []
    text = render(partial)
    assert "at 400 TFLOP/s (*assumed*)" in text and "The score rate is still assumed" in text


def test_the_page_as_committed_is_the_rendering_of_no_gpu_figures(tmp_path: Path) -> None:
    text = (REPO / "docs" / "scale.md").read_text()
    cpu = json.loads(FIXTURE.read_text())
    cpu["environment"]["device"] = "cpu"  # a CPU run (the tiny check) has no GPU figures
    for check in (None, cpu):
        assert scale_docs.replace_section(text, render(check)) == text
    assert "**Awaiting the GPU run.**" in text and "*assumed*" in text
    doc = tmp_path / "scale.md"
    doc.write_text(text.replace(scale_docs.END, "stale\n" + scale_docs.END))
    scale_docs.main(["--device-check", "none", "--doc", str(doc), "--keep", str(tmp_path / "kept.json")])
    assert doc.read_text() == text and not (tmp_path / "kept.json").exists()
    doc.write_text(text.replace(scale_docs.BEGIN, ""))
    with pytest.raises(SystemExit, match="markers"):
        scale_docs.main(["--device-check", "none", "--doc", str(doc)])


def test_prepare_refuses_a_carry_above_60_mib(capsys: pytest.CaptureFixture) -> None:
    device_prepare.check_carry(40 << 20, 19 << 20)
    assert "59.00 MiB of the 60 MiB" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="60 MiB"):
        device_prepare.check_carry(40 << 20, 21 << 20)
    assert any(w.startswith("typing-extensions==") for w in device_prepare.WHEELS)


def test_a_killed_process_tree_leaves_nothing(tmp_path: Path) -> None:
    """kill_tree ends a session leader, its group, and a grandchild that started a session of its own."""
    import subprocess
    import time

    pidfile = tmp_path / "pid"
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(600)\n"
    )
    top = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.time() + 30
    while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    grandchild = int(pidfile.read_text())
    device_check.kill_tree(top.pid)
    top.wait(timeout=10)
    for _ in range(50):
        if not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the grandchild outlived kill_tree")
