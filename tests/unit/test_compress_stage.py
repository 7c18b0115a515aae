"""Compressed encodings in the stage world: `diffret compress` of a stored float16 system, `diffret
encode --store` from the start (the same codebook, shards and runs), scoring over the codes, and a codebook that is
corrupted, missing or of another K_p / dataset."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import write_beir
from tiny_models import save_tiny_mlm

from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.search.codecs import CodebookError
from diffret.stages import execute, stages
from diffret.stages.compress import CompressConfig
from diffret.stages.download import DownloadConfig
from diffret.stages.encode import EncodeConfig
from diffret.stages.evaluate import EvaluateConfig
from diffret.stages.index import IndexConfig
from diffret.stages.readers import read_codebook, read_encodings
from diffret.stages.report import ReportConfig
from diffret.stages.score import ScoreConfig
from diffret.stages.systems import SystemRef, find_system
from diffret.storage import ArtifactStore, ChecksumError, IncompleteArtifactError, StoreError
from diffret.storage.layout import CODEBOOK_FILE, codebook_dir, encodings_dir, index_dir, run_dir
from diffret.storage.sql import StoreSQL

WORDS = (
    "cats purr dogs bark tea coffee cocoa garden fox jumps lazy mailman retrieval words query river stone "
    "cloud apple lemon"
).split()
CORPUS = [
    {"_id": f"d{i}", "title": WORDS[i % 20], "text": " ".join(WORDS[(i * 3 + j) % 20] for j in range(6))}
    for i in range(60)
]
QUERIES = [{"_id": f"q{i}", "text": " ".join(WORDS[(2 * i + j) % 20] for j in range(3))} for i in range(8)]
QRELS = {"test": [(f"q{i}", f"d{3 * i}", 1) for i in range(8)]}
K = [1, 4]


def _run(name: str, config) -> object:  # noqa: ANN001
    return execute(stages()[name], config, log=lambda _: None)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("compress")
    model = save_tiny_mlm(base / "model")
    beir = write_beir(base / "tiny", CORPUS, QUERIES, QRELS)
    root = str(base / "store")
    bb = BackboneConfig(model=str(model))
    _run("download", DownloadConfig(name="tiny", source=str(beir), root=root))
    enc = EncodeConfig(root=root, dataset="tiny", k=K, backbone=bb, max_length=64, shard_size=20, batch_size=8)
    _run("tokenize", enc.tokenize_config())
    f16 = _run("encode", enc).system
    _run("score", _score(root, f16))
    return {"base": base, "root": root, "model": model, "encode": enc, "f16": f16}


def _score(root: str, system: str) -> ScoreConfig:
    return ScoreConfig(
        root=root,
        dataset="tiny",
        system=SystemRef(system=system),
        kq=K,
        kp=K,
        q1p1_multi="keep",
        modes=["multi_dense", "single_dense", "fusion_multi_sparse_max"],
    )


def _runs(root: str, system: str) -> dict[tuple[int, int, str], list[dict]]:
    store = ArtifactStore(root)
    out = {}
    for kq in K:
        for kp in K:
            for mode in ("multi_dense", "single_dense", "fusion_multi_sparse_max"):
                t = store.read_table(run_dir(system, "tiny", "test", kq, kp, mode), "run.parquet")
                out[kq, kp, mode] = t.to_pylist()
    return out


def _assert_scores_close(a: list[dict], b: list[dict], what: object = None) -> None:
    """Most (query, doc) pairs of run ``a`` are in run ``b``, each scored within 0.01 (a random tiny model's passages
    are near ties: the scores barely move, not the ranks)."""
    sa = {(r["query_id"], r["doc_id"]): r["score"] for r in a}
    sb = {(r["query_id"], r["doc_id"]): r["score"] for r in b}
    both = sa.keys() & sb.keys()
    assert len(both) > len(sa) // 2 and max(abs(sa[x] - sb[x]) for x in both) < 0.01, what


def _copy(world: dict, tmp_path: Path) -> str:
    root = tmp_path / "store"
    shutil.copytree(world["root"], root)
    return str(root)


def test_int8_compress_scores_like_float16_and_is_a_system_of_its_own(world: dict, tmp_path: Path) -> None:
    root = _copy(world, tmp_path)
    res = _run(
        "compress", CompressConfig(root=root, dataset="tiny", system=SystemRef(system=world["f16"]), store="int8")
    )
    assert res.done == 2 * (1 + 3) and "-int8-" in res.system  # K x (1 query shard + 3 passage shards)
    store = ArtifactStore(root)
    # --model alone still names the float16 system; --store names the compressed one
    assert find_system(store, SystemRef(model=str(world["model"]))).system == world["f16"]
    assert find_system(store, SystemRef(model=str(world["model"]), where={"store": "int8"})).system == res.system
    f16 = store.read_manifest(encodings_dir(world["f16"], "tiny", "passage", 4))
    i8 = store.read_manifest(encodings_dir(res.system, "tiny", "passage", 4))
    assert sum(e.bytes for e in i8.files.values()) < sum(e.bytes for e in f16.files.values())
    _run("score", _score(root, res.system))
    a, b = _runs(root, world["f16"]), _runs(root, res.system)
    for cell in a:
        if cell[2] != "fusion_multi_sparse_max":  # min-max normalised: ranks, not scores
            _assert_scores_close(a[cell], b[cell], cell)
    # SQL: bytes measured per vector and passage, each cell against the float16 system's
    _run("evaluate", EvaluateConfig(root=root))
    with StoreSQL(store) as db:
        _, sizes = db.query(
            "select system, store, kp, bytes_per_vector, bytes_per_passage from vector_bytes "
            "where kp = 4 order by store"
        )
        _, effect = db.query("select store, float16_system, kq, kp, mode, ndcg_10_change from compression_effect")
        _, enc = db.query("select system, count(*), count(dense), count(codes) from encodings group by 1 order by 1")
    (f, _, _, f_vec, f_pas), (c, store_name, _, c_vec, c_pas) = sizes
    assert (f, c, store_name) == (world["f16"], res.system, "int8") and c_vec < 0.7 * f_vec and c_pas < f_pas
    assert len(effect) == 4 * 3 and {e[:2] for e in effect} == {("int8", world["f16"])}
    assert all(abs(e[-1]) <= 1 for e in effect)
    by_system = {r[0]: r[1:] for r in enc}
    assert by_system[res.system][1] == 8 * 2 and by_system[res.system][2] == 60 * 2  # queries dense, passages coded
    # the report's Compression section: sizes, the MS MARCO projection, the change per mode, the figure
    folder = Path(_run("report", ReportConfig(root=root, name="c", n_boot=20)).details["folder"])
    md = (folder / "report.md").read_text()
    section = md.split("## Compression", 1)[1].split("\n## ", 1)[0]
    assert "| int8 | tiny |" in section and "TB |" in section and "multi_dense" in section
    assert (folder / "compression.png").read_bytes()[:4] == b"\x89PNG"
    lines = (folder / "compression.csv").read_text().splitlines()
    assert len(lines) == 2 and "msmarco_projection" in lines[0]
    # a second compress does nothing
    again = _run(
        "compress", CompressConfig(root=root, dataset="tiny", system=SystemRef(system=world["f16"]), store="int8")
    )
    assert again.done == 0 and again.skipped == res.done


def test_compress_then_score_equals_encode_with_the_store_from_the_start(world: dict, tmp_path: Path) -> None:
    """A store compressed afterwards or encoded compressed from the start: the same codebook seed gives the same
    codebook, the same shards and the same runs."""
    a = _copy(world, tmp_path / "a")
    res = _run(
        "compress",
        CompressConfig(root=a, dataset="tiny", system=SystemRef(system=world["f16"]), store="residual:2", store_seed=3),
    )
    _run("score", _score(a, res.system))
    # b: the float16 passages are gone, so encode --store encodes its codebook's sample itself
    b = _copy(world, tmp_path / "b")
    for k in K:
        ArtifactStore(b).remove_folder(encodings_dir(world["f16"], "tiny", "passage", k))
    enc = world["encode"].model_copy(update={"root": b, "store": "residual:2", "store_seed": 3})
    direct = _run("encode", enc)
    assert direct.system == res.system
    _run("score", _score(b, direct.system))
    sa, sb = ArtifactStore(a), ArtifactStore(b)
    for k in K:
        assert (
            read_codebook(sa, codebook_dir(res.system, "tiny", k))[1]
            == read_codebook(sb, codebook_dir(res.system, "tiny", k))[1]
        )
        for side in ("query", "passage"):
            ma = sa.read_manifest(encodings_dir(res.system, "tiny", side, k))
            mb = sb.read_manifest(encodings_dir(res.system, "tiny", side, k))
            assert ma.config_hash == mb.config_hash
            assert sorted(ma.files) == sorted(mb.files)
            for name in ma.files:  # the same rows and codes (Parquet may lay the same table out otherwise)
                folder = encodings_dir(res.system, "tiny", side, k)
                assert sa.read_table(folder, name).equals(sb.read_table(folder, name)), (side, k, name)
    assert _runs(a, res.system) == _runs(b, res.system)
    # the codes are a quarter of a byte per dimension (plus the centroid id), and search still ranks sensibly
    t = sa.read_table(encodings_dir(res.system, "tiny", "passage", 4), "shard=00000.parquet")
    assert "dense" not in t.column_names and t.schema.field("codes").type.value_type.byte_width == 4 + 32 * 2 // 8


def test_a_damaged_or_missing_codebook_is_named_and_rebuilt(world: dict, tmp_path: Path) -> None:
    root = _copy(world, tmp_path)
    cfg = CompressConfig(root=root, dataset="tiny", system=SystemRef(system=world["f16"]), store="residual:1")
    system = _run("compress", cfg).system
    store = ArtifactStore(root)
    folder = codebook_dir(system, "tiny", 4)
    digest = read_codebook(store, folder)[1]
    path = Path(root) / folder / CODEBOOK_FILE
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=CODEBOOK_FILE):
        _run("score", _score(root, system))
    _, problems = store.verify_all()
    assert any(CODEBOOK_FILE in p and "diffret compress" in p for p in problems)
    res = _run("compress", cfg)  # retrained from the same seeded sample: the same codebook, no shard redone
    assert res.done == 0 and read_codebook(store, folder)[1] == digest
    store.remove_folder(folder)
    with pytest.raises(IncompleteArtifactError, match="diffret compress"):
        _run("score", _score(root, system))
    assert _run("compress", cfg).done == 0 and read_codebook(store, folder)[1] == digest


def test_a_codebook_of_another_k_or_dataset_is_refused_naming_both(world: dict, tmp_path: Path) -> None:
    root = _copy(world, tmp_path)
    system = _run(
        "compress", CompressConfig(root=root, dataset="tiny", system=SystemRef(system=world["f16"]), store="residual:2")
    ).system
    store = ArtifactStore(root)
    cb, _ = read_codebook(store, codebook_dir(system, "tiny", 4))
    with pytest.raises(CodebookError, match="k=4, not k=1"):
        cb.check("residual:2", cb.dim, k=1, dataset="tiny")
    with pytest.raises(CodebookError, match="dataset='tiny', not dataset='nfcorpus'"):
        cb.check("residual:2", cb.dim, k=4, dataset="nfcorpus")
    # K_p = 4's codebook put in K_p = 1's place: scoring refuses it rather than decode with it
    shutil.rmtree(Path(root) / codebook_dir(system, "tiny", 1))
    shutil.copytree(Path(root) / codebook_dir(system, "tiny", 4), Path(root) / codebook_dir(system, "tiny", 1))
    with pytest.raises(StoreError, match="codebook"):
        _run("score", _score(root, system))


def test_bad_choices_are_refused_before_any_work(world: dict, tmp_path: Path) -> None:
    root = _copy(world, tmp_path)
    ref = SystemRef(system=world["f16"])
    with pytest.raises(ValueError, match="unknown store 'residual:3'"):
        _run("compress", CompressConfig(root=root, dataset="tiny", system=ref, store="residual:3"))
    with pytest.raises(CodebookError, match="needs at least 256 vectors"):  # 60 passages at K_p = 1
        _run("compress", CompressConfig(root=root, dataset="tiny", system=ref, store="pq:8", k=[1]))
    with pytest.raises(ValueError, match="float16 is the system as stored"):
        _run("compress", CompressConfig(root=root, dataset="tiny", system=ref, store="float16"))
    with pytest.raises(ValueError, match="unknown store"):
        EncodeConfig(root=root, dataset="tiny", backbone=BackboneConfig(model="x"), store="int4").settings()


def test_codebook_sample_is_seeded_and_reads_only_the_shards_it_needs() -> None:
    from diffret.stages.codebooks import codebook_sample

    read: list[str] = []
    data = {f"s{i}": np.full((10, 2), i, np.float32) for i in range(6)}

    def vectors(name: str) -> np.ndarray:
        read.append(name)
        return data[name]

    a = codebook_sample(sorted(data), vectors, 15, seed=1)
    assert len(a) == 15 and len(read) == 2
    assert np.array_equal(a, codebook_sample(sorted(data), data.__getitem__, 15, seed=1))


def test_a_colbert_codebook_sample_is_colbert_v2s_and_below_256_is_refused(world: dict, tmp_path: Path) -> None:
    """``--codebook-sample colbert``: every vector of min(1 + 16 sqrt(120 N), N) passages (all 60 here), recorded
    in the codebook folder's config as the count it resolved to; the default stays 65,536; the CLI takes both."""
    from typer.testing import CliRunner

    from diffret.flows.cli import app
    from diffret.stages.codebooks import DEFAULT_SAMPLE, sample_vectors

    root = _copy(world, tmp_path)
    ref = SystemRef(system=world["f16"])
    cfg = CompressConfig(root=root, dataset="tiny", system=ref, store="residual:1", k=[4], codebook_sample="colbert")
    system = _run("compress", cfg).system
    m = ArtifactStore(root).require_manifest(codebook_dir(system, "tiny", 4))
    assert m.config["sample"] == sample_vectors("colbert", 60, 4) == 240 == m.stats["vectors"]
    assert sample_vectors(DEFAULT_SAMPLE, 60, 4) == 65536 and sample_vectors("colbert", 10**6, 16) == 2_804_352
    with pytest.raises(ValueError, match="at least 256 vectors or 'colbert', got 100"):
        CompressConfig(root=root, dataset="tiny", system=ref, store="residual:1", codebook_sample=100)
    with pytest.raises(ValueError):
        CompressConfig(root=root, dataset="tiny", system=ref, store="residual:1", codebook_sample="colbertv3")
    res = CliRunner().invoke(
        app,
        [
            "compress",
            "-d",
            "tiny",
            "--system",
            world["f16"],
            "--store",
            "residual:1",
            "--k",
            "4",
            "--codebook-sample",
            "colbert",
            "--root",
            root,
        ],  # fmt: skip
    )
    assert res.exit_code == 0, res.output  # the same sample (240 vectors): the stored codebook is current


def test_a_queries_only_dataset_has_its_queries_copied_and_is_scored_on_its_compressed_corpus(
    world: dict, tmp_path: Path
) -> None:
    """TREC DL holds queries only: compress copies them, and the corpus (msmarco-passage) is compressed as a
    dataset of its own; the compressed system then scores the queries-only dataset against that corpus."""
    root = str(tmp_path / "store")
    corpus = write_beir(tmp_path / "ms", CORPUS, QUERIES[:2], {"dev": [("q0", "d0", 1)]})
    dl = write_beir(tmp_path / "dl", None, QUERIES, QRELS)
    _run("download", DownloadConfig(name="msmarco-passage", source=str(corpus), root=root))
    _run("download", DownloadConfig(name="trec-dl-2019", source=str(dl), root=root))
    f16 = None
    for name, sides in (("msmarco-passage", ["query", "passage"]), ("trec-dl-2019", ["query"])):
        enc = world["encode"].model_copy(update={"root": root, "dataset": name, "sides": sides})
        _run("tokenize", enc.tokenize_config())
        f16 = _run("encode", enc).system
    ref = SystemRef(system=f16)
    res = _run("compress", CompressConfig(root=root, dataset="trec-dl-2019", system=ref, store="int8"))
    store = ArtifactStore(root)
    assert res.done == len(K)  # one query shard per K, no passage folder
    for k in K:
        assert not store.exists(encodings_dir(res.system, "trec-dl-2019", "passage", k))
        folder = encodings_dir(res.system, "trec-dl-2019", "query", k)
        src = encodings_dir(f16, "trec-dl-2019", "query", k)
        assert store.read_table(folder, "shard=00000.parquet").equals(store.read_table(src, "shard=00000.parquet"))
    with pytest.raises(IncompleteArtifactError, match="msmarco-passage"):  # its corpus is not compressed yet
        _run("score", _score(root, res.system).model_copy(update={"dataset": "trec-dl-2019"}))
    _run("compress", CompressConfig(root=root, dataset="msmarco-passage", system=ref, store="int8"))
    for system in (f16, res.system):
        _run("score", _score(root, system).model_copy(update={"dataset": "trec-dl-2019"}))
    run = run_dir(res.system, "trec-dl-2019", "test", 4, 4, "multi_dense")
    a = store.read_table(run_dir(f16, "trec-dl-2019", "test", 4, 4, "multi_dense"), "run.parquet").to_pylist()
    b = store.read_table(run, "run.parquet").to_pylist()
    assert {r["query_id"] for r in b} == {q["_id"] for q in QUERIES}
    _assert_scores_close(a, b)


def test_a_lancedb_index_is_built_from_the_decoded_codes(world: dict, tmp_path: Path) -> None:
    """LanceDB tables of a compressed system (`--vectors float32`: its codes index is the default) hold its decoded
    vectors, and a flat table finds what exact search over the codes finds (up to the near ties of a random tiny
    model)."""
    root = _copy(world, tmp_path)
    ref = SystemRef(system=world["f16"])
    system = _run("compress", CompressConfig(root=root, dataset="tiny", system=ref, store="residual:2")).system
    res = _run(
        "index",
        IndexConfig(
            root=root,
            dataset="tiny",
            system=SystemRef(system=system),
            kq=[1, 4],
            kp=[4],
            index_type="none",
            vectors="float32",
        ),
    )
    checks = res.details["checks"][4]
    assert res.done == 1 and len(checks) == 2 and all(c["recall_10"] >= 0.9 for c in checks.values()), checks
    import lancedb

    store = ArtifactStore(root)
    rows = lancedb.connect(str(Path(root) / index_dir(system, "tiny", 4))).open_table("docs").to_arrow().to_pylist()
    assert len(rows) == 60
    decoded, as_stored = (
        read_encodings(store, st, store.read_manifest(st))
        for st in (encodings_dir(system, "tiny", "passage", 4), encodings_dir(world["f16"], "tiny", "passage", 4))
    )
    row = decoded.ids.index(rows[7]["doc_id"])
    vectors = np.asarray(rows[7]["vector"], np.float32)
    coded, stored = (e.multi[row][e.mask[row]].numpy() for e in (decoded, as_stored))
    loss = np.abs(coded - stored).max()  # what residual:2 changed
    assert loss > 0 and np.abs(vectors - coded).max() < loss / 10
