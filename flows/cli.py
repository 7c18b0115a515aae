"""``diffret``: the command line. Each subcommand runs one flow (or opens SQL over the store).

A flow runs through Prefect (tracked in the UI, resumable as a deployment) when a Prefect API is
configured (``PREFECT_API_URL``) or ``--prefect`` is given; otherwise the same work runs in-process
without starting Prefect's temporary server, which costs ~15 s per command.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from enum import StrEnum
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

app = typer.Typer(
    name="diffret",
    help="Representative-token retrieval experiments (DiffRetriever and baselines) over an artifact store.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True, emoji=False)
out = Console(emoji=False)

RootOpt = Annotated[
    str,
    typer.Option("--root", "-r", envvar="DIFFRET_ROOT", help="Artifact store root (local folder or fsspec URL)."),
]
PrefectOpt = Annotated[
    bool | None,
    typer.Option(
        "--prefect/--no-prefect",
        help="Run as a Prefect flow run. Default: only when PREFECT_API_URL is set.",
        show_default=False,
    ),
]


class OutputFormat(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


def _use_prefect(flag: bool | None) -> bool:
    return flag if flag is not None else bool(os.environ.get("PREFECT_API_URL"))


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def _known_errors() -> tuple[type[Exception], ...]:
    from retrieval.backbones import BackboneError
    from retrieval.datasets import DatasetError
    from storage import StoreError

    return (DatasetError, StoreError, BackboneError, ValueError)


@app.command()
def download(
    name: Annotated[str, typer.Argument(help="Collection name: scifact, nfcorpus, msmarco-passage, trec-dl-2019, ...")],
    source: Annotated[
        str | None,
        typer.Option("--source", "-s", help="Mirror in BEIR layout: folder, .zip/.tar.gz, or URL. Default: official."),
    ] = None,
    root: RootOpt = "./diffret-store",
    cache_dir: Annotated[str, typer.Option(help="Where downloads are cached.")] = "~/.cache/diffret/downloads",
    force: Annotated[bool, typer.Option("--force", help="Replace a stored copy built from another source.")] = False,
    prefect: PrefectOpt = None,
) -> None:
    """Materialise a test collection as corpus / queries / qrels Parquet in the store."""
    from flows.download import DownloadConfig, download_flow, run_download

    config = DownloadConfig(name=name, source=source, root=root, cache_dir=cache_dir, force=force)
    try:
        if _use_prefect(prefect):
            summary = download_flow(config)
            lines = summary["report"]
        else:
            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                console=console,
                transient=True,
            ) as bar:
                tasks: dict[str, int] = {}

                def progress(label: str, done: int, total: int | None) -> None:
                    if label not in tasks:
                        tasks[label] = bar.add_task(f"download {label}", total=total)
                    bar.update(tasks[label], completed=done)

                with console.status(f"reading {name}…"):
                    result = run_download(config, progress=progress)
            lines = result.report_lines
    except _known_errors() as exc:
        _fail(exc)
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)


class DocsPerSecond(ProgressColumn):
    def render(self, task):  # noqa: ANN001, ANN201
        return Text(f"{task.speed:,.0f} docs/s" if task.speed else "… docs/s")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@app.command()
def encode(
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="A dataset in the store.")],
    model: Annotated[str, typer.Option("--model", "-m", help="HF hub id or local folder.")] = (
        "dllm-hub/ModernBERT-base-chat-v0.1"
    ),
    side: Annotated[list[str], typer.Option("--side", help="query and/or passage (repeatable).")] = None,  # type: ignore[assignment]
    k: Annotated[str, typer.Option("--k", help="Budgets K, comma-separated.")] = "1,2,4,8,16",
    readout: Annotated[str, typer.Option(help="diffretriever | promptreps | diffembed | repllama")] = "diffretriever",
    family: Annotated[str, typer.Option(help="Backbone family: auto | mlm | dream | llada | causal")] = "auto",
    gguf_file: Annotated[str | None, typer.Option(help="GGUF file inside the model folder.")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow the model's own code (Dream, LLaDA).")] = False,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    attn_implementation: Annotated[str | None, typer.Option(help="eager | sdpa | flash_attention_2")] = None,
    prompt: Annotated[str, typer.Option(help="auto | one_word | few_words | three_words | path.yaml")] = "auto",
    chat_template: Annotated[str, typer.Option(help="auto | yes | no: wrap the prompt in the chat template.")] = "auto",
    content_filter: Annotated[bool, typer.Option(help="Sparse: keep only the text's content words.")] = True,
    padding_side: Annotated[str, typer.Option(help="left | right")] = "left",
    mask_token: Annotated[str | None, typer.Option(help="Override the mask token.")] = None,
    turn_end: Annotated[str | None, typer.Option(help="Override the end-of-turn token.")] = None,
    denoise_steps: Annotated[int, typer.Option(help="S: forward passes of the mask readout.")] = 1,
    sparse_topk: Annotated[int, typer.Option(help="Sparse entries kept per text.")] = 256,
    max_length: Annotated[int, typer.Option(help="Text tokens kept per text.")] = 512,
    batch_size: Annotated[int, typer.Option(help="Texts per forward pass.")] = 32,
    shard_size: Annotated[int, typer.Option(help="Texts per shard (unit of resume).")] = 1000,
    workers: Annotated[int, typer.Option(help="Local Dask workers (0: in this process).")] = 0,
    dask_address: Annotated[str | None, typer.Option(help="Existing Dask scheduler, e.g. tcp://host:8786.")] = None,
    root: RootOpt = "./diffret-store",
    prefect: PrefectOpt = None,
) -> None:
    """Encode a dataset's queries / passages for every K: dense multi-vectors + sparse weights."""
    import transformers

    from flows.encode import EncodeConfig, encode_flow, run_encode
    from retrieval.backbones import BackboneConfig
    from retrieval.readouts import ReadoutConfig

    transformers.utils.logging.disable_progress_bar()
    try:
        config = EncodeConfig(
            root=root,
            dataset=dataset,
            sides=side or ["query", "passage"],
            k=_int_list(k),
            backbone=BackboneConfig(
                model=model,
                family=family,
                gguf_file=gguf_file,
                trust_remote_code=trust_remote_code,
                dtype=dtype,
                device=device,
                attn_implementation=attn_implementation,
                mask_token=mask_token,
                turn_end=turn_end,
            ),
            readout=ReadoutConfig(
                readout=readout,
                prompt=prompt,
                chat_template=chat_template,
                content_filter=content_filter,
                padding_side=padding_side,
                denoise_steps=denoise_steps,
                sparse_topk=sparse_topk,
            ),
            max_length=max_length,
            batch_size=batch_size,
            shard_size=shard_size,
            workers=workers,
            dask_address=dask_address,
        )
        if _use_prefect(prefect) or workers or dask_address:
            summary = encode_flow(config)
            console.print(
                f"{summary['model']}: {summary['encoded']} shard(s) encoded, {summary['skipped']} already done"
            )
            return
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            DocsPerSecond(),
            TimeRemainingColumn(),
            console=console,
        ) as bar:
            state: dict[str, int] = {}

            def start(plan):  # noqa: ANN001
                total = sum(j.rows for j in plan.jobs)
                state["task"] = bar.add_task(f"encode {plan.slug}", total=total)
                return lambda n: bar.advance(state["task"], n)

            plan = run_encode(config, progress=start, log=lambda m: console.print(m, highlight=False, soft_wrap=True))
        console.print(
            f"{plan.slug}: {len(plan.jobs)} shard(s) encoded, {plan.skipped} already done ({plan.total_shards} in all)",
            highlight=False,
            soft_wrap=True,
        )
    except _known_errors() as exc:
        _fail(exc)


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="SQL over the views corpus, queries, qrels, manifests, ...")],
    root: RootOpt = "./diffret-store",
    fmt: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    verify: Annotated[bool, typer.Option("--verify", help="Check every file's sha256 before querying.")] = False,
) -> None:
    """Run DuckDB SQL over the store's views (defined in queries/*.sql) and print the result."""
    import duckdb

    from storage import ArtifactStore
    from storage.sql import StoreSQL

    try:
        with StoreSQL(ArtifactStore(root), verify=verify) as db:
            cols, rows = db.query(query)
    except duckdb.Error as exc:
        _fail(ValueError(f"SQL error: {exc}"))
    except _known_errors() as exc:
        _fail(exc)
    _print_rows(cols, rows, fmt)


def _print_rows(cols: list[str], rows: list[tuple], fmt: OutputFormat) -> None:
    if fmt is OutputFormat.csv:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        w.writerows(rows)
        sys.stdout.write(buf.getvalue())
    elif fmt is OutputFormat.json:
        sys.stdout.write(json.dumps([dict(zip(cols, r, strict=True)) for r in rows], default=str, indent=1) + "\n")
    else:
        table = Table(*cols, show_lines=False)
        for r in rows:
            table.add_row(*("NULL" if v is None else str(v) for v in r))
        out.print(table)


@app.command()
def views(root: RootOpt = "./diffret-store") -> None:
    """List the SQL views and their columns."""
    from storage import ArtifactStore
    from storage.sql import StoreSQL

    try:
        with StoreSQL(ArtifactStore(root)) as db:
            for name in db.views:
                cols, rows = db.query(f"DESCRIBE {name}")
                out.print(f"[bold]{name}[/]: " + ", ".join(f"{r[0]} {r[1]}" for r in rows), highlight=False)
    except _known_errors() as exc:
        _fail(exc)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
