"""``diffret``: the command line. Each stage's command is generated from its config (flows/commands.py: the
options, their defaults and help come from the pydantic fields, declared once); it runs the stage through
``flows.runner.run_stage`` and prints its one result line. ``sql``, ``views``, ``systems``, ``verify`` and
``export-run`` read the store and are written here.

A stage runs through Prefect (tracked in the UI, resumable as a deployment) when a Prefect API is
configured (``PREFECT_API_URL``) or ``--prefect`` is given; otherwise the same work runs in-process
without starting Prefect's temporary server, which costs ~15 s per command.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.markup import escape
from typer._click import Context, HelpFormatter  # typer carries its own click: its commands format with these
from typer.core import TyperCommand

from diffret.storage.layout import DEFAULT_ROOT

from .commands import config_command
from .display import (
    OutputFormat,
    console,
    help_text,
    library_output,
    log,
    out,
    print_leaderboard,
    print_rows,
    progress,
)


class Command(TyperCommand):
    """A command whose ``--help`` fits the terminal (rich's own width; 80 columns when piped): one paragraph per
    option (:func:`flows.display.help_text`)."""

    def format_help(self, ctx: Context, formatter: HelpFormatter) -> None:
        from rich.console import Console

        formatter.write(help_text(self, ctx, Console().width))


app = typer.Typer(
    name="diffret",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Representative-token retrieval experiments (DiffRetriever, baselines) over an artifact store.",
)
Opt = typer.Option


@app.callback()
def _options(
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Show the libraries' own warnings, logs and "
            "progress bars (hidden otherwise: the stages show their own).",
        ),
    ] = False,
) -> None:
    """Representative-token retrieval experiments (DiffRetriever, baselines) over an artifact store."""
    library_output(verbose)


Root = Annotated[str, Opt("--root", "-r", envvar="DIFFRET_ROOT", help="Store root (a folder or an fsspec URL).")]
Format = Annotated[OutputFormat, Opt("--format", "-f", help="Output format.")]
PREFECT = inspect.Parameter(
    "prefect",
    inspect.Parameter.KEYWORD_ONLY,
    default=None,
    annotation=Annotated[
        bool | None,
        Opt(
            "--prefect/--no-prefect",
            help="Run as a Prefect flow run (default: when PREFECT_API_URL is set).",
            show_default=False,
        ),
    ],
)


DRY_RUN = inspect.Parameter(
    "dry_run",
    inspect.Parameter.KEYWORD_ONLY,
    default=False,
    annotation=Annotated[
        bool,
        Opt(
            "--dry-run",
            help="Print the stages this run would make, each with its settings "
            "(validated), and exit: nothing downloaded, loaded or written.",
        ),
    ],
)


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(_one_line(exc))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def _one_line(exc: Exception) -> str:
    """An error as one line: a pydantic validation error as ``field: message; ...`` (not its multi-line text)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e["loc"])
            msg = e["msg"].removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
        return f"invalid {exc.title} settings: " + "; ".join(parts)
    return str(exc)


_FS_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}


def _known_errors() -> tuple[type[Exception], ...]:
    from diffret.retrieval.data.collections import DatasetError
    from diffret.retrieval.models.backbones import BackboneError
    from diffret.storage import StoreError

    from .cluster import ClusterStartError
    from .runner import PrefectUnreachable

    return (DatasetError, StoreError, BackboneError, ValueError, PrefectUnreachable, ClusterStartError)


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Known errors (bad input, store state, models) become one clear line and exit code 2."""
    try:
        yield
    except _known_errors() as exc:
        _fail(exc)
    except OSError as exc:  # a read-only or full store root, a folder without permission: one line, not a traceback
        if exc.errno not in _FS_ERRNOS:
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        _fail(OSError(f"{where}{exc.strerror or exc} (check --root and the paths given, their permissions and space)"))


def _config(cls: type[BaseModel], data: dict[str, Any]) -> Any:
    with _errors():
        return cls(**data)


def _run(stage_name: str, prefect: bool | None, config: Any) -> Any:
    """Run a stage with ``config`` (Prefect or in-process; the stages it needs first before it), print its result
    line and what the stage prints of its result (its presentation's ``shown`` to standard output, ``printed``,
    the result's warnings), return it."""
    from diffret.stages import presentation_of, stages

    from .runner import run_stage, use_prefect

    stage = stages()[stage_name]
    with _errors(), progress() as report:
        res = run_stage(stage, config, prefect=use_prefect(prefect), log=log, report=report)
    console.print(res.line(), highlight=False, soft_wrap=True)
    shows = presentation_of(stage)
    if shown := shows.shown(res):
        out.print(shown, highlight=False, markup=False, soft_wrap=True, end="")
    for line in shows.printed(res):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    _print_warnings(res)
    return res


def stage_command(stage_name: str, command: str | None = None) -> None:
    """Register ``diffret <command>``: the stage's config as options, then the stage (:func:`_run`)."""
    from diffret.stages import stages

    stage = stages()[stage_name]
    cls = stage.config

    def body(data: dict[str, Any], prefect: bool | None = None) -> None:
        _run(stage_name, prefect, _config(cls, data))

    body.__doc__ = stage.description.split("\n\n")[0]
    name = command or stage_name
    app.command(name, help=body.__doc__, cls=Command)(config_command(cls, body, name=name, extra=[PREFECT]))


def _warning(line: str) -> None:
    """One warning line on stderr (a damaged folder a query leaves out, with its repair)."""
    console.print(f"[bold yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)


def _print_warnings(res: Any) -> None:
    """The summaries' and reports' warnings (a system near chance, or built with random weights), after the
    leaderboard."""
    details = res if isinstance(res, dict) else res.details
    for line in details.get("warnings", []):
        _warning(line)


def _pipeline(data: dict[str, Any], prefect: bool | None = None, dry_run: bool = False) -> None:
    """The whole zero-shot experiment: download, encode the grid, score every cell, BM25, evaluate, leaderboard."""
    from diffret.stages.pipeline import PipelineConfig, pipeline_plan

    from .runner import prefect_api, run_pipeline_stages, use_prefect

    t0 = time.perf_counter()
    if dry_run:  # a checkpoint whose settings cannot be read (offline) is planned on the defaults, saying so
        from diffret.retrieval.models.released import assume_unreadable_not_released

        with _errors(), assume_unreadable_not_released() as unread:
            config = PipelineConfig(**data)
            plan = pipeline_plan(config)
        for note in unread:
            console.print(
                f"[bold yellow]note:[/] {escape(note)}. This plan assumes it is not a released checkpoint: "
                f"the grid K_q in {config.kq}, K_p in {config.kp} and the readout's default prompt; `diffret "
                "run` refuses until its settings can be read.",
                highlight=False,
                soft_wrap=True,
            )
        for stage, settings in plan:
            out.print(f"{stage}: {settings}", highlight=False, markup=False, soft_wrap=True)
        return
    config = _config(PipelineConfig, data)
    with _errors():
        if use_prefect(prefect):
            from .pipeline import pipeline_flow

            with prefect_api():
                res = pipeline_flow(config)
        else:
            with progress(transient=True) as report:
                res = run_pipeline_stages(config, log=log, report=report)
    for sp, rows in res["leaderboards"].items():
        print_leaderboard(config.name(), sp, rows)
        console.print(f"summary, leaderboard and heatmaps: {res['folders'][sp]}", highlight=False, soft_wrap=True)
    _print_warnings(res)
    console.print(f"done in {time.perf_counter() - t0:,.1f} s", highlight=False)


def _register() -> None:
    """Every stage's command, generated from its config, in pipeline order (the whole experiment first); a stage
    registered with ``stages.register`` or the ``diffret.stages`` entry points gets its command the same way."""
    from diffret.stages import stages
    from diffret.stages.pipeline import PipelineConfig

    app.command("run", help=_pipeline.__doc__, cls=Command)(
        config_command(PipelineConfig, _pipeline, name="run", extra=[PREFECT, DRY_RUN])
    )
    for name, st in stages().items():
        stage_command(name, st.command)


_register()


@app.command("export-run", cls=Command)
def export_run(
    system: Annotated[str, Opt("--system", help="A stored system (`diffret systems`).")],
    dataset: Annotated[str, Opt("--dataset", "-d", help="The dataset the run was scored on.")],
    output: Annotated[str, Opt("--output", "-o", help="The TREC run file to write (outside the store).")],
    split: Annotated[str, Opt(help="The run's query split.")] = "test",
    kq: Annotated[int, Opt(help="The run's K_q (0 for BM25).")] = 0,
    kp: Annotated[int, Opt(help="The run's K_p (0 for BM25).")] = 0,
    mode: Annotated[
        str | None, Opt(help="The run's mode (default: the one mode of BM25, an imported run, a fusion).")
    ] = None,
    root: Root = DEFAULT_ROOT,
) -> None:
    """Write one stored run as a TREC run file (qid Q0 docid rank score tag)."""
    from diffret.retrieval.evaluation import write_trec_run
    from diffret.stages.rerank import first_stage_mode
    from diffret.stages.runs import read_run
    from diffret.stages.systems import SystemRef, find_system
    from diffret.storage import ArtifactStore
    from diffret.storage.layout import run_dir

    with _errors():
        store = ArtifactStore(root)
        store.refuse_inside(output, "--output")
        slug = find_system(store, SystemRef(system=system)).system
        mode = first_stage_mode(store, slug, mode, "--mode (and --kq, --kp)")
        table = read_run(store, run_dir(slug, dataset, split, kq, kp, mode))
        write_trec_run(table, output, tag=f"{slug}.{mode}.kq{kq}.kp{kp}")
    console.print(f"wrote {table.num_rows:,} lines to {output}", highlight=False)


# a query may start with '-' (a comment: "-- x")
@app.command(cls=Command, context_settings={"ignore_unknown_options": True})
def sql(
    query: Annotated[str, typer.Argument(help="SQL over the views (`diffret views` lists them).")],
    root: Root = DEFAULT_ROOT,
    fmt: Format = OutputFormat.table,
    verify: Annotated[
        bool,
        Opt(
            "--verify",
            help="Check every file's sha256 first (by default its size and mtime "
            "against its manifest; a file touched since is hashed).",
        ),
    ] = False,
    out: Annotated[str | None, Opt("--out", "-o", help="Write the result to FILE.csv or FILE.parquet.")] = None,
) -> None:
    """Run read-only DuckDB SQL over the store's views (queries/*.sql) and print the result (or --out it).

    Queries read the store and nothing else, one statement at a time (a SELECT, or an EXPLAIN of one): EXPLAIN
    ANALYZE, COPY, CREATE, INSERT, ATTACH, INSTALL, SET, ..., several statements at once and reading files other than
    the store's are refused. A damaged or incomplete folder is left out of its views, with a warning naming it and
    its repair."""
    import duckdb

    from diffret.storage import ArtifactStore
    from diffret.storage.sql import StoreSQL

    with _errors():
        try:
            with StoreSQL(ArtifactStore(root), verify=verify, warn=_warning) as db:
                if out:
                    n = db.export(query, out)
                else:
                    cols, rows = db.query(query)
        except duckdb.Error as exc:
            raise ValueError(f"SQL error: {' '.join(str(exc).split())}") from None
    if out:
        console.print(f"{n:,} row(s) written to {out}", highlight=False, soft_wrap=True)
        return
    print_rows(cols, rows, fmt)


@app.command(cls=Command)
def verify(root: Root = DEFAULT_ROOT) -> None:
    """Check every stored file against its manifest's sha256; exit 1 naming each damaged or missing file (the
    next run of its stage redoes it)."""
    from diffret.storage import ArtifactStore

    from .repairs import repair_line

    with _errors():
        checked, problems = ArtifactStore(root).damage_all()
    for damage in problems:  # results go to stdout (errors of the command itself to stderr)
        out.print(f"[bold red]damaged:[/] {escape(damage.line(repair_line))}", highlight=False, soft_wrap=True)
    if problems:
        out.print(f"{len(problems)} problem(s) in {checked:,} file(s)", highlight=False)
        raise typer.Exit(code=1)
    out.print(f"{checked:,} file(s) match their manifests", highlight=False)


@app.command(cls=Command)
def views(root: Root = DEFAULT_ROOT) -> None:
    """List the SQL views and their columns."""
    from diffret.storage import ArtifactStore
    from diffret.storage.sql import StoreSQL

    with _errors(), StoreSQL(ArtifactStore(root), warn=lambda _: None) as db:  # a folder left out changes no column
        for name in db.views:
            _, rows = db.query(f"DESCRIBE {name}")
            out.print(f"[bold]{name}[/]: " + ", ".join(f"{r[0]} {r[1]}" for r in rows), highlight=False)


@app.command(cls=Command)
def systems(root: Root = DEFAULT_ROOT, fmt: Format = OutputFormat.table) -> None:
    """List the systems in the store (the registry) with every setting that made them."""
    from diffret.stages.systems import list_systems, weights_label
    from diffret.storage import ArtifactStore

    with _errors():
        recs = list_systems(ArtifactStore(root))
    cols = ["system", "kind", "model", "readout", "settings", "model_path", "weights"]
    rows = [
        (
            r.system,
            r.kind,
            r.model,
            r.readout,
            json.dumps(r.settings, sort_keys=True),
            st.get("model_path"),
            weights_label(r),
        )
        for r, st in recs
    ]
    print_rows(cols, rows, fmt)


@app.command(cls=Command)
def deployments(
    write: Annotated[
        bool, Opt("--write", help="Rewrite prefect.yaml in the current folder (the repository root).")
    ] = False,
) -> None:
    """Print the Prefect deployments of every stage (prefect.yaml), generated from the stage registry."""
    from .deployments import render

    text = render()
    if write:
        from pathlib import Path

        Path("prefect.yaml").write_text(text)
        out.print("prefect.yaml written", highlight=False)
    else:
        print(text, end="")


def _exit_now(code: int) -> None:
    """Leave the process without C++ static destructors: pyarrow's and DuckDB's thread pools can abort a finished
    command at interpreter exit (exit -6; apache/arrow#34314, duckdb/duckdb#13904). What Python's shutdown does
    first still happens: non-daemon threads are joined, atexit handlers run (Prefect flushes there), stdio is flushed.
    """
    import atexit
    import threading

    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the stages show their own progress
    try:
        app()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # an unexpected error: the traceback, then exit 1 like Python would
        import traceback

        traceback.print_exc()
        code = 1
    if code == 130:  # Ctrl-C / SIGINT (click turns it into exit 130): every finished shard, run, table is stored
        print("interrupted: finished work is kept; run the same command again to resume", file=sys.stderr)
    _exit_now(code)


if __name__ == "__main__":
    main()
