"""A repair the store names (:class:`storage.repairs.Repair`, data) as the command a user runs: ``diffret`` and the
command's words, shell-quoted, an option left out where its value is the command's own default. Importing this
module makes it the store's renderer, so that every error, warning and ``verify`` line names its repair this way."""

from __future__ import annotations

import functools
import shlex
from typing import Any

from diffret.storage.repairs import Repair, removal_line, use_renderer

PROGRAM = "diffret"


@functools.cache
def _defaults(command: str) -> dict[str, Any]:
    """The command's options and their defaults, by name without dashes (a switch ``--x/--no-x`` as ``x``)."""
    import typer.main

    from .cli import app

    group = typer.main.get_command(app)
    cmd = getattr(group, "commands", {}).get(command)
    out: dict[str, Any] = {}
    for param in getattr(cmd, "params", []):
        for opt in param.opts:
            if opt.startswith("--"):
                out[opt[2:]] = param.default
    return out


def _is_default(value: Any, default: Any) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, tuple):
        return isinstance(default, list | tuple) and tuple(default) == value
    return default is not None and str(value) == str(getattr(default, "value", default))


def command_words(repair: Repair) -> list[str]:
    """The words of the command that runs ``repair``: ``diffret``, the command, its options that differ from the
    command's defaults, its arguments.

    >>> command_words(Repair("encode", (("verify", True), ("dataset", "c"), ("batch-size", 32), ("k", (1,)))))
    ['diffret', 'encode', '--verify', '--dataset', 'c', '--k', '1']
    """
    try:
        defaults = _defaults(repair.command)
    except Exception:  # noqa: BLE001  (no command line to read defaults from: every option is named)
        defaults = {}
    kept = tuple((n, v) for n, v in repair.options if n not in defaults or not _is_default(v, defaults[n]))
    return [PROGRAM, *Repair(repair.command, kept, repair.arguments).words()]


def command_line(repair: Repair) -> str:
    """The shell command that runs ``repair`` (its words shell-quoted).

    >>> command_line(Repair("bm25", (("root", "/data/my store"),)))
    "diffret bm25 --root '/data/my store'"
    """
    return shlex.join(command_words(repair))


def repair_line(repair: Repair) -> str:
    """A repair as the line the store's messages hold: the command to run again (``with the settings that made
    it`` where the store does not hold them all), or the folder to remove.

    >>> repair_line(Repair("score", (("dataset", "c"), ("system", "s"))))
    'repair: run `diffret score --dataset c --system s` again'
    >>> repair_line(Repair("late", complete=False))
    'repair: run `diffret late` again with the settings that made it'
    """
    if repair.remove:
        return removal_line(repair)
    if not repair.command:
        root = repair.option("root")
        return "repair: run the stage that wrote it again" + (
            f" (with --root {shlex.quote(str(root))})" if root else ""
        )
    tail = "" if repair.complete else " with the settings that made it"
    return f"repair: run `{command_line(repair)}` again{tail}"


use_renderer(repair_line)
