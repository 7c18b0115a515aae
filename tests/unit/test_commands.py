"""One declaration per stage. Every stage's command is generated from its config: its --help lists every
field (nested configs flattened) with the field's description and default, and nothing else but --root, --force
and --prefect; prefect.yaml's deployments validate against the same configs; every config field is described."""

from __future__ import annotations

import importlib
import inspect
import re
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined
from typer.testing import CliRunner

from diffret.flows.cli import app
from diffret.flows.runner import flows
from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.models.readouts import SIDR_ONLY, ReadoutConfig
from diffret.stages import stages
from diffret.stages.encode import EncodeConfig
from diffret.stages.pipeline import PipelineConfig
from diffret.stages.systems import EncodeSettings, SystemRef, numeric_settings

REPO = Path(__file__).resolve().parents[2]
COMMANDS = {stage: stage for stage in stages()}
CONFIGS = {name: st.config for name, st in stages().items()} | {"encode": EncodeConfig, "run": PipelineConfig}


def command_of(stage: str) -> str:
    return "run" if stage == "run" else COMMANDS[stage]


def _inner(annotation):  # noqa: ANN001, ANN202
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def expected_fields(model: type[BaseModel]) -> dict[str, tuple[str, object]]:
    """Option name -> (description, default) of every leaf field, nested configs flattened: what the
    generated --help must show (written from the field declarations, not from the generator)."""
    out = {}
    for name, info in model.model_fields.items():
        inner = _inner(info.annotation)
        cli = (info.json_schema_extra or {}).get("cli", {}) if isinstance(info.json_schema_extra, dict) else {}
        if inner is SystemRef:
            out["--system"] = (info.description, None)
            keys = numeric_settings(EncodeSettings(backbone={"model": "x"}))
            keys |= numeric_settings(EncodeSettings(backbone={"model": "x", "load_format": "random"}))  # + shape
            owners = [
                (BackboneConfig, ["model", *(k for k in keys if k in BackboneConfig.model_fields)]),
                (ReadoutConfig, [*keys["readout"], *SIDR_ONLY]),  # SIDR's settings tell SIDR systems apart
                (EncodeSettings, [k for k in EncodeSettings.model_fields if k not in ("backbone", "readout")]),
            ]
            for cls, names in owners:
                for n in names:
                    out["--" + n.replace("_", "-")] = (cls.model_fields[n].description, None)
        elif inspect.isclass(inner) and issubclass(inner, BaseModel):
            out.update(expected_fields(inner))
        elif "switch" in cli:
            out[next(iter(cli["switch"]))] = (info.description, None)
        elif cli.get("positional"):
            out[name.upper()] = (info.description, info.default)
        else:
            out[cli.get("flag", "--" + name.replace("_", "-"))] = (info.description, info.default)
    return out


def help_segments(command: str) -> dict[str, str]:
    """Option name -> the text the --help shows beside it (description, default), from a wide rendering (one line
    per option: ``  -d, --dataset <str>  help [default: x]``)."""
    res = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "1000"})
    assert res.exit_code == 0, res.output
    segments: dict[str, str] = {}
    for line in res.output.splitlines():
        m = re.match(r"^  (?:-[a-z], )?(--[a-z0-9-]+|[a-z_]+(?= <))(?: / --no-[a-z0-9-]+)?(?: <[^>]*>)?  (.*)$", line)
        if m:
            name = m.group(1) if m.group(1).startswith("--") else m.group(1).upper()  # an argument: NAME
            segments[name] = m.group(2)
    return {k: " ".join(v.split()) for k, v in segments.items()}


@pytest.mark.parametrize("stage", list(CONFIGS))
def test_help_lists_every_field_with_its_description_and_default(stage: str) -> None:
    expected = expected_fields(CONFIGS[stage])
    shown = help_segments(command_of(stage))
    allowed = {"--root", "--force", "--prefect", "--help"} | ({"--dry-run"} if stage == "run" else set())
    assert set(shown) - set(expected) - allowed == set(), "options beside the config's"
    assert set(expected) - set(shown) == set(), "config fields without an option"
    for name, (description, default) in expected.items():
        text = shown[name]
        words = " ".join((description or "").split())[:40]
        assert words and words in text, (stage, name, words, text)
        if default not in (None, PydanticUndefined) and not isinstance(default, BaseModel | dict | bool):
            value = (
                ",".join(map(str, default))
                if isinstance(default, list) and all(isinstance(x, int) for x in default)
                else default
            )
            if isinstance(default, list) and not all(isinstance(x, int) for x in default):
                assert f"(default: {', '.join(map(str, default))})" in text, (stage, name, text)
            else:
                assert f"default: {value}]" in text, (stage, name, text)  # "[env var: X; default: Y]" too


def _models(model: type[BaseModel], seen: set) -> list[type[BaseModel]]:
    out = [model]
    for info in model.model_fields.values():
        inner = _inner(info.annotation)
        if inspect.isclass(inner) and issubclass(inner, BaseModel) and inner not in seen:
            seen.add(inner)
            out += _models(inner, seen)
    return out


def test_every_config_field_has_a_description() -> None:
    seen: set = set()
    missing = [
        f"{m.__name__}.{n}"
        for cfg in CONFIGS.values()
        for m in _models(cfg, seen)
        for n, info in m.model_fields.items()
        if not (info.description or "").strip()
    ]
    assert missing == []


def test_every_prefect_deployment_validates_against_its_config() -> None:
    by_flow = {f"{module}:{fn}": CONFIGS[stage] for stage, (module, fn) in flows().items()}
    by_flow["diffret.flows.pipeline:pipeline_flow"] = PipelineConfig
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    assert {d["entrypoint"] for d in deployments} == set(by_flow), "a stage without a deployment, or the reverse"
    for d in deployments:
        config = by_flow[d["entrypoint"]].model_validate(d["parameters"]["config"])
        assert config.root, d["name"]
        module, fn = d["entrypoint"].split(":")
        assert getattr(importlib.import_module(module), fn) is not None


def test_a_new_stage_is_a_new_command(tmp_path, monkeypatch) -> None:
    """The generator takes any config: a field declared once gives its option, default and help."""
    from pydantic import Field

    from diffret.flows.commands import config_command
    from diffret.stages.base import StageConfig, cli

    class Toy(StageConfig):
        dataset: str = Field(description="The dataset.", json_schema_extra=cli(short="-d"))
        ks: list[int] = Field(default=[1, 2], description="Budgets.", json_schema_extra=cli(flag="--k"))
        mode: typing.Literal["a", "b"] = Field(default="a", description="A or b.")
        pairs: dict[str, str] = Field(default_factory=dict, description="Names.")

    got = {}

    def body(data: dict, prefect: bool | None = None) -> None:
        got.update(Toy(**data).model_dump())

    import typer

    toy = typer.Typer()
    toy.command("toy")(config_command(Toy, body, name="toy"))
    toy.command("other")(lambda: None)
    res = CliRunner().invoke(toy, ["toy", "-d", "scifact", "--k", "4,16", "--mode", "b", "--root", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert got == {
        "root": str(tmp_path),
        "force": False,
        "dataset": "scifact",
        "ks": [4, 16],
        "mode": "b",
        "pairs": {},
    }  # an omitted mapping is its default, not None
    res = CliRunner().invoke(toy, ["toy", "-d", "x", "--pairs", "a=b", "--pairs", "c=d"])
    assert res.exit_code == 0, res.output
    assert got["pairs"] == {"a": "b", "c": "d"}
    assert CliRunner().invoke(toy, ["toy", "-d", "x", "--mode", "c"]).exit_code == 2  # the Literal's choices


def test_a_value_a_validator_derives_is_not_pinned_by_the_command() -> None:
    """train-reranker's loss defaults to None and is derived from the method (mdlm for the permutation methods):
    the command must pass None on, not the listwise_ce its default instance derived for pointwise."""
    import typer

    from diffret.flows.commands import config_command
    from diffret.stages.train_reranker import TrainRerankerConfig

    got = {}

    def body(data: dict, prefect: bool | None = None) -> None:
        got["config"] = TrainRerankerConfig(**data)

    toy = typer.Typer()
    toy.command("train-reranker")(config_command(TrainRerankerConfig, body, name="train-reranker"))
    toy.command("other")(lambda: None)
    res = CliRunner().invoke(toy, ["train-reranker", "-d", "scifact", "--method", "permutation_sampling"])
    assert res.exit_code == 0, res.output
    assert got["config"].settings.loss == "mdlm"
    assert got["config"].backbone.model == "dllm-hub/ModernBERT-base-chat-v0.1"  # the stage's default backbone


def _fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    """Path -> field info of every field, nested configs flattened (a system reference is one field)."""
    out: dict[tuple[str, ...], object] = {}
    for name, info in model.model_fields.items():
        inner = _inner(info.annotation)
        if inspect.isclass(inner) and issubclass(inner, BaseModel) and inner is not SystemRef:
            out.update(_fields(inner, prefix + (name,)))
        out[prefix + (name,)] = info
    return out


def test_one_spelling_per_setting_across_commands() -> None:
    """An option means one setting in every command, a setting is one option in every command (a list's
    field is named in the plural, its option in the singular), and a field passed on from another config
    (``like``) keeps that config's option: the first stage is --first-kq / --first-kp / --first-mode in late,
    rerank and train-reranker alike, a compressed store --store / --store-seed in encode and compress."""
    from diffret.flows.commands import cli_meta, config_opts
    from diffret.retrieval.fields import origin_of

    configs = _project_configs()
    by_flag: dict[str, set] = {}
    by_name: dict[str, set] = {}
    passed_on = []
    for stage, cls in CONFIGS.items():
        fields = _fields(cls)
        for o in config_opts(cls):
            if o.positional:
                continue
            flag = o.flags[0].split("/")[0]
            if o.ref is not None:  # a filter of the registry by a setting: that setting's name and option
                by_flag.setdefault(flag, set()).add(o.path[-1])
                by_name.setdefault(o.path[-1], set()).add(flag)
                continue
            info = fields[o.path]
            listed = typing.get_origin(_inner(info.annotation)) is list
            name = o.path[-1].removesuffix("s") if listed else o.path[-1]
            by_flag.setdefault(flag, set()).add(name)
            if "switch" in cli_meta(info):  # --full sets a value of its field: an option beside the field's own
                continue
            by_name.setdefault(name, set()).add(flag)
            if origin := origin_of(info):
                owner, field = origin.rsplit(".", 1)
                source = cli_meta(configs[owner].model_fields[field])
                if not source.get("positional"):
                    passed_on.append((command_of(stage), flag, source.get("flag", "--" + field.replace("_", "-"))))
    assert {f: n for f, n in by_flag.items() if len(n) > 1} == {}, "one option, several settings"
    assert {n: f for n, f in by_name.items() if len(f) > 1} == {}, "one setting, several options"
    assert [p for p in passed_on if p[1] != p[2]] == [], "a setting passed on under another option"


def _project_configs() -> dict[str, type[BaseModel]]:
    """Every pydantic model of the project, by name (where a ``like`` field's origin is declared)."""
    out, todo = {}, [BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.split(".")[0] == "diffret":
                out[sub.__qualname__] = sub
    return out


# a renamed option's former spelling, by command, and the option that replaced it
# fmt: off
FORMER_SPELLINGS = [("rerank", "--kq", "--first-kq"), ("rerank", "--kp", "--first-kp"),
                    ("rerank", "--mode", "--first-mode"), ("train-reranker", "--kq", "--first-kq"),
                    ("train-reranker", "--kp", "--first-kp"), ("train-reranker", "--mode", "--first-mode"),
                    ("late", "--m", "--depth"), ("compress", "--to", "--store"), ("compress", "--seed", "--store-seed"),
                    ("latency", "--sides", "--side"), ("latency", "--batch-sizes", "--batch-size")]
# fmt: on
CLI_KEYS = {"flag", "short", "envvar", "positional", "switch", "hidden", "filters_except"}  # read by flows/commands.py


@pytest.mark.parametrize(("command", "old", "new"), FORMER_SPELLINGS)
def test_former_spellings_are_refused(command: str, old: str, new: str) -> None:
    """A renamed option's former spelling is no option of its command (click's usage error, exit 2), in --help
    neither shown nor hidden; the new spelling is."""
    res = CliRunner().invoke(app, [command, old, "1"], env={"COLUMNS": "1000"})
    assert res.exit_code == 2, res.output
    assert f"No such option: {old}" in " ".join(res.output.split())
    shown = help_segments(command)
    assert new in shown and old not in shown


def test_renamed_options_take_their_values() -> None:
    """rerank's first stage is --first-kq / --first-kp / --first-mode and compress's store --store / --store-seed,
    also as a deployment's parameters (their former keys ``to`` / ``seed`` are no field); late's own --kq / --kp /
    --mode are its re-scoring budgets and mode; no field declares a command-line key the commands do not read."""
    import typer
    from pydantic import ValidationError

    from diffret.flows.commands import cli_meta, config_command, config_opts
    from diffret.stages.compress import CompressConfig
    from diffret.stages.late import LateConfig
    from diffret.stages.rerank import RerankConfig

    got = {}
    toy = typer.Typer()
    for name, cls in (("rerank", RerankConfig), ("compress", CompressConfig)):
        toy.command(name)(config_command(cls, lambda data, cls=cls: got.update(cfg=cls(**data)), name=name))
    res = CliRunner().invoke(toy, ["rerank", "--first-kq", "4", "--first-kp", "16", "--first-mode", "multi_dense"])
    assert res.exit_code == 0, res.output
    assert (got["cfg"].first_kq, got["cfg"].first_kp, got["cfg"].first_mode) == (4, 16, "multi_dense")
    res = CliRunner().invoke(toy, ["compress", "-d", "x", "--store", "int8", "--store-seed", "3"])
    assert res.exit_code == 0, res.output
    assert (got["cfg"].store, got["cfg"].store_seed) == ("int8", 3)
    assert CompressConfig.model_validate({"dataset": "x", "store": "pq:8", "store_seed": 2}).store_seed == 2
    with pytest.raises(ValidationError, match="store"):
        CompressConfig.model_validate({"dataset": "x", "to": "pq:8", "seed": 2})  # a deployment's former keys
    late = {o.flags[0]: o.path for o in config_opts(LateConfig)}
    assert (late["--kq"], late["--kp"], late["--mode"]) == (("kq",), ("kp",), ("mode",))
    declared = {k for cls in CONFIGS.values() for info in _fields(cls).values() for k in cli_meta(info)}
    assert declared <= CLI_KEYS, declared - CLI_KEYS
