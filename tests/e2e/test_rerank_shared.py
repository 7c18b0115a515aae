"""End-to-end: `diffret rerank` of SciFact's BM25 top 100 with each DiffuRank method on the tiny Dream / LLaDA
checkpoints and splade-tiny (../shared; skipped when absent). The reranked runs are evaluated and listed with
every other system; running again does nothing; bad input fails with one line and writes nothing. A reranker
trained by `diffret train-reranker` (qrels-ordered lists over BM25 on the train split, and a RankZephyr-format
file) reranks like any model; on another base model it is refused.

To keep CI short the dataset is SciFact with its first 12 test and 12 train queries (the whole corpus, BM25 over
it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_harness import run, sql
from conftest import SHARED, write_beir

N_QUERIES = 12


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scifact, models = SHARED / "data" / "scifact", SHARED / "models"
    if not (scifact / "corpus.jsonl").exists() or not (models / "tiny-dream-random").exists():
        pytest.skip("../shared/data/scifact or ../shared/models is absent")
    tmp = tmp_path_factory.mktemp("rerank")
    corpus = [json.loads(line) for line in (scifact / "corpus.jsonl").read_text().splitlines() if line.strip()]
    queries = [json.loads(line) for line in (scifact / "queries.jsonl").read_text().splitlines() if line.strip()]
    rows = [line.split("\t") for line in (scifact / "qrels" / "test.tsv").read_text().splitlines()[1:]]
    keep = list(dict.fromkeys(r[0] for r in rows))[:N_QUERIES]
    qrels = {"test": [(q, d, int(g)) for q, d, g in rows if q in keep]}
    train = [line.split("\t") for line in (scifact / "qrels" / "train.tsv").read_text().splitlines()[1:]]
    keep_train = list(dict.fromkeys(r[0] for r in train))[:N_QUERIES]
    qrels["train"] = [(q, d, int(g)) for q, d, g in train if q in keep_train]
    src = write_beir(tmp / "scifact-12", corpus, [q for q in queries if q["_id"] in {*keep, *keep_train}], qrels)
    root = tmp / "store"
    run("download", "scifact", "--source", str(src), "--root", str(root))
    run("bm25", "--dataset", "scifact", "--split", "test", "--split", "train", "--root", str(root))
    return root


CASES = [  # (model, method, extra options)
    ("tiny-dream-random", "pointwise", []),
    ("tiny-dream-random", "logits_listwise", []),
    ("tiny-dream-random", "permutation_assignment", []),
    ("tiny-dream-random", "permutation_sampling", ["--steps", "2", "--depth", "30"]),
    ("tiny-llada-random", "logits_listwise", []),
    ("splade-tiny-mlm", "pointwise", []),
    ("splade-tiny-mlm", "logits_listwise", ["--window", "8", "--step", "4"]),
]


@pytest.mark.e2e
def test_rerank_each_method_writes_an_evaluated_run(store: Path) -> None:
    models = SHARED / "models"
    slugs = []
    for model, method, extra in CASES:
        args = [
            "rerank",
            "--root",
            str(store),
            "--model",
            str(models / model),
            "--method",
            method,
            "--doc-tokens",
            "32",
            *extra,
        ]
        p = run(*args)
        assert "1 run(s) reranked" in p.stdout + p.stderr, p.stdout + p.stderr
        if not slugs:  # the same command again: nothing to do (checked once; every method plans alike)
            again = run(*args)
            assert "0 run(s) reranked, 1 already done" in again.stdout + again.stderr
        slug = next(
            r["system"]
            for r in sql(
                store,
                "select system from systems where kind = 'reranker' "
                f"and readout = '{method}' and model like '%{model}'",
            )
        )
        slugs.append(slug)
        depth = 30 if "--depth" in extra else 100
        got = sql(
            store,
            f"select count(distinct query_id) q, count(*) n, min(rank) lo, max(rank) hi from runs "
            f"where system = '{slug}'",
        )
        assert got == [{"q": N_QUERIES, "n": N_QUERIES * depth, "lo": 1, "hi": depth}]
        # the reranked run holds the first stage's candidates, in another order
        same = sql(
            store,
            f"select count(*) n from runs r join runs b on r.query_id = b.query_id and "
            f"r.doc_id = b.doc_id where r.system = '{slug}' and b.mode = 'bm25' and b.rank <= {depth}",
        )
        assert same == [{"n": N_QUERIES * depth}]
    assert len(set(slugs)) == len(CASES)
    run("evaluate", "--root", str(store))
    board = {
        r["system"]: r for r in sql(store, "select system, mode, ndcg_10, queries from best_cells where split = 'test'")
    }
    for slug in slugs:
        assert board[slug]["mode"] == "rerank" and board[slug]["queries"] == N_QUERIES
        assert 0.0 <= board[slug]["ndcg_10"] <= 1.0


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--first-stage", "nosuch"], "no system named 'nosuch'"),
        (["--first-stage", "bm25", "--first-mode", "multi_dense"], "no first-stage run"),
        (["--depth", "0"], "depth"),
        (["--method", "logits_listwise", "--window", "20"], "exceeds"),  # splade-tiny's 512 tokens
        (["--method", "permutation_assignment", "--prompt", "BAD_PROMPT"], "is not a single token"),
    ],
)
def test_rerank_bad_input_is_one_line_and_writes_nothing(
    store: Path, tmp_path: Path, extra: list[str], message: str
) -> None:
    bad_prompt = tmp_path / "bad.yaml"
    bad_prompt.write_text(
        'system: ""\nuser: "{query} {documents} {n}"\ndocument: "[{id}] {text}"\nassistant: "{slots}"\n'
        'slot: "{slot}"\nslot_separator: "\\n"\nidentifiers: [' + ", ".join(f"zqxw{i}" for i in range(20)) + "]\n"
    )
    extra = [str(bad_prompt) if x == "BAD_PROMPT" else x for x in extra]
    models = SHARED / "models"
    before = sorted(p.relative_to(store) for p in store.rglob("*") if "_locks" not in p.parts)
    p = run(
        "rerank",
        "--root",
        str(store),
        "--model",
        str(models / "splade-tiny-mlm"),
        "--doc-tokens",
        "64",
        *extra,
        check=False,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    errors = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], p.stdout + p.stderr
    assert sorted(p.relative_to(store) for p in store.rglob("*") if "_locks" not in p.parts) == before


def _tree(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if "_locks" not in p.parts)


@pytest.mark.e2e
def test_a_trained_reranker_reranks_and_is_refused_on_another_base(store: Path, tmp_path: Path) -> None:
    models = SHARED / "models"
    small = ["--batch-size", "2", "--grad-accum", "1", "--list-size", "6", "--doc-tokens", "32", "--max-steps", "3"]
    args = [
        "train-reranker",
        "--root",
        str(store),
        "-d",
        "scifact",
        "--model",
        str(models / "splade-tiny-mlm"),
        "--method",
        "pointwise",
        "--loss",
        "ranknet",
        *small,
    ]
    p = run(*args)
    assert "1 model(s) trained" in p.stdout + p.stderr, p.stdout + p.stderr
    folder = str(next(store.glob("models/model=splade-tiny-mlm-rr-*")))
    assert f"model: {folder}" in " ".join((p.stdout + p.stderr).split()), p.stdout + p.stderr
    assert (Path(folder) / "adapter_config.json").exists() and not list(store.glob("checkpoints/**/last.pt"))
    again = run(*args)
    assert "0 model(s) trained, 1 already done" in again.stdout + again.stderr
    model = Path(folder).name.removeprefix("model=")
    log = sql(store, f"select count(*) n from train_log where model = '{model}'")  # the store's view of the log
    assert log == [{"n": 3}]

    p = run(
        "rerank",
        "--root",
        str(store),
        "--model",
        folder,
        "--method",
        "pointwise",
        "--depth",
        "20",
        "--doc-tokens",
        "32",
        "--batch-size",
        "32",
    )
    assert "1 run(s) reranked" in p.stdout + p.stderr, p.stdout + p.stderr
    slug = next(
        r["system"] for r in sql(store, f"select system from systems where kind = 'reranker' and model = '{folder}'")
    )
    run("evaluate", "--root", str(store))
    got = sql(store, f"select mode, queries from best_cells where system = '{slug}' and split = 'test'")
    assert got == [{"mode": "rerank", "queries": N_QUERIES}]

    # the adapter on another base model: one line, nothing written
    before = _tree(store)
    p = run(
        "rerank",
        "--root",
        str(store),
        "--model",
        str(models / "tiny-dream-random"),
        "--adapter",
        folder,
        "--method",
        "pointwise",
        "--depth",
        "20",
        check=False,
    )
    errors = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "was trained on" in errors[0], p.stdout + p.stderr
    assert _tree(store) == before


@pytest.mark.e2e
def test_a_permutation_reranker_trains_by_mdlm_on_rankzephyr_lists(store: Path, tmp_path: Path) -> None:
    passages = ["Aspirin reduces fever.", "The moon orbits the earth.", "Fever is a symptom.", "Tea is a drink."]
    human = (
        "I will provide you with 4 passages, each indicated by a numerical identifier [].\n"
        + "".join(f"[{i + 1}] {t}\n" for i, t in enumerate(passages))
        + "Search Query: what reduces fever.\nRank the 4 passages above."
    )
    lines = [
        json.dumps(
            {
                "id": f"z{k}",
                "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": "[1] > [3] > [4] > [2]"}],
            }
        )
        for k in range(4)
    ]
    src = tmp_path / "rank_zephyr.jsonl"
    src.write_text("\n".join(lines) + "\n")
    models = SHARED / "models"
    args = [
        "train-reranker",
        "--root",
        str(store),
        "--source",
        str(src),
        "--model",
        str(models / "tiny-dream-random"),
        "--method",
        "permutation_assignment",
        "--masking",
        "random",
        "--batch-size",
        "2",
        "--grad-accum",
        "1",
        "--list-size",
        "4",
        "--doc-tokens",
        "16",
        "--max-steps",
        "2",
    ]
    p = run(*args)
    assert "1 model(s) trained" in p.stdout + p.stderr, p.stdout + p.stderr
    manifest = next(store.glob("models/model=tiny-dream-random-rr-*/_manifest.json"))
    cfg = json.loads(manifest.read_text())["config"]
    assert cfg["settings"]["loss"] == "mdlm" and cfg["settings"]["masking"] == "random"

    # a malformed file and a missing one: one line each, nothing written
    before = _tree(store)
    src.write_text(lines[0] + "\n{oops\n")
    for source, message in ((src, "rank_zephyr.jsonl:2: malformed JSON"), (tmp_path / "missing.jsonl", "no such file")):
        p = run(*[str(source) if a == str(src) else a for a in args], "--name", "bad", check=False)
        errors = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("error:")]
        assert p.returncode == 2 and len(errors) == 1 and message in errors[0], p.stdout + p.stderr
        assert _tree(store) == before
