"""The systems registry: what each system slug in the store stands for.

A *system* is everything that makes a set of runs: an encoder (backbone, readout and every setting that
changes the numbers) or BM25 (its parameters). Its slug names the ``system=`` partition of every folder it
produced, and ``systems/system=<slug>/_manifest.json`` records its full settings. Stages that read a
system (score, index, evaluate, report) look it up here, by name or by model plus the settings that tell it
apart; they never rebuild a slug from their own options.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from diffret.caching import KeyedCache
from diffret.retrieval.fields import Settings
from diffret.retrieval.models.backbones import BackboneConfig, canonical_model, load_tokenizer, weights_fingerprint
from diffret.retrieval.models.readouts import DEFAULT_MAX_LENGTH, ReadoutConfig, readout_class
from diffret.retrieval.models.released import CHECKPOINT_PROMPT, RELEASED_CONFIG, read_released, released_fingerprint
from diffret.retrieval.search.codecs import FLOAT16, parse_store, store_tag
from diffret.storage import ArtifactStore, Manifest, StoreError, config_hash
from diffret.storage.layout import system_dir
from diffret.storage.manifest import diff_configs

from .readers import TITLE_SEP

SYSTEMS_STAGE = "systems"


class EncodeSettings(Settings):
    """Everything that determines the numbers of an encoder system (its slug hashes :func:`numeric_settings`).

    The readout's ``auto`` settings are resolved here (:meth:`ReadoutConfig.resolved`), the encode path from the
    model (:func:`finetuned_model`), so a slug always records concrete values.
    """

    backbone: BackboneConfig
    readout: ReadoutConfig = Field(default_factory=ReadoutConfig)
    max_length: int = Field(
        default=DEFAULT_MAX_LENGTH,
        ge=1,
        description="Tokens per input: the prompt and the text "
        "(see the readout's truncation); run_encode.sh's 256, encode.py's own default 512.",
    )
    # the reference's choice: docs/ARCHITECTURE.md, parity table
    title_sep: str = Field(
        default=TITLE_SEP, description="Between a passage's title and its text ('. ': the reference's choice)."
    )
    store: str = Field(
        default=FLOAT16,
        description="How passage vectors are stored: float16, int8, residual:B "
        "(B = 1, 2, 4 bits; e.g. residual:2:16384 for 16,384 centroids) or pq:M (search/codecs.py). "
        "A compressed system is a system of its own; queries stay float16.",
    )
    store_seed: int = Field(default=0, ge=0, description="Seed of a compressed store's codebook sample and training.")

    @model_validator(mode="after")
    def _resolve_readout(self) -> EncodeSettings:
        if not self.readout.is_resolved:
            self.readout = released_readout(self.readout, self.backbone).resolved(finetuned_model(self.backbone))
        parse_store(self.store)  # an unknown choice is refused here, naming the choices
        return self


def released_readout(readout: ReadoutConfig, backbone: BackboneConfig) -> ReadoutConfig:
    """A released checkpoint's own settings where the readout leaves them open: its prompt ids (``auto`` ->
    ``checkpoint``) and its denoising steps (where ``denoise_steps`` is left at 1). Any other model: unchanged; the
    checkpoint prompt asked of one is refused.

    >>> released_readout(ReadoutConfig(), BackboneConfig(model="org/some-base")).prompt
    'auto'
    """
    ckpt = read_released(backbone.adapter or backbone.model)
    if ckpt is None:
        if readout.prompt == CHECKPOINT_PROMPT:
            raise ValueError(
                f"--prompt {CHECKPOINT_PROMPT} reads a released checkpoint's {RELEASED_CONFIG}; "
                f"{backbone.adapter or backbone.model} has none (give auto or a prompt variant)"
            )
        return readout
    if readout.readout != "diffretriever":
        return readout
    update: dict[str, Any] = {"prompt": CHECKPOINT_PROMPT} if readout.prompt == "auto" else {}
    if readout.denoise_steps == 1 and ckpt.denoise_steps > 1:
        update["denoise_steps"] = ckpt.denoise_steps
    return readout.model_copy(update=update)


# what marks a fine-tuned model: diffret train's manifest in its folder, or a reference checkpoint's config
REFERENCE_TRAINED_CONFIGS = ("retriever_config.json", "ar_retriever_config.json")


def finetuned_model(backbone: BackboneConfig) -> bool:
    """Whether a model (or its adapter) is a fine-tuned retriever: a folder ``diffret train`` saved (its
    ``_manifest.json`` of stage ``models`` names a readout) or a reference checkpoint (``retriever_config.json``,
    ``ar_retriever_config.json``). Hub ids are not (pass ``--finetuned yes``).

    >>> finetuned_model(BackboneConfig(model="org/some-base"))
    False
    """
    if read_released(backbone.adapter or backbone.model) is not None:  # a released one, by hub id too
        return True
    for name in (backbone.adapter, backbone.model):
        if not name:
            continue
        folder = Path(name).expanduser()
        if not folder.is_dir():
            continue
        if any((folder / f).exists() for f in REFERENCE_TRAINED_CONFIGS):
            return True
        try:
            m = json.loads((folder / "_manifest.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(m, dict) and m.get("stage") == "models" and "readout" in (m.get("config") or {}):
            return True
    return False


def slug_base(model: str) -> str:
    base = model.rstrip("/").split("/")[-1] or "model"
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", base).strip("-.")[:60] or "model"


# a system's storage settings when it stores float16 (left out of its settings: float16 slugs are unchanged)
STORED = {"store": FLOAT16, "store_seed": 0}
CHECKPOINT = {"load_format": "checkpoint", "shape": None}  # likewise its weights' when they are a checkpoint's


def numeric_settings(s: EncodeSettings) -> dict[str, Any]:
    """The settings that change the numbers (device, attention kernel and batch size do not); the storage choice
    only when it is not float16."""
    stored = {"store": s.store, "store_seed": s.store_seed} if s.store != FLOAT16 else {}
    return {
        **backbone_settings(s.backbone),
        "readout": s.readout.numbers(),
        "max_length": s.max_length,
        "title_sep": s.title_sep,
        **stored,
    }


def float16_settings(s: EncodeSettings) -> EncodeSettings:
    """The same encoder, storing float16 (the system a compressed one is made from)."""
    return s.model_copy(update=STORED)


def backbone_settings(b: BackboneConfig) -> dict[str, Any]:
    """The backbone settings that change a system's numbers (an encoder's or a reranker's)."""
    return {
        "model": b.model,
        "gguf_file": b.gguf_file,
        "family": b.family,
        "loader": b.loader,  # the remote LLaDA code ignores padding: its vectors depend on the batch
        "dtype": b.dtype,
        "mask_token": b.mask_token,
        "turn_end": b.turn_end,
        **({"adapter": b.adapter, "merge_adapter": b.merge_adapter} if b.adapter else {}),
        **({"load_format": b.load_format, "shape": b.shape} if b.random_weights else {}),  # checkpoints: as before
    }


def model_name(b: BackboneConfig) -> str:
    """The model part of a system's slug: its folder's (or hub id's) last part, an adapter's folder; ``random-`` and
    the shape (or the folder) for random weights, so that such a system is never taken for a trained one.

    >>> model_name(BackboneConfig(model="org/tiny-bert"))
    'tiny-bert'
    >>> model_name(BackboneConfig(model="org/tiny-dream", load_format="random", shape="dream-7b:num_hidden_layers=2"))
    'random-dream-7b'
    """
    if b.random_weights:
        return slug_base(f"random-{b.shape.partition(':')[0] if b.shape else slug_base(b.model)}")
    return slug_base(b.adapter or b.model)  # an adapter is named by its folder


def weights_label(record: SystemRecord) -> str:
    """What ``diffret systems`` says of a system's weights: RANDOM (and the shape) for random weights, checkpoint for
    a model's, nothing for a system without a model (BM25, an imported run, a fusion).

    >>> weights_label(SystemRecord(system="s", kind="encoder", settings={"load_format": "random", "shape": None}))
    "RANDOM (the folder's shape)"
    """
    backbone = record.settings.get("backbone")
    settings: dict[str, Any] = backbone if isinstance(backbone, dict) else record.settings
    if settings.get("load_format") == "random":
        shape = settings.get("shape") or "the folder's shape"
        return f"RANDOM ({shape})"
    return "checkpoint" if record.kind in ("encoder", "reranker") else ""


def random_weights_note(settings: dict[str, Any]) -> str | None:
    """What a system's settings (its registry record's) say about random weights, as the summaries and reports print
    it; None for a trained checkpoint.

    >>> random_weights_note({"model": "m", "load_format": "random", "shape": "dream-7b"})[:68]
    'RANDOM WEIGHTS (load format random, shape dream-7b, tokenizer of m):'
    """
    if isinstance(settings.get("backbone"), dict):  # a reranker's record holds its backbone's settings apart
        settings = settings["backbone"]
    if settings.get("load_format") != "random":
        return None
    shape = f"shape {settings['shape']}" if settings.get("shape") else "the folder's own shape"
    return (
        f"RANDOM WEIGHTS (load format random, {shape}, tokenizer of {settings.get('model')}): its numbers measure "
        "speed and plumbing, not retrieval"
    )


def weights_of(b: BackboneConfig) -> dict[str, str]:
    """Content fingerprints of a local model (and adapter) folder's weights, when they are there (hub ids: none).
    Recorded in the registry, not hashed into the slug: a re-run with every artifact current needs no weights. Random
    weights: none (no file is read; the slug's load format and shape say what they are)."""
    out: dict[str, str] = {}
    if b.random_weights:
        return out
    if released := released_fingerprint(b.adapter or b.model):  # its adapter and settings (a hub id's snapshot too)
        out["adapter_weights"] = released
        if b.adapter and (fp := weights_fingerprint(b.model, b.gguf_file)):
            out["weights"] = fp
        return out
    if fp := weights_fingerprint(b.model, b.gguf_file):
        out["weights"] = fp
    if b.adapter and (fp := weights_fingerprint(b.adapter)):
        out["adapter_weights"] = fp
    return out


def encoder_slug(s: EncodeSettings) -> str:
    """``<model basename>-<readout>-[<store>-]<hash of numeric_settings>``.

    >>> encoder_slug(EncodeSettings(backbone=BackboneConfig(model="org/tiny-bert")))
    'tiny-bert-diffretriever-49546d2856'
    >>> encoder_slug(EncodeSettings(backbone=BackboneConfig(model="org/tiny-bert"), store="residual:2"))[:32]
    'tiny-bert-diffretriever-residual'
    >>> encoder_slug(EncodeSettings(backbone=BackboneConfig(model="org/tiny-bert", load_format="random")))[:31]
    'random-tiny-bert-diffretriever-'
    """
    name = model_name(s.backbone)
    tag = f"{store_tag(s.store)}-" if s.store != FLOAT16 else ""
    return f"{name}-{s.readout.readout}-{tag}{config_hash(numeric_settings(s))[:10]}"


def bm25_slug(settings: BaseModel) -> str:
    return f"bm25-{config_hash(settings.model_dump())[:10]}"


def tokenizer_slug(
    model: str, gguf_file: str | None, max_length: int, tokenizer: Any, title_sep: str = TITLE_SEP
) -> str:
    """The tokens folder of a (tokenizer, max_length, passage join): the vocabulary is hashed, so a changed
    tokenizer is new."""
    key = {
        "model": model,
        "gguf": gguf_file,
        "max_length": max_length,
        "vocab": vocab_hash(tokenizer),
        "title_sep": title_sep,
    }
    h = config_hash(key)[:10]
    return f"{slug_base(model)}-{h}"


def vocab_hash(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary (token -> id): two tokenizers with the same one give the same ids.

    >>> class Tok:
    ...     def get_vocab(self): return {"a": 0, "b": 1}
    >>> vocab_hash(Tok())
    '532c111a'
    """
    import hashlib

    return hashlib.sha256(repr(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:8]


_TOKENIZERS: KeyedCache[str, Any] = KeyedCache(size=32)  # more models than one process loads


def tokenizer_of(backbone: BackboneConfig) -> Any:
    """The backbone's tokenizer, loaded once per process."""
    key = backbone.model_dump_json(include={"model", "gguf_file", "trust_remote_code"})
    return _TOKENIZERS.get(key, lambda: load_tokenizer(backbone))


def tokens_slug(backbone: BackboneConfig, max_length: int, title_sep: str = TITLE_SEP) -> str:
    """The ``tokenizer=`` partition of a backbone's token ids cut at ``max_length`` (passages joined by
    ``title_sep``)."""
    return tokenizer_slug(backbone.model, backbone.gguf_file, max_length, tokenizer_of(backbone), title_sep)


# ------------------------------------------------------------------------------------------- records
class SystemRecord(BaseModel):
    """One registered system (the ``config`` of its registry manifest)."""

    system: str
    kind: Literal["encoder", "bm25", "reranker", "run", "fusion"]  # run: imported (diffret import-run)
    model: str | None = None  # the backbone as given (HF id or path); None for BM25
    readout: str | None = None
    multi_vector: bool = False
    has_sparse: bool = False
    settings: dict[str, Any] = Field(default_factory=dict)  # exactly what the slug's hash covers

    def flat_settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {**STORED, **CHECKPOINT} if self.kind == "encoder" else {}
        for key, value in self.settings.items():
            if isinstance(value, dict):
                out.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                out[key] = value
        return out


def settings_of(record: SystemRecord, device: str = "auto") -> EncodeSettings:
    """The encode settings an encoder system was made with (its registry record), on ``device``; refused when
    they do not give back its slug (a record of another version).

    >>> r = encoder_record(EncodeSettings(backbone=BackboneConfig(model="org/tiny-bert")))
    >>> settings_of(r).backbone.model, encoder_slug(settings_of(r)) == r.system
    ('org/tiny-bert', True)
    """
    st = dict(record.settings)
    backbone = {k: st.pop(k) for k in list(st) if k in BackboneConfig.model_fields}
    stored = {k: st[k] for k in STORED if k in st}
    s = EncodeSettings(
        backbone=BackboneConfig(**backbone, device=device),
        readout=ReadoutConfig(**st["readout"]),
        max_length=st["max_length"],
        title_sep=st["title_sep"],
        **stored,
    )
    if encoder_slug(s) != record.system:
        raise StoreError(f"{record.system}: its registry record does not give back its settings; encode it again")
    return s


def encoder_record(s: EncodeSettings) -> SystemRecord:
    cls = readout_class(s.readout.readout)
    return SystemRecord(
        system=encoder_slug(s),
        kind="encoder",
        model=s.backbone.model,
        readout=cls.name,
        multi_vector=cls.multi_vector,
        has_sparse=cls.has_sparse,
        settings=numeric_settings(s),
    )


def register(
    store: ArtifactStore,
    record: SystemRecord,
    weights: dict[str, str] | None = None,
    write: bool = True,
    named: bool = False,
) -> None:
    """Write the record unless the registry holds it already (a record never changes: its slug is its hash).

    ``weights`` (:func:`weights_of`) are recorded with it; when the registry holds the system with other
    weights, the folder now holds another checkpoint than the one its artifacts came from (retrained or
    replaced in place): refused, so that its results are never reported as the new model's. ``write=False``
    only checks (a stage plans with it and registers once its first unit is done, so a failed run leaves no
    system without artifacts). ``named``: the slug is a name the user gave (``--name``), so another system
    registered under it is refused with the advice to choose another name."""
    folder = system_dir(record.system)
    config = record.model_dump()
    try:
        old = store.read_manifest(folder)
    except StoreError:  # unreadable or edited by hand: the record is written again (what verify's repair says)
        old = None
    if old is not None and old.config_hash == config_hash(config):
        before = (old.stats or {}).get("weights") or {}
        changed = sorted(k for k, v in (weights or {}).items() if k in before and before[k] != v)
        if changed and weights is not None:
            raise StoreError(
                f"{record.model}: its weights are not the ones system {record.system} was built from ({changed[0]} "
                f"{before[changed[0]]} in the registry, {weights[changed[0]]} now), so its stored artifacts are "
                "another model's; save the new model under another path (it is then a system of its own)"
            )
        return
    if old is not None and named:  # the name is the user's: another one, not the other system's folder
        raise StoreError(
            f"{record.system!r} is the name of another system in {store.root} (a {old.config.get('kind')} "
            f"system); choose another name for this one (--name NEW)"
        )
    if old is not None:
        raise StoreError(
            f"{store.abspath(folder)}: another system is registered under {record.system!r} "
            f"(fields {[d[0] for d in diff_configs(old.config, config)]} differ); remove that folder"
        )
    if not write:
        return
    path = _local_path(record.model) if record.model else None
    stats = {"model_path": path, **({"weights": weights} if weights else {})}
    if record.kind == "encoder" and record.settings.get("store", FLOAT16) != FLOAT16:  # the system it compresses
        stats["float16_system"] = encoder_slug(float16_settings(settings_of(record)))
    m = Manifest.new(SYSTEMS_STAGE, {"system": record.system}, config, stats=stats)
    store.write_manifest(folder, m)


def _local_path(model: str) -> str | None:
    p = Path(model).expanduser()
    return str(p.resolve()) if p.exists() else None


def load(store: ArtifactStore, system: str) -> SystemRecord:
    m = store.read_manifest(system_dir(system))  # a damaged record: its error names the repair
    if m is None:
        raise StoreError(f"no system {system!r} in {store.root}; {_known(store)}")
    return SystemRecord.model_validate(m.config)


def list_systems(store: ArtifactStore) -> list[tuple[SystemRecord, dict[str, Any]]]:
    """Every registered system with its manifest stats (``model_path``), by slug; a damaged record (unreadable,
    edited by hand) is left out, so that the others stay usable (``diffret verify`` names it)."""
    out = []
    for slug in store.list_partitions(SYSTEMS_STAGE, "system"):
        try:
            m = store.read_manifest(system_dir(slug))
        except StoreError:
            continue
        if m is not None:
            out.append((SystemRecord.model_validate(m.config), m.stats))
    return out


def _known(store: ArtifactStore) -> str:
    names = [r.system for r, _ in list_systems(store)]
    damaged = sorted(set(store.list_partitions(SYSTEMS_STAGE, "system")) - set(names))
    root = f" --root {shlex.quote(at)}" if (at := store.printed_root()) else ""
    note = (
        f"; damaged registry record(s): {', '.join(damaged)} (`diffret verify{root}` names the repair)"
        if damaged
        else ""
    )
    if not names:
        return "the store has no systems yet (diffret encode)" + note
    return f"systems in the store: {', '.join(names)}" + note


class SystemRef(Settings):
    """Which stored system a stage reads: its slug, or its model plus the settings that tell it apart.

    With neither, the store's only encoder system is used.
    """

    system: str | None = Field(
        default=None, description="A system slug, as `diffret systems` lists it (a unique prefix is enough)."
    )
    model: str | None = Field(default=None, description="The HF id or local folder the system was encoded with.")

    @field_validator("model")
    @classmethod
    def _canonical(cls, v: str | None) -> str | None:
        return canonical_model(v) if v else v

    where: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings the system must have, by name: e.g. {'dtype': 'bfloat16', 'readout.prompt': "
        "'few_words'}.",
    )


def find_system(store: ArtifactStore, ref: SystemRef, kind: str = "encoder") -> SystemRecord:
    """The one registered system that ``ref`` names; a clear error when none or several match."""
    records = list_systems(store)
    if ref.system:
        exact = [r for r, _ in records if r.system == ref.system]
        hits = exact or [r for r, _ in records if r.system.startswith(ref.system)]
        if len(hits) == 1:
            _refuse_disagreement(ref, hits[0], next(st for r, st in records if r is hits[0]))
            return hits[0]
        what = "several systems start with" if hits else "no system named"
        raise StoreError(f"{what} {ref.system!r} in {store.root}; {_known(store)}")
    cands = [(r, st) for r, st in records if r.kind == kind]
    if ref.model:
        path = _local_path(ref.model)
        cands = [(r, st) for r, st in cands if r.model == ref.model or (path and st.get("model_path") == path)]
    for key, want in ref.where.items():
        known = set().union(*(r.flat_settings() for r, _ in cands)) if cands else set()
        if cands and key not in known:
            raise StoreError(f"unknown system setting {key!r}; settings: {', '.join(sorted(known))}")
        cands = [(r, st) for r, st in cands if r.flat_settings().get(key) == want]
    if len(cands) > 1 and "store" not in ref.where:  # a model names its float16 system unless --store is given
        cands = [(r, st) for r, st in cands if r.flat_settings().get("store") == FLOAT16] or cands
    if len(cands) == 1:
        return cands[0][0]
    asked = " and ".join([f"model {ref.model!r}"] * bool(ref.model) + [f"{k}={v!r}" for k, v in ref.where.items()])
    if not cands:
        hint = "run `diffret encode` with these settings first" if kind == "encoder" else "run it first"
        raise StoreError(f"no {kind} system with {asked or 'any settings'} in {store.root}; {_known(store)}; {hint}")
    differ = _differing(r.flat_settings() for r, _ in cands)

    def apart(r: SystemRecord) -> str:
        return ", ".join(f"{k}={r.flat_settings().get(k)!r}" for k in differ) or "the same settings"

    listing = "; ".join(f"{r.system} ({apart(r)})" for r, _ in cands)
    given = {"model"} if ref.model else set()
    given |= set(ref.where)
    flags = [f"--{k.split('.')[-1].replace('_', '-')}" for k in differ if k not in given]
    how = f"or add the setting that tells them apart ({', '.join(flags)})" if flags else "as the settings given fit all"
    raise StoreError(
        f"{len(cands)} {kind} systems match {asked or 'any settings'}: {listing}. Name one with --system SLUG, {how}"
    )


def _refuse_disagreement(ref: SystemRef, record: SystemRecord, stats: dict[str, Any]) -> None:
    """A slug given with ``--model`` or settings that do not describe it: refused naming both (the slug never
    silently wins over the other selectors)."""
    wrong = []
    if ref.model and record.model != ref.model:
        path = _local_path(ref.model)
        if not (path and stats.get("model_path") == path):
            wrong.append(f"--model {ref.model} (it was encoded from {record.model})")
    flat = record.flat_settings()
    for key, want in ref.where.items():
        if flat.get(key) != want:
            have = flat.get(key, "nothing (not a setting of this system)")
            wrong.append(f"--{key.split('.')[-1].replace('_', '-')} {want} (it has {have})")
    if wrong:
        raise StoreError(
            f"--system {record.system} does not match {'; '.join(wrong)}: give the slug alone, or the "
            "model and settings alone (`diffret systems` lists both)"
        )


def _differing(settings: Any) -> list[str]:
    rows = list(settings)
    keys = sorted(set().union(*rows)) if rows else []
    return [k for k in keys if len({repr(r.get(k)) for r in rows}) > 1]
