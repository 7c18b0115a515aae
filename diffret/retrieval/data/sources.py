"""Where a collection comes from: the catalog of official locations, ir_datasets, mirrors, and fetching.

``resolve_source`` turns (dataset name or ir_datasets id, optional ``--source``) into local files plus a provenance
record (``inputs``: file -> checksum) that becomes part of the artifact's config, so that a changed
source is detected as config drift instead of being mixed silently with what is already stored.

The catalog's files (BEIR zips, MS MARCO, TREC DL) are fetched through ir_datasets (its mirrors, md5 checks and
cache, ``IR_DATASETS_HOME``), which lists every one of them under the same URL and checksum: the stored collection is
the one the hand-written fetch made (same files, same config). An ir_datasets id maps to the catalog's collection
where it is one (``beir/scifact/test`` -> ``scifact``, ``msmarco-passage/dev/small`` -> ``msmarco-passage``,
``msmarco-passage/trec-dl-2019/judged`` -> ``trec-dl-2019``: :data:`IRDS_NAMES`); any other id is read through
ir_datasets' own API (docs, queries, qrels) into the BEIR layout and stored the same way (:func:`irds_source`).
The hand-written fetch (:func:`download`) remains for ``--source`` URLs (mirrors) only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .collections import DatasetError


class DownloadError(DatasetError):
    """A network / remote-storage failure: worth retrying, unlike malformed input."""


BEIR_BASE_URL = "https://public.ukp.informatik.tu-darmstadt.de/thakur/BEIR/datasets"
MSMARCO_BASE_URL = "https://msmarco.z22.web.core.windows.net/msmarcoranking"
TREC_DL_BASE_URL = "https://trec.nist.gov/data/deep"

# md5 of the official BEIR zips, as published in the BEIR README ("Available Datasets").
BEIR_MD5 = {
    "msmarco": "444067daf65d982533ea17ebd59501e4",
    "trec-covid": "ce62140cb23feb9becf6270d0d1fe6d1",
    "nfcorpus": "a89dba18a62ef92f7d323ec890a0d38d",
    "nq": "d4d3d2e48787a744b6f6e691ff534307",
    "hotpotqa": "f412724f78b0d91183a0e86805e16114",
    "fiqa": "17918ed23cd04fb15047f73e6c3bd9d9",
    "arguana": "8ad3e3c2a5867cdced806d6503f29b99",
    "webis-touche2020": "46f650ba5a527fc69e0a6521c5a23563",
    "cqadupstack": "4e41456d7df8ee7760a7f866133bda78",
    "quora": "18fb154900ba42a600f84b839c173167",
    "dbpedia-entity": "c2a39eb420a3164af735795df012ac2c",
    "scidocs": "38121350fc3a4d2f48850f6aff52e4a9",
    "fever": "5a818580227bfb4b35bb6fa46d9b6c03",
    "climate-fever": "8b66f0a9126c521bae2bde127b4dc99d",
    "scifact": "5f7d1de60b170fc8027bb7898e2efca1",
}


@dataclass(frozen=True)
class RemoteFile:
    url: str
    md5: str | None = None  # the publisher's checksum, where one is published


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    kind: str  # "beir" | "msmarco" | "trec-dl"
    files: tuple[RemoteFile, ...]
    corpus_from: str | None = None  # a collection whose corpus these qrels judge (TREC DL -> msmarco-passage)
    mirror_subdirs: tuple[str, ...] = ()  # BEIR-layout sub-folders to read when --source is a parent folder


def catalog(beir_base_url: str = BEIR_BASE_URL) -> dict[str, CatalogEntry]:
    out = {
        name: CatalogEntry(name, "beir", (RemoteFile(f"{beir_base_url}/{name}.zip", md5),))
        for name, md5 in BEIR_MD5.items()
        if name != "msmarco"
    }
    out["msmarco-passage"] = CatalogEntry(
        "msmarco-passage",
        "msmarco",
        # collection.tsv, queries.{train,dev.small}.tsv, qrels.{train,dev.small}.tsv (md5 from the MS MARCO site)
        (RemoteFile(f"{MSMARCO_BASE_URL}/collectionandqueries.tar.gz", "31644046b18952c1386cd4564ba2ae69"),),
        mirror_subdirs=("dev-small", "train"),
    )
    out["trec-dl-2019"] = CatalogEntry(
        "trec-dl-2019",
        "trec-dl",
        (
            RemoteFile(f"{MSMARCO_BASE_URL}/msmarco-test2019-queries.tsv.gz", "eda71eccbe4d251af83150abe065368c"),
            RemoteFile(f"{TREC_DL_BASE_URL}/2019qrels-pass.txt"),
        ),
        corpus_from="msmarco-passage",
        mirror_subdirs=("trec-dl-2019",),
    )
    out["trec-dl-2020"] = CatalogEntry(
        "trec-dl-2020",
        "trec-dl",
        (
            RemoteFile(f"{MSMARCO_BASE_URL}/msmarco-test2020-queries.tsv.gz"),
            RemoteFile(f"{TREC_DL_BASE_URL}/2020qrels-pass.txt"),
        ),
        corpus_from="msmarco-passage",
        mirror_subdirs=("trec-dl-2020",),
    )
    return out


def corpus_of(dataset: str) -> str:
    """The collection whose corpus a dataset's qrels judge (TREC DL -> msmarco-passage; else itself).

    >>> corpus_of("trec-dl-2019"), corpus_of("scifact")
    ('msmarco-passage', 'scifact')
    """
    entry = catalog().get(dataset)
    return entry.corpus_from if entry is not None and entry.corpus_from else dataset


@dataclass
class SourceFiles:
    """Local files of one collection, ready to read."""

    origin: str  # what the user named: "official", a folder, a URL
    corpus: Path | None = None
    corpus_format: str = "jsonl"
    queries: list[tuple[Path, str]] = field(default_factory=list)
    qrels: dict[str, Path] = field(default_factory=dict)
    corpus_from: str | None = None
    inputs: dict[str, str] = field(default_factory=dict)  # file -> "sha256:..." or "md5:..." (publisher's)
    notes: list[str] = field(default_factory=list)


Progress = Callable[[str, int, int | None], None]  # (label, bytes done, bytes total)


# ---------------------------------------------------------------------------------------- checksums
def file_digest(path: Path, algo: str = "sha256") -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ fetching
def _is_url(source: str) -> bool:
    scheme = urllib.parse.urlparse(source).scheme
    return len(scheme) > 1  # not a Windows drive letter, not a plain path


# Network failures worth retrying: no answer, a timeout, or a server-side error (never a 404 or bad content).
RETRY_DELAYS_S = (2.0, 10.0)


def _transient(exc: OSError) -> bool:
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code >= 500 or exc.code == 429
    return True


def download(url: str, dest: Path, md5: str | None = None, progress: Progress | None = None) -> Path:
    """Fetch ``url`` to ``dest`` (kept as a cache: skipped when present and its md5 matches).

    Written as ``dest.part`` and renamed when complete, so an interrupted download is never used.
    Transient network failures are retried (``RETRY_DELAYS_S``) before a DownloadError.
    """
    if dest.exists() and (md5 is None or file_digest(dest, "md5") == md5):
        return dest
    for delay in RETRY_DELAYS_S:
        try:
            return _download_once(url, dest, md5, progress)
        except DownloadError as exc:
            if not _transient(exc.__cause__):  # type: ignore[arg-type]
                raise
            time.sleep(delay)
    return _download_once(url, dest, md5, progress)


def _download_once(url: str, dest: Path, md5: str | None, progress: Progress | None) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    scheme = urllib.parse.urlparse(url).scheme
    try:
        if scheme in ("http", "https", "ftp", "file"):
            req = urllib.request.Request(url, headers={"User-Agent": "diffret"})
            with urllib.request.urlopen(req, timeout=120) as resp, open(part, "wb") as out:
                total = resp.headers.get("Content-Length")
                total_n = int(total) if total and total.isdigit() else None
                done = 0
                while chunk := resp.read(1 << 20):
                    out.write(chunk)
                    done += len(chunk)
                    if progress:
                        progress(dest.name, done, total_n)
        else:  # any fsspec protocol (s3://, gs://, ...)
            import fsspec

            with fsspec.open(url, "rb") as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise DownloadError(
            f"could not download {url}: {' '.join(str(exc).split())} (offline? give --source a local BEIR-layout "
            "folder (corpus.jsonl, queries.jsonl, qrels/) or archive; this repository's checkouts have them in "
            "../shared/data/<name>)"
        ) from exc
    if md5 is not None:
        got = file_digest(part, "md5")
        if got != md5:
            part.unlink(missing_ok=True)
            raise DatasetError(f"{url}: md5 {got} does not match the published {md5}; download removed")
    os.replace(part, dest)
    return dest


def _safe_extract_zip(archive: Path, into: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        for member in zf.infolist():
            target = (into / member.filename).resolve()
            if not str(target).startswith(str(into.resolve()) + os.sep) and target != into.resolve():
                raise DatasetError(f"{archive}: member {member.filename!r} would escape the extraction folder")
        zf.extractall(into)


def _safe_extract_tar(archive: Path, into: Path) -> None:
    with tarfile.open(archive) as tf:
        tf.extractall(into, filter="data")


def extract(archive: Path, into: Path) -> Path:
    """Extract once (a ``.done`` marker is written last) and return the folder."""
    marker = into / ".done"
    if marker.exists():
        return into
    if into.exists():
        shutil.rmtree(into)
    tmp = into.with_name(into.name + ".extracting")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if archive.name.endswith(".zip"):
        _safe_extract_zip(archive, tmp)
    else:
        _safe_extract_tar(archive, tmp)
    (tmp / ".done").write_text(archive.name)
    os.replace(tmp, into)
    return into


# --------------------------------------------------------------------------------------- BEIR layout
def _beir_root(folder: Path) -> Path:
    """The folder holding queries.jsonl: ``folder`` itself or its single sub-folder (BEIR zips nest one)."""
    if (folder / "queries.jsonl").exists() or (folder / "queries.jsonl.gz").exists():
        return folder
    subs = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if len(subs) == 1 and ((subs[0] / "queries.jsonl").exists() or (subs[0] / "queries.jsonl.gz").exists()):
        return subs[0]
    return folder


def _first_existing(*paths: Path) -> Path | None:
    return next((p for p in paths if p.exists()), None)


def read_beir_folder(folder: Path, into: SourceFiles) -> None:
    folder = _beir_root(folder)
    queries = _first_existing(folder / "queries.jsonl", folder / "queries.jsonl.gz")
    if queries is None:
        raise DatasetError(
            f"{folder}: no queries.jsonl (expected BEIR layout: corpus.jsonl, queries.jsonl, qrels/<split>.tsv)"
        )
    into.queries.append((queries, "jsonl"))
    corpus = _first_existing(folder / "corpus.jsonl", folder / "corpus.jsonl.gz")
    if corpus is not None:
        if into.corpus is not None:
            raise DatasetError(f"{folder}: a second corpus.jsonl for the same collection ({into.corpus})")
        into.corpus, into.corpus_format = corpus, "jsonl"
    qrels_dir = folder / "qrels"
    splits = sorted(qrels_dir.glob("*.tsv")) if qrels_dir.is_dir() else []
    if not splits:
        raise DatasetError(f"{folder}: no qrels/<split>.tsv files")
    for p in splits:
        split = p.stem
        if split in into.qrels:
            raise DatasetError(f"{p}: split {split!r} is already given by {into.qrels[split]}")
        into.qrels[split] = p


def _record_local_inputs(files: SourceFiles, base: Path) -> None:
    paths = ([files.corpus] if files.corpus else []) + [q for q, _ in files.queries] + list(files.qrels.values())
    for p in paths:
        p = p.resolve()
        key = str(p.relative_to(base)) if p.is_relative_to(base) else str(p)
        files.inputs[key] = "sha256:" + file_digest(p)


def _local_source(name: str, folder: Path, entry: CatalogEntry | None) -> SourceFiles:
    files = SourceFiles(origin=str(folder.resolve()), corpus_from=entry.corpus_from if entry else None)
    root = _beir_root(folder)
    if (root / "queries.jsonl").exists() or (root / "queries.jsonl.gz").exists():
        read_beir_folder(root, files)
    else:
        subdirs = [d for d in (entry.mirror_subdirs if entry else ()) if (folder / d).is_dir()]
        if not subdirs and (folder / name).is_dir():
            subdirs = [name]
        if not subdirs:
            raise DatasetError(f"{folder}: not a BEIR-layout folder (no queries.jsonl) and no sub-folder for {name!r}")
        for d in subdirs:
            read_beir_folder(folder / d, files)
        files.notes.append(f"read from sub-folders {', '.join(subdirs)} of {folder}")
    _record_local_inputs(files, folder.resolve())
    return files


# ------------------------------------------------------------------------------------------- resolve
def resolve_source(
    name: str,
    source: str | None,
    cache_dir: Path,
    beir_base_url: str = BEIR_BASE_URL,
    progress: Progress | None = None,
) -> SourceFiles:
    """Local files for collection ``name``; downloads (with checksums) when the source is remote."""
    entries = catalog(beir_base_url)
    name = IRDS_NAMES.get(name, name)
    entry = entries.get(name)
    if source is None:
        if entry is None:
            if is_irds_id(name):
                return irds_source(name, cache_dir)
            raise DatasetError(
                f"unknown collection {name!r}; known: {', '.join(sorted(entries))}, or any ir_datasets id "
                "(https://ir-datasets.com; e.g. beir/scifact/test) (or give --source DIR_OR_URL for any collection in "
                "BEIR layout)"
            )
        return _official(entry, cache_dir / name, progress)
    name = stored_name(name)

    if not _is_url(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise DatasetError(f"source {source!r} does not exist")
        if path.is_file():
            if not (path.name.endswith(".zip") or ".tar" in path.name):
                raise DatasetError(f"source {source!r}: expected a folder or a .zip / .tar.gz archive")
            folder = extract(path, cache_dir / name / f"{path.name}.d")
            files = _local_source(name, folder, entry)
            files.origin = str(path.resolve())
            files.inputs = {path.name: "sha256:" + file_digest(path)}
            return files
        return _local_source(name, path, entry)

    # a URL: an archive, or a folder in BEIR layout
    cache = cache_dir / name / hashlib.sha256(source.encode()).hexdigest()[:16]
    base = source.rstrip("/")
    if base.endswith(".zip") or ".tar" in base.rsplit("/", 1)[-1]:
        archive = download(source, cache / base.rsplit("/", 1)[-1], progress=progress)
        files = _local_source(name, extract(archive, cache / "extracted"), entry)
        files.origin = source
        files.inputs = {archive.name: "sha256:" + file_digest(archive)}
        return files
    folder = cache / "folder"
    download(f"{base}/queries.jsonl", folder / "queries.jsonl", progress=progress)
    try:
        download(f"{base}/corpus.jsonl", folder / "corpus.jsonl", progress=progress)
    except DatasetError:
        pass  # collections without a corpus (queries + qrels only) are allowed
    for split in ("train", "dev", "test"):
        try:
            download(f"{base}/qrels/{split}.tsv", folder / "qrels" / f"{split}.tsv", progress=progress)
        except DownloadError:
            continue
    files = _local_source(name, folder, entry)
    files.origin = source
    return files


def _official(entry: CatalogEntry, cache: Path, progress: Progress | None) -> SourceFiles:
    got = [
        irds_download(f.url, cache / f.url.rsplit("/", 1)[-1])
        or download(f.url, cache / f.url.rsplit("/", 1)[-1], f.md5, progress)
        for f in entry.files
    ]
    inputs = {  # by the publisher's file name (ir_datasets keeps its own names in its cache)
        f.url.rsplit("/", 1)[-1]: (f"md5:{f.md5}" if f.md5 else "sha256:" + file_digest(p))
        for p, f in zip(got, entry.files, strict=True)
    }
    if entry.kind == "beir":
        folder = extract(got[0], cache / "extracted")
        files = SourceFiles(origin="official")
        read_beir_folder(folder, files)
    elif entry.kind == "msmarco":
        folder = extract(got[0], cache / "extracted")
        corpus = folder / "collection.tsv"
        files = SourceFiles(
            origin="official",
            corpus=corpus,
            corpus_format="tsv",
            queries=[(folder / "queries.train.tsv", "tsv"), (folder / "queries.dev.small.tsv", "tsv")],
            qrels={"train": folder / "qrels.train.tsv", "dev": folder / "qrels.dev.small.tsv"},
        )
        for p in [corpus, *(q for q, _ in files.queries), *files.qrels.values()]:
            if not p.exists():
                raise DatasetError(f"{got[0]}: archive lacks {p.name}")
    else:  # trec-dl: queries (tsv.gz) + NIST qrels, judged against msmarco-passage
        files = SourceFiles(origin="official", queries=[(got[0], "tsv")], qrels={"test": got[1]})
    files.corpus_from = entry.corpus_from
    files.inputs = inputs
    return files


# -------------------------------------------------------------------------------------------- ir_datasets
# ir_datasets ids of the catalog's collections: the same stored dataset (the same files, every split of it) as the name
IRDS_NAMES: dict[str, str] = {
    **{
        f"beir/{n}{sub}": n
        for n in BEIR_MD5
        if n not in ("msmarco", "cqadupstack", "webis-touche2020")
        for sub in ("", "/train", "/dev", "/test")
    },
    "beir/webis-touche2020/v2": "webis-touche2020",  # the catalog's zip is v2's
    "msmarco-passage/train": "msmarco-passage",
    "msmarco-passage/dev/small": "msmarco-passage",
    "msmarco-passage/trec-dl-2019": "trec-dl-2019",
    "msmarco-passage/trec-dl-2019/judged": "trec-dl-2019",
    "msmarco-passage/trec-dl-2020": "trec-dl-2020",
    "msmarco-passage/trec-dl-2020/judged": "trec-dl-2020",
}
IRDS_SPLITS = ("train", "dev", "test", "validation", "valid", "eval")


def stored_name(name: str) -> str:
    """The store's name of a collection named by catalog name or ir_datasets id: the catalog's name where the id is
    one of its collections, else the id with ``/`` as ``-``.

    >>> stored_name("beir/scifact/test"), stored_name("msmarco-passage/dev/small"), stored_name("lotte/science/test")
    ('scifact', 'msmarco-passage', 'lotte-science-test')
    """
    return IRDS_NAMES.get(name) or name.replace("/", "-")


def is_irds_id(name: str) -> bool:
    """Whether ``name`` is registered in ir_datasets (read from its registry: no download)."""
    try:
        import ir_datasets
    except ImportError:
        return False
    return name in ir_datasets.registry


def _irds_url_index() -> dict[str, tuple[str, str]]:
    """URL -> (group, key) of every file ir_datasets' downloads.json lists (its download contexts)."""
    from ir_datasets.util import DownloadConfig

    out: dict[str, tuple[str, str]] = {}
    for group, entries in DownloadConfig.contents().items():
        if isinstance(entries, dict):
            for key, dlc in entries.items():
                if isinstance(dlc, dict) and isinstance(dlc.get("url"), str):
                    out.setdefault(dlc["url"], (group, key))
    return out


def irds_download(url: str, dest: Path) -> Path | None:
    """``url`` fetched through ir_datasets (its mirrors, md5 check and cache under ``IR_DATASETS_HOME``), where its
    downloads.json lists it; None where it does not (the caller fetches it itself). A file ir_datasets keeps no copy
    of is copied to ``dest``."""
    try:
        import ir_datasets
        from ir_datasets.util import DownloadConfig
    except ImportError:
        return None
    where = _irds_url_index().get(url)
    if where is None:
        return None
    group, key = where
    dl = DownloadConfig.context(group, ir_datasets.util.home_path() / group)[key]
    try:
        path = Path(dl.path())
    except Exception as exc:  # noqa: BLE001 - a network or checksum failure, as one error
        raise DownloadError(
            f"could not download {url} through ir_datasets: {' '.join(str(exc).split())[:300]} (offline? give --source "
            "a local BEIR-layout folder or archive; this repository's checkouts have them in ../shared/data/<name>)"
        ) from exc
    if "cache_path" in DownloadConfig.contents()[group][key]:
        return path
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, dest.with_name(dest.name + ".part"))
    os.replace(dest.with_name(dest.name + ".part"), dest)
    return dest


def _split_of(dataset_id: str) -> str:
    """The split an ir_datasets id's qrels are: its last split-named component (``test`` when it has none).

    >>> _split_of("lotte/science/test/search"), _split_of("msmarco-passage/dev/small"), _split_of("antique")
    ('test', 'dev', 'test')
    """
    return next((p for p in reversed(dataset_id.split("/")) if p in IRDS_SPLITS), "test")


def irds_source(dataset_id: str, cache_dir: Path) -> SourceFiles:
    """A collection read through ir_datasets' API (``docs_iter``, ``queries_iter``, ``qrels_iter``; it downloads,
    checks and caches what it needs) and written once as BEIR-layout files under ``cache_dir``, then read like any
    ``--source`` folder. An id with qrels is one split (:func:`_split_of`); an id without them takes as its splits its
    direct sub-ids that have qrels (``beir/fiqa`` -> train, dev, test). Documents keep their title where the
    collection has one; other fields become ``metadata``."""
    import ir_datasets

    ds = ir_datasets.load(dataset_id)
    if ds.has_qrels():
        splits = {_split_of(dataset_id): ds}
    else:
        depth = dataset_id.count("/") + 1
        subs = sorted(i for i in ir_datasets.registry if i.startswith(dataset_id + "/") and i.count("/") == depth)
        splits = {i.rsplit("/", 1)[1]: sub for i in subs if (sub := ir_datasets.load(i)).has_qrels()}
    if not splits:
        raise DatasetError(f"ir_datasets {dataset_id!r} has no qrels (nor sub-datasets with qrels) to evaluate against")
    folder = cache_dir / "ir_datasets" / dataset_id.replace("/", "--")
    if not (folder / ".done").exists():
        _write_irds(ds, splits, folder)
    name = stored_name(dataset_id)
    files = _local_source(name, folder, None)
    files.origin = f"ir_datasets:{dataset_id}"
    files.notes.append(
        f"read through ir_datasets {dataset_id!r} (splits {', '.join(sorted(splits))}); stored as "
        f"{name!r}: give -d {name} to the other commands"
    )
    return files


def _record(item: Any, id_field: str, keep: tuple[str, ...]) -> dict[str, Any]:
    fields = item._asdict()
    out: dict[str, Any] = {"_id": str(fields.pop(id_field))}
    for name in keep:
        if name in fields:
            value = fields.pop(name)
            out[name] = "" if value is None else str(value)
    meta = {k: v for k, v in fields.items() if isinstance(v, str | int | float | bool) or v is None}
    if meta:
        out["metadata"] = meta
    return out


def _write_irds(ds: Any, splits: dict[str, Any], folder: Path) -> None:
    import json

    tmp = folder.with_name(folder.name + ".writing")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "qrels").mkdir(parents=True)
    try:
        if ds.has_docs():
            with open(tmp / "corpus.jsonl", "w", encoding="utf-8") as f:
                for doc in ds.docs_iter():
                    rec = _record(doc, "doc_id", ("title", "text"))
                    rec.setdefault("text", doc.default_text() if hasattr(doc, "default_text") else "")
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        sources = [ds] if ds.has_queries() else list(splits.values())
        seen: set[str] = set()
        with open(tmp / "queries.jsonl", "w", encoding="utf-8") as f:
            for src in sources:
                for q in src.queries_iter():
                    rec = _record(q, "query_id", ("text",))
                    rec.setdefault("text", q.default_text() if hasattr(q, "default_text") else "")
                    if rec["_id"] not in seen:
                        seen.add(rec["_id"])
                        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        for split, sub in splits.items():
            with open(tmp / "qrels" / f"{split}.tsv", "w", encoding="utf-8") as f:
                f.write("query-id\tcorpus-id\tscore\n")
                for qrel in sub.qrels_iter():
                    f.write(f"{qrel.query_id}\t{qrel.doc_id}\t{int(qrel.relevance)}\n")
        (tmp / ".done").write_text("ir_datasets")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, folder)
