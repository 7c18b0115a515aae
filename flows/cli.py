"""``diffret``: the command line. Each command runs one stage through ``flows.runner.run_stage`` (or opens
SQL over the store) and prints the stage's one result line.

A stage runs through Prefect (tracked in the UI, resumable as a deployment) when a Prefect API is
configured (``PREFECT_API_URL``) or ``--prefect`` is given; otherwise the same work runs in-process
without starting Prefect's temporary server, which costs ~15 s per command.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from rich.markup import escape

from retrieval.models.backbones import BackboneConfig
from retrieval.rerank.training import RerankTrainSettings
from retrieval.search.rules import ScoreRules
from retrieval.training.loop import TrainSettings
from storage.layout import DEFAULT_ROOT

from .display import OutputFormat, console, index_checks, log, out, print_leaderboard, print_rows, progress
from .options import config_options, encode_settings, system_options, system_ref

app = typer.Typer(
    name="diffret",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Representative-token retrieval experiments (DiffRetriever, baselines) over an artifact store.",
)
Opt = typer.Option

Root = Annotated[str, Opt("--root", "-r", envvar="DIFFRET_ROOT", help="Store root (a folder or an fsspec URL).")]
Prefect = Annotated[bool | None, Opt("--prefect/--no-prefect", help="Run as a Prefect flow run (default: when "
                                     "PREFECT_API_URL is set).", show_default=False)]  # fmt: skip
Force = Annotated[bool, Opt("--force", help="Replace artifacts built with other settings (else refused).")]
Dataset = Annotated[str, Opt("--dataset", "-d", help="A dataset in the store (its queries and qrels).")]
System = Annotated[str | None, Opt("--system", help="A stored system (`diffret systems`); or name it by --model.")]
Corpus = Annotated[str | None, Opt(help="The passages' collection (default: the dataset's).")]
UnknownJudgments = Annotated[str, Opt(help="Judgments of documents the corpus lacks: error | drop (left out) | keep "
                                     "(as BEIR's evaluation).")]
Splits = Annotated[list[str] | None, Opt("--split", help="Query split(s), repeatable (default: test).")]
Ks = Annotated[str, Opt(help="Budgets, comma-separated.")]
TrainTopk = Annotated[int, Opt(min=1, help="Documents per train-split query (at most --topk; test splits: --topk).")]
Modes = Annotated[list[str] | None, Opt("--mode", help="Scoring mode(s), repeatable (default: all five).")]
SelfHits = Annotated[str, Opt(help="A retrieved document whose id is the query's (ArguAna, Quora): keep (the "
                              "reference evaluator's) | drop (BEIR's evaluation).")]  # fmt: skip
Ties = Annotated[str, Opt(help="Tied documents within a measure's depth: trec (pytrec_eval's order, the reference's) "
                          "| rank (the stored rank order).")]  # fmt: skip
Format = Annotated[OutputFormat, Opt("--format", "-f", help="Output format.")]
VerifyShards = Annotated[bool, Opt("--verify", help="Re-hash every stored shard (sha256) before resuming; default: "
                                   "trust a shard whose size and mtime match its record.")]  # fmt: skip
GRID = "1,2,4,8,16"


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
    from retrieval.data.collections import DatasetError
    from retrieval.models.backbones import BackboneError
    from storage import StoreError

    return (DatasetError, StoreError, BackboneError, ValueError)


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


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        out = []
    if not out:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}")
    return out


def _modes(mode: list[str] | None) -> dict[str, Any]:
    return {"modes": mode} if mode else {}


def _run(stage_name: str, prefect: bool | None, /, **fields: Any) -> Any:
    """Run a stage with a config of ``fields`` (Prefect or in-process), print its result line, return it."""
    from stages import stages

    from .runner import run_stage, use_prefect

    stage = stages()[stage_name]
    with _errors(), progress() as report:
        res = run_stage(stage, stage.config(**fields), prefect=use_prefect(prefect), log=log, report=report)
    console.print(res.line(), highlight=False, soft_wrap=True)
    return res


@app.command()
def download(
    name: Annotated[str, typer.Argument(help="Collection: scifact, nfcorpus, msmarco-passage, trec-dl-2019, ...")],
    source: Annotated[str | None, Opt("--source", "-s", help="Mirror: a folder, .zip/.tar.gz or URL.")] = None,
    cache_dir: Annotated[str, Opt(help="Where downloads are cached.")] = "~/.cache/diffret/downloads",
    unknown_judgments: UnknownJudgments = "error", root: Root = DEFAULT_ROOT, force: Force = False,
    prefect: Prefect = None,
) -> None:  # fmt: skip
    """Materialise a test collection as corpus / queries / qrels Parquet in the store."""
    res = _run("download", prefect, name=name, source=source, root=root, cache_dir=cache_dir, force=force,
               unknown_judgments=unknown_judgments)  # fmt: skip
    for line in res.details.get("report", []):
        console.print(line, highlight=False, markup=False, soft_wrap=True)


@app.command()
@system_options("settings")
def encode(
    dataset: Dataset, settings: dict, side: Annotated[list[str] | None, Opt("--side", help="query, passage")] = None,
    k: Ks = GRID, batch_size: Annotated[int, Opt(help="Texts per forward pass.")] = 32,
    shard_size: Annotated[int, Opt(help="Texts per shard (the unit of resume).")] = 1000,
    workers: Annotated[int, Opt(help="Local Dask workers (0: this process).")] = 0,
    dask_address: Annotated[str | None, Opt(help="An existing Dask scheduler, e.g. tcp://host:8786.")] = None,
    verify: VerifyShards = False, root: Root = DEFAULT_ROOT, force: Force = False, prefect: Prefect = None,
) -> None:  # fmt: skip
    """Tokenize, then encode a dataset's queries / passages for every K: dense multi-vectors + sparse weights."""
    from .encode import EncodeConfig, run_encode
    from .runner import use_prefect

    with _errors(), progress() as report:
        config = EncodeConfig(
            root=root, force=force, dataset=dataset, sides=side or ["query", "passage"], k=_ints(k),
            batch_size=batch_size, shard_size=shard_size, workers=workers, dask_address=dask_address,
            verify=verify, **encode_settings(settings),
        )  # fmt: skip
        res = run_encode(config, prefect=use_prefect(prefect) or bool(workers or dask_address), log=log, report=report)
    console.print(res.line(), highlight=False, soft_wrap=True)


@app.command()
@system_options("filter")
@config_options(ScoreRules, "rules")
def score(
    dataset: Dataset, settings: dict, rules: dict, system: System = None, corpus: Corpus = None,
    split: Splits = None, kq: Ks = GRID, kp: Ks = GRID, mode: Modes = None,
    topk: Annotated[int, Opt(help="Documents per query.")] = 1000, train_topk: TrainTopk = 100,
    self_hits: SelfHits = "keep", device: Annotated[str, Opt(help="auto | cpu | cuda | cuda:N")] = "auto",
    block_mb: Annotated[float, Opt(help="Memory for the scoring blocks, MiB (results do not depend on it).")] = 256,
    root: Root = DEFAULT_ROOT, force: Force = False, prefect: Prefect = None,
) -> None:  # fmt: skip
    """Exact search for every (K_q, K_p, mode) cell of a stored system: one run per cell in the store."""
    _run("score", prefect, root=root, force=force, dataset=dataset, corpus=corpus, system=system_ref(system, settings),
         splits=split or ["test"], kq=_ints(kq), kp=_ints(kp), topk=topk, train_topk=train_topk, device=device,
         block_mb=block_mb, rules=rules, self_hits=self_hits, **_modes(mode))  # fmt: skip


@app.command()
def bm25(
    dataset: Dataset, corpus: Corpus = None, split: Splits = None, topk: int = 1000, k1: float = 0.9, b: float = 0.4,
    train_topk: TrainTopk = 100, self_hits: SelfHits = "keep", root: Root = DEFAULT_ROOT, force: Force = False,
    prefect: Prefect = None,
) -> None:  # fmt: skip
    """BM25 baseline runs (bm25s, Lucene variant, English stemmer and stopwords)."""
    _run("bm25", prefect, root=root, force=force, dataset=dataset, corpus=corpus, splits=split or ["test"], topk=topk,
         train_topk=train_topk, self_hits=self_hits, bm25={"k1": k1, "b": b})  # fmt: skip


@app.command()
@config_options(BackboneConfig, "backbone")
def rerank(
    backbone: dict, dataset: Dataset = "scifact", corpus: Corpus = None, split: Splits = None,
    method: Annotated[str, Opt(help="pointwise | logits_listwise | permutation_sampling | permutation_assignment")]
    = "logits_listwise",
    first_stage: Annotated[str, Opt(help="The run to rerank: bm25, or a system slug (or unique prefix).")] = "bm25",
    kq: Annotated[int, Opt(help="The first-stage run's K_q (0 for BM25).")] = 0,
    kp: Annotated[int, Opt(help="The first-stage run's K_p (0 for BM25).")] = 0,
    mode: Annotated[str, Opt(help="The first-stage run's mode (bm25 for BM25).")] = "bm25",
    depth: Annotated[int, Opt(help="Candidates reranked per query.")] = 100,
    window: Annotated[int, Opt(help="Documents per listwise window.")] = 20,
    step: Annotated[int, Opt(help="Window step (RankGPT's sliding window).")] = 10,
    steps: Annotated[int, Opt(help="Denoising steps of permutation_sampling.")] = 4,
    doc_tokens: Annotated[int, Opt(help="Tokens of each document in a prompt.")] = 128,
    batch_size: Annotated[int, Opt(help="Prompts per forward pass.")] = 8,
    prompt: Annotated[str | None, Opt(help="A built-in rerank prompt or a YAML file (default: the method's).")] = None,
    root: Root = DEFAULT_ROOT, force: Force = False, prefect: Prefect = None,
) -> None:  # fmt: skip
    """Rerank a stored run's top candidates with a diffusion LM (DiffuRank); the result is a run like any other."""
    _run("rerank", prefect, root=root, force=force, dataset=dataset, corpus=corpus, splits=split or ["test"],
         method=method, first_stage=first_stage, first_kq=kq, first_kp=kp, first_mode=mode, depth=depth,
         window=window, step=step, steps=steps, doc_tokens=doc_tokens, batch_size=batch_size, prompt=prompt,
         backbone=backbone)  # fmt: skip


@app.command("training-data")
def training_data(
    dataset: Annotated[str | None, Opt("--dataset", "-d", help="Mine groups from this dataset's train split.")] = None,
    source: Annotated[str | None, Opt("--source", "-s", help="A Tevatron jsonl / Parquet file or hub id.")] = None,
    name: Annotated[str | None, Opt(help="The set's name (default: the dataset or the file's stem).")] = None,
    split: str = "train", negatives: Annotated[str, Opt(help="The stored system giving negatives.")] = "bm25",
    kq: int | None = None, kp: int | None = None, mode: str | None = None, depth: int = 30, n_negatives: int = 15,
    seed: int = 0, root: Root = DEFAULT_ROOT, force: Force = False, prefect: Prefect = None,
) -> None:  # fmt: skip
    """Training groups (query, positives, hard negatives) from a Tevatron file or mined from a stored run."""
    _run("training", prefect, root=root, force=force, dataset=dataset, source=source, name=name, split=split,
         negatives=negatives, kq=kq, kp=kp, mode=mode, depth=depth, n_negatives=n_negatives, seed=seed)  # fmt: skip


@app.command()
@system_options("settings")
@config_options(TrainSettings, "train_settings", exclude=("adapter",))
def train(
    training_set: Annotated[str, Opt("--training-set", "-t", help="A stored training set (diffret training-data).")],
    settings: dict, train_settings: dict, full: Annotated[bool, Opt("--full", help="Train every weight "
    "(else LoRA r 16, alpha 64).")] = False, merge: Annotated[bool, Opt("--merge", help="LoRA: save the merged "
    "weights (a plain model folder) instead of the adapter alone.")] = False, checkpoint_every: int = 50,
    name: str | None = None,
    root: Root = DEFAULT_ROOT, force: Force = False, prefect: Prefect = None,
) -> None:  # fmt: skip
    """Fine-tune a backbone contrastively (InfoNCE: dense tau 0.01 + sparse) on a stored training set; resumable.
    Several processes: `torchrun --nproc_per_node N -m flows.cli train ...` (docs/operations.md)."""
    enc = encode_settings(settings)
    train_settings = {**train_settings, "adapter": "full" if full else "lora"}
    res = _run("train", prefect, root=root, force=force, training_set=training_set, backbone=enc["backbone"],
               readout=enc["readout"], settings=train_settings, name=name,
               checkpoint_every=checkpoint_every, merge=merge)  # fmt: skip
    console.print(f"model: {res.details.get('model_dir')}", highlight=False, soft_wrap=True)


@app.command("train-reranker")
@config_options(BackboneConfig, "backbone")
@config_options(RerankTrainSettings, "train_settings", exclude=("adapter",))
def train_reranker(
    backbone: dict, train_settings: dict,
    source: Annotated[str | None, Opt("--source", "-s", help="A RankZephyr-format jsonl / jsonl.gz of ranked "
                                      "lists.")] = None,
    dataset: Annotated[str | None, Opt("--dataset", "-d", help="Teacher lists from this stored dataset's qrels "
                                       "over a first-stage run.")] = None,
    split: str = "train",
    teacher: Annotated[str, Opt(help="qrels: relevant documents first, then the run's; run: the run's own order "
                                "(distillation).")] = "qrels",
    first_stage: Annotated[str, Opt(help="The run giving the candidates: bm25, or a system slug.")] = "bm25",
    kq: Annotated[int, Opt(help="The first-stage run's K_q (0 for BM25).")] = 0,
    kp: Annotated[int, Opt(help="The first-stage run's K_p (0 for BM25).")] = 0,
    mode: Annotated[str, Opt(help="The first-stage run's mode (bm25 for BM25).")] = "bm25",
    full: Annotated[bool, Opt("--full", help="Train every weight (else LoRA r 16, alpha 32).")] = False,
    merge: Annotated[bool, Opt("--merge", help="LoRA: save the merged weights instead of the adapter.")] = False,
    checkpoint_every: int = 50, name: str | None = None,
    root: Root = DEFAULT_ROOT, force: Force = False, prefect: Prefect = None,
) -> None:  # fmt: skip
    """Fine-tune a DiffuRank reranker (listwise CE / RankNet for pointwise and logits_listwise, MDLM SFT for the
    permutation methods) on RankZephyr lists or qrels-ordered lists from the store; resumable. Rerank with it:
    `diffret rerank --model <the printed folder> --method <the same method>`."""
    train_settings = {**train_settings, "adapter": "full" if full else "lora"}
    res = _run("train-reranker", prefect, root=root, force=force, source=source, dataset=dataset, split=split,
               teacher=teacher,
               first_stage=first_stage, first_kq=kq, first_kp=kp, first_mode=mode, backbone=backbone,
               settings=train_settings, name=name, checkpoint_every=checkpoint_every, merge=merge)  # fmt: skip
    console.print(f"model: {res.details.get('model_dir')}", highlight=False, soft_wrap=True)


@app.command()
def evaluate(
    system: Annotated[list[str] | None, Opt("--system", help="System(s), repeatable (default: all).")] = None,
    dataset: Annotated[list[str] | None, Opt("--dataset", "-d", help="Dataset(s), repeatable (default: all).")] = None,
    split: Splits = None, relevance_level: Annotated[int | None, Opt(help="Grade that binary measures count "
                                                                     "(default: 2 on TREC DL, else 1).")] = None,
    ties: Ties = "trec", root: Root = DEFAULT_ROOT, force: Force = False, prefect: Prefect = None,
) -> None:  # fmt: skip
    """Per-query metrics (pytrec_eval) for every run in the store without current ones."""
    _run("evaluate", prefect, root=root, force=force, systems=system or None, datasets=dataset or None,
         splits=split or None, relevance_level=relevance_level, ties=ties)  # fmt: skip


@app.command()
@system_options("filter")
def index(
    dataset: Dataset, settings: dict, system: System = None,
    index_type: Annotated[str, Opt("--type", help="none (flat) | IVF_PQ | IVF_HNSW_SQ")] = "IVF_PQ",
    split: Annotated[str, Opt(help="Query split of the recall check.")] = "test", kq: Ks = GRID, kp: Ks = GRID,
    overfetch: Annotated[int | None, Opt(help="Candidates = k x overfetch.")] = None,
    root: Root = DEFAULT_ROOT, force: Force = False, prefect: Prefect = None,
) -> None:  # fmt: skip
    """LanceDB multivector index per K_p; prints recall@10/@100 against exact search and latency."""
    res = _run("index", prefect, root=root, force=force, dataset=dataset, system=system_ref(system, settings),
               split=split, kq=_ints(kq), kp=_ints(kp), index_type=index_type, overfetch=overfetch)  # fmt: skip
    out.print(index_checks(res.details["checks"]), highlight=False, markup=False)


@app.command("export-run")
def export_run(
    system: Annotated[str, Opt("--system", help="A stored system (`diffret systems`).")], dataset: Dataset,
    output: Annotated[str, Opt("--output", "-o", help="The TREC run file to write.")], split: str = "test",
    kq: int = 0, kp: int = 0, mode: str = "bm25", root: Root = DEFAULT_ROOT,
) -> None:  # fmt: skip
    """Write one stored run as a TREC run file (qid Q0 docid rank score tag)."""
    from retrieval.evaluation import write_trec_run
    from stages.runs import read_run
    from stages.systems import SystemRef, find_system
    from storage import ArtifactStore
    from storage.layout import run_dir

    with _errors():
        store = ArtifactStore(root)
        store.refuse_inside(output, "--output")
        slug = find_system(store, SystemRef(system=system)).system
        table = read_run(store, run_dir(slug, dataset, split, kq, kp, mode))
        write_trec_run(table, output, tag=f"{slug}.{mode}.kq{kq}.kp{kp}")
    console.print(f"wrote {table.num_rows:,} lines to {output}", highlight=False)


@app.command()
@system_options("settings")
@config_options(ScoreRules, "rules")
def run(
    settings: dict, rules: dict, dataset: Dataset = "scifact",
    source: Annotated[str | None, Opt("--source", "-s", help="Mirror of the dataset: a BEIR-layout folder, "
                                      ".zip/.tar.gz or URL (offline: ../shared/data/<name>).")] = None,
    corpus_source: Annotated[str | None, Opt(help="Mirror of the judged corpus (TREC DL).")] = None,
    unknown_judgments: UnknownJudgments = "error",
    preset: Annotated[str, Opt(help="paper: the 5x5 grid; laptop: {1,4,16}^2, batch 16.")] = "paper",
    kq: Annotated[str | None, Opt(help="Query budgets (default: the preset's).")] = None,
    kp: Annotated[str | None, Opt(help="Passage budgets (default: the preset's).")] = None,
    batch_size: Annotated[int | None, Opt(help="Texts per forward pass (default: the preset's).")] = None,
    mode: Modes = None, split: Splits = None, bm25: Annotated[bool, Opt("--bm25/--no-bm25")] = True,
    train_topk: TrainTopk = 100,
    index_type: Annotated[str, Opt("--index", help="skip | none (flat) | IVF_PQ | IVF_HNSW_SQ")] = "skip",
    shard_size: int = 1000, workers: int = 0, dask_address: str | None = None, verify: VerifyShards = False,
    self_hits: SelfHits = "keep", ties: Ties = "trec", root: Root = DEFAULT_ROOT, force: Force = False,
    prefect: Prefect = None,
) -> None:  # fmt: skip
    """The whole zero-shot experiment: download, encode the grid, score every cell, BM25, evaluate, leaderboard."""
    import time

    from .pipeline import PRESETS, PipelineConfig, pipeline_flow, run_pipeline
    from .runner import prefect_api, use_prefect

    t0 = time.perf_counter()
    with _errors():
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
        base = PRESETS[preset]
        config = PipelineConfig(
            root=root, force=force, dataset=dataset, source=source, corpus_source=corpus_source, bm25=bm25,
            unknown_judgments=unknown_judgments, train_topk=train_topk,
            splits=split or ["test"], kq=_ints(base["kq"] if kq is None else kq),
            kp=_ints(base["kp"] if kp is None else kp), index=index_type,
            batch_size=batch_size or base["batch_size"], shard_size=shard_size, workers=workers, verify=verify,
            dask_address=dask_address, device=settings["backbone.device"], rules=rules, self_hits=self_hits, ties=ties,
            **encode_settings(settings), **_modes(mode),
        )  # fmt: skip
        if use_prefect(prefect) or workers or dask_address:
            with prefect_api():
                res = pipeline_flow(config)
        else:
            with progress(transient=True) as report:
                res = run_pipeline(config, log=log, report=report)
    for sp, rows in res["leaderboards"].items():
        print_leaderboard(dataset, sp, rows)
        console.print(f"summary, leaderboard and heatmaps: {res['folders'][sp]}", highlight=False, soft_wrap=True)
    console.print(f"done in {time.perf_counter() - t0:,.1f} s", highlight=False)


@app.command()
def report(
    root: Root = DEFAULT_ROOT, name: Annotated[str, Opt(help="reports/report=<name>/ in the store.")] = "default",
    out_dir: Annotated[str | None, Opt("--out", "-o", help="Also copy the report here.")] = None,
    ref: Annotated[list[str] | None, Opt("--ref", help="Reference system(s) of the † / ‡ markers.")] = None,
    finetuned: Annotated[list[str] | None, Opt("--finetuned", help="BASE=FT: a fine-tuned system.")] = None,
    n_boot: Annotated[int, Opt(help="Bootstrap resamples of the correlation CIs.")] = 1000,
    hidden: Annotated[int, Opt(help="Footprint projection: hidden size.")] = 3584,
    backbones: Annotated[int, Opt(help="Footprint projection: backbones.")] = 4,
    settings: Annotated[int, Opt(help="Footprint projection: settings per backbone.")] = 2,
    force: Force = False, prefect: Prefect = None,
) -> None:  # fmt: skip
    """Budget selection, landscapes, oracle, feature correlation, paper tables, footprint: markdown + PNG + CSV."""
    pairs = [item.partition("=") for item in finetuned or []]
    if any(not a or not sep or not b for a, sep, b in pairs):
        _fail(ValueError(f"--finetuned expects BASE=FT, got {finetuned}"))
    res = _run("report", prefect, root=root, force=force, name=name, out_dir=out_dir, refs=ref or None,
               n_boot=n_boot, finetuned={a: b for a, _, b in pairs}, hidden=hidden, backbones=backbones,
               settings=settings)  # fmt: skip
    console.print(f"report written: {res.details['folder']}/report.md", highlight=False, soft_wrap=True)


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="SQL over the views (`diffret views` lists them).")],
    root: Root = DEFAULT_ROOT, fmt: Format = OutputFormat.table,
    verify: Annotated[bool, Opt("--verify", help="Check every file's sha256 first.")] = False,
    out: Annotated[str | None, Opt("--out", "-o", help="Write the result to FILE.csv or FILE.parquet.")] = None,
) -> None:  # fmt: skip
    """Run read-only DuckDB SQL over the store's views (queries/*.sql) and print the result (or --out it).

    Queries read the store and nothing else: COPY, CREATE, ATTACH, INSTALL, SET and reading files outside the
    store root are refused."""
    import duckdb

    from storage import ArtifactStore
    from storage.sql import StoreSQL

    with _errors():
        try:
            with StoreSQL(ArtifactStore(root), verify=verify) as db:
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


@app.command()
def verify(root: Root = DEFAULT_ROOT) -> None:
    """Check every stored file against its manifest's sha256; exit 1 naming each damaged or missing file (the
    next run of its stage redoes it)."""
    from storage import ArtifactStore

    with _errors():
        checked, problems = ArtifactStore(root).verify_all()
    for line in problems:  # results go to stdout (errors of the command itself to stderr)
        out.print(f"[bold red]damaged:[/] {escape(line)}", highlight=False, soft_wrap=True)
    if problems:
        out.print(f"{len(problems)} problem(s) in {checked:,} file(s)", highlight=False)
        raise typer.Exit(code=1)
    out.print(f"{checked:,} file(s) match their manifests", highlight=False)


@app.command()
def views(root: Root = DEFAULT_ROOT) -> None:
    """List the SQL views and their columns."""
    from storage import ArtifactStore
    from storage.sql import StoreSQL

    with _errors(), StoreSQL(ArtifactStore(root)) as db:
        for name in db.views:
            _, rows = db.query(f"DESCRIBE {name}")
            out.print(f"[bold]{name}[/]: " + ", ".join(f"{r[0]} {r[1]}" for r in rows), highlight=False)


@app.command()
def systems(root: Root = DEFAULT_ROOT, fmt: Format = OutputFormat.table) -> None:
    """List the systems in the store (the registry) with every setting that made them."""
    from stages.systems import list_systems
    from storage import ArtifactStore

    with _errors():
        recs = list_systems(ArtifactStore(root))
    cols = ["system", "kind", "model", "readout", "settings", "model_path"]
    rows = [(r.system, r.kind, r.model, r.readout, json.dumps(r.settings, sort_keys=True), st.get("model_path"))
            for r, st in recs]  # fmt: skip
    print_rows(cols, rows, fmt)


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


HELP_WIDTH = 160  # --help is laid out at least this wide: option names and their help are never cut


def _help_width() -> None:
    import shutil

    import typer.rich_utils

    if not os.environ.get("TERMINAL_WIDTH"):
        typer.rich_utils.MAX_WIDTH = max(shutil.get_terminal_size((HELP_WIDTH, 24)).columns, HELP_WIDTH)


def main() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the stages show their own progress
    _help_width()
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
