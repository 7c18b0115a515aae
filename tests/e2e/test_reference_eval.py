"""diffret's scoring, fusion and evaluation against the reference evaluator's own outputs
(../shared/fixtures/reference-eval: ielab/diffretriever's evaluate_sweep.py over the reference encoder's
encodings of scifact-mini, both families, all nine (K_q, K_p) cells of {1, 4, 16}^2).

The reference's stored encodings (../shared/fixtures/reference-parity: the dense states as stored, the sparse
weights as x100 integers) go through diffret's encodings tables, exact search under the default score rules,
fusion, run tables and evaluation exactly as the score and evaluate stages run them. The float32 evaluator
(``runs/fp32``) is matched within the fixture README's tolerances: scores within 1e-4 (sparse exactly),
rankings equal except inside exact ties and near-ties under 1e-5, NDCG@10 and MRR@10 equal at 4 decimals,
per query and on average. The released bfloat16 evaluator (``runs/bf16``) is matched by ``score_dtype
bfloat16`` within the README's smoke tolerances. Skipped when ../shared is absent.
"""

from __future__ import annotations

import gzip
import json
from functools import cache

import numpy as np
import pyarrow as pa
import pytest
from conftest import SHARED

from retrieval.evaluation import evaluate, run_from_table
from retrieval.models.encoding import encoded_table
from retrieval.models.readouts import Encoded, sparse_quantised
from retrieval.search import SearchSettings, all_modes, encodings_from_table, run_table, search_pass
from retrieval.search.modes import BASE_MODES
from retrieval.search.rules import ScoreRules
from stages.score import ScoreConfig

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
    tops, doc_ids = search_pass({kq: q}, [p], BASE_MODES, SearchSettings(topk=1000, rules=rules))
    runs = all_modes(tops, 1000, rules)
    return {mode: run_table(runs[(kq, mode)], q.ids, doc_ids) for (_, mode) in runs}


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
    """Equal rankings except inside groups of reference scores that tie or sit within 1e-5 of each other (the
    group's members compared as a set, at the same ranks)."""
    assert len(got) == len(ref), what
    start = 0
    for i in range(1, len(ref) + 1):
        if i == len(ref) or ref[i - 1][1] - ref[i][1] >= 1e-5:
            block = slice(start, i)
            assert {d for d, _ in ref[block]} == {d for d, _ in got[block]}, f"{what}: ranks {start + 1}-{i}"
            start = i


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("kq", "kp"), CELLS, ids=[f"q{q}-p{p}" for q, p in CELLS])
def test_fp32_reference_evaluator_reproduced(family: str, kq: int, kp: int) -> None:
    _skip_without_fixtures()
    rules = ScoreConfig(dataset="scifact-mini").rules  # the score stage's defaults
    runs = diffret_cell(family, kq, kp, rules)
    summary = reference_summary("fp32", family, kq, kp)
    assert summary, "empty reference summary"
    for mode, avg in summary.items():  # the modes the reference evaluated in this cell
        ref = reference_run("fp32", family, kq, kp, mode)
        got = ours(runs[mode])
        assert set(got) == set(ref), mode
        for qid, ranked in ref.items():
            what = f"{family} q{kq}-p{kp} {mode} query {qid}"
            by_doc = dict(got[qid])
            diffs = [abs(by_doc[d] - s) for d, s in ranked]
            assert max(diffs) <= (0.0 if mode == "sparse_max" else 1e-4), what  # sparse: exact integers
            assert_same_ranking(ranked, got[qid], what)
        per_query = json.loads((EVAL / "runs" / "fp32" / family / f"q{kq}-p{kp}" / f"{mode}.json").read_text())
        mine = metrics(runs[mode])
        for name in MEASURES.values():
            for qid, values in per_query["per_query"].items():
                assert abs(round(mine[qid][name], 4) - values[name]) <= 1e-4, (mode, name, qid)
            mean = sum(v[name] for v in mine.values()) / len(mine)
            assert abs(round(mean, 4) - avg[name]) <= 1e-4, (mode, name)
        assert len(mine) == avg["num_queries"]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_reference_evaluator_within_smoke_tolerance(family: str) -> None:
    """score_dtype bfloat16 against the released (bfloat16) evaluator: every cell's metrics within the README's
    smoke bounds (0.1 dense, 0.05 sparse and fusion; bfloat16's ties decide the top 10 on these random-weight
    inputs), sparse scores bit-exact after bfloat16 rounding."""
    _skip_without_fixtures()
    rules = ScoreRules(score_dtype="bfloat16")
    for kq, kp in CELLS:
        runs = diffret_cell(family, kq, kp, rules)
        for mode, avg in reference_summary("bf16", family, kq, kp).items():
            mine = metrics(runs[mode])
            bound = 0.1 if mode in ("single_dense", "multi_dense") else 0.05
            for name in MEASURES.values():
                mean = sum(v[name] for v in mine.values()) / len(mine)
                assert abs(mean - avg[name]) <= bound, (family, kq, kp, mode, name, mean, avg[name])
        ref = reference_run("bf16", family, kq, kp, "sparse_max")
        got = ours(runs["sparse_max"])
        for qid, ranked in ref.items():
            by_doc = dict(got[qid])
            assert all(by_doc[d] == s for d, s in ranked), (family, kq, kp, qid)


def test_the_old_rules_do_not_reproduce_the_reference() -> None:
    """diffret 0.1's scoring (every rule switched back) misses the reference: the fixture tells them apart."""
    _skip_without_fixtures()
    legacy = ScoreRules(maxsim_clamp=False, maxsim_reduce="mean", single_renorm=True, sparse_scale="unit",
                        sparse_floor="positive", fusion_flat="one")  # fmt: skip
    runs = diffret_cell("dream", 4, 16, legacy)
    for mode in ("single_dense", "multi_dense", "sparse_max"):
        ref = reference_run("fp32", "dream", 4, 16, mode)
        got = ours(runs[mode])
        worst = max(abs(dict(got[q]).get(d, -1.0) - s) for q, r in ref.items() for d, s in r)
        assert worst > 1e-2, mode  # other scales: sum vs mean, renormalised, x100 integers
