"""Commands generated from the stages' configs: each setting is declared once, on its pydantic field.

A stage's command has one option per field of its config, nested configs (backbone, readout, training or scoring
settings) flattened: the option's name, type, default, bounds, choices (``Literal``) and help text all come from
the field. What the command line needs beyond that is declared on the field too, in
``json_schema_extra={"cli": {...}}``:

- ``flag``: the option's name when it is not ``--field-name`` (``splits`` -> ``--split``);
- ``short``: a short flag (``-d``); ``envvar``: an environment variable that supplies it;
- ``positional``: an argument, not an option;
- ``switch``: ``{"--full": "full"}``, a flag that sets the field to a value (else its default);
- ``hidden``: not on the command line;
- ``filters_except``: on a :class:`~stages.systems.SystemRef` field, settings not offered as filters (``["store"]``:
  the command has its own ``--store``).

Lists of integers (budgets) are comma-separated (``--kq 1,4,16``), other lists repeat the option (``--split
train --split test``), mappings take ``KEY=VALUE`` (``--finetuned BASE=FT``). A field that names a stored system
(:class:`stages.systems.SystemRef`) becomes ``--system`` plus one option per setting that tells systems apart
(``--model``, ``--dtype``, ``--readout``, ...): a lookup in the registry.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.models.readouts import ReadoutConfig
from diffret.stages.systems import EncodeSettings, SystemRef, numeric_settings


@dataclass
class Opt:
    """One command-line option (or argument) of a config field."""

    path: tuple[str, ...]  # where its value goes in the config: ("settings", "lr")
    param: str  # the Python parameter name (unique in the command)
    flags: list[str]  # ["--dataset", "-d"]; a bool: ["--verify/--no-verify"]
    annotation: Any  # Annotated[type, typer.Option(...)]
    default: Any
    convert: Callable[[Any], Any]
    positional: bool = False
    ref: str | None = None  # part of a SystemRef: "system", "model" or a setting the registry is filtered by


def cli_meta(info: Any) -> dict[str, Any]:
    """A field's command-line declarations (``json_schema_extra={"cli": {...}}``)."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return dict(extra.get("cli") or {})


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of ``X``, ``X | None``, ``Annotated[X, ...]``."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _strip_optional(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip_optional(args[0])[0], True
    return annotation, False


def _count_or_word(annotation: Any) -> tuple[str, ...]:
    """The words of an ``int | Literal[...]`` field (empty for any other type)."""
    args = typing.get_args(annotation)
    if int not in args or len(args) != 2:
        return ()
    (lit,) = [a for a in args if a is not int]
    return tuple(typing.get_args(lit)) if typing.get_origin(lit) is Literal else ()


def _int_or_word(v: Any, words: tuple[str, ...]) -> Any:
    """An option's text as a whole number, or one of ``words`` as is (the config checks it)."""
    if v is None or v in words:
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return v  # the config's validation names it


def _is_model(t: Any) -> bool:
    return inspect.isclass(t) and issubclass(t, BaseModel)


def ints(text: str | None) -> list[int] | None:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (a comma-separated budget list).

    >>> ints("1, 4,16"), ints(None)
    ([1, 4, 16], None)
    """
    if text is None:
        return None
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        out = []
    if not out:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}")
    return out


def pairs(items: list[str] | None) -> dict[str, str] | None:
    """``["A=B", ...]`` -> ``{"A": "B", ...}``.

    >>> pairs(["base=ft"])
    {'base': 'ft'}
    """
    if items is None:
        return None
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key or not sep or not value:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _same(v: Any) -> Any:
    return v


def _switched(v: bool, value: Any, default: Any) -> Any:
    """A switch's setting: ``value`` when the flag is given, else ``default``."""
    return value if v else default


def _given_or(v: Any, fallback: Any) -> Any:
    """An option's value, or ``fallback`` when it is not given."""
    return fallback if v is None else v


def _pairs_or(v: list[str] | None, fallback: Any) -> Any:
    """A KEY=VALUE option's pairs as a dict, or ``fallback`` when it is not given."""
    return fallback if v is None else pairs(v)


def _field_default(info: Any, instance: Any, name: str, plain: Any = None) -> Any:
    """The value a command starts a field from: a nested default's own value where it overrides the class's
    (``plain``: the class built with no arguments), else the field's declared default. A value a validator derives
    (``loss`` None -> the method's) stays derived: passing it on would pin it."""
    if instance is not None and (plain is None or getattr(instance, name) != getattr(plain, name)):
        return getattr(instance, name)
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.default_factory()
    return PydanticUndefined


def leaf_opt(path: tuple[str, ...], info: Any, default: Any, filter_mode: bool = False) -> Opt:
    """The option of one plain field (``default``: the value the command starts from; ``filter_mode``: an
    optional filter of the registry, default unset)."""
    name = path[-1]
    meta = {} if filter_mode else cli_meta(info)
    annotation, optional = _strip_optional(info.annotation)
    origin = typing.get_origin(annotation)
    help_text = " ".join((info.description or "").split())
    if filter_mode:
        help_text += " (filters the stored systems)"
        default, optional = None, True
    long = meta.get("flag", "--" + name.replace("_", "-"))
    flags = [long] + ([meta["short"]] if meta.get("short") else [])
    required = default is PydanticUndefined
    kw: dict[str, Any] = {"help": help_text, "show_default": not required and default is not None}
    if meta.get("envvar"):
        kw["envvar"] = meta["envvar"]
    convert: Callable[[Any], Any] = _same
    if "switch" in meta:  # a flag that sets a value: --full -> adapter = "full"
        ((flag, value),) = meta["switch"].items()
        text = f"{help_text} (sets it to {value!r}; otherwise {default!r})"
        param = flag.removeprefix("--").replace("-", "_")
        return Opt(
            path,
            param,
            [flag],
            Annotated[bool, typer.Option(flag, help=text)],
            False,
            functools.partial(_switched, value=value, default=default),
        )
    if annotation is bool:
        flags = [f"{long}/--no-{long.removeprefix('--')}"] + flags[1:]
        typ: Any = bool | None if optional else bool
    elif origin is Literal:  # typer shows and checks the choices
        typ = annotation | None if optional else annotation
    elif origin is list:
        (inner,) = typing.get_args(annotation) or (str,)
        inner, _ = _strip_optional(inner)
        if inner is int:  # budgets: comma-separated
            typ, convert = str | None, ints
            if isinstance(default, list):
                default = ",".join(map(str, default))
            kw["help"] = help_text + " Comma-separated."
        else:
            typ = list[str] | None  # choices of a list of Literal: checked by the config
            if typing.get_origin(inner) is Literal:
                help_text += f" One of {', '.join(map(str, typing.get_args(inner)))}."
            kw["help"] = help_text + " Repeat the option for several."
            if isinstance(default, list):
                kw["help"] += f" (default: {', '.join(map(str, default))})"
            kw["show_default"] = False
            fallback = None if default is PydanticUndefined else default
            convert = functools.partial(_given_or, fallback=fallback)
            default = None if not required else default
    elif origin in (typing.Union, types.UnionType) and (words := _count_or_word(annotation)):
        # int | Literal["colbert"]: a count or one of the words
        typ, convert = str | None if optional else str, functools.partial(_int_or_word, words=words)
        default = None if default is None else str(default)
    elif origin is dict:
        fallback = None if default is PydanticUndefined else default
        typ, convert = list[str] | None, functools.partial(_pairs_or, fallback=fallback)
        kw["help"] = help_text + " KEY=VALUE; repeat the option for several."
        kw["show_default"] = False
        default = None
    else:
        typ = annotation | None if optional else annotation
    if required:
        kw.pop("show_default", None)
    if meta.get("positional"):
        ann = Annotated[typ, typer.Argument(help=help_text, show_default=kw.get("show_default", True))]
        return Opt(path, name, [], ann, ... if required else default, convert, positional=True)
    return Opt(path, name, flags, Annotated[typ, typer.Option(*flags, **kw)], ... if required else default, convert)


def _numeric_paths() -> list[str]:
    """The settings that tell stored encoder systems apart: "backbone.dtype", "readout.prompt", "max_length", ..."""
    keys = numeric_settings(EncodeSettings.model_validate({"backbone": {"model": "x"}}))
    keys |= numeric_settings(  # and its shape
        EncodeSettings.model_validate({"backbone": {"model": "x", "load_format": "random"}})
    )
    out = [f"backbone.{k}" for k in keys if k not in ("readout", "model", *EncodeSettings.model_fields)]
    sidr = numeric_settings(
        EncodeSettings.model_validate({"backbone": {"model": "x"}, "readout": ReadoutConfig(readout="sidr")})
    )["readout"]
    out += [f"readout.{k}" for k in dict.fromkeys([*keys["readout"], *sidr])]  # the SIDR-only settings too
    return out + [k for k in EncodeSettings.model_fields if k not in ("backbone", "readout")]


def system_ref_opts(path: tuple[str, ...], description: str, skip: Sequence[str] = ()) -> list[Opt]:
    """``--system`` and one filter option per setting that tells stored systems apart (``--model`` first), except
    the settings in ``skip``."""
    text = (
        f"{description} A slug as `diffret systems` lists it (a unique prefix is enough), or name it by "
        "--model and the settings that tell stored systems apart."
    ).strip()
    out = [
        Opt(
            path + ("system",),
            "system",
            ["--system"],
            Annotated[str | None, typer.Option("--system", help=text)],
            None,
            _same,
            ref="system",
        )
    ]
    owners: dict[str, type[BaseModel]] = {"backbone": BackboneConfig, "readout": ReadoutConfig}
    for setting in ["backbone.model", *_numeric_paths()]:
        group, _, name = setting.rpartition(".")
        if name in skip:
            continue
        info = (owners[group] if group else EncodeSettings).model_fields[name]
        o = leaf_opt(path + (name,), info, None, filter_mode=True)
        o.ref = "model" if setting == "backbone.model" else setting.removeprefix("backbone.")
        out.append(o)
    return out


def config_opts(model: type[BaseModel], prefix: tuple[str, ...] = (), instance: Any = None) -> list[Opt]:
    """One :class:`Opt` per field of ``model`` (nested configs flattened), defaults from ``instance`` if given."""
    out: list[Opt] = []
    plain = None
    if instance is not None:
        with contextlib.suppress(ValueError):  # a model with required fields: its instance's values are the defaults
            plain = model()
    for name, info in model.model_fields.items():
        if cli_meta(info).get("hidden"):
            continue
        annotation, _ = _strip_optional(info.annotation)
        default = _field_default(info, instance, name, plain)
        if annotation is SystemRef:
            out += system_ref_opts(
                prefix + (name,), " ".join((info.description or "").split()), cli_meta(info).get("filters_except") or ()
            )
        elif _is_model(annotation):
            out += config_opts(annotation, prefix + (name,), default if isinstance(default, BaseModel) else None)
        else:
            out.append(leaf_opt(prefix + (name,), info, default))
    return out


def _names(o: Opt) -> list[str]:
    return [o.param] + [part for f in o.flags for part in f.split("/")]


def check_unique(opts: Sequence[Opt], where: str, reserved: Sequence[str] = ()) -> None:
    """Refuse two fields that would take the same option (the fix: a ``flag`` on one of them)."""
    seen: dict[str, tuple[str, ...]] = {r: ("the command",) for r in reserved}
    for o in opts:
        for n in _names(o):
            if n in seen and seen[n] != o.path:
                raise TypeError(
                    f"{where}: {n} is declared by {'.'.join(seen[n])} and {'.'.join(o.path)}; give one "
                    "a cli flag in its json_schema_extra"
                )
            seen[n] = o.path


def config_data(opts: Sequence[Opt], values: dict[str, Any]) -> dict[str, Any]:
    """The config's fields (a nested dict) from a command's parameter values."""
    data: dict[str, Any] = {}
    for o in opts:
        value = o.convert(values[o.param])
        if o.ref is None:
            _nested(data, o.path[:-1])[o.path[-1]] = value
            continue
        ref = _nested(data, o.path[:-1])
        if o.ref in ("system", "model"):
            ref[o.ref] = value
        elif value is not None:
            ref.setdefault("where", {})[o.ref] = value
    return data


def _nested(data: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for key in path:
        data = data.setdefault(key, {})
    return data


def params_of(opts: Sequence[Opt]) -> list[inspect.Parameter]:
    """The typer parameters of ``opts`` (arguments first)."""
    args = [
        inspect.Parameter(o.param, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=o.default, annotation=o.annotation)
        for o in opts
        if o.positional
    ]
    return args + [
        inspect.Parameter(o.param, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.annotation)
        for o in opts
        if not o.positional
    ]


def config_command(
    config_cls: type[BaseModel],
    body: Callable[..., Any],
    *,
    name: str,
    extra: Sequence[inspect.Parameter] = (),
    instance: Any = None,
) -> Callable[..., Any]:
    """A function typer registers as a command: its options are ``config_cls``'s fields (defaults from
    ``instance`` when given) and the ``extra`` parameters; it calls ``body(data, **extras)`` with the config's
    fields as a nested dict (``body`` builds and runs the config)."""
    opts = config_opts(config_cls, instance=instance)
    check_unique(opts, name, [p.name for p in extra] + ["--" + p.name.replace("_", "-") for p in extra])
    params = params_of(opts) + list(extra)

    def command(**kwargs: Any) -> Any:
        extras = {p.name: kwargs.pop(p.name) for p in extra}
        return body(config_data(opts, kwargs), **extras)

    command.__name__ = name.replace("-", "_")
    command.__doc__ = body.__doc__
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def option_names(config_cls: type[BaseModel], instance: Any = None) -> set[str]:
    """The long option names (and argument names) a command generated from ``config_cls`` takes."""
    out = set()
    for o in config_opts(config_cls, instance=instance):
        if o.positional:
            out.add(o.param.upper())
        for f in o.flags:
            out.update(p for p in f.split("/") if p.startswith("--"))
    return out
