"""Every kind of stage folder (dataset, tokens, filters, encodings, a compressed system's encodings and codebooks, runs
of score / bm25 / beta / late / rerank / budget / import-run / fuse, metrics, features, index, bag of tokens, partial/,
summaries, reports, comparisons, training sets, models, reranker models, latency) x four faults (manifest deleted, a
file truncated, a byte flipped, a data file deleted with its manifest kept; some kinds also a manifest edited by hand,
and a manifest holding a value every setting refuses now: a NaN an earlier version wrote as null): `diffret verify`
names the damage with its repair, SQL reads the other folders meanwhile (the damaged one's view leaves it out with a
warning naming it and its repair; the other views are untouched), and the repair it prints (the command that made the
folder, with the settings that made it where the line says so; removing a folder no command can build again), run as
printed, leaves `verify` clean and the folder's outputs as they were. One store with a poisoned fusion and a deleted
run file: SQL and evaluate of the other systems work, both are named with their repairs. Printed repairs and advice
work as printed (--root when the root is not the default, a name another system holds, measures). The CLI runs in
this process (typer's runner, the store root from $DIFFRET_ROOT as a user would have it) to keep the cases fast.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import write_beir
from tiny_models import save_tiny_mlm
from typer.testing import CliRunner

from diffret.api import Store
from diffret.flows.cli import app
from diffret.storage.layout import STAGE_FOLDERS, TRAIN_LOG_FILE
from diffret.storage.manifest import config_hash
from diffret.storage.sql import DamagedFolderWarning

CORPUS = [{"_id": f"d{i}", "title": f"t{i}", "text": f"passage {i} about cats dogs tea and gardens"} for i in range(8)]
QUERIES = [{"_id": f"q{i}", "text": f"what about cats {i}"} for i in range(3)]
QRELS = {"test": [("q0", "d0", 1), ("q1", "d1", 1), ("q2", "d2", 1)]}
PROMPT = str(Path(__file__).parent / "data" / "rerank_tiny.yaml")

# kind -> (its folder: a glob, {f16} / {res} / {sidr} / {bm25} the systems' slugs; the view that reads it, or None;
# the command that made it)
KINDS = {
    "dataset": ("datasets/dataset=c", "corpus", "download"),
    "tokens": ("tokens/*/dataset=c/side=passage", "tokens", "tokenize"),
    "filters": ("filters/*/dataset=c/side=passage/filter=nltk", None, "tokenize"),
    "encodings": ("encodings/system={f16}/dataset=c/side=passage/k=1", "encodings", "encode"),
    "compressed": ("encodings/system={res}/dataset=c/side=passage/k=1", "encodings", "compress"),
    "codebooks": ("codebooks/system={res}/dataset=c/k=1", None, "compress"),
    "runs": ("runs/system={f16}/dataset=c/split=test/kq=1/kp=1/mode=single_dense", "runs", "score"),
    "bm25 runs": ("runs/system={bm25}/dataset=c/split=test/kq=0/kp=0/mode=bm25", "runs", "bm25"),
    "beta runs": ("runs/system={sidr}/dataset=c/split=test/kq=1/kp=0/mode=beta", "runs", "beta"),
    "late runs": ("runs/system={sidr}/dataset=c/split=test/kq=1/kp=1/mode=late_sparse_max_m4", "runs", "late"),
    "rerank runs": ("runs/*/dataset=c/split=test/kq=0/kp=0/mode=rerank", "runs", "rerank"),
    "imported runs": ("runs/system=ext/dataset=c/split=test/kq=0/kp=0/mode=imported", "runs", "import-run"),
    "fused runs": ("runs/*/dataset=c/split=test/kq=0/kp=0/mode=fusion", "runs", "fuse"),
    "adaptive runs": ("runs/system={f16}/dataset=c/split=test/kq=0/kp=0/mode=adaptive_*", "runs", "budget"),
    "metrics": ("metrics/system={f16}/dataset=c/split=test/kq=1/kp=1/mode=single_dense", "metrics", "evaluate"),
    "features": ("features/system={f16}/dataset=c/split=test/*", "budget_features", "budget"),
    "index": ("index/system={f16}/dataset=c/kp=1", None, "index"),
    "bot": ("bot/*/dataset=c", "bot", "bot"),
    "partial": ("partial/system={sidr}/dataset=c/k=1", None, "late"),
    "summaries": ("summaries/system={f16}/dataset=c/split=test", None, "summary"),
    "reports": ("reports/report=t", None, "report"),
    "comparisons": ("comparisons/comparison=cmp", None, "compare"),
    "training": ("training/set=c", "training_groups", "training-data"),
    "models": ("models/model=tiny-ft", "train_log", "train"),
    "reranker": ("models/model=*-rr-*", "train_log", "train-reranker"),
    "latency": ("latency/system={f16}/kind=encode/*", "encode_latency", "latency"),
}
FAULTS = ("delete manifest", "truncate", "flip byte", "delete file")
# a manifest edited by hand: the stage folders the pipeline reads most and a sharded cache (the other kinds read their
# manifest the same way)
EDITED = ("dataset", "tokens", "encodings", "runs", "metrics", "index", "models", "summaries", "partial")
# a manifest holding a value every setting refuses now: a NaN an earlier version took and wrote as null (its config no
# longer gives its hash), in the kinds whose config holds a float setting
REFUSED = ("bm25 runs", "fused runs", "comparisons", "models", "reranker")
CASES = (
    [(k, f) for k in KINDS for f in FAULTS]
    + [(k, "edit manifest") for k in EDITED]
    + [(k, "refused value") for k in REFUSED]
)


def invoke(*args: str, root: Path | str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args), env={"DIFFRET_ROOT": str(root), "COLUMNS": "400"})
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output


def invoke_sql(query: str, *args: str, root: Path | str) -> tuple[int, list[str], list[str]]:
    """``diffret sql --format csv``: its exit code, the result's lines (stdout) and its warnings (stderr)."""
    res = CliRunner().invoke(app, ["sql", "--format", "csv", *args, query], env={"DIFFRET_ROOT": str(root)})
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.stdout.splitlines(), [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("faults")
    m = str(save_tiny_mlm(base / "model"))
    beir = write_beir(base / "c", CORPUS, QUERIES, QRELS)
    trec = base / "ext.trec"  # a run made elsewhere (diffret import-run)
    trec.write_text(
        "".join(f"{q['_id']} Q0 {d['_id']} {r + 1} {8 - r} ext\n" for q in QUERIES for r, d in enumerate(CORPUS))
    )
    root = base / "store"

    def run(*args: str) -> None:
        code, out = invoke(*args, root=root)
        assert code == 0, (args, out)

    pipeline = [
        "run",
        "-d",
        "c",
        "--source",
        str(beir),
        "--model",
        m,
        "--kq",
        "1",
        "--kp",
        "1",
        "--max-length",
        "32",
        "--mode",
        "single_dense",
        "--mode",
        "sparse_max",
        "--split",
        "test",
    ]
    run(*pipeline)
    run("encode", "-d", "c", "--model", m, "--readout", "sidr", "--k", "1", "--max-length", "32", "--side", "query")
    code, out = invoke("systems", "--format", "csv", root=root)
    slugs = {r.split(",")[3] if r.split(",")[1] == "encoder" else "bm25": r.split(",")[0] for r in out.splitlines()[1:]}
    s = {"f16": slugs["diffretriever"], "sidr": slugs["sidr"], "bm25": slugs["bm25"]}
    # the settings that made each folder (the stage commands `run` composes, for what `run` made)
    made = {
        "download": ["c", "--source", str(beir)],
        "tokenize": ["-d", "c", "--model", m, "--max-length", "32"],
        "encode": ["-d", "c", "--model", m, "--k", "1", "--max-length", "32"],
        "compress": ["-d", "c", "--system", s["f16"], "--store", "residual:1"],
        "score": [
            "-d",
            "c",
            "--system",
            s["f16"],
            "--kq",
            "1",
            "--kp",
            "1",
            "--mode",
            "single_dense",
            "--mode",
            "sparse_max",
            "--split",
            "test",
        ],
        "bm25": ["-d", "c", "--split", "test"],
        "evaluate": [],
        "bot": ["-d", "c", "--model", m, "--max-length", "32"],
        "beta": ["-d", "c", "--system", s["sidr"]],
        "late": [
            "-d",
            "c",
            "--system",
            s["sidr"],
            "--mode",
            "sparse_max",
            "--depth",
            "4",
            "--first-stage",
            s["sidr"],
            "--first-kq",
            "1",
            "--first-kp",
            "0",
            "--first-mode",
            "beta",
        ],
        "training-data": ["-d", "c", "--split", "test", "--n-negatives", "3"],
        "train": [
            "-t",
            "c",
            "--model",
            m,
            "--full",
            "--kq",
            "1",
            "--kp",
            "1",
            "--n-negatives",
            "3",
            "--batch-size",
            "2",
            "--pool-size",
            "2",
            "--global-batch",
            "2",
            "--max-steps",
            "2",
            "--q-max-len",
            "8",
            "--p-max-len",
            "12",
            "--name",
            "tiny-ft",
        ],
        "train-reranker": [
            "-d",
            "c",
            "--split",
            "test",
            "--model",
            m,
            "--method",
            "logits_listwise",
            "--prompt",
            PROMPT,
            "--list-size",
            "3",
            "--doc-tokens",
            "8",
            "--batch-size",
            "1",
            "--grad-accum",
            "1",
            "--max-steps",
            "2",
            "--full",
        ],
        "index": ["-d", "c", "--system", s["f16"], "--kq", "1", "--kp", "1", "--type", "none"],
        "budget": [
            "-d",
            "c",
            "--system",
            s["f16"],
            "--cross-fit",
            "--folds",
            "2",
            "--selector",
            "fixed",
            "--mode",
            "single_dense",
        ],
        "latency": [
            "--model",
            m,
            "--max-length",
            "32",
            "--lengths",
            "8",
            "--k",
            "1",
            "--search-sizes",
            "10",
            "--search-k",
            "1x1",
            "--search-queries",
            "2",
            "--topk",
            "5",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--kinds",
            "encode",
        ],
        "report": ["--name", "t", "--n-boot", "20"],
        "import-run": [str(trec), "-d", "c", "--name", "ext"],
        "fuse": ["-d", "c", "--run", "bm25", "--run", "ext"],
        "compare": ["-d", "c", "--name", "cmp"],
    }
    for command in (
        "bot",
        "beta",
        "late",
        "compress",
        "index",
        "budget",
        "training-data",
        "train",
        "train-reranker",
        "import-run",
        "fuse",
    ):
        run(command, *made[command])
    rr = next(root.glob("models/model=*-rr-*"))
    made["rerank"] = [
        "-d",
        "c",
        "--model",
        str(rr),
        "--method",
        "logits_listwise",
        "--prompt",
        PROMPT,
        "--depth",
        "4",
        "--window",
        "3",
        "--step",
        "1",
        "--doc-tokens",
        "8",
    ]
    for command in ("rerank", "evaluate", "latency", "compare"):
        run(command, *made[command])
    run(*pipeline)  # the summary again, over every run now evaluated
    run("report", *made["report"])
    code, out = invoke("systems", "--format", "csv", root=root)
    s["res"] = next(r.split(",")[0] for r in out.splitlines() if "residual1" in r)
    code, out = invoke("verify", root=root)
    assert code == 0, out
    # every kind of stage folder is in the store and in the matrix (the registry's records hold no file to damage;
    # partials/ holds a running pass's finished units and is gone once the pass merges: a killed pass's are kept
    # and resumed, tests/unit/test_sharded_passes.py)
    assert {g.split("/")[0] for g, _, _ in KINDS.values()} | {"systems", "partials"} == set(STAGE_FOLDERS)
    assert {p.name for p in root.iterdir() if p.name in STAGE_FOLDERS} == set(STAGE_FOLDERS) - {"partials"}
    return {"root": root, "slugs": s, "made": made, "counts": {v: count(root, v) for v in ("corpus", "runs")}}


def damage(folder: Path, fault: str) -> None:
    manifest = folder / "_manifest.json"
    m = json.loads(manifest.read_text())
    name = min(m["files"] or [""], key=lambda n: (not n.endswith(".parquet"), n))  # a registry record has none
    target = folder / name
    if fault == "delete manifest":
        manifest.unlink()
    elif fault == "truncate":
        target.write_bytes(target.read_bytes()[: max(1, target.stat().st_size // 3)])
    elif fault == "flip byte":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif fault == "delete file":
        target.unlink()
    elif fault == "refused value":  # a NaN setting, written as null with the hash of the config that held it
        parent, key = next(_floats(m["config"]))
        parent[key] = math.nan
        m["config_hash"] = config_hash(m["config"])
        parent[key] = None
        manifest.write_text(json.dumps(m, indent=2))
    else:
        m["files"][name]["sha256"] = "f" * 64
        manifest.write_text(json.dumps(m))


def _floats(obj: object) -> Iterator[tuple[object, object]]:
    """(container, key) of every float setting of a manifest's config (not its inputs' fingerprints)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        if isinstance(value, float):
            yield obj, key
        elif key != "inputs":
            yield from _floats(value)


def count(root: Path, view: str) -> int:
    code, lines, warned = invoke_sql(f"select count(*) from {view}", root=root)
    assert code == 0 and not warned, (lines, warned)
    return int(lines[1])


def outputs(folder: Path, kind: str) -> object:
    """A folder's outputs as its manifest lists them: each file's sha256; the rows of a file that holds timings (a
    train log, latencies); an index's rows and recall against exact search (LanceDB names its files by uuid)."""
    m = json.loads((folder / "_manifest.json").read_text())
    if kind == "index":
        return m["stats"]["rows"], {k: (c["recall_10"], c["recall_100"]) for k, c in m["stats"]["check"].items()}
    return {n: e["rows"] if kind == "latency" or n == TRAIN_LOG_FILE else e["sha256"] for n, e in m["files"].items()}


def repair(printed: str, made: dict[str, list[str]]) -> list[str]:
    """The command a `verify` line prints, as a user runs it: its words, then (where the line says "with the settings
    that made it") the settings that made the folder which it does not name already."""
    words = shlex.split(re.search(r"repair: run `diffret ([^`]*)`", printed).group(1))
    if "with the settings that made it" not in printed:
        return words
    given = {w for w in words if w.startswith("-")}
    extra, settings = [], made[words[0]]
    i = 0
    while i < len(settings):
        flag = settings[i]
        takes = flag.startswith("-") and i + 1 < len(settings) and not settings[i + 1].startswith("--")
        if flag.startswith("-") and flag not in given:
            extra += settings[i : i + 1 + takes]
        elif not flag.startswith("-") and flag not in words:  # a positional argument (import-run's file)
            extra.append(flag)
        i += 1 + takes
    return words + extra


@pytest.mark.parametrize(("kind", "fault"), CASES)
def test_damage_is_named_isolated_and_repaired_as_printed(world: dict, tmp_path: Path, kind: str, fault: str) -> None:
    root = tmp_path / "store"
    shutil.copytree(world["root"], root, symlinks=True)
    pattern, view, maker = KINDS[kind]
    (folder,) = list(root.glob(pattern.format(**world["slugs"])))
    before = outputs(folder, kind)
    damage(folder, fault)
    code, out = invoke("verify", root=root)
    lines = [line for line in out.splitlines() if str(folder) in line]
    assert code == 1 and lines and "repair: " in lines[0], out
    other = "runs" if kind == "dataset" else "corpus"
    assert count(root, other) == world["counts"][other]  # every other view keeps working
    if view is not None:  # its view reads the other folders and leaves this one out, naming it and its repair (a
        verify = ["--verify"] if fault == "flip byte" else []  # flipped byte DuckDB may read through: --verify)
        code, _, warned = invoke_sql(f"select count(*) from {view}", *verify, root=root)
        assert code == 0 and len(warned) == 1 and str(folder) in warned[0] and "repair: " in warned[0], warned
    if fault == "refused value":  # no command builds it again as it was: the repair removes it
        assert "not finite" in lines[0] and "repair: remove the folder: `rm -r" in lines[0], lines[0]
        command = re.search(r"repair: remove the folder: `([^`]*)`", lines[0]).group(1)
        subprocess.run(shlex.split(command), check=True)
        assert not folder.exists()
        code, out = invoke("verify", root=root)
        assert code == 0, (command, out)
        return
    args = repair(lines[0], world["made"])
    assert args[0] == maker, (lines[0], maker)  # the command that made it
    code, out = invoke(*args, root=root)
    assert code == 0, (args, out)
    code, out = invoke("verify", root=root)
    assert code == 0, (args, out)
    assert outputs(folder, kind) == before  # as they were


def test_one_poisoned_manifest_and_one_deleted_file_take_down_only_their_folders(world: dict, tmp_path: Path) -> None:
    """A fusion an earlier version made with a NaN weight (its run and registry record hold null where the NaN was) and
    a run whose file was deleted under its manifest: SQL and evaluate work over the other systems, naming both with
    their repairs, and the repairs run as printed leave `verify` clean."""
    root = tmp_path / "store"
    shutil.copytree(world["root"], root, symlinks=True)
    s = world["slugs"]
    (fused,) = root.glob(KINDS["fused runs"][0])
    fusion = fused.parts[-6].removeprefix("system=")
    scored = root / KINDS["runs"][0].format(**s)
    for folder, fault in (
        (fused, "refused value"),
        (root / "systems" / f"system={fusion}", "refused value"),
        (scored, "delete file"),
    ):
        damage(folder, fault)
    query = "select system, mode, count(*) from runs group by all order by all"
    code, rows, warned = invoke_sql(query, root=root)
    before = {tuple(r.split(",")[:2]) for r in invoke_sql(query, root=world["root"])[1][1:]}
    assert code == 0 and {tuple(r.split(",")[:2]) for r in rows[1:]} == before - {
        (fusion, "fusion"),
        (s["f16"], "single_dense"),
    }
    assert len(warned) == 2, warned  # each damaged folder named once, with its repair
    for folder in (fused, scored):
        assert [w for w in warned if str(folder) in w and "repair: " in w], warned
    with pytest.warns(DamagedFolderWarning) as caught:  # the Python API: the same rows, the same warnings
        assert Store(root).sql(query).num_rows == len(rows) - 1
    api = sorted(str(w.message).replace(f" --root {root}", "") for w in caught)  # no $DIFFRET_ROOT: its root named
    assert api == sorted(w.removeprefix("warning: ") for w in warned)
    for metrics in root.glob(f"metrics/system={s['bm25']}/*/*/*/*/*"):  # BM25's metrics to compute again
        shutil.rmtree(metrics)
    code, out = invoke("evaluate", root=root)
    assert code == 0 and "1 run(s) evaluated" in out, out  # the other systems: evaluated
    assert all(str(f) in out for f in (fused, scored)) and out.count("repair: ") == 2, out  # the damaged: named
    for command in (["summary", "-d", "c", "--system", s["f16"]], ["report", *world["made"]["report"]]):
        code, out = invoke(*command, root=root)  # what reads many folders through the views: rebuilt without them
        warned = [ln for ln in out.splitlines() if ln.startswith("warning:") and "damaged folder" in ln]
        assert code == 0 and all(str(fused) in w or str(scored) in w for w in warned), (command, out)
    code, out = invoke("verify", root=root)
    lines = [ln for ln in out.splitlines() if ln.startswith("damaged:")]
    assert code == 1 and len(lines) == 3, out
    for line in lines:  # each repair, as printed
        if removal := re.search(r"repair: remove the folder: `([^`]*)`", line):
            subprocess.run(shlex.split(removal.group(1)), check=True)
        else:
            code, out = invoke(*repair(line, world["made"]), root=root)
            assert code == 0, (line, out)
    code, out = invoke("verify", root=root)
    assert code == 0, out
    fused_rows = json.loads((world["root"] / fused.relative_to(root) / "_manifest.json").read_text())
    assert count(root, "runs") == world["counts"]["runs"] - fused_rows["files"]["run.parquet"]["rows"]  # removed


def _elsewhere(root: Path) -> Callable[..., tuple[int, str]]:
    """The CLI as a user types it away from the store: --root given, no $DIFFRET_ROOT."""

    def cli(*args: str) -> tuple[int, str]:
        res = CliRunner().invoke(app, [*args, "--root", str(root)], env={"DIFFRET_ROOT": None, "COLUMNS": "400"})
        assert "Traceback" not in res.output, res.output
        return res.exit_code, res.output

    return cli


def test_a_repair_names_the_store_root_when_a_command_would_not_find_it(world: dict, tmp_path: Path) -> None:
    root = tmp_path / "store"
    shutil.copytree(world["root"], root, symlinks=True)
    cli = _elsewhere(root)
    folder = root / KINDS["bm25 runs"][0].format(**world["slugs"])
    damage(folder, "delete file")
    code, out = cli("verify")
    (line,) = [ln for ln in out.splitlines() if str(folder) in ln]
    assert code == 1 and f"--root {root}" in line, line
    res = CliRunner().invoke(app, repair(line, world["made"]), env={"DIFFRET_ROOT": None})  # as printed
    assert res.exit_code == 0, res.output
    assert cli("verify")[0] == 0


def test_a_name_another_system_holds_is_refused_with_advice_to_choose_another(world: dict, tmp_path: Path) -> None:
    root = tmp_path / "store"
    shutil.copytree(world["root"], root, symlinks=True)
    code, out = _elsewhere(root)(
        "import-run", str(world["root"].parent / "ext.trec"), "-d", "c", "--name", world["slugs"]["f16"]
    )  # an encoder's slug
    assert code == 2 and "choose another name" in out and "remove" not in out, out


def test_a_measure_unknown_or_not_evaluated_gets_advice_that_works(world: dict, tmp_path: Path) -> None:
    root = tmp_path / "store"
    shutil.copytree(world["root"], root, symlinks=True)
    cli = _elsewhere(root)
    code, out = cli("compare", "-d", "c", "--measure", "nosuch")  # the measures there are, not a repair that fails
    assert code == 2 and "unknown measure 'nosuch'" in out and "ndcg_cut" in out and "`diffret" not in out, out
    code, out = cli("compare", "-d", "c", "--measure", "P_5", "--name", "p5")
    command = re.search(r"run `diffret ([^`]*)`", out)
    assert code == 2 and command and "--measure ndcg_cut_10" in out and f"--root {root}" in out, out
    assert CliRunner().invoke(app, shlex.split(command.group(1)), env={"DIFFRET_ROOT": None}).exit_code == 0
    assert cli("compare", "-d", "c", "--measure", "P_5", "--measure", "ndcg_cut_10", "--name", "p5")[0] == 0


def _sha256s(folder: Path, kind: str) -> object:
    """The sha256 of every file a folder's manifest lists, read from disk; an index's data files by content (LanceDB
    names them, its transaction and its version files by uuid and time: the rows are what a rebuild must give)."""
    m = json.loads((folder / "_manifest.json").read_text())
    digests = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in m["files"]}
    if kind == "index":
        return sorted(d for n, d in digests.items() if n.startswith("docs.lance/data/")), m["stats"]["rows"]
    return digests


def test_a_printed_repair_run_verbatim_rebuilds_the_same_bytes(world: dict, tmp_path: Path) -> None:
    """For each kind a damaged file is most often in (tokens, encodings, a scored run, its metrics, an index): one of
    its files deleted, `verify` prints the repair, the command it prints is run word for word (nothing added), and
    every file of the folder is as it was, byte for byte. The CLI as a user types it away from the store (--root, no
    $DIFFRET_ROOT). The encodings were made at a batch size of their own (it changes the vectors' last bits), which the
    repair names."""
    root = tmp_path / "store"
    shutil.copytree(world["root"], root, symlinks=True)

    def cli(*args: str) -> tuple[int, str]:
        res = CliRunner().invoke(app, list(args), env={"DIFFRET_ROOT": None, "COLUMNS": "400"})
        assert "Traceback" not in res.output, res.output
        return res.exit_code, res.output

    at = ["--root", str(root)]
    s, made = world["slugs"], world["made"]
    # the query encodings made again at batch size 3 (recorded in their folder's config)
    code, out = cli("encode", *made["encode"], "--side", "query", "--batch-size", "3", "--force", *at)
    assert code == 0, out
    kinds = {
        "tokens": (KINDS["tokens"][0], "tokenize"),
        "runs": (KINDS["runs"][0], "score"),
        "metrics": (KINDS["metrics"][0], "evaluate"),
        "index": (KINDS["index"][0], "index"),
        "encodings": ("encodings/system={f16}/dataset=c/side=query/k=1", "encode"),
    }
    for kind, (pattern, command) in kinds.items():
        (folder,) = root.glob(pattern.format(**s))
        before = _sha256s(folder, kind)
        name = max(json.loads((folder / "_manifest.json").read_text())["files"])
        (folder / name).unlink()
        code, out = cli("verify", *at)
        (line,) = [ln for ln in out.splitlines() if str(folder) in ln]
        assert code == 1 and "with the settings that made it" not in line, line
        words = shlex.split(re.search(r"repair: run `([^`]*)`", line).group(1))
        assert words[:2] == ["diffret", command], line
        if kind == "encodings":  # at another batch size the shard would differ: refused, not mixed in
            i = words.index("--batch-size")
            assert words[i + 1] == "3", line
            code, out = cli(*words[1:i], *words[i + 2 :])
            assert code == 2 and "(batch_size: 3 stored" in out and not (folder / name).exists(), out
        code, out = cli(*words[1:])  # verbatim
        assert code == 0, (line, out)
        assert _sha256s(folder, kind) == before, (kind, line)
        assert cli("verify", *at)[0] == 0, kind
