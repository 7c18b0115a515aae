"""What repairs a damaged folder, as data: the command that made it and the settings that made it, read from what
the store holds (the folder's manifest config, the system registry), or the folder to remove when no command builds
it again as it was. The store never writes a command line: whoever shows a repair renders it
(:func:`use_renderer`; the command line's renderer is ``flows.repairs``), and until one is installed a repair reads
as the command's name and its options (:func:`plain`)."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Value = str | int | float | bool | tuple[Any, ...] | None


@dataclass(frozen=True)
class Repair:
    """How to rebuild a damaged folder.

    ``command``: the stage command to run again (``"encode"``), ``""`` when the folder is to be removed;
    ``options``: ``(name, value)`` pairs, the name the command's option without its dashes (``("dataset", "c")``;
    a boolean is a switch, ``True`` on and ``False`` off; a tuple is a list: integers one comma-separated value,
    others the option repeated; ``None`` leaves it out); ``arguments``: positional arguments; ``complete``: the
    options are every setting that made the folder (else the settings that made it are to be added to them);
    ``remove``: the folder (its absolute path) to remove, when no command builds it again as it was; ``local``: that
    folder is on the local filesystem (``rm -r`` removes it).

    >>> plain(Repair("encode", (("verify", True), ("dataset", "c"), ("k", (1, 4)))))
    'repair: run the encode command again: encode --verify --dataset c --k 1,4'
    >>> plain(Repair(remove="/data/s/runs/system=a b"))
    "repair: remove the folder: `rm -r '/data/s/runs/system=a b'`"
    """

    command: str = ""
    options: tuple[tuple[str, Value], ...] = ()
    arguments: tuple[str, ...] = ()
    complete: bool = True
    remove: str = ""
    local: bool = True

    def option(self, name: str) -> Value:
        """The value of option ``name`` (``None`` when it has none).

        >>> Repair("score", (("dataset", "c"),)).option("dataset")
        'c'
        """
        return next((v for n, v in self.options if n == name), None)

    def words(self) -> list[str]:
        """The command's words after the program name: the command, its arguments and its options (``--name
        value``; a switch ``--name`` / ``--no-name``).

        >>> Repair("evaluate", (("system", "s"), ("measure", ("ndcg_cut_10", "mrr_10")), ("verify", False))).words()
        ['evaluate', '--system', 's', '--measure', 'ndcg_cut_10', '--measure', 'mrr_10', '--no-verify']
        """
        out = [self.command, *self.arguments]
        for name, value in self.options:
            if value is None:
                continue
            if isinstance(value, bool):
                out.append(f"--{name}" if value else f"--no-{name}")
            elif isinstance(value, tuple):
                if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                    out += [f"--{name}", ",".join(str(v) for v in value)]
                else:
                    for v in value:
                        out += [f"--{name}", str(v)]
            else:
                out += [f"--{name}", str(value)]
        return out

    def __str__(self) -> str:
        return render(self)


@dataclass(frozen=True)
class Damage:
    """What is damaged and what repairs it: ``where`` (the file or folder, its absolute path), ``problem`` (what is
    wrong with it), ``repair`` (``None`` when ``problem`` names it already).

    >>> Damage("/s/x/run.parquet", "missing", Repair("score", (("dataset", "c"),))).line(plain)
    '/s/x/run.parquet: missing; repair: run the score command again: score --dataset c'
    """

    where: str
    problem: str
    repair: Repair | None = None

    def line(self, renderer: Callable[[Repair], str] | None = None) -> str:
        """One line: where, the problem and the repair (``renderer``'s; default the installed one)."""
        head = f"{self.where}: {self.problem}" if self.where else self.problem
        if self.repair is None:
            return head
        return f"{head}; {(renderer or render)(self.repair)}"

    def __str__(self) -> str:
        return self.line()


def removal_line(repair: Repair) -> str:
    """The line of a repair that removes a folder (``rm -r``, its path quoted, where it is local)."""
    if repair.local:
        return f"repair: remove the folder: `rm -r {shlex.quote(repair.remove)}`"
    return f"repair: remove the folder {repair.remove}"


def plain(repair: Repair) -> str:
    """A repair as one line without a program name: the command's name and its options (shell-quoted)."""
    if repair.remove:
        return removal_line(repair)
    if not repair.command:
        return "repair: run the stage that wrote it again"
    words = " ".join(shlex.quote(w) for w in repair.words())
    tail = "" if repair.complete else ", with the settings that made it"
    return f"repair: run the {repair.command} command again: {words}{tail}"


_renderer: list[Callable[[Repair], str]] = [plain]


def use_renderer(renderer: Callable[[Repair], str]) -> None:
    """Render every repair the store names (in its errors, warnings and ``verify`` lines) with ``renderer``."""
    _renderer[0] = renderer


def render(repair: Repair) -> str:
    """A repair as the line the store's messages hold (the renderer installed by :func:`use_renderer`)."""
    return _renderer[0](repair)


# the command that makes a run of each mode (a score mode is any other; adaptive_* and late_* are prefixes)
_RUN_COMMANDS = {"bm25": "bm25", "rerank": "rerank", "beta": "beta", "imported": "import-run", "fusion": "fuse"}
# the command that registers each kind of system (a registry record is written again by its next run)
_SYSTEM_COMMANDS = {"bm25": "bm25", "run": "import-run", "fusion": "fuse", "reranker": "rerank"}
# an encoder's settings as its folders' configs and its registry record hold them (storage.layout: the stages'
# numeric settings), each the encode option of the same name
_BACKBONE_KEYS = (
    "model",
    "family",
    "loader",
    "gguf_file",
    "dtype",
    "mask_token",
    "turn_end",
    "adapter",
    "attn_implementation",
)
_SWITCH_KEYS = ("merge_adapter",)
_RANDOM_KEYS = ("load_format", "shape")
_TEXT_KEYS = ("max_length", "title_sep")
# a run's scoring rules, each the score option of the same name
_RULE_KEYS = (
    "maxsim_clamp",
    "maxsim_reduce",
    "single_renorm",
    "sparse_scale",
    "sparse_floor",
    "fusion_flat",
    "score_dtype",
)


def _flag(key: str) -> str:
    return key.replace("_", "-")


def encoder_options(settings: dict[str, Any]) -> list[tuple[str, Value]]:
    """The encode options that give an encoder's settings (a folder config's or a registry record's).

    >>> encoder_options({"model": "/m", "dtype": "float32", "readout": {"readout": "sidr", "stop_cut": True}})
    [('model', '/m'), ('dtype', 'float32'), ('readout', 'sidr'), ('stop-cut', True)]
    """
    out: list[tuple[str, Value]] = []
    for key in (*_BACKBONE_KEYS, *_SWITCH_KEYS, *_RANDOM_KEYS):
        if settings.get(key) is not None:
            out.append((_flag(key), settings[key]))
    for key, value in sorted((settings.get("readout") or {}).items(), key=lambda kv: kv[0] != "readout"):
        if value is not None:
            out.append((_flag(key), value))
    for key in _TEXT_KEYS:
        if settings.get(key) is not None:
            out.append((_flag(key), settings[key]))
    if settings.get("store") is not None:
        out += [("store", settings["store"]), ("store-seed", settings.get("store_seed", 0))]
    return out


def _root(root: str) -> list[tuple[str, Value]]:
    return [("root", root)] if root else []


def repair_of(rel: str, facts: dict[str, Any] | None = None, root: str = "") -> Repair:
    """What rebuilds the folder holding ``rel`` (a path relative to the root): the command that made it, with
    the settings that made it where the store holds them. ``facts`` are what the store tells beyond the path
    (:meth:`storage.ArtifactStore.repair`): ``config`` (the folder's manifest config), ``system`` (its system's
    registry settings, where its manifest is gone), ``tokenizer`` (a tokens folder's tokenizer settings: those of an
    encoder whose encodings name it), ``compressed`` (a compressed system's ``{"store", "seed",
    "float16_system"}``; ``float16_system`` only when its float16 folders are stored, so that ``compress`` can
    rebuild it), ``task`` (a model's: ``reranker``), ``bm25`` (a summary's BM25 system), ``kind`` (a registry
    record's: the command that registers that kind of system). ``root``: the store root the command must be given
    (``--root``), when it is not the one a command finds without it.

    >>> repair_of("runs/system=b/dataset=d/split=test/kq=0/kp=0/mode=bm25", root="/data/my store").words()
    ['bm25', '--root', '/data/my store']
    >>> r = repair_of("encodings/system=s/dataset=d/side=query/k=1", {"config": {"model": "/m", "batch_size": 16}})
    >>> " ".join(r.words()), r.complete
    ('encode --verify --dataset d --side query --k 1 --model /m --batch-size 16', True)
    >>> repair_of("summaries/system=s/dataset=d/split=test", {"bm25": "bm25-1f"}).words()
    ['summary', '--system', 's', '--dataset', 'd', '--split', 'test', '--bm25', 'bm25-1f']
    """
    from .layout import STAGE_FOLDERS

    facts = facts or {}
    parts = rel.lstrip("/").split("/")
    entry = STAGE_FOLDERS.get(parts[0])
    if entry is None:
        return Repair(options=tuple(_root(root)), complete=False)
    kind, command = parts[0], entry[1]
    keys = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
    config: dict[str, Any] = facts.get("config") or {}
    at = _root(root)
    if kind == "datasets" and "dataset" in keys:
        return Repair("download", tuple(at), (keys["dataset"],), complete=False)
    if kind == "tokens" and {"dataset", "side"} <= keys.keys():
        return _tokens_repair(keys, config, facts.get("tokenizer") or {}, at)
    if kind in ("encodings", "codebooks") and (c := facts.get("compressed")):
        seed = [("store-seed", c["seed"])] if c.get("seed") else []
        if c.get("float16_system"):  # a float16 system stored: compress made it (or can make it again)
            options = [("system", c["float16_system"]), ("dataset", keys.get("dataset")), ("store", c["store"])]
            return Repair("compress", tuple(options + seed + [("verify", True)] + at), complete=False)
        return Repair("encode", tuple([("store", c["store"])] + seed + [("verify", True)] + at), complete=False)
    if kind == "encodings" and {"system", "dataset", "side", "k"} <= keys.keys():
        return _encodings_repair(keys, config, facts, at)
    if kind == "runs" and len(parts) >= 7:
        return _run_repair(keys, config, at)
    if kind == "metrics" and config and {"system", "dataset", "split"} <= keys.keys():
        options = [
            ("system", keys["system"]),
            ("dataset", keys["dataset"]),
            ("split", keys["split"]),
            ("measure", tuple(config.get("measures") or ())),
            ("relevance-level", config.get("relevance_level")),
            ("ties", config.get("ties")),
        ]
        return Repair("evaluate", tuple(options + at))
    if kind == "index" and config and {"system", "dataset", "kp"} <= keys.keys():
        return _index_repair(keys, config, at)
    if kind == "filters" and "filter" in keys:
        return Repair("tokenize", (("content-filter", keys["filter"]), ("verify", True), *at), complete=False)
    if kind == "models" and facts.get("task") == "reranker":
        command = "train-reranker"
    elif kind == "systems" and facts.get("kind") in _SYSTEM_COMMANDS:
        command = _SYSTEM_COMMANDS[facts["kind"]]
    elif kind == "summaries" and "bm25" in facts and {"system", "dataset", "split"} <= keys.keys():
        options = [("system", keys["system"]), ("dataset", keys["dataset"]), ("split", keys["split"])]
        return Repair("summary", tuple(options + [("bm25", facts["bm25"] or None)] + at))
    sharded = kind in ("tokens", "filters", "encodings", "partial")  # a shard is trusted by its size and mtime
    return Repair(command, tuple(([("verify", True)] if sharded else []) + at), complete=False)


def _tokens_repair(
    keys: dict[str, str], config: dict[str, Any], tokenizer: dict[str, Any], at: list[tuple[str, Value]]
) -> Repair:
    """A tokens folder's: its tokenizer (an encoder's model, named by the encodings that read these tokens), its
    lengths and passage join, its shard size."""
    options: list[tuple[str, Value]] = [("verify", True), ("dataset", keys["dataset"]), ("side", keys["side"])]
    for key in ("model", "gguf_file"):
        if tokenizer.get(key) is not None:
            options.append((_flag(key), tokenizer[key]))
    source = config or tokenizer
    for key in ("max_length", "title_sep", "shard_size"):
        if source.get(key) is not None:
            options.append((_flag(key), source[key]))
    complete = bool(config) and tokenizer.get("model") is not None
    return Repair("tokenize", tuple(options + at), complete=complete)


def _encodings_repair(
    keys: dict[str, str], config: dict[str, Any], facts: dict[str, Any], at: list[tuple[str, Value]]
) -> Repair:
    """An encodings folder's: its side and K, the encoder's settings (its config's; its system's record when the
    manifest is gone, which leaves the batch size untold) and the batch size it was encoded at."""
    settings = config or facts.get("system") or {}
    options: list[tuple[str, Value]] = [
        ("verify", True),
        ("dataset", keys["dataset"]),
        ("side", keys["side"]),
        ("k", (int(keys["k"]),)),
        *encoder_options(settings),
    ]
    if config:
        options.append(("batch-size", config.get("batch_size")))  # absent: the default made it
        options.append(("head-stats", True if config.get("head_stats") else None))
    return Repair("encode", tuple(options + at), complete=bool(config) and settings.get("model") is not None)


def _run_repair(keys: dict[str, str], config: dict[str, Any], at: list[tuple[str, Value]]) -> Repair:
    """A run folder's: the command of its mode; a scored cell's with its system, split, cell, depth and rules."""
    mode = keys.get("mode", "")
    command = (
        "budget"
        if mode.startswith("adaptive_")
        else "late"
        if mode.startswith("late_")
        else _RUN_COMMANDS.get(mode, "score")
    )
    if command != "score" or not config:
        return Repair(command, tuple(at), complete=False)
    split = keys.get("split", "")
    options: list[tuple[str, Value]] = [
        ("dataset", keys.get("dataset")),
        ("system", keys.get("system")),
        ("split", (split,)),
        ("kq", (int(keys["kq"]),)),
        ("kp", (int(keys["kp"]),)),
        ("mode", (mode,)),
    ]
    if config.get("corpus") and config["corpus"] != keys.get("dataset"):
        options.append(("corpus", config["corpus"]))
    if config.get("topk") is not None:
        options.append(("train-topk" if split == "train" else "topk", config["topk"]))
    if config.get("ignore_identical_ids") is not None:
        options.append(("self-hits", "drop" if config["ignore_identical_ids"] else "keep"))
    rules = config.get("rules") or {}
    options += [(_flag(k), rules[k]) for k in _RULE_KEYS if rules.get(k) is not None]
    if (search := config.get("search")) and search.get("engine"):  # searched over the codes, not exactly
        options += [("search", search["engine"]), ("probes", search.get("probes"))]
        options.append(("candidates", search.get("candidates")))
    if (config.get("fusion") or {}).get("depth") is not None:
        options.append(("fusion-depth", config["fusion"]["depth"]))
    return Repair("score", tuple(options + at))


def _index_repair(keys: dict[str, str], config: dict[str, Any], at: list[tuple[str, Value]]) -> Repair:
    """An index folder's: its system, corpus and K_p, the queries it was checked with, its type and search
    settings."""
    check = config.get("check") or {}
    dataset = check.get("dataset") or keys["dataset"]
    options: list[tuple[str, Value]] = [
        ("dataset", dataset),
        ("system", keys["system"]),
        ("kp", (int(keys["kp"]),)),
        ("kq", tuple(int(k) for k in check.get("kq") or ()) or None),
        ("split", check.get("split")),
    ]
    if config.get("corpus") and config["corpus"] != dataset:
        options.append(("corpus", config["corpus"]))
    if config.get("engine") == "codes":
        options += [("probes", config.get("probes")), ("candidates", config.get("candidates"))]
    else:
        options += [("type", config.get("index_type")), ("overfetch", config.get("overfetch"))]
        options.append(("vectors", config.get("vectors") or "float32"))  # a float32 table names none
    return Repair("index", tuple(options + at))
