"""Refusals and repairs through the CLI, typed exactly as a user types them: a load that would degrade, outputs
aimed into the store, damaged manifests and shards, ambiguous model paths, first runs offline, failed stages and
settings that cannot work. Each ends in exit code 2 (1 for `diffret verify` finding damage) with one line naming
the cause and the repair, and the store's files and SQL counts unchanged apart from finished units; SQL over a damaged
folder's view leaves that folder out, with a warning naming it and its repair.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import write_beir
from test_bad_input import cli, error_line
from tiny_models import save_tiny_mlm

CORPUS = [{"_id": f"d{i}", "title": f"t{i}", "text": f"passage {i} about cats dogs tea and gardens"} for i in range(8)]
QUERIES = [{"_id": f"q{i}", "text": f"what about cats {i}"} for i in range(3)]
QRELS = {"test": [("q0", "d0", 1), ("q1", "d1", 1), ("q2", "d2", 1)]}
ENCODE = ["--k", "1", "--max-length", "32", "--shard-size", "4"]


def files_of(root: Path) -> dict[str, tuple[int, int]]:
    """Every file of the store (but lock files) with its size and mtime."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = (p.stat().st_size, p.stat().st_mtime_ns)
    return out


def sql_count(root: Path, view: str) -> int:
    p = cli("sql", "--root", str(root), "--format", "csv", f"select count(*) from {view}")
    assert p.returncode == 0, p.stdout + p.stderr
    return int(p.stdout.splitlines()[1])


def ok(p) -> None:  # noqa: ANN001
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny store: a collection, a tiny BERT's encodings, its runs and BM25's, their metrics."""
    base = tmp_path_factory.mktemp("world")
    model = save_tiny_mlm(base / "model")
    beir = write_beir(base / "c", CORPUS, QUERIES, QRELS)
    root = base / "store"
    ok(cli("download", "c", "--source", str(beir), "--root", str(root)))
    ok(cli("encode", "-d", "c", "--model", str(model), *ENCODE, "--root", str(root)))
    ok(cli("score", "-d", "c", "--kq", "1", "--kp", "1", "--root", str(root)))
    ok(cli("bm25", "-d", "c", "--root", str(root)))
    ok(cli("evaluate", "--root", str(root)))
    return {"base": base, "model": model, "beir": beir, "root": root}


def copy(world: dict, tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(world["root"], root)
    return root


def first(root: Path, pattern: str) -> Path:
    return sorted(root.glob(pattern))[0]


# -------------------------------------------------------------------------------------------- 1. silent garbage
@pytest.mark.parametrize("case", ["no tokenizer files", "vocabulary of another model", "mask token not in it"])
def test_a_load_that_degrades_is_refused_before_any_work(world: dict, tmp_path: Path, case: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    extra: list[str] = []
    if case == "no tokenizer files":
        for f in model.glob("*"):
            if f.is_file() and f.name.startswith(("tokenizer", "vocab", "special_tokens")):
                f.unlink()
        expect = "no tokenizer files"
    elif case == "vocabulary of another model":
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] * 4}))
        expect = "embedding has"
    else:
        extra = ["--mask-token", "<not-a-token>"]
        expect = "'<not-a-token>' (--mask-token) is not in its tokenizer's vocabulary"
    root = copy(world, tmp_path)
    before = files_of(root)
    p = cli("encode", "-d", "c", "--model", str(model), *ENCODE, *extra, "--root", str(root))
    assert p.returncode == 2 and expect in error_line(p)
    assert files_of(root) == before  # no tokens, encodings or system of the degraded model


# -------------------------------------------------------------------------------- 2. outputs outside the store
def test_results_never_land_inside_the_store(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    run = first(root, "runs/*/*/*/*/*/mode=single_dense/run.parquet")
    system = run.parts[-7].removeprefix("system=")
    before = files_of(root)
    p = cli("sql", "--root", str(root), "select 1 as x", "--out", str(run))
    assert p.returncode == 2 and "is inside the store root" in error_line(p)
    p = cli(
        "export-run",
        "--system",
        system,
        "-d",
        "c",
        "--kq",
        "1",
        "--kp",
        "1",
        "--mode",
        "single_dense",
        "-o",
        str(root / "runs" / "x.trec"),
        "--root",
        str(root),
    )
    assert p.returncode == 2 and "is inside the store root" in error_line(p)
    p = cli("report", "--root", str(root), "--out", str(root / "copy"))
    assert p.returncode == 2 and "is inside the store root" in error_line(p)
    assert files_of(root) == before
    ok(cli("sql", "--root", str(root), "select 1 as x", "--out", str(tmp_path / "x.csv")))  # outside: fine


# --------------------------------------------------------------------------------------- 3. repairs that work
def test_an_unreadable_manifest_is_damage_the_next_run_rebuilds(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    manifest = first(root, "encodings/*/*/side=passage/k=1/_manifest.json")
    manifest.write_text("{not json")
    p = cli("verify", "--root", str(root))
    assert p.returncode == 1 and "unreadable manifest" in p.stdout and "diffret encode --verify" in p.stdout
    p = cli("score", "-d", "c", "--kq", "1", "--kp", "1", "--root", str(root), "--force")
    assert p.returncode == 2 and "unreadable manifest" in error_line(p) and "repair:" in error_line(p)
    ok(cli("encode", "-d", "c", "--model", str(world["model"]), *ENCODE, "--root", str(root)))  # the same command
    ok(cli("verify", "--root", str(root)))
    assert sql_count(root, "encodings") == sql_count(world["root"], "encodings")


@pytest.mark.parametrize("field", ["sha256", "rows"])
def test_a_hand_edited_file_list_is_repaired_by_the_stage_itself(world: dict, tmp_path: Path, field: str) -> None:
    root = copy(world, tmp_path)
    path = first(root, "encodings/*/*/side=passage/k=1/_manifest.json")
    m = json.loads(path.read_text())
    name = sorted(m["files"])[0]
    m["files"][name][field] = "0" * 64 if field == "sha256" else m["files"][name]["rows"] + 1
    path.write_text(json.dumps(m))
    p = cli("verify", "--root", str(root))
    assert p.returncode == 1 and "manifest edited by hand" in p.stdout
    p = cli("score", "-d", "c", "--kq", "1", "--kp", "1", "--root", str(root))
    assert p.returncode in (0, 2)  # current runs need no encoding; when they do, the edit is named with its repair
    p = cli("encode", "-d", "c", "--model", str(world["model"]), *ENCODE, "--root", str(root))
    ok(p)
    assert "1 shard(s) encoded" in p.stdout + p.stderr  # only the edited entry's shard is redone
    ok(cli("verify", "--root", str(root)))


def test_a_checksum_failure_names_the_command_that_repairs_it(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    shard = first(root, "encodings/*/*/side=passage/k=1/shard=*.parquet")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    mtime = shard.stat().st_mtime_ns
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(mtime, mtime))  # the size and the time kept: only a re-hash finds it
    p = cli("verify", "--root", str(root))
    assert p.returncode == 1 and "diffret encode --verify" in p.stdout
    p = cli("encode", "-d", "c", "--model", str(world["model"]), *ENCODE, "--verify", "--root", str(root))
    ok(p)
    assert "1 shard(s) encoded" in p.stdout + p.stderr
    ok(cli("verify", "--root", str(root)))


# ------------------------------------------------------------------- 4. one damaged folder is left out, named
def test_a_corrupt_shard_leaves_its_folder_out_of_its_view_named_with_its_repair(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    shard = first(root, "encodings/*/*/side=passage/k=1/shard=*.parquet")
    shard.write_bytes(shard.read_bytes()[:200])
    p = cli("sql", "--root", str(root), "--format", "csv", "select side, count(*) from encodings group by all")
    warned = [ln for ln in p.stderr.splitlines() if ln.startswith("warning:")]
    assert p.returncode == 0 and len(warned) == 1 and str(shard) in warned[0], p.stdout + p.stderr
    assert "repair: run `diffret encode --verify" in warned[0]
    assert [ln.split(",")[0] for ln in p.stdout.splitlines()[1:]] == ["query"]  # the queries' folder is read
    assert sql_count(root, "corpus") == len(CORPUS) and sql_count(root, "metrics") > 0  # the other views work
    ok(cli("encode", "-d", "c", "--model", str(world["model"]), *ENCODE, "--root", str(root)))  # the repair
    assert sql_count(root, "encodings") == sql_count(world["root"], "encodings")


# -------------------------------------------------------------------------------- 5. one folder, one system
def test_however_a_model_path_is_typed_it_is_one_system(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    model = world["model"]
    link = tmp_path / "linked-model"
    link.symlink_to(model)
    rel = os.path.relpath(model, Path(__file__).resolve().parents[2])  # relative to the CLI's working directory
    for spelling in (str(model) + "/", rel, str(link)):
        p = cli("encode", "-d", "c", "--model", spelling, *ENCODE, "--root", str(root))
        ok(p)
        assert "0 shard(s) encoded" in p.stdout + p.stderr, spelling
    assert len(list((root / "systems").glob("system=*"))) == 2  # the encoder and BM25
    ok(cli("score", "-d", "c", "--model", str(link), "--kq", "1", "--kp", "1", "--root", str(root)))


def test_an_ambiguous_lookup_lists_the_candidates_and_what_tells_them_apart(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    ok(cli("encode", "-d", "c", "--model", str(world["model"]), *ENCODE, "--sparse-topk", "64", "--root", str(root)))
    p = cli("score", "-d", "c", "--model", str(world["model"]), "--kq", "1", "--kp", "1", "--root", str(root))
    line = error_line(p)
    assert (
        p.returncode == 2
        and "readout.sparse_topk=64" in line
        and "--sparse-topk" in line
        and "--model" not in (line.split("tells them apart")[-1])
    )  # --model is given already: the setting that differs is named


# ------------------------------------------------------------------------------- 6. one line, not a traceback
def test_each_of_these_is_one_line(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    empty = tmp_path / "empty-store"
    ok(cli("download", "c", "--source", str(world["beir"]), "--root", str(empty)))
    cases = [
        (("verify", "--root", str(a_file)), "is a file, not a folder"),
        (("sql", "--root", str(a_file), "select 1"), "is a file, not a folder"),
        (("report", "--root", str(empty)), "no metrics in the store"),
        (("sql", "--root", str(root), ""), "empty SQL query"),
        (("report", "--root", str(root), "--out", str(a_file)), "is a file: give a folder"),
    ]
    import torch

    if not torch.cuda.is_available():
        cases.append((("score", "-d", "c", "--device", "cuda", "--root", str(root)), "CUDA is not available"))
    try:
        import s3fs  # noqa: F401
    except ImportError:
        cases.append((("sql", "--root", "s3://bucket/store", "select 1"), "s3fs"))
    for args, expect in cases:
        p = cli(*args)
        assert p.returncode == 2 and expect in error_line(p), (args, p.stdout, p.stderr)


# ----------------------------------------------------------------------------- 7. a deleted manifest is damage
def test_a_folder_without_its_manifest_is_named_and_rebuilt(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    (root / "datasets" / "dataset=c" / "_manifest.json").unlink()
    p = cli("verify", "--root", str(root))
    assert p.returncode == 1 and "no manifest" in p.stdout and "diffret download c" in p.stdout
    p = cli("sql", "--root", str(root), "--format", "csv", "select count(*) from corpus")
    assert p.returncode == 0 and p.stdout.splitlines()[1] == "0", p.stdout  # its files are not trusted: left out,
    assert "without a manifest" in p.stderr and "diffret download c" in p.stderr  # named with the repair
    assert sql_count(root, "runs") > 0  # the other views work meanwhile
    ok(cli("download", "c", "--source", str(world["beir"]), "--root", str(root)))
    ok(cli("verify", "--root", str(root)))
    assert sql_count(root, "corpus") == len(CORPUS)


# ------------------------------------------------------------------------------------------- 8. report state
def test_report_settings_and_slugs(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    p = cli("report", "--root", str(root), "--finetuned", "nope=also-nope")
    assert p.returncode == 2 and "unknown system 'nope'" in error_line(p)
    ok(cli("report", "--root", str(root), "--n-boot", "20"))
    p = cli("report", "--root", str(root), "--n-boot", "30")
    line = error_line(p)
    assert p.returncode == 2 and "n_boot: 20 stored, 30 now" in line and "--name" in line
    ok(cli("report", "--root", str(root), "--n-boot", "30", "--name", "second"))


# ------------------------------------------------------------------------------------------------ 9. first run
def test_offline_first_run_says_what_to_do(tmp_path: Path) -> None:
    p = cli("download", "scifact", "--root", str(tmp_path / "store"), "--cache-dir", str(tmp_path / "cache"))
    if p.returncode == 0:
        pytest.skip("this machine reached the BEIR download (online)")
    line = error_line(p)
    assert p.returncode == 2 and "--source" in line and "../shared/data/<name>" in line
    env = {"HF_HUB_OFFLINE": "1"}
    p = cli(
        "encode",
        "-d",
        "scifact",
        "--model",
        "org/not-cached-anywhere",
        "--root",
        str(tmp_path / "store"),
        env_extra=env,
    )
    line = error_line(p)
    assert p.returncode == 2 and "cannot reach the Hugging Face hub" in line and "--model PATH" in line


# ------------------------------------------------------------------------------------------------ 10. leftovers
FAILING_MODEL = """
from diffret.stages import encode as enc
def _boom(*a, **k):
    raise RuntimeError("the model failed")
enc.reader_for = _boom
"""


def test_a_failed_stage_leaves_only_its_finished_units(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    model = tmp_path / "other"
    save_tiny_mlm(model, seed=3)
    before = files_of(root)
    p = cli(
        "encode",
        "-d",
        "c",
        "--model",
        str(model),
        "--k",
        "2",
        "--max-length",
        "32",
        "--root",
        str(root),
        prelude=FAILING_MODEL,
    )
    assert p.returncode == 1 and "the model failed" in p.stderr
    added = set(files_of(root)) - set(before)
    assert all(f.startswith(("tokens/", "filters/")) for f in added), sorted(added)  # finished tokenize units only
    assert len(list((root / "systems").glob("system=*"))) == 2  # no system without encodings
    assert not (root / "_locks").exists() and not (root / "_staging").exists()


def test_a_clean_run_leaves_no_lock_files(world: dict) -> None:
    assert not (world["root"] / "_locks").exists() and not (world["root"] / "_staging").exists()


# ---------------------------------------------------------------------------------- 11. refused with a word
def test_k_far_beyond_max_length(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    before = files_of(root)
    p = cli("encode", "-d", "c", "--model", str(world["model"]), "--k", "64", "--max-length", "16", "--root", str(root))
    assert p.returncode == 2 and "K = 64 is beyond --max-length 16" in error_line(p)
    assert files_of(root) == before  # refused before tokenizing


def test_more_negatives_than_stored(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    ok(cli("bm25", "-d", "c", "--split", "test", "--root", str(root)))
    ok(cli("training-data", "-d", "c", "--split", "test", "--n-negatives", "3", "--root", str(root)))
    p = cli(
        "train",
        "-t",
        "c",
        "--model",
        str(world["model"]),
        "--kq",
        "1",
        "--kp",
        "1",
        "--n-negatives",
        "15",
        "--root",
        str(root),
    )
    assert p.returncode == 2 and "stores at most 3 per group" in error_line(p)


def test_negative_grades(world: dict, tmp_path: Path) -> None:
    beir = write_beir(tmp_path / "neg", CORPUS, QUERIES, {"test": [("q0", "d0", 1), ("q1", "d1", -1)]})
    p = cli("download", "neg", "--source", str(beir), "--root", str(tmp_path / "store"))
    assert p.returncode == 2 and "test.tsv:3: grade -1 is negative" in error_line(p)


HELD = """
import os, time, diffret.stages.encode as enc
_encode = enc.encode_rows
def _held(*a, **k):  # the first shard waits until the test lets it go (at most 5 minutes)
    deadline = time.monotonic() + 300
    while not os.path.exists({release!r}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _encode(*a, **k)
enc.encode_rows = _held
"""


def test_two_encodes_of_one_folder_at_once(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    release = tmp_path / "release"
    args = (
        "encode",
        "-d",
        "c",
        "--model",
        str(world["model"]),
        "--k",
        "2",
        "--max-length",
        "64",
        "--shard-size",
        "4",
        "--root",
        str(root),
    )
    # the first encode holds its folders until the second has been refused, however slow the machine is
    first_run = cli(*args, prelude=HELD.format(release=str(release)), background=True)
    try:
        deadline = time.monotonic() + 120
        while not list(root.glob("encodings/*/*/*/k=2/_manifest.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        second = cli(*args)
        assert second.returncode == 2 and "is being written by another process" in error_line(second)
        release.touch()
        out, _ = first_run.communicate(timeout=300)
    finally:
        release.touch()
        if first_run.poll() is None:
            first_run.kill()
    assert first_run.returncode == 0, out
    p = cli(*args)
    ok(p)
    assert "0 shard(s) encoded" in p.stdout + p.stderr


# ------------------------------------------------------------------------------------------------- 12. small
def test_small_things(world: dict, tmp_path: Path) -> None:
    root = copy(world, tmp_path)
    p = cli("verify", "--root", str(root))
    assert p.returncode == 0 and "match their manifests" in p.stdout  # a result: on stdout
    bad = tmp_path / "bad"
    (bad / "qrels").mkdir(parents=True)
    (bad / "corpus.jsonl").write_text('{"_id": "d1", "text": "x"}\n"unterminated\n')
    (bad / "queries.jsonl").write_text('{"_id": "q1", "text": "x"}\n')
    (bad / "qrels" / "test.tsv").write_text("q1\td1\t1\n")
    p = cli("download", "bad", "--source", str(bad), "--root", str(tmp_path / "s2"))
    assert p.returncode == 2 and " at at " not in error_line(p) and "column" in error_line(p)
    out = tmp_path / "x.csv"
    ok(cli("sql", "--root", str(root), "select 1.0 / 3 as third", "--out", str(out)))
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # as any new file, not 0600
    p = cli("sql", "--root", str(root), "select 1.0 / 3 as third")
    assert "0.333333" in p.stdout and "0.3333333333" not in p.stdout  # 6 significant digits in a table
    ok(cli("report", "--root", str(root), "--n-boot", "20", "--out", str(tmp_path / "report")))
    for csv in (tmp_path / "report").glob("*.csv"):
        assert csv.read_text().strip(), f"{csv.name}: empty, without a header"
    p = cli("run", "--help")
    assert "--source" in p.stdout and "BEIR-layout folder" in p.stdout


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
