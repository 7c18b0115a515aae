"""Every numeric setting of every stage is finite and in range, refused before anything is written: the cases are
generated from the configs (every registered stage's, the pipeline's), every int or float field, a list's items and
the settings nested in a config (cluster, backbone, readout, BM25, training) included. NaN, +inf and -inf (as numbers
and as the text the command line passes) and a value just outside each declared bound are a ValidationError naming
the field; every numeric setting declares its lower bound. Through the CLI, `diffret fuse --weight nan` (or inf, or
all weights 0) exits 2 with one line and writes nothing.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from pathlib import Path

import annotated_types as at
import pytest
import yaml
from conftest import write_beir
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from typer.testing import CliRunner

from diffret.flows.cli import app
from diffret.flows.runner import flows
from diffret.stages import stages
from diffret.stages.pipeline import PipelineConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {name: st.config for name, st in stages().items()} | {"run": PipelineConfig}


def _base_data() -> dict[str, dict]:
    """A valid config of each stage: its Prefect deployment's parameters (prefect.yaml, validated by test_commands)."""
    by_flow = {f"{module}:{fn}": stage for stage, (module, fn) in flows().items()}
    by_flow["diffret.flows.pipeline:pipeline_flow"] = "run"
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    return {by_flow[d["entrypoint"]]: d["parameters"]["config"] for d in deployments}


BASE = _base_data()


def _strip(annotation: object) -> tuple[object, list]:
    """(the type, its constraints) of ``X``, ``X | None``, ``Annotated[X, ...]``."""
    found: list = []
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            annotation, *meta = typing.get_args(annotation)
            found += meta
        elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation, found
            annotation = args[0]
        else:
            return annotation, found


def _bounds(meta: list) -> dict[str, float]:
    """``{"ge": 1, "le": 100, ...}`` from a field's or an item's constraints."""
    out: dict[str, float] = {}
    for m in meta:
        if isinstance(m, FieldInfo):
            out.update(_bounds(m.metadata))
        for kind in ("ge", "gt", "le", "lt"):
            if isinstance(m, getattr(at, kind.capitalize())):
                out[kind] = getattr(m, kind)
    return out


def numeric_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple]:
    """(path, number type, bounds, is a list) of every numeric setting of ``model``, nested settings included."""
    out = []
    for name, info in model.model_fields.items():
        typ, meta = _strip(info.annotation)
        meta = [*info.metadata, *meta]
        path = (*prefix, name)
        if inspect.isclass(typ) and issubclass(typ, BaseModel):
            out += numeric_fields(typ, path)
        elif typing.get_origin(typ) is list:
            item, item_meta = _strip(typing.get_args(typ)[0])
            if item in (int, float):
                out.append((path, item, _bounds(item_meta), True))
        elif typ in (int, float):
            out.append((path, typ, _bounds(meta), False))
    return out


CASES = [(stage, *f) for stage, cls in CONFIGS.items() for f in numeric_fields(cls)]
IDS = [f"{stage}:{'.'.join(path)}" for stage, path, *_ in CASES]


def _with(stage: str, path: tuple[str, ...], value: object) -> dict:
    """The stage's valid config with ``value`` at ``path`` (nested settings made from their defaults)."""
    data = CONFIGS[stage].model_validate(BASE[stage]).model_dump(mode="json")
    node = data
    for key in path[:-1]:
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
    node[path[-1]] = value
    return data


def refused(stage: str, path: tuple[str, ...], value: object) -> str:
    """The error of ``value`` at ``path``, which must be a ValidationError located at that field."""
    with pytest.raises(ValidationError) as caught:
        CONFIGS[stage].model_validate(_with(stage, path, value))
    located = [e for e in caught.value.errors() if [x for x in e["loc"] if x in path] == list(path)]
    assert located, (stage, path, value, caught.value.errors())
    return located[0]["msg"]


def outside(kind: str, bound: float, typ: type) -> float:
    """The nearest value outside a bound (``ge=1`` -> 0 for an int, the float just below 1 for a float)."""
    if kind == "gt" or kind == "lt":
        return bound
    step = -1 if kind == "ge" else 1
    return bound + step if typ is int else math.nextafter(bound, step * math.inf)


def test_the_cases_cover_every_stage_and_the_nested_settings() -> None:
    found = {i.split(":")[0] for i in IDS}
    assert {"fuse", "bm25", "train", "train-reranker", "evaluate", "score", "latency", "run"} <= found
    for case in (
        "fuse:weights",
        "bm25:bm25.k1",
        "bm25:bm25.b",
        "train:settings.lr",
        "encode:readout.denoise_steps",
        "evaluate:workers",
        "score:kq",
        "late:depths",
        "compare:alpha",
    ):
        assert case in IDS, case
    assert len(CASES) > 150


@pytest.mark.parametrize(("stage", "path", "typ", "bounds", "is_list"), CASES, ids=IDS)
def test_a_number_that_is_not_finite_or_out_of_range_is_refused(
    stage: str, path: tuple, typ: type, bounds: dict, is_list: bool
) -> None:
    wrap = (lambda v: [v]) if is_list else (lambda v: v)
    for bad in (math.nan, math.inf, -math.inf, "nan", "inf", "-inf"):
        refused(stage, path, wrap(bad))
    assert "ge" in bounds or "gt" in bounds, f"{stage}: {'.'.join(path)} declares no lower bound"
    for kind, bound in bounds.items():
        refused(stage, path, wrap(outside(kind, bound, typ)))
        inside = bound if kind in ("ge", "le") else outside({"gt": "le", "lt": "ge"}[kind], bound, typ)
        try:  # the bound itself (or the nearest value inside) is not what refuses it
            CONFIGS[stage].model_validate(_with(stage, path, wrap(inside)))
        except ValidationError as exc:
            assert not [
                e
                for e in exc.errors()
                if e["type"].startswith(("greater_than", "less_than", "finite"))
                and [x for x in e["loc"] if x in path] == list(path)
            ], exc


# ------------------------------------------------------------------------------------------ through the CLI
@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny store with two imported runs to fuse."""
    base = tmp_path_factory.mktemp("fuse")
    docs = [f"d{i}" for i in range(4)]
    src = write_beir(
        base / "tiny",
        [{"_id": d, "title": "", "text": f"text {d}"} for d in docs],
        [{"_id": "q1", "text": "query"}],
        {"test": [("q1", "d1", 1)]},
    )
    root = base / "store"
    for args in (
        ["download", "tiny", "--source", str(src)],
        *(
            ["import-run", str(_trec(base / f"{n}.trec", order)), "-d", "tiny", "--name", n]
            for n, order in (("a", docs), ("b", docs[::-1]))
        ),
        *(  # runs that score every document of the query alike
            ["import-run", str(_trec(base / f"{n}.trec", order, flat=True)), "-d", "tiny", "--name", n]
            for n, order in (("flat1", docs), ("flat2", docs[::-1]))
        ),
    ):
        res = CliRunner().invoke(app, [*args, "--root", str(root)])
        assert res.exit_code == 0, res.output
    return root


def _trec(path: Path, docs: list[str], flat: bool = False) -> Path:
    path.write_text("".join(f"q1 Q0 {d} {r + 1} {5 if flat else 10 - r} x\n" for r, d in enumerate(docs)))
    return path


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("weights", "says"),
    [
        (["nan", "1"], "weights.0: Input should be a finite number"),
        (["1", "inf"], "weights.1: Input should be a finite number"),
        (["-inf", "1"], "weights.0: Input should be a finite number"),
        (["0", "0"], "are all 0"),
        (["1e-320", "0"], "are all 0 in the fused run's float32 scores (the largest, 1e-320, is below"),
        (["1e-40", "1e-45"], "are all 0 in the fused run's float32 scores"),
        (["-1", "2"], "weights.0: Input should be greater than or equal to 0"),
    ],
)
def test_fuse_refuses_a_weight_that_is_not_finite_or_all_zero_and_writes_nothing(
    store: Path, weights: list[str], says: str
) -> None:
    before = _files(store)
    args = ["fuse", "-d", "tiny", "--run", "a", "--run", "b", "--name", "w"]
    for w in weights:
        args += ["--weight", w]
    res = CliRunner().invoke(app, [*args, "--root", str(store)])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], res.output
    assert _files(store) == before
    res = CliRunner().invoke(app, [*args[:-4], "--weight", "1", "--weight", "3", "--root", str(store)])
    assert res.exit_code == 0, res.output  # finite weights, not all 0: fused


def test_fuse_refuses_runs_whose_fusion_scores_every_document_alike_and_writes_nothing(store: Path) -> None:
    """Runs whose scores are constant within each query fuse to 0 for every document (min-max normalisation):
    refused in one line before anything is written; a normal run beside them fuses."""
    before = _files(store)
    args = ["fuse", "-d", "tiny", "--run", "flat1", "--run", "flat2", "--name", "flat", "--root", str(store)]
    res = CliRunner().invoke(app, args)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert res.exit_code != 0 and len(errors) == 1, res.output
    assert "scores every document of each query alike (0)" in " ".join(res.output.split()), res.output
    assert _files(store) == before
    res = CliRunner().invoke(app, [*args[:5], "--run", "a", *args[7:]])
    assert res.exit_code == 0, res.output
