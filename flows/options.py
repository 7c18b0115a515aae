"""The CLI's shared option group: one ``--option`` per field of the backbone and readout configs (and
``--max-length``), generated from the pydantic models so that a new setting is a new option everywhere.

``settings`` mode (encode, run) gives every option its config default and builds the settings; ``filter``
mode (score, index) defaults every option to unset and turns the ones given into a system lookup
(``--model`` plus the settings that tell stored systems apart), next to ``--system``.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel

from retrieval.models.backbones import BackboneConfig
from retrieval.models.readouts import ReadoutConfig
from stages.systems import EncodeSettings, SystemRef, numeric_settings
from stages.tokenize import DEFAULT_MODEL


@dataclass(frozen=True)
class SettingOpt:
    name: str  # parameter name; the option is --name-with-dashes
    path: str  # where it goes: "backbone.dtype", "readout.prompt", "max_length"
    kind: type  # str, int, float or bool
    optional: bool  # may be None in the config
    default: Any
    help: str


def _kind(annotation: Any) -> tuple[type, bool]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return type(args[0]), False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _kind(inner[0])[0], True
    return annotation, False


def _fields(model: type[BaseModel], prefix: str) -> list[SettingOpt]:
    out = []
    for name, f in model.model_fields.items():
        if model is EncodeSettings and name not in TOP:
            continue
        kind, optional = _kind(f.annotation)
        default = DEFAULT_MODEL if (model is BackboneConfig and name == "model") else f.default
        out.append(SettingOpt(name, f"{prefix}{name}", kind, optional, default, f.description or ""))
    return out


TOP = tuple(n for n in EncodeSettings.model_fields if n not in ("backbone", "readout"))  # max_length, title_sep


def setting_opts() -> list[SettingOpt]:
    return [*_fields(BackboneConfig, "backbone."), *_fields(ReadoutConfig, "readout."), *_fields(EncodeSettings, "")]


def _numeric_paths() -> set[str]:
    """Settings paths that are part of a system's identity (what a stored system can be looked up by)."""
    keys = numeric_settings(EncodeSettings(backbone=BackboneConfig(model="x")))
    out = {f"readout.{k}" for k in keys["readout"]} | set(TOP)
    return out | {f"backbone.{k}" for k in keys if k not in ("readout", "model", *TOP)}


def _param(opt: SettingOpt, filter_mode: bool) -> inspect.Parameter:
    kind = opt.kind | None if (filter_mode or opt.optional) else opt.kind
    flag = "--" + opt.name.replace("_", "-")
    decls = [f"{flag}/--no-{opt.name.replace('_', '-')}"] if opt.kind is bool else [flag]
    help_ = opt.help + (" (filters the stored systems)" if filter_mode else "")
    annotation = Annotated[kind, typer.Option(*decls, help=help_, show_default=not filter_mode)]
    default = None if filter_mode else opt.default
    return inspect.Parameter(opt.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def system_options(mode: Literal["settings", "filter"]) -> Callable[[Callable], Callable]:
    """Add the backbone / readout / max-length options to a typer command.

    The command receives them as one ``settings`` argument: a dict path -> value (in ``filter`` mode only
    the options given, ``--model`` included).
    """
    filter_mode = mode == "filter"
    numeric = _numeric_paths()
    opts = [o for o in setting_opts() if not filter_mode or o.path in numeric or o.name == "model"]

    def collect(kwargs: dict[str, Any]) -> dict[str, Any]:
        values = {o.path: kwargs.pop(o.name) for o in opts}
        return {k: v for k, v in values.items() if v is not None} if filter_mode else values

    return _adding(opts, "settings", collect, filter_mode)


def config_options(model: type[BaseModel], arg: str, exclude: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Add one ``--option`` per field of ``model`` (but ``exclude``) to a typer command, which receives them
    as one ``arg`` dict field -> value (e.g. the train command's ``TrainSettings``)."""
    opts = [o for o in _fields(model, "") if o.name not in exclude]

    def collect(kwargs: dict[str, Any]) -> dict[str, Any]:
        return {o.name: kwargs.pop(o.name) for o in opts}

    return _adding(opts, arg, collect, False)


def _adding(opts: list[SettingOpt], arg: str, collect: Callable[[dict[str, Any]], dict[str, Any]],
            filter_mode: bool) -> Callable[[Callable], Callable]:  # fmt: skip
    def deco(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn, include_extras=True)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()]
        own = [p for p in own if p.name != arg]
        params = own + [_param(o, filter_mode) for o in opts]

        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> Any:
            values = collect(kwargs)
            return fn(**kwargs, **{arg: values})

        wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return deco


def encode_settings(values: dict[str, Any]) -> dict[str, Any]:
    """The ``backbone``, ``readout`` and top-level settings config fields from ``settings``-mode option values."""
    nested: dict[str, Any] = {"backbone": {}, "readout": {}}
    for path, value in values.items():
        group, _, name = path.rpartition(".")
        (nested[group] if group else nested)[name or group] = value
    return {
        "backbone": BackboneConfig(**nested["backbone"]),
        "readout": ReadoutConfig(**nested["readout"]),
        **{name: nested[name] for name in TOP},
    }


def system_ref(system: str | None, values: dict[str, Any]) -> SystemRef:
    """A registry lookup from ``--system`` and ``filter``-mode option values."""
    where = {p.removeprefix("backbone."): v for p, v in values.items() if p != "backbone.model"}
    return SystemRef(system=system, model=values.get("backbone.model"), where=where)
