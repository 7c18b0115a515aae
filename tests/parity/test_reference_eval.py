"""diffret's scoring, fusion and evaluation against the reference evaluator's own outputs
(../shared/fixtures/reference-eval: ielab/diffretriever's evaluate_sweep.py over the reference encoder's
encodings of scifact-mini, both families, all nine (K_q, K_p) cells of {1, 4, 16}^2).

The reference's stored encodings (../shared/fixtures/reference-parity: the dense states as stored, the sparse
weights as x100 integers) go through diffret's encodings tables, exact search under the default score rules,
fusion, run tables and evaluation exactly as the score and evaluate stages run them. Matched at the precision the
code reaches: against the float32 evaluator (``runs/fp32``) every score within 1e-5 of the printed one
(sparse exactly), rankings equal except inside exact ties, NDCG@10 and MRR@10 equal at 4 decimals per query and on
average; against the released bfloat16 evaluator (``runs/bf16``), with ``score_dtype bfloat16``, every score within
1e-5 and the rankings equal once ties are broken alike. One test runs the same through the CLI (download, the
reference's encodings stored as the encode stage stores them, score, evaluate, SQL). At q1-p1 diffret scores the
modes the reference scores (no multi_dense, no fusion_multi_sparse_max). Skipped when ../shared is absent.
"""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import SHARED

from diffret.retrieval.evaluation import evaluate, run_from_table
from diffret.retrieval.models.encoding import encoded_table
from diffret.retrieval.models.readouts import Encoded, sparse_quantised
from diffret.retrieval.search import SearchSettings, all_modes, encodings_from_table, run_table, search_pass
from diffret.retrieval.search.modes import MODE_NAMES, base_modes_needed, cell_modes
from diffret.retrieval.search.rules import ScoreRules
from diffret.stages.score import ScoreConfig

pytestmark = pytest.mark.e2e

PARITY = SHARED / "fixtures" / "reference-parity"
EVAL = SHARED / "fixtures" / "reference-eval"
CELLS = [(kq, kp) for kq in (1, 4, 16) for kp in (1, 4, 16)]
FAMILIES = ("dream", "llada")
MEASURES = {"ndcg_cut_10": "ndcg@10", "mrr_10": "mrr@10"}


def _skip_without_fixtures() -> None:
    if not (EVAL / "runs" / "fp32").is_dir() or not (PARITY / "scifact-mini" / "corpus.jsonl").exists():
        pytest.skip("../shared/fixtures/reference-eval or reference-parity is absent")


@cache
def _texts(side: str) -> list[str]:
    """The side's ids in the order diffret stores them (corpus.jsonl / queries.jsonl order)."""
    name = "corpus.jsonl" if side == "passage" else "queries.jsonl"
    return [json.loads(line)["_id"] for line in (PARITY / "scifact-mini" / name).read_text().splitlines() if line]


@cache
def _table(family: str, side: str, k: int) -> pa.Table:
    """The reference's stored encoding as an encodings table, as diffret's encoder stores it (float16 dense, the
    x100 integers as weights in steps of 0.01)."""
    path = PARITY / family / f"{side}-k{k}"
    meta = json.loads(path.with_suffix(".json").read_text())
    arrays = np.load(path.with_suffix(".npz"))
    ids = _texts(side)
    encs = []
    for x in ids:
        dense = arrays[f"{x}|stored"].astype(np.float16)
        sparse = sorted(((int(t), round(float(w) * 100)) for t, w in meta[x]["sparse"].items()), key=lambda t: -t[1])
        sp_ids = np.array([t for t, _ in sparse], np.int32)
        sp_w = (np.array([w for _, w in sparse], np.float32) / np.float32(100)).astype(np.float32)
        encs.append(Encoded(dense, sp_ids, sp_w, n_tokens=len(meta[x]["prompt_ids"])))
    return encoded_table(ids, encs, encs[0].dense.shape[1])


@cache
def _qrels() -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for line in (PARITY / "scifact-mini" / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        q, d, r = line.split("\t")
        out.setdefault(q, {})[d] = int(r)
    return out


def diffret_cell(family: str, kq: int, kp: int, rules: ScoreRules) -> dict[str, pa.Table]:
    """Every mode's run of one cell, as the score stage computes it (the system's sparse weights quantised)."""
    factor = rules.sparse_factor(sparse_quantised("diffretriever", {}))
    q = encodings_from_table(_table(family, "query", kq), rules=rules, sparse_factor=factor)
    p = encodings_from_table(_table(family, "passage", kp), rules=rules, sparse_factor=factor)
    modes = cell_modes(MODE_NAMES, kq, kp)  # the score stage's: q1-p1 without multi_dense, as the reference
    tops, doc_ids = search_pass({kq: q}, [p], base_modes_needed(modes), SearchSettings(topk=1000, rules=rules))
    runs = all_modes(tops, 1000, rules)
    return {mode: run_table(runs[(kq, mode)], q.ids, doc_ids) for (_, mode) in runs if mode in modes}


def metrics(table: pa.Table) -> dict[str, dict[str, float]]:
    """Per query {measure: value}, as the evaluate stage computes them (ties="trec")."""
    run = run_from_table(table.sort_by([("query_id", "ascending"), ("rank", "ascending")]), order="score")
    out: dict[str, dict[str, float]] = {}
    for r in evaluate(_qrels(), run, list(MEASURES), 1, ranked=True).to_pylist():
        out.setdefault(r["query_id"], {})[MEASURES[r["measure"]]] = r["value"]
    return out


def reference_run(variant: str, family: str, kq: int, kp: int, mode: str) -> dict[str, list[tuple[str, float]]]:
    path = EVAL / "runs" / variant / family / f"q{kq}-p{kp}" / f"{mode}.trec.gz"
    out: dict[str, list[tuple[str, float]]] = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            qid, _, doc, rank, score, _ = line.split()
            out.setdefault(qid, []).append((doc, float(score)))
            assert len(out[qid]) == int(rank)
    return out


def reference_summary(variant: str, family: str, kq: int, kp: int) -> dict[str, dict[str, float]]:
    return json.loads((EVAL / "runs" / variant / family / f"q{kq}-p{kp}" / "summary.json").read_text())


def ours(table: pa.Table) -> dict[str, list[tuple[str, float]]]:
    out: dict[str, list[tuple[str, float]]] = {}
    for q, d, s in zip(*(table.column(c).to_pylist() for c in ("query_id", "doc_id", "score")), strict=True):
        out.setdefault(q, []).append((d, s))
    return out


def assert_same_ranking(ref: list[tuple[str, float]], got: list[tuple[str, float]], what: str) -> None:
    """Equal rankings except inside exact ties of the reference (equal printed scores: the group's members compared
    as a set, at the same ranks), and equal once ties are broken alike (by doc id, on both sides' 6-decimal
    scores): ties fall where the reference's fall."""
    assert len(got) == len(ref), what
    start = 0
    for i in range(1, len(ref) + 1):
        if i == len(ref) or ref[i - 1][1] != ref[i][1]:
            assert {d for d, _ in ref[start:i]} == {d for d, _ in got[start:i]}, f"{what}: ranks {start + 1}-{i}"
            start = i

    def tie_broken(run: list[tuple[str, float]]) -> list[str]:
        return [d for d, _ in sorted(((d, round(s, 6)) for d, s in run), key=lambda t: (-t[1], t[0]))]

    assert tie_broken(got) == tie_broken(ref), what


def assert_same_run(
    variant: str,
    family: str,
    kq: int,
    kp: int,
    mode: str,
    got: dict[str, list[tuple[str, float]]],
) -> None:
    """Every query's scores within 1e-5 of the reference's printed ones (sparse_max: the same integers), and its
    ranking (:func:`assert_same_ranking`)."""
    ref = reference_run(variant, family, kq, kp, mode)
    assert set(got) == set(ref), mode
    for qid, ranked in ref.items():
        what = f"{variant} {family} q{kq}-p{kp} {mode} query {qid}"
        by_doc = dict(got[qid])
        worst = max(abs(by_doc[d] - s) for d, s in ranked)
        assert worst <= (5e-7 if mode == "sparse_max" else 1e-5), (what, worst)  # sparse: integers, printed %.6f
        assert_same_ranking(ranked, got[qid], what)


def assert_same_metrics(family: str, kq: int, kp: int, mode: str, mine: dict[str, dict[str, float]]) -> None:
    """NDCG@10 and MRR@10 equal to the float32 evaluator's at 4 decimals, per query and on average."""
    path = EVAL / "runs" / "fp32" / family / f"q{kq}-p{kp}" / f"{mode}.json"
    per_query = json.loads(path.read_text())["per_query"]
    avg = reference_summary("fp32", family, kq, kp)[mode]
    assert set(mine) == set(per_query) and len(mine) == avg["num_queries"], mode
    for name in MEASURES.values():
        assert {q: round(v[name], 4) for q, v in mine.items()} == {q: v[name] for q, v in per_query.items()}, (
            family,
            kq,
            kp,
            mode,
            name,
        )
        assert round(sum(v[name] for v in mine.values()) / len(mine), 4) == avg[name], (family, kq, kp, mode, name)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("kq", "kp"), CELLS, ids=[f"q{q}-p{p}" for q, p in CELLS])
def test_fp32_reference_evaluator_reproduced(family: str, kq: int, kp: int) -> None:
    _skip_without_fixtures()
    rules = ScoreConfig(dataset="scifact-mini").rules  # the score stage's defaults
    runs = diffret_cell(family, kq, kp, rules)
    summary = reference_summary("fp32", family, kq, kp)
    assert summary, "empty reference summary"
    assert sorted(runs) == sorted(summary)  # the modes the reference evaluated in this cell, no more
    for mode in summary:
        assert_same_run("fp32", family, kq, kp, mode, ours(runs[mode]))
        assert_same_metrics(family, kq, kp, mode, metrics(runs[mode]))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_reference_evaluator_reproduced(family: str) -> None:
    """score_dtype bfloat16 against the released (bfloat16) evaluator: every cell and mode, scores within 1e-5 and
    the rankings equal once ties (frequent in bfloat16) are broken alike."""
    _skip_without_fixtures()
    rules = ScoreRules(score_dtype="bfloat16")
    for kq, kp in CELLS:
        runs = diffret_cell(family, kq, kp, rules)
        summary = reference_summary("bf16", family, kq, kp)
        assert sorted(runs) == sorted(summary)
        for mode in summary:
            assert_same_run("bf16", family, kq, kp, mode, ours(runs[mode]))


def test_the_old_rules_do_not_reproduce_the_reference() -> None:
    """Every score rule set to its non-reference option misses the reference: the fixture tells them apart."""
    _skip_without_fixtures()
    legacy = ScoreRules(
        maxsim_clamp=False,
        maxsim_reduce="mean",
        single_renorm=True,
        sparse_scale="unit",
        sparse_floor="positive",
        fusion_flat="one",
    )
    runs = diffret_cell("dream", 4, 16, legacy)
    for mode in ("single_dense", "multi_dense", "sparse_max"):
        ref = reference_run("fp32", "dream", 4, 16, mode)
        got = ours(runs[mode])
        worst = max(abs(dict(got[q]).get(d, -1.0) - s) for q, r in ref.items() for d, s in r)
        assert worst > 1e-2, mode  # other scales: sum vs mean, renormalised, x100 integers


def store_reference_encodings(root: Path, family: str) -> str:
    """The reference encoder's stored encodings (both sides, K in {1, 4, 16}) written into the store as the encode
    stage stores them (one shard a folder, the system in the registry); its slug."""
    from diffret.stages.systems import EncodeSettings, encoder_record, register
    from diffret.storage import ArtifactStore
    from diffret.storage.layout import encodings_dir

    store = ArtifactStore(root)
    model = SHARED / "models" / f"tiny-{family}-random"
    record = encoder_record(EncodeSettings(backbone={"model": str(model)}, max_length=512))
    register(store, record)
    for side, k in ((side, k) for side in ("query", "passage") for k in (1, 4, 16)):
        folder = encodings_dir(record.system, "scifact-mini", side, k)
        part = {"system": record.system, "dataset": "scifact-mini", "side": side, "k": str(k)}
        m, _ = store.open_sharded(folder, "encodings", part, {**part, "source": f"reference-parity/{family}"})
        name = "shard=00000.parquet"
        store.record_shard(folder, name, store.write_shard(folder, name, _table(family, side, k)), m.config_hash)
        store.compact_shards(folder)
    return record.system


def test_the_cli_reproduces_the_fp32_evaluator(tmp_path: Path) -> None:
    """The same through the CLI (in this process): `diffret download` of scifact-mini, the reference's encodings
    stored as encode stores them, `diffret score` (no K given: the stored ones), `diffret evaluate`, then the runs,
    metrics and cells read back with `diffret sql`: every (cell, mode) the reference evaluated, no other, its
    scores and ranking, its per-query NDCG@10 / MRR@10 at 4 decimals, and the cells' means."""
    _skip_without_fixtures()
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from diffret.flows.cli import app

    root, family = tmp_path / "store", "dream"

    def cli(*args: str) -> str:
        res = CliRunner().invoke(app, list(args), env={"DIFFRET_ROOT": str(root), "COLUMNS": "200"})
        assert res.exit_code == 0, (args, res.output)
        return res.output

    def sql(query: str) -> list[dict]:
        out = tmp_path / f"q{len(list(tmp_path.glob('q*.parquet')))}.parquet"
        cli("sql", "--out", str(out), query.replace("SYSTEM", f"'{system}'"))
        return pq.read_table(out).to_pylist()

    cli("download", "scifact-mini", "--source", str(PARITY / "scifact-mini"))
    system = store_reference_encodings(root, family)
    assert "K_q = 1, 4, 16" in cli("score", "-d", "scifact-mini", "--system", system, "--split", "test")
    cli("evaluate", "-d", "scifact-mini")
    cells = {(r["kq"], r["kp"], r["mode"]): r for r in sql("select * from cells where system = SYSTEM")}
    expected = {
        (kq, kp, mode): avg for kq, kp in CELLS for mode, avg in reference_summary("fp32", family, kq, kp).items()
    }
    assert sorted(cells) == sorted(expected) and len(cells) == 43  # q1-p1: 3 modes, as the reference
    for (kq, kp, mode), avg in expected.items():
        assert (round(cells[kq, kp, mode]["ndcg_10"], 4), round(cells[kq, kp, mode]["mrr_10"], 4)) == (
            avg["ndcg@10"],
            avg["mrr@10"],
        ), (kq, kp, mode)
    runs: dict[tuple, dict[str, list[tuple[str, float]]]] = {}
    for r in sql(
        "select kq, kp, mode, query_id, doc_id, score from runs where system = SYSTEM order by kq, kp, "
        "mode, query_id, rank"
    ):
        runs.setdefault((r["kq"], r["kp"], r["mode"]), {}).setdefault(r["query_id"], []).append(
            (r["doc_id"], r["score"])
        )
    mine: dict[tuple, dict[str, dict[str, float]]] = {}
    for r in sql(
        "select kq, kp, mode, query_id, measure, value from metrics where system = SYSTEM and measure in "
        "('ndcg_cut_10', 'mrr_10')"
    ):
        mine.setdefault((r["kq"], r["kp"], r["mode"]), {}).setdefault(r["query_id"], {})[MEASURES[r["measure"]]] = r[
            "value"
        ]
    for kq, kp, mode in expected:
        assert_same_run("fp32", family, kq, kp, mode, runs[kq, kp, mode])
        assert_same_metrics(family, kq, kp, mode, mine[kq, kp, mode])
