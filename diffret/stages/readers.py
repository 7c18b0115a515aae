"""Reading what earlier stages stored: a dataset's texts, splits and qrels, and encodings as tensors.

Every stage reads the store through these functions, so each rule (a passage is "title. text", queries in
first-appearance order, an encoding is complete only with every text) is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from diffret.retrieval.data.collections import TITLE_SEP, passage_text
from diffret.retrieval.search.bot import binary_flat
from diffret.retrieval.search.codecs import FLOAT16, Codebook, Codec, codes_of, parse_store
from diffret.retrieval.search.codes import CodedPassages, CodesIndex
from diffret.retrieval.search.encodings import Encodings, SparseFlat, encodings_from_table, select
from diffret.retrieval.search.rules import ScoreRules
from diffret.storage import ArtifactStore, IncompleteArtifactError, Manifest, StoreError
from diffret.storage.layout import BOT_FILE, CODEBOOK_FILE, CODES_INDEX_FILE, codebook_dir, dataset_dir

SIDES = ("query", "passage")
READ_ROWS = 256  # an encodings shard is decoded from Parquet this many rows at a time (bounded scratch)


def dataset_manifest(store: ArtifactStore, dataset: str) -> Manifest:
    """The manifest of a stored dataset (IncompleteArtifactError naming the folder when it is absent)."""
    return store.require_manifest(dataset_dir(dataset))


def corpus_size(store: ArtifactStore, corpus: str) -> int:
    """Documents in a stored corpus (from its manifest; no read)."""
    entry = dataset_manifest(store, corpus).files.get("corpus.parquet")
    if entry is None:
        raise ValueError(f"dataset {corpus!r} has no corpus in the store (queries and qrels only)")
    return int(entry.rows or 0)


def side_texts(
    store: ArtifactStore, dataset: str, side: str, title_sep: str = TITLE_SEP
) -> tuple[list[str], list[str], str]:
    """(ids, texts, dataset config hash) of one side; passages as :func:`passage_text`."""
    folder = dataset_dir(dataset)
    m = dataset_manifest(store, dataset)
    if side == "passage":
        corpus_size(store, dataset)
        t = store.read_table(folder, "corpus.parquet", columns=["doc_id", "title", "text"])
        ids = t.column("doc_id").to_pylist()
        texts = [
            passage_text(ti, tx, title_sep)
            for ti, tx in zip(t.column("title").to_pylist(), t.column("text").to_pylist(), strict=True)
        ]
    elif side == "query":
        t = store.read_table(folder, "queries.parquet", columns=["query_id", "text"])
        seen: dict[str, str] = {}
        for qid, tx in zip(t.column("query_id").to_pylist(), t.column("text").to_pylist(), strict=True):
            seen.setdefault(qid, tx)
        ids, texts = list(seen), list(seen.values())
    else:
        raise ValueError(f"unknown side {side!r}; expected query or passage")
    return ids, texts, m.config_hash


def cut_ranges(
    batches: Iterable[tuple[list, list]], ranges: list[tuple[int, int]]
) -> Iterator[tuple[int, int, list, list]]:
    """(start, end, ids, texts) of each ``[start, end)`` row range (ascending, not overlapping) of a stream of
    (ids, texts) batches, holding only the rows from the next range's start on.

    >>> batches = [(["a", "b"], ["A", "B"]), (["c", "d"], ["C", "D"]), (["e"], ["E"])]
    >>> [(s, e, ids, texts) for s, e, ids, texts in cut_ranges(iter(batches), [(0, 1), (2, 5)])]
    [(0, 1, ['a'], ['A']), (2, 5, ['c', 'd', 'e'], ['C', 'D', 'E'])]
    >>> list(cut_ranges(iter([]), [(0, 0)]))  # an empty side's one empty range
    [(0, 0, [], [])]
    """
    todo = sorted(ranges)
    i, at = 0, 0  # the next range; the corpus row of the buffer's first row
    buf_ids: list = []
    buf_texts: list = []
    for ids, texts in batches:
        if i == len(todo):
            return
        buf_ids += ids
        buf_texts += texts
        while i < len(todo) and at + len(buf_ids) >= todo[i][1]:
            s, e = todo[i]
            yield s, e, buf_ids[s - at : e - at], buf_texts[s - at : e - at]
            i += 1
            keep_from = todo[i][0] if i < len(todo) else at + len(buf_ids)
            drop = max(0, min(keep_from, at + len(buf_ids)) - at)
            buf_ids, buf_texts, at = buf_ids[drop:], buf_texts[drop:], at + drop
        if i < len(todo) and at + len(buf_ids) <= todo[i][0]:  # rows before the next range: not kept
            at += len(buf_ids)
            buf_ids, buf_texts = [], []
    for s, e in todo[i:]:  # ranges at or past the end
        yield s, e, buf_ids[max(s - at, 0) : max(e - at, 0)], buf_texts[max(s - at, 0) : max(e - at, 0)]


def side_text_ranges(
    store: ArtifactStore, dataset: str, side: str, ranges: list[tuple[int, int]], title_sep: str = TITLE_SEP
) -> Iterator[tuple[int, int, list[str], list[str]]]:
    """:func:`side_texts`' ids and texts for each ``[start, end)`` range (ascending, not overlapping), the corpus
    read a batch at a time: memory holds a range and a batch, not the corpus (:func:`cut_ranges`)."""
    if side != "passage":
        ids, texts, _ = side_texts(store, dataset, side, title_sep)
        for s, e in sorted(ranges):
            yield s, e, ids[s:e], texts[s:e]
        return
    corpus_size(store, dataset)
    batches = (
        (
            b.column("doc_id").to_pylist(),
            [
                passage_text(ti, tx, title_sep)
                for ti, tx in zip(b.column("title").to_pylist(), b.column("text").to_pylist(), strict=True)
            ],
        )
        for b in store.iter_batches(dataset_dir(dataset), "corpus.parquet", columns=["doc_id", "title", "text"])
    )
    yield from cut_ranges(batches, ranges)


def side_size(store: ArtifactStore, dataset: str, side: str) -> tuple[int, str]:
    """(number of texts, dataset config hash) of one side, without reading the texts."""
    m = dataset_manifest(store, dataset)
    if side == "passage":
        return corpus_size(store, dataset), m.config_hash
    if side == "query":
        qids = store.read_table(dataset_dir(dataset), "queries.parquet", columns=["query_id"])
        return len(dict.fromkeys(qids.column("query_id").to_pylist())), m.config_hash
    raise ValueError(f"unknown side {side!r}; expected query or passage")


def split_queries(store: ArtifactStore, dataset: str, split: str) -> list[str]:
    """Query ids judged in ``split`` (in first-appearance order); a clear error for an unknown split."""
    t = store.read_table(dataset_dir(dataset), "queries.parquet", columns=["query_id", "split"])
    splits = sorted({s for s in t.column("split").to_pylist() if s is not None})
    if split not in splits:
        raise ValueError(f"dataset {dataset!r} has no split {split!r}; it has {splits}")
    ids = t.filter(pc.equal(t.column("split"), split)).column("query_id").to_pylist()
    return list(dict.fromkeys(ids))


def qrels_table(store: ArtifactStore, dataset: str, split: str) -> pa.Table:
    t = store.read_table(dataset_dir(dataset), "qrels.parquet")
    return t.filter(pc.equal(t.column("split"), split))


def tokens_manifest(store: ArtifactStore, folder: str, hint: str) -> Manifest:
    """The manifest of a tokens folder that holds every text of its side; else a clear error ending in ``hint``
    (what to run).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as root:
    ...     try:
    ...         tokens_manifest(ArtifactStore(root), "tokens/x", "run the tokenize stage")
    ...     except IncompleteArtifactError as exc:
    ...         print(str(exc).split(": ", 1)[1])
    token ids are missing or incomplete; run the tokenize stage
    """
    m = store.read_manifest(folder)
    if m is None or m.total_rows() != m.config.get("inputs", {}).get("rows"):
        raise IncompleteArtifactError(f"{store.abspath(folder)}: token ids are missing or incomplete; {hint}")
    return m


def bot_index(store: ArtifactStore, folder: str) -> tuple[list[str], SparseFlat]:
    """A stored bag-of-tokens index (the bot stage's folder): its passage ids and their bags, in corpus order.

    >>> import tempfile
    >>> from diffret.storage import Manifest
    >>> from diffret.storage.layout import BOT_FILE, BOT_SCHEMA
    >>> with tempfile.TemporaryDirectory() as root:
    ...     store = ArtifactStore(root)
    ...     with store.folder_writer("bot/x", Manifest.new("bot", {}, {})) as w:
    ...         _ = w.write_parquet(BOT_FILE, BOT_SCHEMA, [pa.table({"id": ["a"], "token_ids": [[3, 7]]}, BOT_SCHEMA)])
    ...     ids, bags = bot_index(store, "bot/x")
    >>> ids, bags.ids.tolist()
    (['a'], [3, 7])
    """
    table = store.read_table(folder, BOT_FILE)
    return table.column("id").to_pylist(), binary_flat(table.column("token_ids"))


# ------------------------------------------------------------------------------------------ encodings
def stored_budgets(store: ArtifactStore, system: str, dataset: str, side: str) -> list[int]:
    """The K of a system's stored encodings of one side of a dataset (folders with a manifest), ascending.

    >>> import tempfile
    >>> from diffret.storage import Manifest
    >>> with tempfile.TemporaryDirectory() as root:
    ...     store = ArtifactStore(root)
    ...     for k in (16, 4):
    ...         store.write_manifest(f"encodings/system=s/dataset=d/side=query/k={k}", Manifest.new("x", {}, {}))
    ...     stored_budgets(store, "s", "d", "query"), stored_budgets(store, "s", "d", "passage")
    ([4, 16], [])
    """
    found = store.list_partitions(f"encodings/system={system}/dataset={dataset}/side={side}", "k")
    return sorted(int(k) for k in found)


def budgets(
    store: ArtifactStore, given: list[int] | None, system: str, dataset: str, side: str, log: Callable[[str], None]
) -> list[int]:
    """``given``, else every K stored for the side (saying which, through ``log``); none stored: an error naming
    the command that makes them."""
    if given is not None:
        return given
    found = stored_budgets(store, system, dataset, side)
    if not found:
        raise IncompleteArtifactError(
            f"{system} has no {side} encodings of {dataset!r}: run `diffret encode -d "
            f"{dataset} --side {side}` with its model first"
        )
    name = "K_q" if side == "query" else "K_p"
    log(f"no {name} given: the {side} encodings stored for {dataset}, {name} = {', '.join(map(str, found))}")
    return found


def encoding_manifest(store: ArtifactStore, folder: str, expected_rows: int | None = None) -> Manifest:
    """The manifest of an encoding folder; with ``expected_rows``, only when it holds every text."""
    m = store.read_manifest(folder)
    if m is None or not m.files:
        raise IncompleteArtifactError(
            f"{store.abspath(folder)}: no encodings; run `diffret encode` for this model, dataset and K first"
        )
    if expected_rows is not None and m.total_rows() != expected_rows:
        raise IncompleteArtifactError(
            f"{store.abspath(folder)}: {m.total_rows():,} of {expected_rows:,} texts encoded; "
            "run `diffret encode` to finish it"
        )
    return m


def iter_encodings(
    store: ArtifactStore,
    folder: str,
    m: Manifest,
    device: str = "cpu",
    rules: ScoreRules | None = None,
    sparse_factor: float = 1.0,
    names: list[str] | None = None,
) -> Iterator[Encodings]:
    """The shards of an encoding folder in order (``names``: only those), each verified against the manifest, ready
    to score under ``rules`` (see ``encodings_from_table``); a compressed folder's codes decoded (:func:`codec_for`)."""
    codec = codec_for(store, folder, m)
    for name in sorted(m.files) if names is None else names:
        table = store.read_table(folder, name, batch_rows=READ_ROWS)
        yield encodings_from_table(table, device, rules, sparse_factor, codec)
        del table


def shard_ids(store: ArtifactStore, folder: str, m: Manifest) -> pa.Array:
    """The ``id`` column of a sharded folder's files, in shard order, as one Arrow array: no Python string per
    text (a tokens, encodings or partial folder; ``m`` its verified manifest)."""
    parts = [store.read_table(folder, name, columns=["id"]).column("id") for name in sorted(m.files)]
    return pa.chunked_array(parts, pa.string()).combine_chunks()


def passage_ids(store: ArtifactStore, folder: str) -> pa.Array:
    """The ids of an encoding folder's texts in stream order (:func:`shard_ids` of a complete encoding)."""
    return shard_ids(store, folder, encoding_manifest(store, folder))


def read_encodings(
    store: ArtifactStore,
    folder: str,
    m: Manifest,
    device: str = "cpu",
    rules: ScoreRules | None = None,
    sparse_factor: float = 1.0,
) -> Encodings:
    tables = [store.read_table(folder, name) for name in sorted(m.files)]
    return encodings_from_table(pa.concat_tables(tables), device, rules, sparse_factor, codec_for(store, folder, m))


def codebook_digest(store: ArtifactStore, folder: str) -> str:
    """The sha256 of a stored codebook, its file verified against its manifest: missing ->
    IncompleteArtifactError, changed -> ChecksumError (each naming the file and the repair)."""
    m = store.read_manifest(folder)
    entry = m.files.get(CODEBOOK_FILE) if m is not None else None
    if entry is None:
        raise IncompleteArtifactError(
            f"{store.abspath(folder)}: no codebook; run `diffret compress` (or `diffret "
            "encode --store`) with the settings that made this system"
        )
    store.verify_file(folder, CODEBOOK_FILE, entry)
    return entry.sha256


def read_codebook(store: ArtifactStore, folder: str) -> tuple[Codebook, str]:
    """A stored codebook (verified, :func:`codebook_digest`) and its sha256."""
    digest = codebook_digest(store, folder)
    return Codebook.from_bytes(store.read_bytes(f"{folder}/{CODEBOOK_FILE}"), store.abspath(folder)), digest


def codec_for(store: ArtifactStore, folder: str, m: Manifest) -> Codec | None:
    """What an encodings folder's vectors decode with: None for float16; a compressed system's storage choice with
    the codebook its manifest names (one of another K_p, dataset or digest is refused, naming both)."""
    spec = m.config.get("store", FLOAT16)
    if spec == FLOAT16 or m.partition.get("side") == "query":  # queries are kept in float16
        return None
    if not parse_store(spec).trained:
        return Codec(spec, 0)
    cb_folder = codebook_dir(m.partition["system"], m.partition["dataset"], int(m.partition["k"]))
    codebook, digest = read_codebook(store, cb_folder)
    want = (m.config.get("inputs") or {}).get("codebook")
    if digest != want:
        raise StoreError(
            f"{store.abspath(folder)}: coded with codebook {str(want)[:12]}…, but "
            f"{store.abspath(cb_folder)} holds {digest[:12]}…; {store.repair(folder)}"
        )
    try:
        codebook.check(
            spec, codebook.dim, k=int(m.partition["k"]), dataset=m.partition["dataset"], system=m.partition["system"]
        )
    except ValueError as exc:
        raise StoreError(f"{store.abspath(cb_folder)}: {exc}") from None
    return Codec(spec, codebook.dim, codebook, digest)


def iter_codes(store: ArtifactStore, folder: str, m: Manifest) -> Iterator[tuple[Any, Any]]:
    """(codes [v, B] uint8 as stored, vectors per passage) of a compressed passage folder's shards in order, each
    verified against the manifest; only those two columns are read, nothing is decoded."""
    for name in sorted(m.files):
        table = store.read_table(folder, name, columns=["n_reps", "codes"])
        yield codes_of(table), table.column("n_reps").to_numpy().astype("int64")


def coded_passages(store: ArtifactStore, folder: str, m: Manifest) -> CodedPassages:
    """A ``residual:B`` passage folder's codes, as stored, with the codec they decode with (the search over codes
    reads its candidates' vectors from them)."""
    codec = codec_for(store, folder, m)
    if codec is None or parse_store(codec.spec).kind != "residual":
        raise StoreError(
            f"{store.abspath(folder)}: search over codes needs a residual:B system's passages, not "
            f"{m.config.get('store', FLOAT16)}"
        )
    return CodedPassages.from_blocks(list(iter_codes(store, folder, m)), codec)


def codes_index_manifest(store: ArtifactStore, folder: str) -> Manifest:
    """The manifest of a codes index folder (``diffret index`` of a residual:B system); a clear error naming the
    command when it holds none (absent, or a LanceDB table built with ``--vectors float16``)."""
    m = store.read_manifest(folder)
    if m is None or CODES_INDEX_FILE not in m.files:
        raise IncompleteArtifactError(
            f"{store.abspath(folder)}: no codes index; run `diffret index` for this system "
            "and K_p first (`--kp K`, `--vectors store`)"
        )
    return m


def codes_index(store: ArtifactStore, folder: str, n_passages: int) -> CodesIndex:
    """A stored codes index, its file verified against its manifest (:func:`codes_index_manifest`)."""
    codes_index_manifest(store, folder)
    return CodesIndex.from_table(store.read_table(folder, CODES_INDEX_FILE), n_passages)


def query_encodings(
    store: ArtifactStore,
    folder: str,
    ids: list[str],
    device: str = "cpu",
    rules: ScoreRules | None = None,
    sparse_factor: float = 1.0,
) -> Encodings:
    """The encodings of the queries ``ids``, in that order (a clear error when one is missing)."""
    enc = read_encodings(store, folder, encoding_manifest(store, folder), device, rules, sparse_factor)
    try:
        return select(enc, ids)
    except KeyError as exc:
        raise IncompleteArtifactError(f"{store.abspath(folder)}: {exc.args[0]}") from None
