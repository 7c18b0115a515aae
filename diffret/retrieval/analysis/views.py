"""Reading the SQL views: rows as dicts, and per-query scores of one cell."""

from __future__ import annotations

from typing import Any, Protocol

from diffret.schemas import PRIMARY


class Views(Protocol):
    """The store's SQL views as the analyses read them: ``execute`` runs a query (``?`` parameters) over views named
    as ``queries/*.sql`` names them and returns DuckDB's result (``description``, ``fetchall``).
    ``storage.sql.StoreSQL`` is one (it also warns of the folders its views leave out)."""

    def execute(self, sql: str, params: list | None = None) -> Any: ...


class Rows(list):
    """Query rows as dicts, with the query's column names (kept when there are no rows)."""

    columns: list[str]


def rows(db: Views, sql: str, params: list | None = None) -> Rows:
    """The rows of a query as dicts (``.columns``: its column names, even without rows)."""
    rel = db.execute(sql, params or [])
    cols = [d[0] for d in rel.description]
    out = Rows(dict(zip(cols, r, strict=True)) for r in rel.fetchall())
    out.columns = cols
    return out


def per_query(
    db: Views, system: str, dataset: str, split: str, mode: str, kq: int, kp: int, measure: str = PRIMARY.pytrec
) -> dict[str, float]:
    """{query_id: value} of one cell and measure (view ``metrics``; default NDCG@10): the t-tests' input."""
    r = db.execute(
        "select query_id, value from metrics where system = ? and dataset = ? and split = ? and mode = ? "
        "and kq = ? and kp = ? and measure = ?",
        [system, dataset, split, mode, kq, kp, measure],
    ).fetchall()
    return dict(r)
