"""All DuckDB access of the service: one locked, in-memory database per index.

The store's Parquet tables are views over exactly the files the manifest lists; DuckDB may read
those files and nothing else (``allowed_paths``, ``enable_external_access = false``), loads no
extension, and its configuration is locked before any user SQL runs. User SQL must be exactly
one SELECT-like statement; it runs on its own cursor with a timer that interrupts it, streams at
most ``max_rows + 1`` rows, and is bounded by the database's memory limit. ``audit_results`` is
materialised from the audit database as an Arrow table, registered on the query's cursor only.
"""

from __future__ import annotations

import decimal
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from prism_tda.errors import PrismError

from . import problems

TABLES = ("documents", "sequences", "activations", "token_grads")
SINGLE_FILES = ("prototypes", "vocab")


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def jsonable(v: Any) -> Any:
    """A value of an Arrow result as JSON: decimals become floats, non-finite floats null, bytes hex,
    dates and times ISO 8601, anything else its string."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, decimal.Decimal):
        f = float(v)
        return f if math.isfinite(f) else None
    if isinstance(v, bytes):
        return v.hex()
    if hasattr(v, "isoformat"):
        return v.isoformat()
    return str(v)


class Store:
    """Read access to one index's tables, and the locked engine for user SQL."""

    def __init__(self, index_dir: Path, *, memory_limit: str = "1GB", threads: int = 2,
                 timeout_s: float = 5.0, max_rows: int = 10_000) -> None:
        self.dir = Path(index_dir).resolve()
        self.timeout_s, self.max_rows = timeout_s, max_rows
        files: dict[str, list[Path]] = {t: sorted((self.dir / t).glob("part-*.parquet")) for t in TABLES}
        files.update({t: [self.dir / f"{t}.parquet"] for t in SINGLE_FILES})
        missing = [t for t, fs in files.items() if not fs or not all(f.is_file() for f in fs)]
        if missing:
            raise PrismError(f"{self.dir}: table(s) {missing} missing")
        con = duckdb.connect(":memory:", config={
            "memory_limit": memory_limit, "threads": threads,
            "autoinstall_known_extensions": False, "autoload_known_extensions": False,
            "python_enable_replacements": False,  # user SQL cannot name Python variables
        })
        for table, fs in files.items():
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet([{', '.join(_quote(str(f)) for f in fs)}])")
        allowed = [str(f) for fs in files.values() for f in fs]
        con.execute(f"SET allowed_paths = [{', '.join(_quote(a) for a in allowed)}]")
        con.execute("SET temp_directory = ''")  # no spilling to disk: the memory limit is the limit
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        self._con = con
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

    # ----------------------------------------------------------------------- user SQL
    def check(self, sql: str) -> str:
        """The one statement of ``sql`` if it is a plain query; raises a problem otherwise."""
        try:
            stmts = duckdb.extract_statements(sql)
        except duckdb.Error as e:
            raise problems.SqlSyntax(_first_line(e)) from None
        if len(stmts) != 1:
            raise problems.SqlOneStatement(f"got {len(stmts)} statements; send exactly one SELECT")
        st = stmts[0]
        if st.type != duckdb.StatementType.SELECT:
            raise problems.SqlForbidden(f"only SELECT queries are allowed, not {st.type.name}")
        return st.query

    def query(self, sql: str, audit_results: Callable[[], pa.Table] | None = None) -> dict[str, Any]:
        """Run one user query under the lock-down; return columns, rows and timing."""
        query = self.check(sql)
        cur = self._cursor()
        timer = threading.Timer(self.timeout_s, cur.interrupt)
        t0 = time.perf_counter()
        try:
            if audit_results is not None and "audit_results" in query.lower():
                cur.register("audit_results", audit_results())
            timer.start()
            reader = cur.sql(query).limit(self.max_rows + 1).to_arrow_reader(1024)
            batches, n = [], 0
            for b in reader:
                batches.append(b)
                n += b.num_rows
            table = pa.Table.from_batches(batches, schema=reader.schema)
        except duckdb.InterruptException:
            raise problems.SqlTimeout(f"the query ran longer than {self.timeout_s:g} s and was interrupted") from None
        except duckdb.OutOfMemoryException:
            raise problems.SqlOutOfMemory("the query needs more memory than the service's SQL memory limit") from None
        except duckdb.PermissionException as e:
            raise problems.SqlForbidden(_first_line(e)) from None
        except duckdb.ParserException as e:
            raise problems.SqlSyntax(_first_line(e)) from None
        except duckdb.Error as e:
            raise problems.SqlError(_first_line(e)) from None
        finally:
            timer.cancel()
            cur.close()
        if n > self.max_rows:
            raise problems.SqlTooManyRows(f"the query returns more than {self.max_rows} rows; add a LIMIT or "
                                          "aggregate")
        cols = table.column_names
        data = [table.column(c).to_pylist() for c in cols]
        rows = [[jsonable(col[i]) for col in data] for i in range(table.num_rows)]
        return {"columns": [{"name": c, "type": str(t)} for c, t in zip(cols, table.schema.types)],
                "rows": rows, "row_count": table.num_rows, "elapsed_ms": 1e3 * (time.perf_counter() - t0)}


def _first_line(e: Exception) -> str:
    msg = str(e).strip()
    return msg.split("\n")[0] if msg else type(e).__name__
