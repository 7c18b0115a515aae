"""diffret from Python: load a retriever, encode texts in memory, search in any mode, evaluate, open a store.

The same code the stages run, in the same order: a text is tokenized as the tokenize stage does, encoded by the
encode stage's readout, scored by the score stage's exact search with the same rules (one place,
:meth:`retrieval.search.rules.ScoreRules.factor_for`, computes the sparse scale for both), and evaluated by the
evaluate stage's evaluator; so a notebook's numbers are the CLI's numbers.

>>> import diffret
>>> r = diffret.load("../shared/models/splade-tiny-mlm")                         # doctest: +SKIP
>>> q = r.encode_queries({"q1": "what do cats eat"}, k=4)                         # doctest: +SKIP
>>> p = r.encode_passages({"d1": ("Cats", "Cats eat fish."), "d2": "Dogs bark."}, k=4)  # doctest: +SKIP
>>> diffret.search(q, p, "multi_dense", topk=10).to_pylist()[0]["doc_id"]        # doctest: +SKIP
'd1'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import pyarrow as pa

Texts = Mapping[str, str] | Mapping[str, tuple[str, str]] | Sequence[str]


@dataclass
class Encoded:
    """Texts encoded at one budget K: the rows of the store's encodings schema (``table``), and what scoring
    them needs (the side, and the sparse scale of the system that made them)."""

    table: pa.Table
    side: str
    k: int
    sparse_factor: float = 1.0
    readout: str = "diffretriever"

    @property
    def ids(self) -> list[str]:
        return self.table.column("id").to_pylist()

    def __len__(self) -> int:
        return self.table.num_rows


@dataclass
class Retriever:
    """A backbone and its readout, loaded once; encodes queries and passages in memory (:func:`load`)."""

    settings: Any  # stages.systems.EncodeSettings
    batch_size: int = 32
    _reader: Any = field(default=None, repr=False)

    @property
    def reader(self) -> Any:
        if self._reader is None:
            from diffret.retrieval.models.backbones import load_backbone
            from diffret.retrieval.models.readouts import make_reader

            s = self.settings
            self._reader = make_reader(load_backbone(s.backbone), s.readout, s.max_length)
        return self._reader

    @property
    def sparse_factor(self) -> float:
        """The scale the score stage applies to this retriever's stored sparse weights (the reference's rules)."""
        from diffret.retrieval.search.rules import ScoreRules

        return ScoreRules().factor_for(self.settings.readout.readout, self.settings.readout.model_dump())

    def _encode(self, texts: Texts, side: str, k: int, batch_size: int | None) -> Encoded:
        from diffret.retrieval.data.collections import passage_text
        from diffret.retrieval.models.encoding import encode_rows, tokenize_texts
        from diffret.stages.systems import tokenizer_of

        _whole("k", k)
        _whole("batch_size", batch_size, optional=True)
        ids, raw = _ids_and_texts(texts)
        if side == "query" and any(isinstance(t, tuple) for t in raw):
            raise ValueError("queries are texts, not (title, text) pairs")
        _checked_texts(ids, raw, side)
        if side == "passage":
            raw = [passage_text(t[0], t[1], self.settings.title_sep) if isinstance(t, tuple) else t for t in raw]
        type(self.reader).check_k([k])
        tokens = tokenize_texts(tokenizer_of(self.settings.backbone), raw, self.settings.max_length)
        table = encode_rows(self.reader, ids, tokens.column("token_ids").to_pylist(), raw,
                            side=side, k=k, batch_size=batch_size or self.batch_size)  # fmt: skip
        return Encoded(table, side, k, self.sparse_factor, self.settings.readout.readout)

    def encode_queries(self, texts: Texts, k: int = 1, batch_size: int | None = None) -> Encoded:
        """Queries at budget ``k`` (K_q): ``{id: text}``, or a list of texts (ids "0", "1", ...); none give an empty
        Encoded (and :func:`search` an empty run)."""
        return self._encode(texts, "query", k, batch_size)

    def encode_passages(self, texts: Texts, k: int = 1, batch_size: int | None = None) -> Encoded:
        """Passages at budget ``k`` (K_p): ``{id: text}`` or ``{id: (title, text)}`` (joined as the tokenize stage
        joins them), or a list; passages keep their order, which breaks score ties (the earlier first). None give an
        empty Encoded."""
        return self._encode(texts, "passage", k, batch_size)


def _whole(name: str, value: Any, least: int = 1, optional: bool = False) -> None:
    """Refuse ``value`` for the argument ``name`` unless it is a whole number >= ``least`` (or None if ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be a whole number >= {least}{' (or None)' if optional else ''}, got {value!r}")


def _checked_texts(ids: list[str], raw: list[Any], side: str) -> None:
    """Every text a string (a passage also a (title, text) pair of strings), naming the first that is not; judged or
    not, a query whose text is empty is encoded as the prompt alone: warned about, naming it."""
    import warnings

    for i, t in zip(ids, raw, strict=True):
        pair = side == "passage" and isinstance(t, tuple) and len(t) == 2 and all(isinstance(x, str) for x in t)
        if not (isinstance(t, str) or pair):
            want = "a string or a (title, text) pair of strings" if side == "passage" else "a string"
            raise TypeError(f"{side} {i!r}: its text is {type(t).__name__} {t!r:.40}, not {want}")
    if side == "query":
        empty = [i for i, t in zip(ids, raw, strict=True) if isinstance(t, str) and not t.strip()]
        if empty:
            shown = ", ".join(map(repr, empty[:5])) + (", ..." if len(empty) > 5 else "")
            warnings.warn(
                f"{len(empty)} quer{'y has' if len(empty) == 1 else 'ies have'} empty text ({shown}): encoded as the "
                "prompt alone, they rank passages by the prompt",
                UserWarning,
                stacklevel=4,
            )


def _ids_and_texts(texts: Texts) -> tuple[list[str], list[Any]]:
    if isinstance(texts, Mapping):
        return [str(i) for i in texts], list(texts.values())
    if isinstance(texts, str):
        raise TypeError("give a list of texts or a {id: text} mapping, not one string")
    items = list(texts)
    return [str(i) for i in range(len(items))], items


def load(model: str, readout: str = "diffretriever", *, max_length: int | None = None, batch_size: int = 32,
         device: str = "auto", dtype: str | None = None, **options: Any) -> Retriever:  # fmt: skip
    """A retriever over any backbone the CLI takes (a hub id or a local folder; a released DiffRetriever
    checkpoint included) with any readout (``diffretriever``, ``promptreps``, ``diffembed``, ``repllama``,
    ``sidr``). ``options`` are the backbone's and the readout's settings as the CLI names them, with ``_`` for
    ``-`` (``prompt="few_words"``, ``denoise_steps=2``, ``trust_remote_code=True``, ...).

    >>> r = load("../shared/models/splade-tiny-mlm")           # doctest: +SKIP
    >>> r.settings.readout.readout                              # doctest: +SKIP
    'diffretriever'
    """
    from diffret.retrieval.models.backbones import BackboneConfig
    from diffret.retrieval.models.readouts import ReadoutConfig
    from diffret.stages.encode import EncodeConfig

    _whole("batch_size", batch_size)
    _whole("max_length", max_length, optional=True)
    bb_fields, ro_fields = set(BackboneConfig.model_fields), set(ReadoutConfig.model_fields)
    unknown = sorted(set(options) - bb_fields - ro_fields)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; backbone: {sorted(bb_fields)}; readout: {sorted(ro_fields)}")
    bb = BackboneConfig.model_validate({"model": model, "device": device, **({"dtype": dtype} if dtype else {}),
                                        **{k: v for k, v in options.items() if k in bb_fields}})  # fmt: skip
    ro = ReadoutConfig.model_validate({"readout": readout, **{k: v for k, v in options.items() if k in ro_fields}})
    extra = {"max_length": max_length} if max_length is not None else {}
    config = EncodeConfig.model_validate({"dataset": "api", "backbone": bb, "readout": ro, **extra})
    settings = config.settings()  # the CLI's resolution
    return Retriever(settings, batch_size)


def search(queries: Encoded, passages: Encoded | Iterable[Encoded], mode: str = "multi_dense", topk: int = 1000,
           *, device: str = "cpu", rules: Any = None, fusion_depth: int = 1000,
           self_hits: str = "keep") -> pa.Table:  # fmt: skip
    """Exact search of ``queries`` against ``passages`` (one Encoded, or several blocks of one corpus, in order)
    in ``mode`` (``single_dense``, ``multi_dense``, ``sparse_max``, ``fusion_single_sparse_max``,
    ``fusion_multi_sparse_max``): the run table the score stage writes (query_id, doc_id, rank, score; ranks by
    score, ties by doc_id), with its rules (``rules``: a ScoreRules, default the reference evaluator's)."""
    from diffret.retrieval.search.encodings import encodings_from_table
    from diffret.retrieval.search.exact import SearchSettings, search_pass
    from diffret.retrieval.search.modes import MODES, all_modes, base_modes_needed
    from diffret.retrieval.search.rules import ScoreRules
    from diffret.retrieval.search.runs import run_table

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {list(MODES)}")
    _whole("topk", topk)
    _whole("fusion_depth", fusion_depth)
    blocks = [passages] if isinstance(passages, Encoded) else list(passages)
    if queries.side != "query" or any(b.side != "passage" for b in blocks):
        raise ValueError("search(queries, passages): encode_queries' output first, then encode_passages'")
    blocks = [b for b in blocks if len(b)]
    if not len(queries) or not blocks:  # no queries, or no passages: no results
        from diffret.schemas import RUN_SCHEMA

        return RUN_SCHEMA.empty_table()
    rules = rules or ScoreRules()
    q = encodings_from_table(queries.table, device, rules, queries.sparse_factor)
    stream = (encodings_from_table(b.table, device, rules, b.sparse_factor) for b in blocks)
    depth = max(topk, fusion_depth) if MODES[mode].is_fusion else topk
    settings = SearchSettings(topk=depth, ignore_identical_ids=self_hits == "drop", rules=rules)
    tops, doc_ids = search_pass({queries.k: q}, stream, base_modes_needed([mode]), settings)
    runs = all_modes(tops, fusion_depth, rules)
    return run_table(runs[(queries.k, mode)], queries.ids, doc_ids, depth=topk)


Run: TypeAlias = "pa.Table | Mapping[str, Mapping[str, float]]"


def evaluate(run: Run, qrels: pa.Table | Mapping[str, Mapping[str, int]], measures: Sequence[str] | None = None,
             relevance_level: int = 1, ties: str = "trec") -> dict[str, float]:  # fmt: skip
    """The mean of each measure (default: NDCG@10, MRR@10, R@100, R@1000 as pytrec_eval names them) over every
    judged query, as the evaluate stage computes it (a judged query without results scores 0; tied scores
    ordered as the stage's default ``ties="trec"`` orders them, ``"rank"`` keeps the run's rank order).
    ``run`` and ``qrels`` are tables or pytrec_eval's dicts. :func:`evaluate_per_query` gives the per-query table.

    >>> evaluate({"q1": {"d1": 0.2, "d2": 0.9}}, {"q1": {"d1": 1}}, ["recip_rank"])
    {'recip_rank': 0.5}
    """
    table = evaluate_per_query(run, qrels, measures, relevance_level, ties)
    n: dict[str, int] = {}
    sums: dict[str, float] = {}
    for m, v in zip(table.column("measure").to_pylist(), table.column("value").to_pylist(), strict=True):
        sums[m] = sums.get(m, 0.0) + v
        n[m] = n.get(m, 0) + 1
    return {m: sums[m] / n[m] for m in sums}


def run_from_dict(run: Mapping[str, Mapping[str, float]]) -> pa.Table:
    """A pytrec_eval run (``{query_id: {doc_id: score}}``) as a run table (query_id, doc_id, rank, score), ranked
    per query by score (kept in float64), ties by doc_id.

    >>> run_from_dict({"q1": {"d1": 0.2, "d2": 0.9}}).to_pylist()[0]
    {'query_id': 'q1', 'doc_id': 'd2', 'rank': 1, 'score': 0.9}
    """
    cols: dict[str, list] = {"query_id": [], "doc_id": [], "rank": [], "score": []}
    for q, docs in run.items():
        if not isinstance(docs, Mapping):
            raise TypeError(f"run[{q!r}] is {type(docs).__name__}, not a {{doc_id: score}} mapping")
        scored = []
        for d, v in docs.items():
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError(f"run[{q!r}][{d!r}]: score {v!r} is not a number")
            scored.append((float(v), str(d)))
        scored.sort(key=lambda x: (-x[0] if x[0] == x[0] else float("inf"), x[1]))
        for rank, (v, d) in enumerate(scored, 1):
            cols["query_id"].append(str(q))
            cols["doc_id"].append(d)
            cols["rank"].append(rank)
            cols["score"].append(v)
    types = {"query_id": pa.string(), "doc_id": pa.string(), "rank": pa.int32(), "score": pa.float64()}
    return pa.table({c: pa.array(v, types[c]) for c, v in cols.items()})  # float64 scores: no ties made, none lost


def _refuse_non_finite(run: pa.Table) -> None:
    """A ValueError naming the first (query, document) whose score is NaN or infinite (it would rank last, or
    first, by accident)."""
    import pyarrow.compute as pc

    if "score" not in run.column_names:
        return
    finite = pc.fill_null(pc.is_finite(run.column("score")), True)
    bad = pc.sum(pc.invert(finite)).as_py() or 0
    if bad:
        i = pc.index(finite, False).as_py()
        row = {c: run.column(c)[i].as_py() for c in ("query_id", "doc_id", "score")}
        raise ValueError(
            f"query {row['query_id']!r}, document {row['doc_id']!r}: score {row['score']} is not a finite number "
            f"({bad:,} such score(s) in the run); drop those rows or give them a score"
        )


def evaluate_per_query(run: Run, qrels: pa.Table | Mapping[str, Mapping[str, int]],
                       measures: Sequence[str] | None = None, relevance_level: int = 1,
                       ties: str = "trec") -> pa.Table:  # fmt: skip
    """Per-query metrics (query_id, measure, value) of a run (a table with query_id, doc_id, rank, score, or
    pytrec_eval's ``{query_id: {doc_id: score}}``) against qrels (a table with query_id, doc_id, relevance, or
    ``{query_id: {doc_id: grade}}``). A run that answers none of the judged queries is refused (a ValueError), as
    `diffret import-run` refuses one: the qrels of another split or collection would otherwise score every query 0
    without a word; so is a score that is NaN or infinite, naming its query and document.

    >>> run = pa.table({"query_id": ["q1"], "doc_id": ["d1"], "rank": [1], "score": [1.0]})
    >>> evaluate_per_query(run, {"q1": {"d1": 1}}, ["ndcg_cut_10"]).column("value").to_pylist()
    [1.0]
    >>> evaluate_per_query(run, {"7": {"d1": 1}})
    Traceback (most recent call last):
    ...
    ValueError: no query in common: the run answers 1 query (e.g. 'q1'), the qrels judge 1 (e.g. '7'); are these \
the qrels of its split and collection?
    """
    import pyarrow.compute as pc

    from diffret.retrieval.evaluation import DEFAULT_MEASURES
    from diffret.retrieval.evaluation.arrays import evaluate_tables

    _whole("relevance_level", relevance_level, least=0)
    if isinstance(run, Mapping):
        run = run_from_dict(run)
    _refuse_non_finite(run)
    if isinstance(qrels, Mapping):
        rows = [(q, d, int(g)) for q, docs in qrels.items() for d, g in docs.items()]
        qrels = pa.table({"query_id": pa.array([r[0] for r in rows], pa.string()),
                          "doc_id": pa.array([r[1] for r in rows], pa.string()),
                          "relevance": pa.array([r[2] for r in rows], pa.int32())})  # fmt: skip
    asked = pc.unique(run.column("query_id")).to_pylist()
    judged = pc.unique(qrels.column("query_id")).to_pylist()
    if not set(asked) & set(judged):

        def some(ids: list[Any]) -> str:
            return f" (e.g. {sorted(ids)[0]!r})" if ids else ""

        raise ValueError(f"no query in common: the run answers {len(asked):,} quer{'y' if len(asked) == 1 else 'ies'}"
                         f"{some(asked)}, the qrels judge {len(judged):,}{some(judged)}; are these the qrels of its "
                         "split and collection?")  # fmt: skip
    return evaluate_tables(qrels, run, list(measures or DEFAULT_MEASURES), relevance_level, ties=ties)  # type: ignore[arg-type]


@dataclass
class Collection:
    """A test collection read from a folder in BEIR layout (corpus.jsonl, queries.jsonl, qrels/<split>.tsv) by the
    download stage's own readers."""

    corpus: dict[str, tuple[str, str]]  # id -> (title, text), in file order
    all_queries: dict[str, str]
    qrels_table: pa.Table  # query_id, doc_id, relevance, split

    def queries(self, split: str = "test") -> dict[str, str]:
        """The queries judged in ``split``, in the order the score stage takes them (first appearance)."""
        judged = dict.fromkeys(self.qrels(split).column("query_id").to_pylist())
        return {q: self.all_queries[q] for q in judged if q in self.all_queries}

    def qrels(self, split: str = "test") -> pa.Table:
        import pyarrow.compute as pc

        return self.qrels_table.filter(pc.equal(self.qrels_table.column("split"), split))


def load_beir(folder: str | Path, name: str | None = None) -> Collection:
    """A BEIR-layout folder, validated and parsed as `diffret download --source FOLDER` parses it."""
    import tempfile

    from diffret.stages import execute, stages
    from diffret.stages.download import DownloadConfig

    folder = Path(folder)
    with tempfile.TemporaryDirectory() as root:
        name = name or folder.name
        execute(stages()["download"], DownloadConfig(name=name, source=str(folder), root=root), log=lambda _: None)
        store = Store(root)
        corpus, queries, qrels = (store.table(what, name) for what in ("corpus", "queries", "qrels"))
    return Collection(
        dict(zip(corpus.column("doc_id").to_pylist(),
                 zip(corpus.column("title").to_pylist(), corpus.column("text").to_pylist(), strict=True),
                 strict=True)),
        dict(zip(queries.column("query_id").to_pylist(), queries.column("text").to_pylist(), strict=True)),
        qrels,
    )  # fmt: skip


class Store:
    """An artifact store (a folder or an fsspec URL) read from Python: its tables as Arrow (or pandas), through the
    same verified readers and SQL views the CLI uses. A folder that does not exist, or holds files but none of a
    store's folders, is refused (a :class:`diffret.storage.StoreError`): an empty folder is an empty store.

    >>> s = Store("/tmp/r")                                      # doctest: +SKIP
    >>> s.sql("select mode, kq, kp, ndcg_10 from best_cells")    # doctest: +SKIP
    """

    def __init__(self, root: str | Path):
        import diffret.flows.repairs  # noqa: F401  (a damaged folder's repair named as the command to run)
        from diffret.storage import ArtifactStore

        self.root = str(root)
        self.store = ArtifactStore(self.root)
        self.store.require_root()  # a missing folder, or one that is not a store (TREC files), is refused here

    def sql(self, query: str) -> pa.Table:
        """A read-only DuckDB query over the store's views (``diffret views`` lists them) as an Arrow table."""
        from diffret.storage.sql import StoreSQL

        with StoreSQL(self.store) as db:
            return db.arrow(query)

    def table(self, what: str, dataset: str) -> pa.Table:
        """A dataset's ``corpus``, ``queries`` or ``qrels`` table (verified against its manifest)."""
        from diffret.storage.layout import dataset_dir

        return self.store.read_table(dataset_dir(dataset), f"{what}.parquet")

    def runs(self, where: str = "true") -> pa.Table:
        """Every stored run row matching a SQL condition on the ``runs`` view (system, dataset, split, kq, kp,
        mode, query_id, doc_id, rank, score)."""
        return self.sql(f"select * from runs where {where}")

    def metrics(self, where: str = "true") -> pa.Table:
        """Per-query metrics rows matching a SQL condition on the ``metrics`` view."""
        return self.sql(f"select * from metrics where {where}")

    def cells(self, where: str = "true") -> pa.Table:
        """Mean metrics per (system, dataset, split, K_q, K_p, mode): the ``cells`` view."""
        return self.sql(f"select * from cells where {where}")
