"""The index stage without Prefect: a passage encoding -> a LanceDB multivector table (+ optional ANN index),
checked against exact search on every build.

Store layout: ``index/model=<slug>/dataset=<corpus>/kp=<K_p>/`` is a LanceDB database folder (table
``docs``) with a ``_manifest.json`` listing every Lance file with its sha256, and in ``stats`` the
recall@10 / @100 of the index against exact MaxSim and its latency, per K_q of the check.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from storage import ArtifactStore, FileEntry, Manifest, config_hash
from storage.layout import dataset_dir, encodings_dir, index_dir

from . import lance_index
from .scoring import complete_encoding, iter_encodings, read_encodings, split_queries
from .search import SearchSettings, search_pass, select


def _passage_batches(store: ArtifactStore, stage: str, m: Manifest) -> Iterator[tuple[list[str], list[np.ndarray]]]:
    """(ids, per-passage [n_j, H] float32 arrays) shard by shard, in corpus order."""
    for enc in iter_encodings(store, stage, m, "cpu"):
        arrays = [enc.multi[i][enc.mask[i]].numpy() for i in range(len(enc))]
        yield enc.ids, arrays


def _file_entries(folder: str) -> dict[str, FileEntry]:
    out = {}
    for base, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(base, f)
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
            out[os.path.relpath(path, folder)] = FileEntry(sha256=h.hexdigest(), bytes=os.path.getsize(path))
    return out


def check_against_exact(
    db_path: str, queries_by_kq: dict[int, Any], passages: Any, k: int = 100, overfetch: int | None = None
) -> dict[str, Any]:
    """recall@10 / @100 and latency of the index against exact MaxSim, per K_q."""
    exact, doc_ids = search_pass(queries_by_kq, passages, ["multi_dense"], SearchSettings(topk=k))
    out: dict[str, Any] = {}
    for kq, q in queries_by_kq.items():
        ex = [[doc_ids[i] for i in row if i >= 0] for row in exact[(kq, "multi_dense")].index]
        qv = [q.multi[i][q.mask[i]].cpu().numpy() for i in range(len(q))]
        kwargs = {"overfetch": overfetch} if overfetch else {}
        res = lance_index.search(db_path, qv, k, **kwargs)
        approx = [[d for d, _ in hits] for hits in res]
        out[str(kq)] = {
            "recall_10": lance_index.recall_at(ex, approx, 10),
            "recall_100": lance_index.recall_at(ex, approx, min(100, k)),
            "latency_ms_mean": res.stats.mean_ms,
            "latency_ms_p95": res.stats.p95_ms,
            "queries": len(q),
        }
    return out


def build_index(
    store: ArtifactStore,
    system: str,
    dataset: str,
    corpus: str,
    split: str,
    kqs: list[int],
    kp: int,
    index_type: str = "IVF_PQ",
    overfetch: int | None = None,
    log: Callable[[str], None] = print,
) -> tuple[bool, dict[str, Any]]:
    """Build the index of one K_p unless it exists with the same config; returns (built, stats)."""
    if index_type not in lance_index.INDEX_TYPES:
        raise ValueError(f"unknown index type {index_type!r}; expected one of {list(lance_index.INDEX_TYPES)}")

    n_passages = int(store.require_manifest(dataset_dir(corpus)).files["corpus.parquet"].rows or 0)
    p_stage = encodings_dir(system, corpus, "passage", kp)
    p_man = complete_encoding(store, p_stage, n_passages)
    config = {
        "system": system,
        "corpus": corpus,
        "kp": kp,
        "passage_encodings_config_hash": p_man.config_hash,
        "index_type": index_type,
        "overfetch": overfetch or lance_index.DEFAULT_OVERFETCH,
        "check": {"dataset": dataset, "split": split, "kq": list(kqs)},
    }
    stage = index_dir(system, corpus, kp)
    old = store.read_manifest(stage)
    if old is not None and old.config_hash == config_hash(config):
        try:
            store.verify(stage)
            return False, old.stats
        except Exception:  # noqa: BLE001 - a damaged index is rebuilt
            log(f"{store.abspath(stage)}: damaged, rebuilding")
    batches = _passage_batches(store, p_stage, p_man)
    first = next(batches, None)
    if first is None:
        raise ValueError(f"{store.abspath(p_stage)}: no passages to index")
    hidden = int(first[1][0].shape[1])
    part = {"model": system, "dataset": corpus, "kp": str(kp)}
    m = Manifest.new("index", part, config)
    with store.stage_writer(stage, m) as w:
        rows = lance_index.build_table(w.work_dir, itertools.chain([first], batches), hidden)
        info = lance_index.create_index(w.work_dir, index_type) if index_type != "none" else None
        ids = split_queries(store, dataset, split)
        queries = {}
        for kq in kqs:
            q_stage = encodings_dir(system, dataset, "query", kq)
            queries[kq] = select(read_encodings(store, q_stage, store.require_manifest(q_stage), "cpu"), ids)
        check = check_against_exact(w.work_dir, queries, iter_encodings(store, p_stage, p_man, "cpu"), 100, overfetch)
        m.stats = {
            "rows": rows,
            "index": None
            if info is None
            else {"params": info.params, "seconds": info.seconds, "vectors": info.vectors},
            "check": check,
        }
        m.files.update(_file_entries(w.work_dir))
    worst = min(c["recall_10"] for c in check.values())
    log(f"index K_p={kp} ({index_type}): {rows:,} passages; recall@10 vs exact >= {worst:.4f}")
    return True, m.stats
