"""Latency measurement on tiny random models: rows per length and batch size carrying their settings, PromptReps'
decoded slots counted, exact search timed over synthetic indexes."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import tiny_backbone

from diffret.retrieval.analysis.latency import encode_latency, environment, exact_search_latency, measure, synthetic_ids
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader

pytestmark = pytest.mark.usefixtures("one_thread")


def test_synthetic_inputs_have_the_exact_length_and_no_special_token(tmp_path: Path) -> None:
    bb, tok = tiny_backbone("bert", tmp_path)
    ids = synthetic_ids(tok, 37, n=3)
    assert [len(r) for r in ids] == [37, 37, 37]
    assert not set(tok.all_special_ids) & {i for r in ids for i in r}
    assert synthetic_ids(tok, 37, n=3) == ids  # seeded
    with pytest.raises(ValueError, match="positive"):
        synthetic_ids(tok, 0)


def test_mask_readout_rows_per_length_and_batch_size(tmp_path: Path) -> None:
    bb, _ = tiny_backbone("bert", tmp_path)
    reader = make_reader(bb, ReadoutConfig(), 128)
    rows = encode_latency(reader, "query", [8, 16], [1, 2], k=4, repeats=2)
    assert [(r["length"], r["batch_size"]) for r in rows] == [(8, 1), (8, 2), (16, 1), (16, 2)]
    for r in rows:
        assert r["k"] == 4 and r["repeats"] == 2 and 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert 1 <= r["slots"] <= 4 and r["input_tokens"] > r["length"]  # the prompt and the masks counted


def test_promptreps_records_the_slots_it_decoded(tmp_path: Path) -> None:
    bb, _ = tiny_backbone("llama", tmp_path)
    reader = make_reader(bb, ReadoutConfig(readout="promptreps"), 128)
    one, many = (encode_latency(reader, "query", [8], [1], k=k, repeats=1)[0] for k in (1, 6))
    assert one["slots"] == 1 and 1 <= many["slots"] <= 6


def test_exact_search_rows_per_size_and_mode() -> None:
    rows = exact_search_latency(
        [10, 100], kq=2, kp=3, hidden=8, modes=["single_dense", "multi_dense"], queries=4, topk=20, repeats=1
    )
    assert [(r["docs"], r["mode"], r["topk"]) for r in rows] == [
        (10, "single_dense", 10),
        (10, "multi_dense", 10),
        (100, "single_dense", 20),
        (100, "multi_dense", 20),
    ]
    assert all(r["engine"] == "exact" and r["min_ms"] > 0 for r in rows)


def test_measure_and_environment() -> None:
    calls = []
    t = measure(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and t.repeats == 3
    with pytest.raises(ValueError):
        measure(lambda: None, repeats=0)
    env = environment()
    assert env["device"] == "cpu" and env["threads"] >= 1 and env["torch"]


def test_the_stage_stores_rows_with_their_settings_and_a_new_setting_is_a_new_folder(tmp_path: Path) -> None:
    from tiny_models import save_tiny_mlm

    from diffret.retrieval.models.backbones import BackboneConfig
    from diffret.stages import execute, stages
    from diffret.stages.latency import LatencyConfig
    from diffret.storage import ArtifactStore
    from diffret.storage.sql import StoreSQL

    model = save_tiny_mlm(tmp_path / "model")
    cfg = LatencyConfig(
        root=str(tmp_path / "store"),
        backbone=BackboneConfig(model=str(model)),
        lengths=[8, 16],
        k=[1, 4],
        search_sizes=[10, 100],
        search_k=["1x1", "2x3"],
        search_queries=4,
        topk=5,
        repeats=1,
        warmup=0,
    )
    first = execute(stages()["latency"], cfg, log=print)
    assert (first.done, first.details["rows"]) == (2, 2 * 2 + 2 * 2 * 2)
    again = execute(stages()["latency"], cfg, log=print)
    assert (again.done, again.skipped) == (0, 2)  # nothing new: nothing measured
    execute(stages()["latency"], cfg.model_copy(update={"lengths": [8], "kinds": ["encode"]}), log=print)
    with StoreSQL(ArtifactStore(cfg.root)) as db:
        _, enc = db.query(
            "SELECT setting, length, k, readout, system, device_name, threads, dtype FROM encode_latency "
            "ORDER BY setting, length, k"
        )
        _, search = db.query("SELECT docs, kq, kp, mode, engine FROM search_latency ORDER BY kq, engine, docs")
        _, latest = db.query("SELECT length, k, setting, measured_at FROM encode_latency_latest ORDER BY length, k")
        _, newest = db.query("SELECT setting FROM encode_latency ORDER BY measured_at DESC LIMIT 1")
    assert len({r[0] for r in enc}) == 2 and len(enc) == 4 + 2  # two settings side by side, never mixed
    # the newest measurement of each point: length 8 from the second setting, 16 from the first
    assert [(n, k) for n, k, _, _ in latest] == [(8, 1), (8, 4), (16, 1), (16, 4)]
    assert [s == newest[0][0] for _, _, s, _ in latest] == [True, True, False, False]
    assert {r[3] for r in enc} == {"diffretriever"} and all(r[4] == first.system and r[5] and r[6] >= 1 for r in enc)
    assert search == [
        (n, kq, kp, mode, engine)
        for kq, kp, mode in ((1, 1, "single_dense"), (2, 3, "multi_dense"))
        for engine in ("exact", "lance")
        for n in (10, 100)
    ]
    from diffret.retrieval.analysis.report import build_report

    with StoreSQL(ArtifactStore(cfg.root)) as db:
        rep = build_report(db, name="latency", n_boot=10)
    body = dict(rep.sections)["Latency (Figures 1 and 3)"]
    assert "fig3_encode_latency.png" in body and "fig3_search_latency.png" in body
    assert all(rep.files[f][:4] == b"\x89PNG" for f in ("fig3_encode_latency.png", "fig3_search_latency.png"))


def test_a_budget_the_readout_cannot_take_is_refused_before_any_model_loads(tmp_path: Path) -> None:
    from diffret.retrieval.models.backbones import BackboneConfig
    from diffret.stages import execute, stages
    from diffret.stages.latency import LatencyConfig

    cfg = LatencyConfig(
        root=str(tmp_path),
        backbone=BackboneConfig(model=str(tmp_path / "absent")),
        readout={"readout": "diffembed"},
        k=[1, 4],
    )
    with pytest.raises(ValueError, match="one vector per text"):
        execute(stages()["latency"], cfg, log=print)
    with pytest.raises(ValueError, match="K_qxK_p"):
        LatencyConfig(root=str(tmp_path), search_k=["4,16"])


def test_both_ways_times_one_checkpoint_as_the_two_systems_their_runs_name() -> None:
    from diffret.retrieval.models.backbones import BackboneConfig
    from diffret.stages.latency import LatencyConfig

    bb = BackboneConfig(model="org/m", family="dream", mask_token="<m>")
    for first in ("diffretriever", "promptreps"):
        cfg = LatencyConfig(backbone=bb, readout={"readout": first}, both_ways=True)
        got = {s.readout.readout: (s.backbone.family, s.backbone.mask_token) for s in cfg.settings()}
        # PromptReps decodes causally and reads no mask: the system `diffret run --readout promptreps` names
        assert got == {"diffretriever": ("dream", "<m>"), "promptreps": ("causal", None)}
        assert cfg.settings()[0].readout.readout == first
    assert [s.readout.readout for s in LatencyConfig(backbone=bb).settings()] == ["diffretriever"]
    with pytest.raises(ValueError, match="both_ways compares"):
        LatencyConfig(backbone=bb, readout={"readout": "diffembed"}, both_ways=True).settings()


def test_figure_1_and_the_ratio_table_from_hand_built_rows(tmp_path: Path) -> None:
    """Two systems of one checkpoint (--both-ways: search timed once, with the first), test metrics for both: each
    gets its (1, 1) and multi point, the second's cost taking the first's search of the same width and machine."""
    import pyarrow as pa
    from test_analysis import put_metrics

    from diffret.retrieval.analysis.report import build_report, cost_points
    from diffret.storage import ArtifactStore, Manifest
    from diffret.storage.layout import (
        ENCODE_LATENCY_FILE,
        ENCODE_LATENCY_SCHEMA,
        SEARCH_LATENCY_FILE,
        SEARCH_LATENCY_SCHEMA,
        latency_dir,
    )
    from diffret.storage.sql import StoreSQL

    store = ArtifactStore(str(tmp_path))
    machine = {"device": "cpu", "device_name": "cpu X", "threads": 1, "hidden": 8}

    def put(system: str, kind: str, rows: list[dict]) -> None:
        name, schema = (
            (ENCODE_LATENCY_FILE, ENCODE_LATENCY_SCHEMA)
            if kind == "encode"
            else (SEARCH_LATENCY_FILE, SEARCH_LATENCY_SCHEMA)
        )
        table = pa.Table.from_pylist([{**r, **machine, "system": system} for r in rows], schema=schema)
        with store.folder_writer(latency_dir(system, kind, "s"), Manifest.new("latency", {}, {})) as w:
            w.write_parquet(name, schema, [table])

    ar, one = "m-promptreps-0000000000", "m-diffretriever-0000000000"
    for system, readout, ms in ((ar, "promptreps", {1: 10.0, 4: 40.0}), (one, "diffretriever", {1: 8.0, 4: 9.0})):
        put(
            system,
            "encode",
            [
                {
                    "model": "org/m",
                    "readout": readout,
                    "family": "causal",
                    "side": "query",
                    "length": n,
                    "batch_size": 1,
                    "k": k,
                    "median_ms": v + n,
                    "slots": k,
                }
                for k, v in ms.items()
                for n in (16, 64)
            ],
        )
        for kq, kp, value in ((1, 1, 0.2), (4, 4, 0.3)):
            put_metrics(store, system, "d", "test", kq, kp, "multi_dense", {"q1": value, "q2": value + 0.1})
    put(
        ar,
        "search",
        [
            {
                "engine": "exact",
                "index_type": "",
                "mode": "x",
                "docs": n,
                "kq": kq,
                "kp": kp,
                "queries": 4,
                "median_ms": float(n * kq * kp) / 1000,
            }
            for n in (100, 1000)
            for kq, kp in ((1, 1), (4, 4))
        ],
    )
    with StoreSQL(store) as db:
        points = cost_points(db)
        rep = build_report(db, name="latency", n_boot=10)
    # query encoding at length 16 (nearest 32) + exact search of the largest index (1000 documents)
    assert [(p["system"], p["kq"], p["kp"], p["ms"], p["ndcg_10"]) for p in points] == [
        (one, 1, 1, 8.0 + 16 + 1.0, 0.25),
        (one, 4, 4, 9.0 + 16 + 16.0, 0.35),
        (ar, 1, 1, 10.0 + 16 + 1.0, 0.25),
        (ar, 4, 4, 40.0 + 16 + 16.0, 0.35),
    ]
    ratios = rep.files["ar_over_one_pass.csv"].decode().splitlines()
    assert ratios[0].startswith("ar_model,one_pass_model,side,batch_size,length,k,")
    assert [r.split(",")[4:6] + [r.split(",")[9]] for r in ratios[1:]] == [
        ["16", "1", str(round(26 / 24, 2))],
        ["64", "1", str(round(74 / 72, 2))],
        ["16", "4", str(round(56 / 25, 2))],
        ["64", "4", str(round(104 / 73, 2))],
    ]
    assert rep.files["fig1_cost_effect.png"][:4] == b"\x89PNG"
