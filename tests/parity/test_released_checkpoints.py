"""Released DiffRetriever checkpoints (the ``ielabgroup/diffretriever-*`` layout: a LoRA adapter, the retriever's
settings, the tokenizer) built on the tiny Dream and LLaDA checkpoints: diffret loads them natively and gives the
reference code path's vectors; ``diffret run --model FOLDER`` takes the trained (K_q, K_p) and prompt by itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import NLTK_DATA, REPO, SHARED
from released_build import build

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]

MODELS = {fam: SHARED / "models" / f"tiny-{fam}-random" for fam in ("dream", "llada")}
MINI = SHARED / "fixtures" / "reference-parity" / "scifact-mini"
TF4 = os.environ.get("DIFFRET_TRANSFORMERS4")  # a transformers 4.57 side install (see .ci/run)
BUDGETS = {"dream": (4, 2), "llada": (1, 1)}  # (K_q, K_p) each checkpoint is "trained" at


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    if not all((m / "config.json").exists() for m in MODELS.values()) or not MINI.is_dir():
        pytest.skip("../shared/models/tiny-{dream,llada}-random or the scifact-mini fixture are absent")
    root = tmp_path_factory.mktemp("released")
    return {fam: build(MODELS[fam], root / fam, fam, *BUDGETS[fam]) for fam in MODELS}


def _texts() -> dict[str, list[str]]:
    queries = [json.loads(line)["text"] for line in (MINI / "queries.jsonl").read_text().splitlines()[:5]]
    docs = [json.loads(line) for line in (MINI / "corpus.jsonl").read_text().splitlines()[:3]]
    return {"query": queries, "passage": [f"{d['title']}. {d['text']}" for d in docs]}


def _diffret(folder, texts, base=None):  # noqa: ANN001, ANN202
    """diffret's encodings of ``texts`` with the released checkpoint (or, with ``base``, that model without the
    adapter, read with the checkpoint's prompt)."""
    from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
    from diffret.retrieval.models.readouts import make_reader
    from diffret.retrieval.models.released import read_released
    from diffret.stages.systems import EncodeSettings

    cfg = BackboneConfig(model=str(folder), device="cpu")
    settings = EncodeSettings(backbone=cfg)
    bb = load_backbone(cfg if base is None else BackboneConfig(model=str(base), device="cpu"))
    bb.source = settings.backbone.model_copy(update={"adapter": str(folder)})  # the prompt ids' checkpoint
    reader = make_reader(bb, settings.readout, 256)
    ckpt = read_released(str(folder))
    out = {}
    for side, items in texts.items():
        toks = [bb.tokenizer(t, add_special_tokens=False)["input_ids"] for t in items]
        out[side] = [reader.encode([tk], [t], side, ckpt.budget(side))[0] for tk, t in zip(toks, items, strict=True)]
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_native_loading_gives_the_reference_code_paths_vectors(released, family, tmp_path):
    if not TF4:
        pytest.skip("DIFFRET_TRANSFORMERS4 (a transformers 4.57 install, as .ci/run makes) is not set")
    texts = _texts()
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([TF4, str(REPO)]),
        "HF_HUB_OFFLINE": "1",
        "NLTK_DATA": str(NLTK_DATA),
    }
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "parity" / "released_reference.py"),
            str(released[family]),
            str(tmp_path / "texts.json"),
            str(tmp_path / "ref.npz"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["transformers"].startswith("4.")
    ref = np.load(tmp_path / "ref.npz")
    ours = _diffret(released[family], texts)
    plain = _diffret(released[family], texts, base=MODELS[family])
    adapter_changes = False
    for side, encs in ours.items():
        for i, e in enumerate(encs):
            want = ref[f"{side}_dense"][i]
            assert e.dense.shape == want.shape, (side, i, e.dense.shape, want.shape)
            assert float((_unit(e.dense) * _unit(want)).sum(-1).min()) >= 0.9999, (side, i)
            ids, vals = ref[f"{side}_ids_{i}"], ref[f"{side}_vals_{i}"]
            got = dict(zip(e.sparse_ids.tolist(), np.round(e.sparse_weights * 100).tolist(), strict=True))
            assert sorted(got) == sorted(ids.tolist()), (side, i)
            assert [got[j] for j in ids.tolist()] == vals.tolist(), (side, i)
            base = plain[side][i]
            adapter_changes |= float((_unit(e.dense) * _unit(base.dense)).sum(-1).min()) < 0.999
    assert adapter_changes, "the adapter changed no vector: the comparison would not see it dropped"


def test_run_takes_the_checkpoints_budget_prompt_and_records_its_fingerprint(released, tmp_path):
    from typer.testing import CliRunner

    from diffret.flows.cli import app
    from diffret.retrieval.models.released import released_fingerprint
    from diffret.stages.systems import list_systems
    from diffret.storage import ArtifactStore

    folder, root = released["dream"], str(tmp_path / "store")
    res = CliRunner().invoke(
        app,
        [
            "run",
            "-d",
            "mini",
            "--source",
            str(MINI),
            "--model",
            str(folder),
            "--no-bm25",
            "--root",
            root,
            "--batch-size",
            "8",
        ],
    )
    assert res.exit_code == 0, res.output
    store = ArtifactStore(root)
    ((record, stats),) = [(r, st) for r, st in list_systems(store) if r.kind == "encoder"]
    assert record.settings["readout"]["prompt"] == "checkpoint" and record.settings["readout"]["finetuned"] == "yes"
    assert stats["weights"]["adapter_weights"] == released_fingerprint(str(folder))
    cells = {
        (p["kq"], p["kp"])
        for p in (store.read_manifest(s).partition for s in store.folders(f"runs/system={record.system}/*/*/*/*/*"))
    }
    assert cells == {("4", "2")}
    encoded = {tuple(s.split("/")[3:5]) for s in store.folders(f"encodings/system={record.system}/*/*/*")}
    assert encoded == {("side=passage", "k=2"), ("side=query", "k=4")}
