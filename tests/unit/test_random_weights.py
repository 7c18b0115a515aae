"""Random weights (``--load-format random``, ``--shape``): a network built without a weight file, labelled as random
weights wherever its numbers appear (its slug, ``diffret systems``, every summary and report), so that none is taken
for a result; its config's hashes as before when the option is not used; the published shapes' sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import write_beir
from tiny_models import save_tiny_mlm
from typer.testing import CliRunner

from diffret.flows.cli import app
from diffret.retrieval.models.backbones import FAMILIES, BackboneConfig, load_backbone
from diffret.retrieval.models.backbones.shapes import shape_config

pytestmark = pytest.mark.usefixtures("one_thread")

CORPUS = [{"_id": f"d{i}", "title": f"t{i}", "text": f"passage {i} about word{i} and tea"} for i in range(12)]
QUERIES = [{"_id": f"q{i}", "text": f"what about word{i}"} for i in range(3)]
QRELS = {"test": [(f"q{i}", f"d{i}", 1) for i in range(3)]}


def invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output


def ok(*args: str) -> str:
    code, out = invoke(*args)
    assert code == 0, (args, out)
    return out


def weightless_mlm(folder: Path) -> Path:
    """A tiny BERT folder with its config and tokenizer but no weight file."""
    save_tiny_mlm(folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    return folder


def test_a_random_weight_system_is_labelled_in_systems_summary_and_report(tmp_path: Path) -> None:
    model = weightless_mlm(tmp_path / "model")
    beir = write_beir(tmp_path / "c", CORPUS, QUERIES, QRELS)
    r = ["--root", str(tmp_path / "store")]
    out = ok(
        "run",
        "-d",
        "c",
        "--source",
        str(beir),
        "--model",
        str(model),
        "--load-format",
        "random",
        "--kq",
        "1",
        "--kp",
        "1",
        "--max-length",
        "32",
        "--mode",
        "single_dense",
        "--split",
        "test",
        *r,
    )
    assert "warning: " in out and "RANDOM WEIGHTS (load format random" in out, out  # after the leaderboard
    listing = json.loads(ok("systems", "--format", "json", *r))
    enc = next(s for s in listing if s["kind"] == "encoder")
    assert enc["system"].startswith("random-model-diffretriever-"), enc
    assert enc["weights"] == "RANDOM (the folder's shape)" and '"load_format": "random"' in enc["settings"]
    assert next(s for s in listing if s["kind"] == "bm25")["weights"] == ""
    assert "RANDOM (the folder's shape)" in ok("systems", *r)  # the table says it too
    folder = next((tmp_path / "store" / "summaries").glob(f"system={enc['system']}/dataset=c/split=test"))
    page = (folder / "summary.md").read_text()
    assert page.startswith(f"# c / test: `{enc['system']}` (RANDOM WEIGHTS)"), page
    assert f"**Warning**: {enc['system']} has RANDOM WEIGHTS" in page, page
    manifest = json.loads((folder / "_manifest.json").read_text())
    assert any("RANDOM WEIGHTS" in w for w in manifest["stats"]["warnings"])
    out = ok("report", "--n-boot", "10", *r)
    assert "warning: " in out and f"{enc['system']} has RANDOM WEIGHTS" in out, out
    report = next((tmp_path / "store" / "reports").glob("report=default")) / "report.md"
    head = report.read_text().split("\n- [", 1)[0]  # the lines under the title, before the contents
    assert f"**Warning**: {enc['system']} has RANDOM WEIGHTS" in head, head
    # the same folder's checkpoint is another system; a shape without random weights is refused before any work
    code, out = invoke("encode", "-d", "c", "--model", str(model), "--shape", "dream-7b", "--k", "1", *r)
    assert code == 2 and "--shape dream-7b is a shape for random weights: add --load-format random" in out, out


def test_random_weights_are_seeded_and_built_on_the_device_in_its_dtype(tmp_path: Path) -> None:
    model = weightless_mlm(tmp_path / "model")
    cfg = BackboneConfig(model=str(model), load_format="random", device="cpu", dtype="bfloat16")
    a, b = load_backbone(cfg), load_backbone(cfg)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa) and a.dtype == torch.bfloat16 and a.device.type == "cpu"
    emb = pa["bert.embeddings.word_embeddings.weight"].detach().float()
    assert 0.015 < float(emb.std()) < 0.025  # N(0, initializer_range)
    # a checkpoint's config dumps as before the option existed: every stored hash that holds it is unchanged
    plain = BackboneConfig(model=str(model)).model_dump()
    assert "load_format" not in plain and "shape" not in plain
    assert BackboneConfig.model_validate(cfg.model_dump()) == cfg


def test_the_published_shapes_have_their_models_sizes() -> None:
    import transformers

    sizes = {}
    for name, family in (("dream-7b", "dream"), ("llada-8b", "llada")):
        native = FAMILIES[family].native
        with torch.device("meta"):  # no memory: the shapes alone
            m = getattr(transformers, native.model_class)(native.config(shape_config(name)))
        sizes[name] = (sum(p.numel() for p in m.parameters()), m.config.hidden_size)
    assert sizes == {"dream-7b": (7_615_616_512, 3584), "llada-8b": (8_015_581_184, 4096)}
    with pytest.raises(ValueError, match="has no field 'layers'"):
        shape_config("dream-7b:layers=2")


def empty_folders(root: Path) -> list[str]:
    """The folders under ``root`` that hold no file at any depth."""
    return sorted(
        str(d.relative_to(root)) for d in root.rglob("*") if d.is_dir() and not any(f.is_file() for f in d.rglob("*"))
    )


@pytest.mark.parametrize("shape, family", [("dream-7b", "Dream"), ("llada-8b", "llada")])
def test_a_full_size_shape_the_device_cannot_hold_is_refused_before_tokenizing(
    tmp_path: Path, monkeypatch, shape: str, family: str
) -> None:
    """`--load-format random --shape dream-7b` where the device's free memory (patched: 1 GiB) cannot hold the
    network's parameters in its dtype: one line with the bytes needed and free, before anything is tokenized."""
    from diffret.retrieval import devices

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["x"], "model_type": family}))  # the family only
    beir = write_beir(tmp_path / "c", CORPUS, QUERIES, QRELS)
    root = tmp_path / "store"
    ok("download", "c", "--source", str(beir), "--root", str(root))
    monkeypatch.setattr(devices, "free_memory", lambda device: 2**30)
    code, out = invoke(
        "encode", "-d", "c", "--model", str(model), "--load-format", "random", "--shape", shape,
        "--dtype", "bfloat16", "--device", "cpu", "--k", "1", "--root", str(root),
    )  # fmt: skip
    need = {"dream-7b": 7_615_616_512, "llada-8b": 8_015_581_184}[shape] * 2
    assert code == 2, out
    line = " ".join(out.split())  # the terminal may wrap it
    assert f"random weights of shape {shape} need {need:,} bytes" in line, out
    assert f"but cpu has {2**30:,} bytes free" in line, out
    assert not (root / "tokens").exists() and not (root / "encodings").exists()
    assert empty_folders(root) == []


def test_a_failed_encode_leaves_no_empty_folder(tmp_path: Path, monkeypatch) -> None:
    """A random-weight encode that fails after it opened its encodings folders (the network cannot be built: the
    device's free memory, read again at load time, is gone): exit 2 in one line, the tokens kept, and none of the
    folders it opened is left behind, empty or holding only empty folders."""
    from diffret.retrieval import devices

    model = weightless_mlm(tmp_path / "model")
    beir = write_beir(tmp_path / "c", CORPUS, QUERIES, QRELS)
    root = tmp_path / "store"
    ok("download", "c", "--source", str(beir), "--root", str(root))
    reads: list[int] = []

    def shrinking(device):  # noqa: ANN001, ANN202 - enough when planned, nothing left when the network is built
        reads.append(1)
        return 2**40 if len(reads) == 1 else 1

    monkeypatch.setattr(devices, "free_memory", shrinking)
    code, out = invoke(
        "encode", "-d", "c", "--model", str(model), "--load-format", "random", "--device", "cpu",
        "--k", "1,2", "--max-length", "32", "--root", str(root),
    )  # fmt: skip
    assert code == 2 and "bytes free" in out and len(reads) == 2, out
    assert list((root / "tokens").rglob("*.parquet")), "the tokens are kept"
    assert not (root / "encodings").exists() and not (root / "systems").exists()
    assert empty_folders(root) == []
