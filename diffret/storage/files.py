"""The store's file-level helpers: checksums, file stats from fsspec listings, the mode of new files, directory
fsyncs and the Parquet settings every store file is written with (shared by :mod:`storage.store` and its parts)."""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any

import fsspec

PARQUET_COMPRESSION = "zstd"
ROW_GROUP_ROWS = 100_000
_HASH_CHUNK = 8 << 20


def info_stat(info: dict[str, Any]) -> tuple[int, int | None]:
    """(size, mtime in ns or None) from an fsspec ``info`` / ``ls(detail=True)`` entry.

    >>> info_stat({"size": 3, "mtime": 1.5}), info_stat({"size": 3, "mtime": "?"})
    ((3, 1500000000), (3, None))
    """
    size = int(info.get("size") or 0)
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
    if mtime is not None and hasattr(mtime, "timestamp"):  # a datetime (object stores)
        mtime = mtime.timestamp()
    try:
        return size, int(round(float(mtime) * 1e9)) if mtime else None
    except (TypeError, ValueError):  # a format we do not know: no quick check, the sha256 decides
        return size, None


def sha256_file(path: str, fs: fsspec.AbstractFileSystem | None = None) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    opener = fs.open if fs is not None else open
    with opener(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() would give a new file (mkstemp gives 0600)


def fsync_dir(path: str) -> None:
    """Flush a local folder's entries (a rename or a new file in it) to disk; a no-op where that is not possible.

    >>> import tempfile
    >>> fsync_dir(tempfile.gettempdir())
    """
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
