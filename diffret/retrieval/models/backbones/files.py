"""A model folder's files, checked before anything is loaded (weights present and whole, shards, tokenizer files,
a diffret-saved folder against its manifest) and fingerprinted by content."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from diffret.caching import KeyedCache

from .adapters import with_adapter
from .config import BackboneConfig
from .errors import BackboneError

PASSAGE_ENCODER = "passage_encoder"  # a model folder's sub-folder: its passage encoder, when trained apart (SIDR)


def passage_encoder_dir(model: str) -> Path | None:
    """The separately trained passage encoder a local model folder holds (``passage_encoder/``), if any.

    >>> passage_encoder_dir("org/some-hub-id") is None
    True
    """
    folder = Path(model).expanduser() / PASSAGE_ENCODER
    return folder if (folder / "config.json").is_file() else None


WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_SAMPLES, _SAMPLE_BYTES = 64, 1 << 16  # a weights fingerprint reads at most 4 MiB per file


def weights_fingerprint(model: str, gguf_file: str | None = None) -> str | None:
    """A content fingerprint of a local model (or adapter) folder: its weight files and config, each by size
    and 64 evenly spaced 64 KiB samples (the whole file when smaller); a copy of the folder elsewhere has the
    same one, a checkpoint retrained in place another. ``None`` for a hub id or a folder without weights.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = open(f"{d}/model.safetensors", "wb").write(b"a" * 100)
    >>> fp = weights_fingerprint(d)
    >>> _ = open(f"{d}/model.safetensors", "wb").write(b"b" * 100)
    >>> weights_fingerprint(d) != fp, weights_fingerprint("org/some-hub-id")
    (True, None)
    """
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return None
    weights = [
        p
        for p in folder.iterdir()
        if p.is_file() and (p.name == gguf_file if gguf_file else p.suffix in WEIGHT_SUFFIXES)
    ]
    if not weights:  # nothing to fingerprint (the weights are elsewhere, or not downloaded)
        return None
    extra = [p for p in folder.iterdir() if p.is_file() and p.name in ("config.json", "adapter_config.json")]
    if (sub := folder / PASSAGE_ENCODER).is_dir():  # a separately trained passage encoder is part of the model
        extra += [p for p in sub.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")]
    files = sorted(weights + extra)
    stats = tuple((str(p.relative_to(folder)), str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _fingerprint(stats)


@functools.lru_cache(maxsize=64)
def _fingerprint(stats: tuple[tuple[str, str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, path, size, _mtime in stats:  # the mtime only keys the cache: a copy keeps its fingerprint
        h.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= _SAMPLES * _SAMPLE_BYTES:
                h.update(f.read())
                continue
            step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
            for i in range(_SAMPLES):
                f.seek(i * step)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]


def check_model_files(cfg: BackboneConfig) -> None:
    """Refuse a local model folder without weights, with a missing shard, or with a truncated or corrupt
    safetensors file, before any work is done (only the safetensors headers are read). Hub ids pass.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = open(f"{d}/config.json", "w").write("{}")
    >>> try:
    ...     check_model_files(BackboneConfig(model=d))
    ... except BackboneError as e:
    ...     print(str(e).split(": ", 1)[1])
    no weights (model.safetensors, pytorch_model.bin, a sharded index or a .gguf file); is the download complete?
    """
    cfg = with_adapter(cfg)
    for saved in (cfg.model, cfg.adapter):
        if saved:
            check_saved_model(Path(saved).expanduser())
    folder = Path(cfg.model).expanduser()
    if not folder.is_dir():
        return
    if cfg.gguf_file:
        gguf = folder / cfg.gguf_file
        if gguf.exists():
            with open(gguf, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise BackboneError(f"{gguf}: not a GGUF file (bad magic bytes)")
        return
    files = list(folder.glob("*.safetensors"))
    for index in WEIGHT_INDEXES:
        if (folder / index).exists():
            try:
                names = set(json.loads((folder / index).read_text())["weight_map"].values())
            except (ValueError, KeyError, TypeError) as exc:
                raise BackboneError(f"{folder / index}: unreadable weight index ({exc})") from None
            missing = sorted(n for n in names if not (folder / n).exists())
            if missing:
                raise BackboneError(f"{folder}: weight shards named by {index} are missing: {missing[:4]}")
    if not files and not list(folder.glob("*.bin")) and not list(folder.glob("*.gguf")):
        raise BackboneError(
            f"{folder}: no weights (model.safetensors, pytorch_model.bin, a sharded index or a .gguf file); "
            "is the download complete?"
        )
    for path in files:
        _check_safetensors(path)


# store root -> ArtifactStore: a file hashed once per process (size, mtime); more stores than one process reads
_SAVED_STORES: KeyedCache[str, Any] = KeyedCache(size=16)


def check_saved_model(folder: Path) -> None:
    """Refuse a model folder diffret saved (``diffret train``, ``train-reranker``: a ``_manifest.json`` of stage
    ``models`` in it, or in its parent for a ``passage_encoder/``) whose files do not match their manifest's sha256,
    as an encoding's shards are checked before they are read; a :class:`storage.ChecksumError` naming the file and
    the repair. Other folders and hub ids pass.

    >>> check_saved_model(Path("org/some-hub-id"))
    """
    from diffret.storage import ArtifactStore
    from diffret.storage.layout import MANIFEST_NAME

    home = folder if folder.name != PASSAGE_ENCODER else folder.parent
    if not (home / MANIFEST_NAME).is_file():  # a model from elsewhere
        return
    try:
        stage = json.loads((home / MANIFEST_NAME).read_text()).get("stage")
    except (OSError, ValueError, AttributeError):
        stage = "models"  # unreadable: verify() below names it and the repair
    if stage != "models":  # another tool's file of that name
        return
    # inside a store (``models/model=<name>``) the error names the stage that rebuilds it
    root, rel = (
        (home.parent.parent, f"models/{home.name}") if home.parent.name == "models" else (home.parent, home.name)
    )
    store = _SAVED_STORES.get(str(root), lambda: ArtifactStore(str(root)))
    store.verify(rel)


def _check_safetensors(path: Path) -> None:
    """The header parses and the file holds every tensor it lists (a truncated download fails here)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or 8 + n > size:
            raise BackboneError(f"{path}: corrupt safetensors file (header length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            raise BackboneError(f"{path}: corrupt safetensors file (unreadable header)") from None
    if 8 + n + end > size:
        raise BackboneError(f"{path}: truncated safetensors file ({size} bytes, its header needs {8 + n + end})")


# a tokenizer's vocabulary lives in one of these (a GGUF file holds its own; an adapter folder names its base)
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.model",
)


def check_tokenizer_files(cfg: BackboneConfig) -> None:
    """A local model folder must hold its tokenizer's vocabulary: without it transformers builds an empty
    tokenizer and every word becomes [UNK] (a run that succeeds on garbage)."""
    folder = Path(cfg.model).expanduser()
    if cfg.gguf_file or not folder.is_dir():
        return
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise BackboneError(
            f"the folder has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}), so every word would become "
            "[UNK]; copy the tokenizer files of the model it was saved from into it"
        )
