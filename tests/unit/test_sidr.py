"""SIDR: the sidr readout, the bag-of-tokens index and beta search, on tiny random models and inline data.

The readout is checked against an independent computation (the model's own MLM forward), padding-invariance, the
official head's formula and the special ids; the bag of tokens against Python sets; beta search against a dense
brute force; the stages on a tiny store: a BoT index from stored tokens, beta runs, bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import write_beir
from tiny_models import TEXTS, save_tiny_mlm, tiny_backbone

from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
from diffret.retrieval.models.sparse import excluded_ids
from diffret.retrieval.search.bot import bag_of_tokens, beta_search, binary_flat
from diffret.retrieval.search.encodings import SparseFlat
from diffret.stages import execute, stages
from diffret.stages.beta import BetaConfig
from diffret.stages.bot import BotConfig
from diffret.stages.download import DownloadConfig
from diffret.stages.encode import EncodeConfig
from diffret.stages.evaluate import EvaluateConfig
from diffret.stages.systems import SystemRef, tokenizer_of, tokens_slug
from diffret.stages.tokenize import TokenizeConfig
from diffret.storage import ArtifactStore, IncompleteArtifactError, StoreError
from diffret.storage.layout import BOT_FILE
from diffret.storage.sql import StoreSQL


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return tiny_backbone("bert", tmp_path_factory.mktemp("bert"))


def _ids(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_lm_head_readout_equals_the_models_own_mlm_forward(bert) -> None:
    bb, tok = bert
    reader = make_reader(bb, ReadoutConfig(readout="sidr", sidr_head="lm", sidr_act="log1p_relu", sparse_topk=40))
    texts = list(TEXTS.values())
    got = reader.encode(_ids(tok, texts), texts, "passage", 1)
    banned = sorted(excluded_ids(tok))
    for text, enc in zip(texts, got, strict=True):
        b = tok(text, return_tensors="pt")
        with torch.no_grad():
            logits = bb.model(**b).logits[0]
        w = torch.log1p(logits.relu()).max(0).values
        w[banned] = 0
        vals, ids = torch.topk(w, 40)
        keep = vals > 0
        assert set(enc.sparse_ids.tolist()) == set(ids[keep].tolist())
        np.testing.assert_allclose(np.sort(enc.sparse_weights), np.sort(vals[keep].numpy()), rtol=1e-5, atol=1e-6)
        assert not set(enc.sparse_ids.tolist()) & set(banned) and len(enc.sparse_ids) <= 40


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_vector_does_not_depend_on_its_batch(bert, side: str) -> None:
    bb, tok = bert
    reader = make_reader(bb, ReadoutConfig(readout="sidr", padding_side=side))
    texts = list(TEXTS.values())
    batch = reader.encode(_ids(tok, texts), texts, "passage", 1)
    for text, enc in zip(texts, batch, strict=True):
        alone = reader.encode(_ids(tok, [text]), [text], "passage", 1)[0]
        assert enc.sparse_ids.tolist() == alone.sparse_ids.tolist()
        np.testing.assert_allclose(enc.sparse_weights, alone.sparse_weights, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("head", "act", "side"), [("official", "elu1p", "left"), ("lm", "log1p_relu", "right")])
@pytest.mark.parametrize("block", [1 << 12, 1 << 30])  # many blocks (a text alone, a few vocabulary columns); one
def test_the_batch_readout_is_each_texts_own_padding_left_out(bert, head: str, act: str, side: str, block: int) -> None:
    """SIDR's head is one product over the batch's real positions, in blocks of scores, max-pooled per
    text: each text's vector is what :meth:`SidrReadout.weights` gives it alone from its own positions (to the
    BLAS's rounding of other row and column blocks, ~1 ulp at these tiny widths; byte for byte on splade-tiny:
    test_sidr_shared), and its padding, whatever it holds, changes nothing."""
    bb, tok = bert
    reader = make_reader(bb, ReadoutConfig(readout="sidr", sidr_head=head, sidr_act=act, padding_side=side))
    texts = list(TEXTS.values())
    with torch.inference_mode():
        _, hidden, att = reader._forward(_ids(tok, texts), bb)
        batch = reader.batch_weights(hidden, att, bb, block=block)
        alone = torch.stack([reader.weights(hidden[i][att[i].bool()], bb) for i in range(len(texts))])
        noisy = hidden.masked_fill(~att.bool()[..., None], 1e4)  # padding that would win every max
        assert torch.equal(reader.batch_weights(noisy, att, bb, block=block), batch)
    assert att.sum(1).unique().numel() > 1  # texts of several lengths: padding in the batch
    torch.testing.assert_close(batch, alone, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_the_batch_readout_on_a_gpu_is_each_texts_own(tmp_path) -> None:
    """On a GPU the official head's blocks are large (few products: cache-sized ones ran at 0.3x the per-text product
    on an H200); each text's vector is still its own, to the GPU BLAS's rounding (byte for byte on splade-tiny:
    ``benchmarks/encode.py --readout sidr --device cuda``)."""
    from diffret.retrieval.models.backbones import load_backbone

    folder = save_tiny_mlm(tmp_path / "mlm")
    bb = load_backbone(BackboneConfig(model=str(folder), device="cuda"))
    reader = make_reader(bb, ReadoutConfig(readout="sidr"))
    texts = list(TEXTS.values())
    with torch.inference_mode():
        _, hidden, att = reader._forward(_ids(bb.tokenizer, texts), bb)
        assert hidden.is_cuda
        batch = reader.batch_weights(hidden, att, bb)
        alone = torch.stack([reader.weights(hidden[i][att[i].bool()], bb) for i in range(len(texts))])
    torch.testing.assert_close(batch, alone, rtol=1e-6, atol=1e-6)


def test_official_head_is_layer_norm_times_the_input_embeddings_elu1p(bert) -> None:
    bb, tok = bert
    reader = make_reader(bb, ReadoutConfig(readout="sidr"))  # official head, elu1p, top 768
    text = TEXTS["long"]
    enc = reader.encode(_ids(tok, [text]), [text], "passage", 1)[0]
    b = tok(text, return_tensors="pt")
    with torch.no_grad():
        h = bb.hidden_states(b["input_ids"], b["attention_mask"], bidirectional=True)[0].float()
        scores = torch.nn.functional.layer_norm(h, h.shape[-1:]) @ bb.model.get_input_embeddings().weight.float().T
    w = (torch.nn.functional.elu(scores) + 1).max(0).values
    w[sorted(excluded_ids(tok))] = 0
    k = min(768, int((w > 0).sum()))
    vals, ids = torch.topk(w, k)
    assert enc.sparse_ids.tolist()[:5] == ids.tolist()[:5]
    np.testing.assert_allclose(enc.sparse_weights, vals.numpy(), rtol=1e-5)
    assert (enc.sparse_weights > 0).all()  # elu(x) + 1 > 0: every kept id has weight


def test_the_sidr_readout_takes_k_1_only(bert) -> None:
    bb, tok = bert
    with pytest.raises(ValueError, match="K = 1|--k 1"):
        make_reader(bb, ReadoutConfig(readout="sidr")).encode(_ids(tok, ["cats"]), ["cats"], "query", 2)


def test_other_readouts_keep_their_slugs() -> None:
    """The sidr settings are not in another readout's settings: systems stored before them are found as they were."""
    assert "sidr_head" not in ReadoutConfig().numbers()
    assert {"sidr_head", "sidr_act"} <= set(ReadoutConfig(readout="sidr").numbers())


# ------------------------------------------------------------------------------------------- bag of tokens
def test_bag_of_tokens_is_each_texts_distinct_ids_without_the_excluded() -> None:
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 50, rng.integers(0, 30)).tolist() for _ in range(40)]
    excluded = [0, 1, 2, 7]
    got = bag_of_tokens(pa.array(rows, pa.list_(pa.int32())), excluded).to_pylist()
    assert got == [sorted(set(r) - set(excluded)) for r in rows]


def test_beta_search_equals_a_dense_brute_force() -> None:
    rng = np.random.default_rng(1)
    v, n_docs = 60, 130
    bags = [sorted(set(rng.integers(0, v, rng.integers(1, 20)).tolist())) for _ in range(n_docs)]
    q_ids = [np.unique(rng.integers(0, v, 8)) for _ in range(7)]
    q_w = [rng.random(len(i)).astype(np.float32) + 0.1 for i in q_ids]
    flat = binary_flat(pa.array(bags, pa.list_(pa.int32())))
    top = beta_search(
        SparseFlat.from_lists(q_ids, q_w),
        [flat.rows(a, min(a + 17, n_docs)) for a in range(0, n_docs, 17)],
        k=10,
        query_rows=3,
    )
    dense_q = np.zeros((7, v), np.float32)
    for i, (ids, w) in enumerate(zip(q_ids, q_w, strict=True)):
        dense_q[i, ids] = w
    dense_p = np.zeros((n_docs, v), np.float32)
    for j, b in enumerate(bags):
        dense_p[j, b] = 1.0
    scores = dense_q @ dense_p.T
    for i in range(7):
        order = sorted(range(n_docs), key=lambda j: (-scores[i, j], j))[:10]
        assert top.index[i].tolist() == order
        np.testing.assert_allclose(top.scores[i], scores[i, order], rtol=1e-6)


# ----------------------------------------------------------------------------------------------- stages
CORPUS = [
    {"_id": f"d{i}", "title": "", "text": t}
    for i, t in enumerate(
        ["cats purr softly", "dogs bark loudly", "tea and coffee", "the lazy fox jumps", "warm garden cats"]
    )
]
QUERIES = [{"_id": "q0", "text": "cats purr"}, {"_id": "q1", "text": "coffee drink"}]
QRELS = {"test": [("q0", "d0", 1), ("q1", "d2", 1)]}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("sidr")
    model = save_tiny_mlm(base / "model")
    beir = write_beir(base / "tiny", CORPUS, QUERIES, QRELS)
    root = str(base / "store")
    bb = BackboneConfig(model=str(model))
    log = lambda _: None  # noqa: E731
    execute(stages()["download"], DownloadConfig(name="tiny", source=str(beir), root=root), log=log)
    execute(stages()["tokenize"], TokenizeConfig(dataset="tiny", backbone=bb, root=root), log=log)
    enc = EncodeConfig(dataset="tiny", k=[1], backbone=bb, readout=ReadoutConfig(readout="sidr"), root=root)
    execute(stages()["encode"], enc, log=log)
    return {"root": root, "model": model, "bb": bb, "base": base}


def test_bot_index_from_stored_tokens_and_beta_runs(store: dict) -> None:
    root, bb = store["root"], store["bb"]
    res = execute(stages()["bot"], BotConfig(dataset="tiny", backbone=bb, root=root), log=lambda _: None)
    assert res.done == 1 and res.details["stats"]["passages"] == len(CORPUS)
    s = ArtifactStore(root)
    folder = res.details["stage"]
    bags = s.read_table(folder, BOT_FILE).to_pylist()
    tok = tokenizer_of(bb)
    for row, doc in zip(bags, CORPUS, strict=True):
        assert row["token_ids"] == sorted(set(tok(doc["text"], add_special_tokens=False)["input_ids"]))
    again = execute(stages()["bot"], BotConfig(dataset="tiny", backbone=bb, root=root), log=lambda _: None)
    assert (again.done, again.skipped) == (0, 1)
    ref = SystemRef(model=str(store["model"]), where={"readout.readout": "sidr"})
    runs = execute(stages()["beta"], BetaConfig(dataset="tiny", system=ref, root=root), log=lambda _: None)
    assert runs.done == 1
    with StoreSQL(s) as db:
        _, rows = db.query("select query_id, count(*) n from runs where mode = 'beta' group by all order by 1")
        assert rows == [("q0", 5), ("q1", 5)]
        _, rows = db.query("select passages, nnz > 0, bytes > 0 from bot_indexes")
        assert rows == [(len(CORPUS), True, True)]


def test_beta_refuses_what_it_cannot_search(store: dict, tmp_path) -> None:
    root = store["root"]
    ref = SystemRef(model=str(store["model"]), where={"readout.readout": "sidr"})
    other = save_tiny_mlm(tmp_path / "other", seed=1)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["cats"], vocab["dogs"] = vocab["dogs"], vocab["cats"]  # another vocabulary: its ids mean other words
    (other / "tokenizer.json").write_text(json.dumps(spec))
    bb2 = BackboneConfig(model=str(other))
    execute(
        stages()["tokenize"],
        TokenizeConfig(dataset="tiny", backbone=bb2, sides=["passage"], root=root),
        log=lambda _: None,
    )
    execute(stages()["bot"], BotConfig(dataset="tiny", backbone=bb2, root=root), log=lambda _: None)
    with pytest.raises(StoreError, match="another tokenizer"):
        execute(
            stages()["beta"],
            BetaConfig(dataset="tiny", system=ref, bot=tokens_slug(bb2, 256), root=root),
            log=lambda _: None,
        )
    with pytest.raises(IncompleteArtifactError, match="diffret bot"):
        execute(
            stages()["beta"], BetaConfig(dataset="tiny", system=ref, bot="nothing-here", root=root), log=lambda _: None
        )
    dense = EncodeConfig(
        dataset="tiny",
        k=[1],
        sides=["query"],
        backbone=BackboneConfig(model=str(store["model"])),
        readout=ReadoutConfig(readout="diffembed"),
        root=root,
    )
    execute(stages()["encode"], dense, log=lambda _: None)
    before = sorted(p for p in Path(root).rglob("*") if "_locks" not in str(p))
    with pytest.raises(ValueError, match="no sparse vectors"):
        execute(
            stages()["beta"],
            BetaConfig(
                dataset="tiny",
                system=SystemRef(model=str(store["model"]), where={"readout.readout": "diffembed"}),
                root=root,
            ),
            log=lambda _: None,
        )
    assert sorted(p for p in Path(root).rglob("*") if "_locks" not in str(p)) == before  # nothing written


# ----------------------------------------------------------------------------------------- late parametric
def test_late_rescoring_encodes_only_what_it_needs_and_ranks_as_the_full_run(store: dict, tmp_path) -> None:
    """BM25's top m re-scored by multi_dense: only the candidates are encoded (a larger m encodes the difference),
    and on its m passages the run ranks them as the full-corpus multi_dense run does, with the same scores."""
    import shutil

    from diffret.stages.bm25 import BM25Config
    from diffret.stages.late import LateConfig
    from diffret.stages.runs import read_run
    from diffret.stages.score import ScoreConfig

    root = str(tmp_path / "store")
    shutil.copytree(store["root"], root)
    bb, log = store["bb"], (lambda _: None)
    execute(stages()["encode"], EncodeConfig(dataset="tiny", k=[1], sides=["query"], backbone=bb, root=root), log=log)
    execute(stages()["bm25"], BM25Config(dataset="tiny", root=root), log=log)
    ref = SystemRef(model=str(store["model"]), where={"readout.readout": "diffretriever"})
    late = LateConfig(dataset="tiny", system=ref, kq=1, kp=2, depths=[2], root=root)
    first = execute(stages()["late"], late, log=log)
    s = ArtifactStore(root)

    def stats(m: int) -> dict:
        return s.require_manifest(f"{_late_dir(root, m)}").stats

    assert first.done == 1 and stats(2)["encoded"] == stats(2)["needed"] <= 2 * len(QUERIES) < len(CORPUS) + 1
    more = execute(stages()["late"], late.model_copy(update={"depths": [2, 4]}), log=log)
    assert (more.done, more.skipped) == (1, 1)
    partial = next(Path(root).glob("partial/*/dataset=tiny/k=2"))
    parts = sorted(partial.glob("part=*.parquet"))
    ids = [i for f in parts for i in pq.read_table(f, columns=["id"])["id"].to_pylist()]
    assert len(ids) == len(set(ids)) == stats(4)["needed"]  # each needed passage encoded once, in two parts
    assert stats(4)["encoded"] == stats(4)["needed"] - stats(2)["needed"]
    with StoreSQL(s) as db:
        _, rows = db.query("select m, passages_needed, corpus from late_runs order by m")
        assert rows == [(2, stats(2)["needed_m"], len(CORPUS)), (4, stats(4)["needed_m"], len(CORPUS))]
        _, costs = db.query(
            "select m, first_ms_per_query, rescore_ms_per_query, encode_ms_per_passage, "
            "on_the_fly_ms_per_query from late_costs order by m"
        )
        assert [c[0] for c in costs] == [2, 4] and all(v is not None and v > 0 for c in costs for v in c[2:])
        assert costs[1][4] == pytest.approx(costs[1][1] + costs[1][2] + 4 * costs[1][3]) if costs[1][1] else True
    execute(stages()["evaluate"], EvaluateConfig(root=root), log=log)
    from diffret.retrieval.analysis.report import build_report

    with StoreSQL(s) as db:  # the views read the files listed when the connection opens
        sections = dict(build_report(db, n_boot=10).sections)
    assert "Late-parametric re-scoring (SIDR)" in sections and "| 4 |" in sections["Late-parametric re-scoring (SIDR)"]
    # the full-corpus run, for comparison
    execute(stages()["encode"], EncodeConfig(dataset="tiny", k=[2], sides=["passage"], backbone=bb, root=root), log=log)
    execute(
        stages()["score"],
        ScoreConfig(dataset="tiny", system=ref, kq=[1], kp=[2], modes=["multi_dense"], root=root),
        log=log,
    )
    full = read_run(
        s,
        next(
            str(p.relative_to(root))
            for p in Path(root).glob("runs/*diffretriever*/dataset=tiny/split=test/kq=1/kp=2/mode=multi_dense")
        ),
    )
    for m in (2, 4):
        got = read_run(s, _late_dir(root, m)).to_pylist()
        for q in {r["query_id"] for r in got}:
            mine = [(r["doc_id"], r["score"]) for r in got if r["query_id"] == q]
            docs = {d for d, _ in mine}
            want = [(r["doc_id"], r["score"]) for r in full.to_pylist() if r["query_id"] == q and r["doc_id"] in docs]
            assert [d for d, _ in mine] == [d for d, _ in want]
            np.testing.assert_allclose([x for _, x in mine], [x for _, x in want], rtol=1e-6)


def _late_dir(root: str, m: int) -> str:
    (path,) = Path(root).glob(f"runs/*diffretriever*/dataset=tiny/split=test/kq=1/kp=2/mode=late_multi_dense_m{m}")
    return str(path.relative_to(root))


def test_late_refuses_bad_input_in_one_line(store: dict) -> None:
    from pydantic import ValidationError

    from diffret.stages.late import LateConfig

    with pytest.raises(ValidationError, match="m must be positive"):
        LateConfig(dataset="tiny", depths=[0])
    ref = SystemRef(model=str(store["model"]), where={"readout.readout": "sidr"})
    before = sorted(p for p in Path(store["root"]).rglob("*") if "_locks" not in str(p))
    with pytest.raises(StoreError, match="run it first"):  # no BM25 run to re-score
        execute(
            stages()["late"],
            LateConfig(dataset="tiny", system=ref, kp=1, mode="sparse_max", first_stage="bm25", root=store["root"]),
            log=lambda _: None,
        )
    assert sorted(p for p in Path(store["root"]).rglob("*") if "_locks" not in str(p)) == before


def test_sidr_settings_tell_stored_systems_apart_from_the_command_line(tmp_path) -> None:
    """Two SIDR systems of one model that differ in their head are told apart by --sidr-head (a filter of every
    command that reads a stored system); the ambiguity names that option."""
    from diffret.flows.commands import system_ref_opts
    from diffret.stages.systems import EncodeSettings, encoder_record, find_system, register

    store = ArtifactStore(str(tmp_path / "store"))
    store.fs.makedirs(store.abspath(""), exist_ok=True)
    for head in ("official", "lm"):
        readout = ReadoutConfig(readout="sidr", sidr_head=head)
        s = EncodeSettings(backbone=BackboneConfig(model="org/tiny"), readout=readout)
        register(store, encoder_record(s))
    flags = {o.flags[0] for o in system_ref_opts(("system",), "")}
    assert {"--sidr-head", "--sidr-act"} <= flags
    with pytest.raises(StoreError, match="--sidr-head"):
        find_system(store, SystemRef(model="org/tiny"))
    got = find_system(store, SystemRef(model="org/tiny", where={"readout.sidr_head": "lm"}))
    assert got.settings["readout"]["sidr_head"] == "lm"
