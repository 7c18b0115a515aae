"""The store's footprint and its projection to MS MARCO scale (the paper reports ~20 TB of artifacts)."""

from __future__ import annotations

from typing import Any

MSMARCO_PASSAGES = 8_841_823


def footprint_projection(
    *,
    hidden: int = 3584,
    passages: int = MSMARCO_PASSAGES,
    grid: tuple[int, ...] = (1, 2, 4, 8, 16),
    backbones: int = 4,
    settings: int = 2,
    bytes_per_value: float = 2.0,
    sparse_topk: int = 256,
    queries: int = 6980 + 43 + 54,
    passage_bytes_per_vector: float | None = None,
) -> dict[str, Any]:
    """Bytes of the encodings of the full grid at MS MARCO scale, with its assumptions.

    One encoding pass per K and side stores K dense vectors of ``hidden`` values per text (float16 by
    default: 2 bytes) plus ``sparse_topk`` (int32 id, float32 weight) pairs; every backbone and setting
    (e.g. zero-shot and fine-tuned) repeats it. Parquet (zstd) barely compresses float16 activations,
    so raw bytes are a fair estimate; ``bytes_per_value`` can be taken from the store's own ratio.
    ``passage_bytes_per_vector``: a compressed store's bytes per passage vector (retrieval/search/codecs.py; the queries
    stay float16).

    >>> round(footprint_projection(hidden=3584, backbones=4, settings=2)["total_tb"], 1)
    16.5
    >>> round(footprint_projection(passage_bytes_per_vector=900)["total_tb"], 1)   # residual:2 at H = 3584
    2.7
    """
    vectors_per_text = sum(grid)
    per_vector = hidden * bytes_per_value
    dense = (passages * (passage_bytes_per_vector or per_vector) + queries * per_vector) * vectors_per_text
    sparse = (passages + queries) * len(grid) * sparse_topk * 8
    per_setting = dense + sparse
    total = per_setting * backbones * settings
    return {
        "assumptions": {
            "passages": passages,
            "queries": queries,
            "hidden": hidden,
            "grid": list(grid),
            "vectors_per_text": vectors_per_text,
            "bytes_per_value": bytes_per_value,
            "sparse_topk": sparse_topk,
            "passage_bytes_per_vector": passage_bytes_per_vector or per_vector,
            "backbones": backbones,
            "settings": settings,
        },
        "dense_bytes_per_setting": dense,
        "sparse_bytes_per_setting": sparse,
        "bytes_per_backbone_setting": per_setting,
        "total_bytes": total,
        "total_tb": total / 1e12,
    }


def human_bytes(n: float) -> str:
    """Decimal units, as disks are sold.

    >>> human_bytes(999), human_bytes(16_500_000_000_000)
    ('999 B', '16.5 TB')
    """
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} PB"
