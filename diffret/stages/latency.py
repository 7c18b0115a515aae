"""The latency stage (paper section 5.4, Figures 1 and 3): a system's encoding latency against input length and
its search latency against index size, measured the same way for every readout and stored as rows.

    latency/system=<slug>/kind=encode/setting=<hash>/encode_latency.parquet
    latency/system=<slug>/kind=search/setting=<hash>/search_latency.parquet

A folder's hash covers its settings and the machine (device name, thread count, library versions): another
setting or another machine is a new folder beside the others, never a mix, and a run with nothing new does
nothing. The views ``encode_latency`` and ``search_latency`` read every folder.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field, field_validator

from diffret.retrieval.analysis.latency import encode_latency, environment, exact_search_latency, lance_search_latency
from diffret.retrieval.fields import cli
from diffret.retrieval.models.backbones import BackboneConfig
from diffret.retrieval.models.readouts import DEFAULT_MAX_LENGTH, ReadoutConfig, readout_class
from diffret.storage import Manifest
from diffret.storage.layout import (
    ENCODE_LATENCY_FILE,
    ENCODE_LATENCY_SCHEMA,
    SEARCH_LATENCY_FILE,
    SEARCH_LATENCY_SCHEMA,
    latency_dir,
)
from diffret.storage.manifest import config_hash

from .base import Context, Folder, KList, Plan, Positive, Stage, StageConfig, StageResult
from .encode import reader_for
from .presentation import Presentation
from .systems import EncodeSettings, encoder_slug
from .tokenize import default_backbone

UNCUT = 1 << 20  # the reader's max_length here: synthetic inputs are cut by nothing but the model's positions


def _positive_sorted(v: list[int]) -> list[int]:
    if not v or any(x <= 0 for x in v):
        raise ValueError(f"give positive integers, got {v}")
    return sorted(set(v))


class LatencyConfig(StageConfig):
    """Parameters of the latency flow."""

    backbone: BackboneConfig = Field(default_factory=default_backbone, description="The model and how it is loaded.")
    readout: ReadoutConfig = Field(default_factory=ReadoutConfig, description="How a text becomes vectors.")
    max_length: int = Field(
        default=DEFAULT_MAX_LENGTH,
        ge=1,
        description="The system's max_length (its slug, as "
        "encode names it); the synthetic inputs are not cut by it, only by the model's positions.",
    )
    kinds: list[Literal["encode", "search"]] = Field(default=["encode", "search"], description="What to time.")
    sides: list[Literal["query", "passage"]] = Field(
        default=["query"], description="The prompt sides to encode.", json_schema_extra=cli(flag="--side")
    )
    lengths: list[Positive] = Field(
        default=[16, 32, 64, 128, 256, 512], description="Synthetic input lengths (text tokens, before the prompt)."
    )
    batch_sizes: list[Positive] = Field(
        default=[1],
        description="Texts per forward pass (1: one query's latency).",
        json_schema_extra=cli(flag="--batch-size"),
    )
    k: KList = Field(default=[1, 16], description="Budgets: K masks (the mask readout), the cap N (PromptReps), 1.")
    search_sizes: list[Positive] = Field(
        default=[1000, 10000, 100000],
        description="Index sizes (documents) to search; synthetic, held in memory: documents x K_p x hidden x 4 bytes.",
    )
    search_k: list[str] = Field(
        default=["1x1", "4x16"],
        description="K_qxK_p budgets to search (1x1: one vector per text, single-vector; the others multi-vector).",
    )
    engines: list[Literal["exact", "lance"]] = Field(
        default=["exact", "lance"],
        description="Search engines to time: the exact block scorer, LanceDB (multivector + MaxSim).",
    )
    lance_index: Literal["auto", "none", "IVF_PQ", "IVF_HNSW_SQ"] = Field(
        default="auto",
        description="LanceDB's index (auto: IVF_PQ where a table has the vectors to train it, else its flat search).",
    )
    search_queries: int = Field(default=16, ge=1, description="Queries searched a call (milliseconds per query).")
    topk: int = Field(default=100, ge=1, description="Documents kept per query.")
    repeats: int = Field(default=5, ge=1, description="Timed runs per row (min / median / max kept).")
    warmup: int = Field(default=1, ge=0, description="Untimed runs before them.")
    both_ways: bool = Field(
        default=False,
        description="Also time the same checkpoint with the other readout (the mask "
        "readout <-> PromptReps; two systems), so that their ratio isolates one-pass against "
        "sequential decoding from the model. PromptReps reads a Dream / LLaDA checkpoint as the "
        "causal model it loads as, and without the mask token, which only the mask readout needs "
        "(--mask-token for a causal LM without one).",
    )

    _check = field_validator("lengths", "batch_sizes", "search_sizes")(_positive_sorted)

    @field_validator("search_k")
    @classmethod
    def _budgets(cls, v: list[str]) -> list[str]:
        for b in v:
            parts = b.lower().split("x")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"a search budget is K_qxK_p with positive integers (1x1, 4x16), got {b!r}")
        return [b.lower() for b in v]

    def search_budgets(self) -> list[tuple[int, int]]:
        """``search_k`` as (K_q, K_p) pairs."""
        return [(int(b.split("x")[0]), int(b.split("x")[1])) for b in self.search_k]

    def settings(self) -> list[EncodeSettings]:
        """The systems to time: this readout's, and with ``both_ways`` the other one's of the same checkpoint."""
        if not self.both_ways:
            return [EncodeSettings(backbone=self.backbone, readout=self.readout, max_length=self.max_length)]
        name = self.readout.readout
        if name not in ("diffretriever", "promptreps"):
            raise ValueError(f"both_ways compares the mask readout with PromptReps; the readout is {name}")
        other = ReadoutConfig(readout="promptreps" if name == "diffretriever" else "diffretriever")
        out = []
        for readout in (self.readout, other):
            backbone = self.backbone
            if readout.readout == "promptreps":  # as `diffret run --readout promptreps` names it: causal, no mask
                family = "causal" if backbone.family in ("dream", "llada") else backbone.family
                backbone = backbone.model_copy(update={"family": family, "mask_token": None})
            out.append(EncodeSettings(backbone=backbone, readout=readout, max_length=self.max_length))
        return out


@dataclass
class LatencyPlan(Plan):
    """A latency run's plan: the tables it writes, by ``system/kind``."""

    folders: dict[str, str] = field(default_factory=dict)


class Latency(Stage, name="latency", config=LatencyConfig, noun="table(s)", verb="measured"):
    """Encoding latency against input length and search latency against index size (the paper's Figures 1, 3)."""

    def plan(self, config: LatencyConfig, ctx: Context) -> LatencyPlan:
        every = config.settings()
        for settings in every:
            for k in config.k:  # each budget is its own encode (PromptReps' cap N too)
                readout_class(settings.readout.readout).check_k([k])
        env = environment(device=_device(config.backbone))
        plan = LatencyPlan(system=encoder_slug(every[0]))
        for n, settings in enumerate(every):
            system = encoder_slug(settings)
            common = {
                "system": system,
                "settings": settings.model_dump(mode="json"),
                "environment": env,
                "repeats": config.repeats,
                "warmup": config.warmup,
            }
            for kind in config.kinds:
                if kind == "encode":
                    cfg = {
                        **common,
                        "kind": kind,
                        "sides": config.sides,
                        "lengths": config.lengths,
                        "batch_sizes": config.batch_sizes,
                        "k": config.k,
                    }
                elif n == 0:  # search does not depend on the readout: timed once, with the first system
                    cfg = {
                        **common,
                        "kind": kind,
                        "sizes": config.search_sizes,
                        "search_k": config.search_budgets(),
                        "queries": config.search_queries,
                        "topk": config.topk,
                        "engines": config.engines,
                        "lance_index": config.lance_index,
                    }
                else:
                    continue
                folder = latency_dir(system, kind, config_hash(cfg)[:12])
                plan.folders[f"{system}/{kind}"] = folder
                plan.add_folder(ctx, folder, cfg, config.force)
        return plan

    def unit_name(self, unit: Folder) -> str:
        return f"{unit.config['kind']} {unit.config['system']}"

    def run(self, unit: Folder, ctx: Context) -> int:
        c = unit.config
        settings = EncodeSettings.model_validate(c["settings"])
        # encode's one-model-per-process reader, uncut: only the model's positions cut the synthetic inputs
        reader = reader_for(settings.model_copy(update={"max_length": UNCUT}))
        bb = reader.bb
        env = {**environment(bb.model, bb.device), "dtype": str(bb.dtype).removeprefix("torch.")}
        if c["kind"] == "encode":
            rows = []
            for side in c["sides"]:
                for k in c["k"]:
                    ctx.log(f"encode latency: {side}, K={k}, lengths {c['lengths']}")
                    rows += encode_latency(reader, side, c["lengths"], c["batch_sizes"], k, c["repeats"], c["warmup"])
            extra = {
                "system": c["system"],
                "model": settings.backbone.model,
                "family": bb.family,
                "readout": settings.readout.readout,
                "denoise_steps": settings.readout.denoise_steps,
                "hidden": bb.hidden_size,
            }
            name, schema = ENCODE_LATENCY_FILE, ENCODE_LATENCY_SCHEMA
        else:
            rows = []
            for kq, kp in c["search_k"]:
                modes = ["single_dense"] if (kq, kp) == (1, 1) else ["multi_dense"]
                ctx.log(f"search latency: {', '.join(c['engines'])}, (K_q, K_p) = ({kq}, {kp}), sizes {c['sizes']}")
                if "exact" in c["engines"]:
                    rows += exact_search_latency(
                        c["sizes"],
                        kq,
                        kp,
                        bb.hidden_size,
                        modes,
                        queries=c["queries"],
                        topk=c["topk"],
                        repeats=c["repeats"],
                        warmup=c["warmup"],
                        device=bb.device,
                    )
                if "lance" in c["engines"]:
                    with tempfile.TemporaryDirectory(prefix="diffret-latency-") as work:
                        rows += lance_search_latency(
                            c["sizes"],
                            kq,
                            kp,
                            bb.hidden_size,
                            work,
                            queries=c["queries"],
                            topk=c["topk"],
                            index_type=c["lance_index"],
                            repeats=c["repeats"],
                            warmup=c["warmup"],
                        )
            extra = {"system": c["system"]}
            name, schema = SEARCH_LATENCY_FILE, SEARCH_LATENCY_SCHEMA
        when = {"measured_at": datetime.now(UTC)}
        table = pa.Table.from_pylist([{**r, **extra, **env, **when} for r in rows], schema=schema)
        part = {"system": c["system"], "kind": c["kind"], "setting": unit.stage.rsplit("=", 1)[-1]}
        m = Manifest.new("latency", part, c, stats={"rows": table.num_rows, "environment": env})
        with ctx.store.folder_writer(unit.stage, m) as w:
            w.write_parquet(name, schema, [table])
        return table.num_rows

    def finish(self, config: LatencyConfig, plan: Plan, results: list[Any], ctx: Context) -> dict[str, Any]:
        assert isinstance(plan, LatencyPlan)
        return {"folders": dict(plan.folders), "rows": sum(results)}


def _printed(result: StageResult) -> list[str]:
    return [f"latency rows measured: {result.details.get('rows')}"]


presentation = Presentation(
    deployment=(
        "The paper's cost figures for one system: encoding latency per text against input length (synthetic "
        "inputs, at each K or PromptReps cap N, batch size 1 by default) and exact search latency per query "
        "against index size, single- and multi-vector; min / median / max of repeated runs after warm-up, with "
        "the device, dtype, attention and library versions. Stored under `latency/` (views `encode_latency`, "
        "`search_latency`); a changed setting or machine is a new folder, a repeated run does nothing."
    ),
    example={},
    next_step='query them: `diffret sql "SELECT * FROM encode_latency"`; plot them: `diffret report`.',
    printed=_printed,
)


def _device(backbone: BackboneConfig) -> str:
    from diffret.retrieval.devices import resolve_device

    return str(resolve_device(backbone.device))


stage = Latency()
