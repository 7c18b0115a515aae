"""``diffret``: the command line. Each subcommand runs one flow (or opens SQL over the store).

A flow runs through Prefect (tracked in the UI, resumable as a deployment) when a Prefect API is
configured (``PREFECT_API_URL``) or ``--prefect`` is given; otherwise the same work runs in-process
without starting Prefect's temporary server, which costs ~15 s per command.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def _encode_progress(transient: bool):  # noqa: ANN202 - yields run_encode's ``progress`` callback
    """A docs/s bar per encode plan with work to do (run_encode calls the yielded function with its plan)."""
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), DocsPerSecond(), TimeRemainingColumn(),
        console=console, transient=transient,
    ) as bar:  # fmt: skip

        def start(plan):  # noqa: ANN001, ANN202
            total = sum(j.rows for j in plan.jobs)
            if not total:
                return None
            task = bar.add_task(f"encode {plan.slug}", total=total)
            return lambda n: bar.advance(task, n)

        yield start


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
        with _encode_progress(transient=False) as start:
            plan = run_encode(config, progress=start, log=_log)
        console.print(
            f"{plan.slug}: {len(plan.jobs)} shard(s) encoded, {plan.skipped} already done ({plan.total_shards} in all)",
            highlight=False,
            soft_wrap=True,
        )
    except _known_errors() as exc:
        _fail(exc)


def _system_opts(model: str, readout: str, max_length: int, family: str = "auto", gguf_file: str | None = None,
                 trust_remote_code: bool = False, dtype: str = "float32", device: str = "auto",
                 prompt: str = "auto", denoise_steps: int = 1) -> dict:  # fmt: skip
    from retrieval.backbones import BackboneConfig
    from retrieval.readouts import ReadoutConfig

    return {
        "backbone": BackboneConfig(
            model=model, family=family, gguf_file=gguf_file, trust_remote_code=trust_remote_code, dtype=dtype,
            device=device,
        ),
        "readout": ReadoutConfig(readout=readout, prompt=prompt, denoise_steps=denoise_steps),
        "max_length": max_length,
    }  # fmt: skip


ModelOpt = Annotated[str, typer.Option("--model", "-m", help="HF hub id or local folder (as given to encode).")]
SystemOpt = Annotated[
    str | None, typer.Option("--system", help="Model slug of the encodings (as printed by encode); overrides --model.")
]
ReadoutOpt = Annotated[str, typer.Option(help="diffretriever | promptreps | diffembed | repllama")]
MaxLenOpt = Annotated[int, typer.Option(help="Text tokens kept per text (as given to encode).")]
SplitOpt = Annotated[list[str], typer.Option("--split", help="Query split(s) (repeatable).")]


@app.command()
def score(
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Queries and qrels (a dataset in the store).")],
    model: ModelOpt = "dllm-hub/ModernBERT-base-chat-v0.1",
    system: SystemOpt = None,
    readout: ReadoutOpt = "diffretriever",
    max_length: MaxLenOpt = 512,
    corpus: Annotated[str | None, typer.Option(help="Passages' collection (default: the dataset's).")] = None,
    split: SplitOpt = None,  # type: ignore[assignment]
    kq: Annotated[str, typer.Option("--kq", help="Query budgets, comma-separated.")] = "1,2,4,8,16",
    kp: Annotated[str, typer.Option("--kp", help="Passage budgets, comma-separated.")] = "1,2,4,8,16",
    mode: Annotated[list[str], typer.Option("--mode", help="Scoring mode(s) (repeatable; default: all five).")] = None,  # type: ignore[assignment]
    topk: Annotated[int, typer.Option(help="Documents kept per query.")] = 1000,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    root: RootOpt = "./diffret-store",
    prefect: PrefectOpt = None,
) -> None:
    """Exact search for every (K_q, K_p, mode) cell: one run per cell in the store."""
    from flows.score import ScoreConfig, run_score, score_flow
    from storage.layout import MODES

    try:
        config = ScoreConfig(
            root=root, dataset=dataset, corpus=corpus, splits=split or ["test"], kq=_int_list(kq), kp=_int_list(kp),
            modes=mode or list(MODES), system=system, topk=topk, device=device,
            **_system_opts(model, readout, max_length),
        )  # fmt: skip
        res = score_flow(config) if _use_prefect(prefect) else run_score(config, _log)
    except _known_errors() as exc:
        _fail(exc)
    console.print(f"{res['system']}: {res['scored']} cell(s) scored, {res['skipped']} already done", highlight=False)


@app.command()
def bm25(
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Queries and qrels (a dataset in the store).")],
    corpus: Annotated[str | None, typer.Option(help="Passages' collection (default: the dataset's).")] = None,
    split: SplitOpt = None,  # type: ignore[assignment]
    topk: Annotated[int, typer.Option(help="Documents kept per query.")] = 1000,
    k1: Annotated[float, typer.Option(help="BM25 k1.")] = 0.9,
    b: Annotated[float, typer.Option(help="BM25 b.")] = 0.4,
    root: RootOpt = "./diffret-store",
    prefect: PrefectOpt = None,
) -> None:
    """BM25 baseline runs (bm25s, Lucene variant, English stemmer and stopwords)."""
    from flows.score import BM25Config, bm25_flow, run_bm25
    from retrieval.bm25 import BM25Settings

    try:
        config = BM25Config(
            root=root, dataset=dataset, corpus=corpus, splits=split or ["test"], topk=topk,
            bm25=BM25Settings(k1=k1, b=b),
        )  # fmt: skip
        res = bm25_flow(config) if _use_prefect(prefect) else run_bm25(config, _log)
    except _known_errors() as exc:
        _fail(exc)
    console.print(f"{res['system']}: {res['scored']} run(s) written, {res['skipped']} already done", highlight=False)


@app.command()
def evaluate(
    model: Annotated[list[str], typer.Option("--system", help="System slug(s) to evaluate (default: all).")] = None,  # type: ignore[assignment]
    dataset: Annotated[list[str], typer.Option("--dataset", "-d", help="Dataset(s) (default: all).")] = None,  # type: ignore[assignment]
    split: SplitOpt = None,  # type: ignore[assignment]
    relevance_level: Annotated[
        int | None, typer.Option(help="Grade counted relevant by binary measures (default: 2 for TREC DL, else 1).")
    ] = None,
    root: RootOpt = "./diffret-store",
    prefect: PrefectOpt = None,
) -> None:
    """Per-query metrics (pytrec_eval) for every run in the store that has none or stale ones."""
    from flows.evaluate import EvaluateConfig, evaluate_flow, run_evaluate

    try:
        config = EvaluateConfig(
            root=root, models=model or None, datasets=dataset or None, splits=split or None,
            relevance_level=relevance_level,
        )  # fmt: skip
        res = evaluate_flow(config) if _use_prefect(prefect) else run_evaluate(config, _log)
    except _known_errors() as exc:
        _fail(exc)
    console.print(
        f"{res['evaluated']} run(s) evaluated, {res['up_to_date']} already up to date ({res['runs']} runs)",
        highlight=False,
    )


@app.command()
def index(
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Dataset whose queries check the index.")],
    model: ModelOpt = "dllm-hub/ModernBERT-base-chat-v0.1",
    system: SystemOpt = None,
    readout: ReadoutOpt = "diffretriever",
    max_length: MaxLenOpt = 512,
    index_type: Annotated[str, typer.Option("--type", help="none (flat) | IVF_PQ | IVF_HNSW_SQ")] = "IVF_PQ",
    split: Annotated[str, typer.Option(help="Query split of the recall check.")] = "test",
    kq: Annotated[str, typer.Option("--kq", help="Query budgets of the recall check.")] = "1,2,4,8,16",
    kp: Annotated[str, typer.Option("--kp", help="Passage budgets to index.")] = "1,2,4,8,16",
    overfetch: Annotated[int | None, typer.Option(help="Candidates = k x overfetch (default: the module's).")] = None,
    root: RootOpt = "./diffret-store",
    prefect: PrefectOpt = None,
) -> None:
    """LanceDB multivector index per K_p; prints recall@10/@100 against exact search and latency."""
    from flows.index import IndexConfig, checks_markdown, index_flow, run_index

    try:
        config = IndexConfig(
            root=root, dataset=dataset, split=split, kq=_int_list(kq), kp=_int_list(kp), system=system,
            index_type=index_type, overfetch=overfetch, **_system_opts(model, readout, max_length),
        )  # fmt: skip
        res = index_flow(config) if _use_prefect(prefect) else run_index(config, _log)
    except _known_errors() as exc:
        _fail(exc)
    console.print(f"{res['system']}: {res['built']} index(es) built, {res['skipped']} already built", highlight=False)
    out.print(checks_markdown(res), highlight=False, markup=False, soft_wrap=True)


@app.command("export-run")
def export_run(
    system: Annotated[
        str, typer.Option("--system", help="System slug (see `diffret sql 'select distinct model from runs'`).")
    ],
    dataset: Annotated[str, typer.Option("--dataset", "-d")],
    output: Annotated[str, typer.Option("--output", "-o", help="TREC run file to write.")],
    split: Annotated[str, typer.Option()] = "test",
    kq: Annotated[int, typer.Option("--kq")] = 0,
    kp: Annotated[int, typer.Option("--kp")] = 0,
    mode: Annotated[str, typer.Option("--mode")] = "bm25",
    root: RootOpt = "./diffret-store",
) -> None:
    """Write one stored run as a TREC run file (qid Q0 docid rank score tag)."""
    from retrieval.evaluation import write_trec_run
    from storage import ArtifactStore
    from storage.layout import RUN_FILE, run_dir

    try:
        store = ArtifactStore(root)
        table = store.read_table(run_dir(system, dataset, split, kq, kp, mode), RUN_FILE)
        write_trec_run(table, output, tag=f"{system}.{mode}.kq{kq}.kp{kp}")
    except _known_errors() as exc:
        _fail(exc)
    console.print(f"wrote {table.num_rows:,} lines to {output}", highlight=False)


class Preset(StrEnum):
    paper = "paper"
    laptop = "laptop"


@app.command()
def run(
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="Collection to run on.")] = "scifact",
    source: Annotated[str | None, typer.Option("--source", "-s", help="Mirror of the dataset (offline).")] = None,
    corpus_source: Annotated[str | None, typer.Option(help="Mirror of the judged corpus (TREC DL).")] = None,
    model: ModelOpt = "dllm-hub/ModernBERT-base-chat-v0.1",
    family: Annotated[str, typer.Option(help="Backbone family: auto | mlm | dream | llada | causal")] = "auto",
    gguf_file: Annotated[str | None, typer.Option(help="GGUF file inside the model folder.")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow the model's own code (Dream, LLaDA).")] = False,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")] = "auto",
    readout: ReadoutOpt = "diffretriever",
    prompt: Annotated[str, typer.Option(help="auto | one_word | few_words | three_words | path.yaml")] = "auto",
    preset: Annotated[Preset, typer.Option(help="paper: 5x5 grid, 512 tokens; laptop: 3x3 grid, 256 tokens.")] = (
        Preset.paper
    ),
    kq: Annotated[str | None, typer.Option("--kq", help="Query budgets (default: the preset's).")] = None,
    kp: Annotated[str | None, typer.Option("--kp", help="Passage budgets (default: the preset's).")] = None,
    max_length: Annotated[int | None, typer.Option(help="Text tokens kept (default: the preset's).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Texts per forward pass (default: the preset's).")] = None,
    mode: Annotated[list[str], typer.Option("--mode", help="Scoring mode(s) (repeatable; default: all five).")] = None,  # type: ignore[assignment]
    split: SplitOpt = None,  # type: ignore[assignment]
    bm25: Annotated[bool, typer.Option("--bm25/--no-bm25", help="Add the BM25 baseline.")] = True,
    index_type: Annotated[
        str, typer.Option("--index", help="skip | none (flat) | IVF_PQ | IVF_HNSW_SQ: LanceDB index per K_p.")
    ] = "skip",
    shard_size: Annotated[int, typer.Option(help="Texts per shard (unit of resume).")] = 1000,
    workers: Annotated[int, typer.Option(help="Local Dask workers for encoding (0: in this process).")] = 0,
    dask_address: Annotated[str | None, typer.Option(help="Existing Dask scheduler for encoding.")] = None,
    root: RootOpt = "./diffret-store",
    prefect: PrefectOpt = None,
) -> None:
    """The whole zero-shot experiment: download, encode the grid, score every cell, BM25, evaluate, leaderboard."""
    import time

    import transformers

    from flows.pipeline import LAPTOP_PRESET, PipelineConfig, pipeline_flow, run_pipeline
    from storage.layout import MODES

    transformers.utils.logging.disable_progress_bar()
    base = LAPTOP_PRESET if preset is Preset.laptop else {}
    t0 = time.perf_counter()
    try:
        grid_q = _int_list(kq) if kq else base.get("kq", [1, 2, 4, 8, 16])
        grid_p = _int_list(kp) if kp else base.get("kp", [1, 2, 4, 8, 16])
        opts = _system_opts(
            model, readout, max_length or base.get("max_length", 512), family, gguf_file, trust_remote_code, dtype,
            device, prompt,
        )  # fmt: skip
        config = PipelineConfig(
            root=root, dataset=dataset, source=source, corpus_source=corpus_source, splits=split or ["test"],
            kq=grid_q, kp=grid_p, modes=mode or list(MODES), bm25=bm25, index=index_type,
            batch_size=batch_size or base.get("batch_size", 32), shard_size=shard_size, workers=workers,
            dask_address=dask_address, device=device, **opts,
        )  # fmt: skip
        if _use_prefect(prefect) or workers or dask_address:
            res = pipeline_flow(config)
            from retrieval.summary import build_summary
            from storage import ArtifactStore
            from storage.sql import StoreSQL

            with StoreSQL(ArtifactStore(root)) as db:
                sums = {sp: build_summary(db, res["system"], dataset, sp, res["bm25"]) for sp in config.splits}
            folders = res["summaries"]
        else:
            with _encode_progress(transient=True) as start:
                result = run_pipeline(config, _log, start)
            sums, folders = result.summaries, result.folders
    except _known_errors() as exc:
        _fail(exc)
    for sp, s in sums.items():
        _print_leaderboard(s)
        console.print(f"summary, leaderboard and heatmaps: {folders[sp]}", highlight=False, soft_wrap=True)
    console.print(f"done in {time.perf_counter() - t0:,.1f} s", highlight=False)


def _print_leaderboard(s) -> None:  # noqa: ANN001 - retrieval.summary.Summary
    table = Table(title=f"{s.dataset} / {s.split}: best (K_q, K_p) per mode by NDCG@10", title_justify="left")
    for c in ("system", "mode", "K_q", "K_p", "NDCG@10", "MRR@10", "R@100", "R@1000", "queries", "p vs BM25"):
        table.add_column(c, justify="left" if c in ("system", "mode") else "right", no_wrap=True)
    for r in s.rows:
        vals = ["–" if v is None else f"{v:.4f}" for v in (r.ndcg_10, r.mrr_10, r.recall_100, r.recall_1000)]
        kq, kp = ("–", "–") if r.mode == "bm25" else (str(r.kq), str(r.kp))
        p = "–" if r.p_vs_bm25 is None else f"{r.p_vs_bm25:.2g}"
        table.add_row(r.system, r.mode, kq, kp, *vals, str(r.queries), p)
    _wide().print(table, crop=False)


def _wide() -> Console:
    """stdout; when piped, wide enough that no value is cut (a terminal keeps its own width)."""
    return out if out.is_terminal else Console(emoji=False, width=100_000)


@app.command()
def report(
    root: RootOpt = "./diffret-store",
    name: Annotated[str, typer.Option(help="Report name (reports/report=<name>/ in the store).")] = "default",
    out_dir: Annotated[str | None, typer.Option("--out", "-o", help="Also copy the report here.")] = None,
    ref: Annotated[
        list[str], typer.Option("--ref", help="Reference system(s) for the † / ‡ markers (default: bm25).")
    ] = None,  # type: ignore[assignment]
    finetuned: Annotated[
        list[str], typer.Option("--finetuned", help="BASE=FT: a fine-tuned system's score beside the oracle.")
    ] = None,  # type: ignore[assignment]
    n_boot: Annotated[int, typer.Option(help="Bootstrap resamples for the correlation CIs.")] = 1000,
    hidden: Annotated[int, typer.Option(help="Footprint projection: hidden size.")] = 3584,
    backbones: Annotated[int, typer.Option(help="Footprint projection: backbones.")] = 4,
    settings: Annotated[int, typer.Option(help="Footprint projection: settings per backbone.")] = 2,
    prefect: PrefectOpt = None,
) -> None:
    """Budget selection, landscapes, oracle, feature correlation, paper tables, footprint: markdown + PNG + CSV."""
    from flows.report import ReportConfig, report_flow, run_report

    try:
        pairs = {}
        for item in finetuned or []:
            base, sep, ft = item.partition("=")
            if not sep or not base or not ft:
                raise ValueError(f"--finetuned expects BASE=FT, got {item!r}")
            pairs[base] = ft
        config = ReportConfig(
            root=root, name=name, out_dir=out_dir, refs=ref or None, finetuned=pairs, n_boot=n_boot, hidden=hidden,
            backbones=backbones, settings=settings,
        )  # fmt: skip
        if _use_prefect(prefect):
            res = report_flow(config)
            folder = res["folder"]
        else:
            _, folder = run_report(config, _log)
    except _known_errors() as exc:
        _fail(exc)
    console.print(f"report written: {folder}/report.md", highlight=False, soft_wrap=True)


def _log(message: str) -> None:
    console.print(message, highlight=False, markup=False, soft_wrap=True)


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
        # piped output is not squeezed to 80 columns: every value is printed whole
        _wide().print(table, crop=False)


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


def _exit_now(code: int) -> None:
    """Leave the process without C++ static destructors.

    pyarrow's and DuckDB's native thread pools can be torn down at interpreter exit while a worker is
    still joinable, and ``std::terminate`` then aborts a command that had finished its work
    ("terminate called without an active exception", exit -6; apache/arrow#34314, duckdb/duckdb#13904).
    Everything Python's own shutdown does first still happens: non-daemon threads are joined, atexit
    handlers run (Prefect's log and event workers flush there), and stdio is flushed.
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


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
    return 1


def main() -> None:
    try:
        app()
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # an unexpected error: the traceback, then exit 1 like Python would
        import traceback

        traceback.print_exc()
        code = 1
    _exit_now(code)


if __name__ == "__main__":
    main()
