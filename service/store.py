"""DuckDB access of the server process itself: the trusted queries behind the endpoints.

Users' SQL never runs here: it runs in worker processes (``service/sqlpool.py``). This store opens
the same locked database (``sqlengine.open_locked``) for the server's own parameterised queries.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import duckdb

from prism_tda.errors import PrismError

from .sqlengine import SINGLE_FILES, TABLES, open_locked


class Store:
    """Read access to one index's tables for the server's own queries."""

    def __init__(self, index_dir: Path, *, memory_limit: str = "256MB", threads: int = 1) -> None:
        self.dir = Path(index_dir).resolve()
        try:
            self._con = open_locked(self.dir, memory_limit=memory_limit, threads=threads)
        except FileNotFoundError as e:
            raise PrismError(str(e)) from None
        self._lock = threading.Lock()  # cursor creation on the shared connection
        self.tables = [*TABLES, *SINGLE_FILES]

    def close(self) -> None:
        self._con.close()

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        with self._lock:
            return self._con.cursor()

    # ----------------------------------------------------------------------- trusted queries
    def _rows(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        cur = self._cursor()
        try:
            cur.execute(sql, params or [])
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]
        finally:
            cur.close()

    def documents(self, doc_ids: list[int]) -> dict[int, dict[str, Any]]:
        if not doc_ids:
            return {}
        rows = self._rows("SELECT doc_id, external_id, source, title, url, text, n_tokens FROM documents "
                          "WHERE doc_id IN (SELECT unnest(?::INTEGER[]))", [list(doc_ids)])
        return {r["doc_id"]: r for r in rows}

    def prototype(self, proto_id: int) -> dict[str, Any] | None:
        rows = self._rows("SELECT proto_id, n_tokens, mass, mean_act, top_tokens, label, "
                          "mass / (SELECT sum(mass) FROM prototypes) AS share FROM prototypes WHERE proto_id = ?",
                          [proto_id])
        return rows[0] if rows else None

    def prototypes(self, limit: int, offset: int, order: str) -> tuple[int, list[dict[str, Any]]]:
        key = {"mass": "mass DESC", "n_tokens": "n_tokens DESC", "proto_id": "proto_id"}[order]
        total = self._rows("SELECT count(*) AS n FROM prototypes")[0]["n"]
        rows = self._rows(f"SELECT proto_id, n_tokens, mass, mean_act, top_tokens, label FROM prototypes "
                          f"ORDER BY {key}, proto_id LIMIT ? OFFSET ?", [limit, offset])
        return total, rows

    def top_contexts(self, proto_id: int, n: int) -> list[dict[str, Any]]:
        """The n training tokens that activate ``proto_id`` most, with their sequences' token ids."""
        return self._rows(
            "WITH top AS (SELECT seq_id, pos, act, doc_id FROM activations WHERE proto_id = ? "
            "ORDER BY act DESC, seq_id, pos LIMIT ?) "
            "SELECT top.seq_id, top.pos, top.act, top.doc_id, s.token_ids FROM top "
            "JOIN sequences s USING (seq_id) ORDER BY top.act DESC, top.seq_id, top.pos", [proto_id, n])
