"""The train stage: contrastive fine-tuning of a backbone on a stored training set (paper section 3.4).

    models/model=<name>/                 LoRA: the peft adapter (adapter_model.safetensors, adapter_config.json
                                         naming the base) and the tokenizer; --full or --merge: a transformers
                                         folder (config, weights, tokenizer). `--model` takes either
                        train_log.parquet   one row per optimizer step (loss, dense, sparse, lr, samples/s)
                        loss.png            the loss curve
    checkpoints/model=<name>/last.pt     the resumable state while training runs (removed at the end)

The model's name is ``<base>-ft-<hash>``, the hash over the training set's config hash, the backbone, the
readout and every training setting, so a fine-tuned model is a system of its own when encoded. A killed run
resumes from its last checkpoint (weights, optimizer, scheduler, RNG states, step) and ends bit-identical
to an uninterrupted one. An adapter folder given as ``--model`` loads its base model and applies it (or
``--model BASE --adapter FOLDER``; an adapter is refused on another base).
"""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
from pydantic import Field

from diffret.retrieval.data.training import groups_from_table
from diffret.retrieval.devices import memory_bytes, resolve_device
from diffret.retrieval.fields import cli
from diffret.retrieval.models.backbones import BASE_FILE, BackboneConfig, BackboneError, load_backbone, raw_config
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader, readout_class
from diffret.retrieval.training.loop import Loop, Trainer, TrainSettings, planned_steps, training_memory, world
from diffret.retrieval.training.negatives import RetrievedNegatives
from diffret.storage import IncompleteArtifactError, Manifest, StoreError
from diffret.storage.layout import (
    BOT_FILE,
    GROUPS_FILE,
    MODEL_TASK_KEY,
    TRAIN_LOG_FILE,
    TRAIN_LOG_SCHEMA,
    bot_dir,
    checkpoint_path,
    dataset_dir,
    model_dir,
    training_dir,
)
from diffret.storage.manifest import config_hash

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from .base import Context, Plan, Stage, StageConfig, StageResult
from .presentation import Presentation
from .readers import bot_index
from .systems import SystemRef, find_system, slug_base, tokenizer_of, vocab_hash
from .tokenize import default_backbone


class TrainConfig(StageConfig):
    """Parameters of the train flow."""

    training_set: str = Field(
        description="A stored training set (diffret training-data).", json_schema_extra=cli(short="-t")
    )
    backbone: BackboneConfig = Field(
        default_factory=default_backbone, description="The model to fine-tune, and how it is loaded."
    )
    readout: ReadoutConfig = Field(default_factory=ReadoutConfig, description="The readout it is trained through.")
    settings: TrainSettings = Field(default_factory=TrainSettings, description="The training settings.")
    name: str | None = Field(default=None, description="The model's name (default: {base}-ft-{hash}).")
    checkpoint_every: int = Field(default=50, ge=1, description="Steps between checkpoints (resume points).")
    merge: bool = Field(
        default=False,
        description="LoRA: save the weights with the adapter merged (a plain model "
        "folder, no base needed) instead of the adapter alone.",
    )
    memory_gb: float | None = Field(
        default=None,
        gt=0,
        description="Memory one training process may use (GiB): "
        "a pool whose estimated peak exceeds it is refused before the model is loaded "
        "(default: the GPU's memory, or the memory the CPU has available).",
    )
    bot: str | None = Field(
        default=None,
        description="Retrieved negatives: the bag-of-tokens index's tokenizer slug "
        "(`diffret sql 'from bot_indexes'`); default: the training corpus's one index with the "
        "model's vocabulary.",
    )


@dataclass
class TrainUnit:
    stage: str
    name: str
    config: dict[str, Any]
    steps: int
    checkpoint_every: int


@dataclass
class TrainPlan(Plan):
    """A training run's plan: its model folder (absolute), reported whether trained now or found current."""

    model_dir: str = ""


class ModelStage(Stage):
    """A stage that trains and saves one model (train, train-reranker): one unit unless a current model is stored,
    progress in optimizer steps, the loss curve as its result's page."""

    @staticmethod
    def model_plan(ctx: Context, config: Any, cfg: dict[str, Any], tag: str, n_items: int) -> TrainPlan:
        """The plan of a training stage: the model's name (``config.name`` or ``<base>-<tag>-<hash of cfg>``), its
        folder, and one unit unless a current model is stored. ``config`` has backbone, settings, name, force and
        checkpoint_every."""
        name = config.name or f"{slug_base(config.backbone.model)}-{tag}-{config_hash(cfg)[:10]}"
        cfg["model"] = name
        _, steps = planned_steps(n_items, config.settings, cfg["world_size"])
        folder = model_dir(name)
        plan = TrainPlan(system=name, work=0, work_unit="steps", model_dir=ctx.store.abspath(folder))
        if plan.needs(ctx, folder, cfg, config.force):
            plan.units.append(TrainUnit(folder, name, cfg, steps, config.checkpoint_every))
            plan.work = steps
        return plan

    def work_of(self, unit: TrainUnit) -> int:
        return unit.steps

    def finish(self, config: Any, plan: Plan, results: list[Any], ctx: Context) -> dict[str, Any]:
        """The loss curve and a table of the log (the Prefect artifact of the run), once a model is trained."""
        assert isinstance(plan, TrainPlan)
        details: dict[str, Any] = {"model_dir": plan.model_dir}
        for unit, stats in zip(plan.units, results, strict=True):
            if stats.get("log"):
                png_path = f"{unit.stage}/loss.png"
                png = ctx.store.read_bytes(png_path) if ctx.store.exists(png_path) else b""
                details["markdown"] = loss_markdown(unit.name, stats["log"], png)
        return details


class Train(
    ModelStage,
    name="train",
    config=TrainConfig,
    noun="model(s)",
    verb="trained",
    reports_progress=True,
    task_tags=("gpu",),
):
    """Fine-tune a backbone contrastively (InfoNCE, dense + sparse) on a stored training set."""

    def plan(self, config: TrainConfig, ctx: Context) -> Plan:
        resolve_device(config.backbone.device)  # a device this machine lacks: refused before any work
        data = ctx.store.require_manifest(training_dir(config.training_set))
        config = config.model_copy(update={"settings": config.settings.resolved(config.readout.readout)})
        stored = max_negatives(ctx.store, config.training_set, data)
        if config.settings.n_negatives and config.settings.n_negatives > stored:
            raise ValueError(
                f"--n-negatives {config.settings.n_negatives} but training set {config.training_set!r} "
                f"stores at most {stored} per group, so every group's would be drawn again and again; "
                "lower --n-negatives or mine more (`diffret training-data --n-negatives N`)"
            )
        budget_from = "given"
        n = config.settings.promptreps_n
        if (config.settings.kq is None or config.settings.kp is None) and config.readout.readout == "promptreps" and n:
            kq, kp, budget_from = n, n, f"PromptReps' cap N = {n} (the paper's fine-tuning)"
            given = {k: v for k, v in (("kq", config.settings.kq), ("kp", config.settings.kp)) if v is not None}
            config = config.model_copy(
                update={"settings": config.settings.model_copy(update={"kq": kq, "kp": kp, **given})}
            )
        if config.settings.kq is None or config.settings.kp is None:
            kq, kp, budget_from = selected_budget(ctx, config)
            given = {k: v for k, v in (("kq", config.settings.kq), ("kp", config.settings.kp)) if v is not None}
            config = config.model_copy(
                update={"settings": config.settings.model_copy(update={"kq": kq, "kp": kp, **given})}
            )
            ctx.log(f"training budget (K_q, K_p) = ({config.settings.kq}, {config.settings.kp}): {budget_from}")
        check_memory(config)
        cfg: dict[str, Any] = {
            "training_set": config.training_set,
            "backbone": config.backbone.model_dump(exclude={"device"}),
            "readout": config.readout.numbers(),
            "settings": config.settings.recorded(),
            "inputs": {"training": data.config_hash},
            "world_size": world()[1],
            "merge": config.merge,
            "budget_from": budget_from,
        }
        if config.settings.retrieved_negatives is not None:
            if config.readout.readout != "sidr":
                raise ValueError("--retrieved-negatives is SIDR's in-training retrieval: train with --readout sidr")
            corpus = str(data.config.get("corpus") or data.config["dataset"])
            _, b_man = _bot_index(ctx.store, config, corpus)
            cfg["inputs"]["bot"] = b_man.files[BOT_FILE].sha256  # its content: the same bags under any name
            cfg["bot"] = corpus
        return self.model_plan(ctx, config, cfg, "ft", int(data.total_rows()))

    def run(self, unit: TrainUnit, ctx: Context) -> dict[str, Any]:
        store, cfg = ctx.store, unit.config
        groups = groups_from_table(store.read_table(training_dir(cfg["training_set"]), GROUPS_FILE))
        backbone = BackboneConfig.model_validate(cfg["backbone"])
        bb = load_backbone(backbone)
        reader = make_reader(bb, ReadoutConfig.model_validate(cfg["readout"]), 512)
        settings = TrainSettings.model_validate(cfg["settings"])
        negatives = None
        if settings.retrieved_negatives is not None:
            stage = _bot_with(store, cfg["bot"], cfg["inputs"]["bot"])
            negatives = _retrieved_negatives(store, stage, settings.retrieved_negatives)
        trainer = Trainer(reader, groups, settings, negatives)
        stats: dict[str, Any] = {"groups": len(groups)}
        return fit_and_save(trainer, unit, cfg, bb.tokenizer, ctx, stats, extra=lambda: _negative_counts(negatives))


def _printed(result: StageResult) -> list[str]:
    return [f"model: {result.details.get('model_dir')}"]


presentation = Presentation(
    deployment=(
        "Contrastive fine-tuning (InfoNCE, dense tau 0.01 + sparse) of a backbone on a stored training set, LoRA "
        "(r 16, alpha 64) or full, at the budget the base model's zero-shot train split selected unless "
        "settings.kq / settings.kp are given; checkpoints every N steps, so a re-run resumes. Writes "
        "`models/model=<name>/` (the peft adapter, or the weights with --full / merge) that encode and run take "
        "as --model; the loss curve is the run's artifact. Several GPUs: torchrun (docs/operations.md)."
    ),
    example={
        "training_set": "scifact",
        "backbone": {"model": "dllm-hub/ModernBERT-base-chat-v0.1"},
    },
    next_step=(
        "encode and score with the fine-tuned model: `diffret run -d DATASET --model MODEL_FOLDER` (the "
        "pipeline deployment)."
    ),
    printed=_printed,
)


def _negative_counts(negatives: RetrievedNegatives | None) -> dict[str, Any]:
    if negatives is None:
        return {}
    return {"retrieved_negatives": negatives.drawn, "retrieved_fallback_queries": negatives.fallback}


def _bot_index(store: Any, config: TrainConfig, corpus: str) -> tuple[str, Manifest]:
    """The bag-of-tokens index retrieved negatives search: ``config.bot``, else the corpus's one index built with
    the model's vocabulary; refused, naming what there is, when there is none or another vocabulary's."""
    mine = vocab_hash(tokenizer_of(config.backbone))
    stages = [bot_dir(config.bot, corpus)] if config.bot else store.folders(f"bot/tokenizer=*/dataset={corpus}")
    found = []
    for stage in stages:
        m = store.read_manifest(stage)
        if m is not None and (config.bot or m.config.get("vocab_hash") == mine):
            found.append((stage, m))
    hint = f"build one with `diffret bot -d {corpus} --model {config.backbone.model}`"
    if not found:
        raise IncompleteArtifactError(
            f"retrieved negatives: no bag-of-tokens index of {corpus!r} with the "
            f"vocabulary of {config.backbone.model}; {hint}"
        )
    if len({m.files[BOT_FILE].sha256 for _, m in found}) > 1:  # the same bags under several names: any of them
        raise StoreError(
            f"retrieved negatives: several different bag-of-tokens indexes of {corpus!r} fit "
            f"({', '.join(m.partition['tokenizer'] for _, m in found)}); name one with --bot"
        )
    stage, m = found[0]
    theirs = m.config.get("vocab_hash")
    if theirs is not None and theirs != mine:
        raise StoreError(
            f"the bag-of-tokens index {m.partition.get('tokenizer')!r} was built with another tokenizer "
            f"than {config.backbone.model}: their token ids do not mean the same words; {hint}"
        )
    return stage, m


def _bot_with(store: Any, corpus: str, sha256: str) -> str:
    """The bag-of-tokens folder of ``corpus`` whose bags file is ``sha256`` (the one a training planned with)."""
    for folder in store.folders(f"bot/tokenizer=*/dataset={corpus}"):
        m = store.read_manifest(folder)
        if m is not None and BOT_FILE in m.files and m.files[BOT_FILE].sha256 == sha256:
            return folder
    raise IncompleteArtifactError(
        f"the bag-of-tokens index of {corpus!r} this training planned with is gone; run it again"
    )


def _retrieved_negatives(store: Any, bot_folder: str, depth: int) -> RetrievedNegatives:
    """The index and the corpus passages retrieved negatives are drawn from."""
    man = store.require_manifest(bot_folder)
    doc_ids, bags = bot_index(store, bot_folder)
    corpus = store.read_table(dataset_dir(man.config["dataset"]), "corpus.parquet", columns=["doc_id", "title", "text"])
    row = {d: i for i, d in enumerate(corpus.column("doc_id").to_pylist())}
    missing = [d for d in doc_ids[:1000] if d not in row]
    if missing:
        raise StoreError(
            f"{store.abspath(bot_folder)}: ids not in the corpus {man.config['dataset']!r} "
            f"({', '.join(missing[:3])}); build the index again (`diffret bot --force`)"
        )
    where = np.asarray([row.get(d, -1) for d in doc_ids], np.int64)

    def passages(rows: list[int]) -> list[dict[str, str]]:
        t = corpus.take(pa.array(where[rows]))
        return [
            {"docid": d, "title": ti or "", "text": x or ""}
            for d, ti, x in zip(*(t.column(c).to_pylist() for c in ("doc_id", "title", "text")), strict=True)
        ]

    return RetrievedNegatives(bags, doc_ids, passages, depth)


def fit_and_save(
    trainer: Loop,
    unit: TrainUnit,
    cfg: dict[str, Any],
    tokenizer: Any,
    ctx: Context,
    stats: dict[str, Any],
    ylabel: str = "InfoNCE",
    extra: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train ``trainer`` to its last step from the unit's checkpoint (when a killed run left one), checkpointing
    every ``unit.checkpoint_every`` steps; then save the model folder (adapter or merged weights, tokenizer, log,
    loss curve) and drop the checkpoint. Under DDP only the first process logs and writes. The train stages'
    shared second half (contrastive and reranker training)."""
    store = ctx.store
    lead = trainer.rank == 0
    log = ctx.log if lead else (lambda _m: None)
    log(
        f"training {unit.name}: {trainer.trainable:,} of {trainer.total:,} parameters trainable "
        f"({100 * trainer.trainable / trainer.total:.2f}%), {trainer.steps} steps"
        + (f", {trainer.world} processes" if trainer.world > 1 else "")
    )
    ckpt = checkpoint_path(f"{unit.name}-{config_hash(cfg)[:10]}")
    if store.exists(ckpt):
        trainer.load_state(store.read_bytes(ckpt))
        log(f"resumed {unit.name} at step {trainer.step} of {trainer.steps}")
        ctx.advance(trainer.step)
    save = (lambda b: store.write_bytes(ckpt, b)) if lead else None

    def on_step(row: dict[str, Any]) -> None:
        ctx.note = f"loss {row['loss']:.4f}  lr {row['lr']:.2e}  {row['samples_per_s']:.1f} samples/s"
        ctx.advance(1)

    trainer.run(on_step=on_step, checkpoint=save, every=unit.checkpoint_every)
    stats = {
        "steps": trainer.step,
        "trainable": trainer.trainable,
        "parameters": trainer.total,
        "final_loss": trainer.log[-1]["loss"],
        "first_loss": trainer.log[0]["loss"],
        **stats,
        "processes": trainer.world,
        **(extra() if extra else {}),
    }
    if lead:
        _save(unit, cfg, trainer, tokenizer, stats, ctx, ylabel)
        store.fs.rm(store.abspath(ckpt.rsplit("/", 1)[0]), recursive=True)
        log(
            f"{unit.name}: loss {stats['first_loss']:.3f} -> {stats['final_loss']:.3f}; "
            f"use it with --model {store.abspath(unit.stage)}"
        )
    trainer.close()
    return {**stats, "log": trainer.log}


def _save(
    unit: TrainUnit,
    cfg: dict[str, Any],
    trainer: Loop,
    tokenizer: Any,
    stats: dict[str, Any],
    ctx: Context,
    ylabel: str,
) -> None:
    m = Manifest.new("models", {"model": unit.name}, cfg, stats=stats)
    log = trainer.log
    with tempfile.TemporaryDirectory(prefix="diffret-model-") as tmp:
        if trainer.peft is not None and not cfg["merge"]:
            base = cfg["backbone"]["model"]
            local = Path(base).expanduser()
            trainer.peft.peft_config["default"].base_model_name_or_path = (
                str(local.resolve()) if local.exists() else base
            )
            trainer.bb.model.eval()
            trainer.peft.save_pretrained(tmp)
            gguf = cfg["backbone"].get("gguf_file")
            if gguf:  # the base is a GGUF file in its folder: loading the adapter alone needs its name
                Path(tmp, BASE_FILE).write_text(json.dumps({"gguf_file": gguf}))
        else:
            extra = trainer.extra_models()  # off the main model first: its folder holds its own weights only
            cast("PreTrainedModel", trainer.merged_model()).save_pretrained(tmp)  # a transformers model, or a peft one
            for sub, model in extra.items():
                cast("PreTrainedModel", model).save_pretrained(Path(tmp, sub))
                tokenizer.save_pretrained(Path(tmp, sub))
        tokenizer.save_pretrained(tmp)
        with ctx.store.folder_writer(unit.stage, m) as w:
            for f in sorted(Path(tmp).rglob("*")):
                if f.is_file():
                    w.write_file(str(f.relative_to(tmp)), f.read_bytes())
            rows = [{k: r.get(k) for k in TRAIN_LOG_SCHEMA.names} for r in log]
            # which command made the model, readable without the manifest (verify names it as the repair)
            schema = TRAIN_LOG_SCHEMA.with_metadata({MODEL_TASK_KEY: cfg.get("task", "encoder")})
            w.write_parquet(TRAIN_LOG_FILE, schema, [pa.Table.from_pylist(rows, schema)])
            w.write_file("loss.png", _loss_png(log, unit.name, ylabel))


def check_memory(config: TrainConfig) -> None:
    """Refuse a training step whose estimated peak (:func:`retrieval.training.loop.training_memory`, from the
    model's config.json) exceeds ``memory_gb`` (default: the device's), before the model is loaded or a pool is
    built; one line with the estimate by part and what lowers it."""
    device = resolve_device(config.backbone.device)
    try:
        raw = raw_config(config.backbone)
    except BackboneError:  # the load that follows names the problem
        return
    s = config.settings
    bf16 = s.precision == "bfloat16" or (s.precision == "auto" and device.type == "cuda")
    sparse = readout_class(config.readout.readout).has_sparse
    need = training_memory(raw, s, sparse, bf16, world()[1], 4 if config.backbone.dtype == "float32" else 2)
    have = config.memory_gb * 2**30 if config.memory_gb else memory_bytes(device)
    if need is None or have is None or sum(need.values()) <= have:
        return
    gib = 2**30
    parts = ", ".join(f"{k} {v / gib:.1f}" for k, v in need.items() if v)
    stated = f"--memory-gb {config.memory_gb:g}" if config.memory_gb else f"this {device.type}'s {have / gib:.1f} GiB"
    raise ValueError(
        f"a training step would need about {sum(need.values()) / gib:.1f} GiB ({parts}; "
        f"{s.batch_size} groups of 1 + {s.n_negatives} passages a pass, a pool of {s.pool_size}), more "
        f"than {stated}: lower --batch-size (gradient caching keeps the pool), --n-negatives or "
        "--p-max-len, add --gradient-checkpointing, or state the memory there is with "
        "--memory-gb"
    )


def max_negatives(store: Any, name: str, data: Manifest) -> int:
    """The most hard negatives any group of a stored training set holds (its manifest's stats, else counted)."""
    if "max_negatives" in data.stats:
        return int(data.stats["max_negatives"])
    import pyarrow.compute as pc

    col = store.read_table(training_dir(name), GROUPS_FILE, columns=["negative_passages"]).column(0)
    return int(pc.max(pc.list_value_length(col)).as_py() or 0)


def selected_budget(ctx: Context, config: TrainConfig) -> tuple[int, int, str]:
    """(K_q*, K_p*, where from): the budget the base model's zero-shot system selected on its train split(s)
    (view ``budget_selection``: best mean hybrid NDCG@10); a clear error when the store has none."""
    from diffret.retrieval.analysis.views import rows
    from diffret.storage.sql import StoreSQL

    ref = SystemRef(model=config.backbone.model, where={"readout.readout": config.readout.readout})
    hint = (
        "run the base model zero-shot on a train split first (`diffret run --model ... --split train`), or "
        "give --kq and --kp"
    )
    try:
        system = find_system(ctx.store, ref).system
    except StoreError as exc:
        raise StoreError(f"no training budget given and {exc}; {hint}") from None
    with StoreSQL(ctx.store, warn=lambda line: ctx.log(f"warning: {line}")) as db:
        found = rows(
            db, "select kq_star, kp_star, train_ndcg_10, train_on from budget_selection where system = ?", [system]
        )
    if not found:
        raise StoreError(f"no training budget given and {system} has no train-split cells to select one; {hint}")
    kq, kp, ndcg, on = found[0].values()
    return int(kq), int(kp), f"selected zero-shot by {system} on {on} train (hybrid NDCG@10 {ndcg:.4f})"


def loss_markdown(name: str, log: list[dict[str, Any]], png: bytes, rows: int = 20) -> str:
    """The loss curve (embedded PNG) and a table of up to ``rows`` logged steps: a Prefect artifact's body.

    >>> print(loss_markdown("m", [{"step": 1, "loss": 2.0, "dense": 1.5, "sparse": 0.5, "lr": 1e-4,
    ...                            "samples_per_s": 3.0}], b"").splitlines()[-1])
    | 1 | 2.0000 | 1.5000 | 0.5000 | 1.00e-04 | 3.0 |
    """
    import base64

    n = min(rows, len(log))
    keep = sorted({round(i * (len(log) - 1) / max(1, n - 1)) for i in range(n)})  # evenly spaced, first and last
    lines = [f"## {name}: training loss", ""]
    if png:
        lines += [f"![loss curve](data:image/png;base64,{base64.b64encode(png).decode()})", ""]
    lines += ["| step | loss | dense | sparse | lr | samples/s |", "|---:|---:|---:|---:|---:|---:|"]
    for i in keep:
        r = log[i]
        vals = [f"{r[k]:.4f}" if r.get(k) is not None else "–" for k in ("loss", "dense", "sparse")]
        lines.append(f"| {r['step']} | {' | '.join(vals)} | {r['lr']:.2e} | {r['samples_per_s']:.1f} |")
    return "\n".join(lines)


def _loss_png(log: list[dict[str, Any]], title: str, ylabel: str = "InfoNCE") -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in log]
    for key in ("loss", "dense", "sparse", "topk", "bot"):
        if any(r.get(key) is not None for r in log):
            ax.plot(steps, [np.nan if r.get(key) is None else r[key] for r in log], label=key)  # None: a gap
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


stage = Train()
