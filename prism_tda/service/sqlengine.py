"""The locked DuckDB engine for user SQL, and the worker process that runs it.

Nothing here imports the web framework or torch: this module is the whole program of a SQL
worker process (``python -m prism_tda.service.sqlengine CONFIG``), which the server starts,
watches and kills when a statement overruns (``service/sqlpool.py``).

The lock-down: the index's tables are views over exactly the files the index lists; DuckDB may
read those files and nothing else (``allowed_paths``, ``enable_external_access = false``), loads
no extension, never spills to disk, cannot see Python variables, and its configuration is locked
before any user SQL runs. A statement must parse into exactly one SELECT-like statement that reads
no setting and runs no SQL given as a string. What a statement answers (its rows, or its error)
names the server's directories only as ``<index>``, ``<state>`` and ``<home>``.

Worker protocol (stdin/stdout, each message a 4-byte big-endian length and a payload): the worker
first sends ``{"ready": true, "pid": ..}``; then for each request ``{"sql": .., "audit": ..}`` it
answers a JSON header (``{"ok": true, "columns": .., "row_count": ..}`` or ``{"ok": false,
"kind": .., "detail": ..}``) followed by the rows as one JSON array (empty on error). The worker
exits when its stdin closes, so it never outlives the server.
"""

from __future__ import annotations

import decimal
import json
import math
import os
import re
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import duckdb
import numpy as np
import pyarrow as pa

TABLES = ("documents", "sequences", "tokens", "activations", "prototypes", "vocab", "shards")


class SqlRefusal(Exception):
    """A statement refused or stopped; ``kind`` is its problem type (``sql-timeout``, ...)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def _first_line(e: Exception) -> str:
    msg = str(e).strip()
    return msg.split("\n")[0] if msg else type(e).__name__


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _arrow_tokens(shard: Path) -> pa.Table:
    """A shard's per-token arrays as an Arrow table over their memory maps (no copy)."""
    from prism_tda.engine.layout import array_file

    tokens = np.load(array_file(shard, "tokens"), mmap_mode="r")
    protos = np.load(array_file(shard, "protos"), mmap_mode="r")
    acts = np.load(array_file(shard, "acts"), mmap_mode="r")
    k = protos.shape[1]
    return pa.table({"token_id": pa.array(tokens),
                     "protos": pa.FixedSizeListArray.from_arrays(pa.array(protos.reshape(-1)), k),
                     "acts": pa.FixedSizeListArray.from_arrays(pa.array(acts.reshape(-1)), k)})


def removed_table(ids: np.ndarray) -> pa.Table:
    """Global document ids (of documents taken down) as the one-column ``_removed`` table."""
    return pa.table({"doc_id": pa.array(np.asarray(ids, np.int64), pa.int64())})


def open_locked(index_dir: Path, *, memory_limit: str, threads: int) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB database whose only tables are the index's, locked down (see module doc).

    ``documents`` and ``sequences`` are views over the shards' Parquet files with their global ids;
    ``tokens`` and ``activations`` put the shards' memory-mapped arrays (registered as Arrow tables)
    beside their sequences' positions (a positional join: token rows follow sequence order), and
    decode the stored 8-bit activations on each prototype's log scale."""
    from prism_tda.engine import layout

    m = layout.read_manifest(index_dir)
    if m is None or not m.complete:
        raise FileNotFoundError(f"{index_dir}: not a complete index (manifest.json missing or incomplete)")
    con = duckdb.connect(":memory:", config={
        "memory_limit": memory_limit, "threads": threads,
        "autoinstall_known_extensions": False, "autoload_known_extensions": False,
        "python_enable_replacements": False,  # user SQL cannot name Python variables
    })
    allowed = [index_dir / layout.PROTOTYPES, index_dir / layout.VOCAB]
    docs, seqs, toks, acts, bases = [], [], [], [], []
    doc0 = seq0 = tok0 = 0
    for i, sh in enumerate(m.shards):
        d = sh.dir(index_dir)
        allowed += [d / layout.DOCUMENTS, d / layout.SEQUENCES]
        con.register(f"_tokens_{i}", _arrow_tokens(d))
        docs.append(f"SELECT doc + {doc0} AS doc_id, external_id, source, title, url, text, n_tokens, trained "
                    f"FROM read_parquet({_quote(str(d / layout.DOCUMENTS))})")
        seqs.append(f"SELECT seq + {seq0} AS seq_id, doc + {doc0} AS doc_id, start_token, n_tokens "
                    f"FROM read_parquet({_quote(str(d / layout.SEQUENCES))})")
        pos = (f"(SELECT seq + {seq0} AS seq_id, doc + {doc0} AS doc_id, unnest(range(n_tokens)) AS pos "
               f"FROM read_parquet({_quote(str(d / layout.SEQUENCES))})) s POSITIONAL JOIN _tokens_{i} t")
        toks.append(f"SELECT s.seq_id, s.pos, t.token_id, s.doc_id FROM {pos}")
        acts.append(f"SELECT s.seq_id, s.pos, t.token_id, unnest(t.protos) AS proto_id, unnest(t.acts) AS q, "
                    f"s.doc_id FROM {pos}")
        bases.append(f"({i}, {sh.unit}, {sh.n_docs}, {sh.n_seqs}, {sh.n_tokens}, {doc0}, {seq0}, {tok0})")
        doc0, seq0, tok0 = doc0 + sh.n_docs, seq0 + sh.n_seqs, tok0 + sh.n_tokens
    def union(parts: list[str], columns: str) -> str:  # an index without shards: empty, typed tables
        return " UNION ALL ".join(parts) or f"SELECT {columns} WHERE false"

    # documents taken down (engine/takedown.py): `_removed` is registered again before every statement
    from prism_tda.engine.takedown import RemovedSet

    con.register("_removed", removed_table(RemovedSet.of(index_dir, m).ids()))

    def kept(view: str) -> str:
        return f"SELECT * FROM ({view}) WHERE doc_id NOT IN (SELECT doc_id FROM _removed)"

    con.execute(f"CREATE VIEW prototypes AS SELECT * FROM read_parquet({_quote(str(index_dir / layout.PROTOTYPES))})")
    con.execute(f"CREATE VIEW vocab AS SELECT * FROM read_parquet({_quote(str(index_dir / layout.VOCAB))})")
    con.execute("CREATE VIEW documents AS " + kept(union(docs, "0::BIGINT AS doc_id, ''::VARCHAR AS external_id, "
                "''::VARCHAR AS source, ''::VARCHAR AS title, ''::VARCHAR AS url, ''::VARCHAR AS text, "
                "0::INTEGER AS n_tokens, true AS trained")))
    con.execute("CREATE VIEW sequences AS " + kept(union(seqs, "0::BIGINT AS seq_id, 0::BIGINT AS doc_id, "
                "0::INTEGER AS start_token, 0::SMALLINT AS n_tokens")))
    con.execute("CREATE VIEW tokens AS " + kept(union(toks, "0::BIGINT AS seq_id, 0::BIGINT AS pos, "
                "0::INTEGER AS token_id, 0::BIGINT AS doc_id")))
    con.execute("CREATE VIEW activations AS SELECT a.seq_id, a.pos, a.token_id, a.proto_id, "
                "exp(p.act_lo + (a.q - 1) / 254.0 * (p.act_hi - p.act_lo))::FLOAT AS act, a.doc_id "
                f"FROM ({kept(union(acts, '0::BIGINT AS seq_id, 0::BIGINT AS pos, 0::INTEGER AS token_id, 0::INTEGER AS proto_id, 0::UTINYINT AS q, 0::BIGINT AS doc_id'))}) a "
                "JOIN prototypes p USING (proto_id) WHERE a.q > 0")
    con.execute("CREATE VIEW shards AS SELECT * FROM (VALUES " + (", ".join(bases) or "(0, 0, 0, 0, 0, 0, 0, 0)")
                + ") v(shard, unit, n_docs, n_seqs, n_tokens, doc_base, seq_base, token_base)"
                + ("" if bases else " WHERE false"))
    con.execute(f"SET allowed_paths = [{', '.join(_quote(str(a)) for a in allowed)}]")
    con.execute("SET temp_directory = ''")  # no spilling to disk: the memory limit is the limit
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def check_statement(sql: str) -> str:
    """The one statement of ``sql`` if it is a plain query; raises :class:`SqlRefusal` otherwise."""
    try:
        stmts = duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise SqlRefusal("sql-syntax", _first_line(e)) from None
    if len(stmts) != 1:
        raise SqlRefusal("sql-one-statement", f"got {len(stmts)} statements; send exactly one SELECT")
    st = stmts[0]
    if st.type != duckdb.StatementType.SELECT:
        raise SqlRefusal("sql-forbidden", f"only SELECT queries are allowed, not {st.type.name}")
    for name, literal in _calls(st.query):
        if name in FORBIDDEN_CALLS:
            raise SqlRefusal("sql-forbidden", f"{name}() is not allowed: it {FORBIDDEN_CALLS[name]}")
        if name == "current_setting" and (literal or "").lower() not in READABLE_SETTINGS:
            raise SqlRefusal("sql-forbidden", "current_setting() may read only these settings, each named by a "
                                              f"string literal: {', '.join(sorted(READABLE_SETTINGS))}")
    return st.query


# functions a statement may not call: SQL given as a string is never seen by this check, and the
# settings may name files and directories (`allowed_paths` lists the index's files by absolute path,
# `secret_directory` lies in the home directory), so only the lock-down's own are readable
FORBIDDEN_CALLS = {
    "duckdb_settings": "reads the engine's settings (current_setting() reads the lock-down's own)",
    "duckdb_profiling_settings": "reads the engine's settings (current_setting() reads the lock-down's own)",
    "query": "runs SQL given as a string; write the statement itself",
    "json_execute_serialized_sql": "runs SQL given as a string; write the statement itself",
}
READABLE_SETTINGS = frozenset({"enable_external_access", "lock_configuration", "autoinstall_known_extensions",
                               "autoload_known_extensions", "python_enable_replacements", "memory_limit",
                               "threads"})
_NAMES = (duckdb.token_type.identifier, duckdb.token_type.keyword)


def _calls(sql: str) -> Iterator[tuple[str, str | None]]:
    """The functions ``sql`` calls: (name, lower case and unquoted; its argument when that is one string
    literal, else None), for each name token followed by ``(``, comments skipped. Names inside string
    literals and comments are not calls."""
    data = sql.encode()  # the tokens' offsets count UTF-8 bytes
    tokens = duckdb.tokenize(sql)
    ends = [start for start, _ in tokens[1:]] + [len(data)]
    spans = [(data[start:end].decode(errors="replace").strip(), kind) for (start, kind), end in zip(tokens, ends)
             if kind != duckdb.token_type.comment]
    spans += [("", duckdb.token_type.operator)] * 3  # so that every call has three tokens after its name
    for i, (text, kind) in enumerate(spans[:-3]):
        if kind in _NAMES and spans[i + 1][0].startswith("("):
            arg, after = spans[i + 2], spans[i + 3][0]
            one_literal = (arg[1] == duckdb.token_type.string_const and arg[0].startswith("'")
                           and after.startswith(")"))
            yield ((text[1:-1].replace('""', '"') if text.startswith('"') else text).lower(),
                   arg[0][1:-1].replace("''", "'") if one_literal else None)


class Redactor:
    """Replaces the server's directories in what a statement answers by a label: DuckDB names files by
    absolute path in its errors (``Cannot access file "/srv/...``) and in its catalog (a view's SQL in
    ``duckdb_views()`` reads ``read_parquet('/srv/.../documents.parquet')``). The home directory is
    replaced in error details only: in rows, a short path such as ``/root`` would match document text."""

    def __init__(self, dirs: dict[str, Path | None]) -> None:
        """``dirs``: label -> directory (``{"index": ..., "state": ...}``); the home directory is added."""
        try:
            home: Path | None = Path.home()
        except RuntimeError:  # no HOME and no user entry
            home = None
        self.text = self._pattern({**dirs, "home": home}, lambda path: path)
        self.rows = self._pattern(dirs, lambda path: json.dumps(path, ensure_ascii=False)[1:-1])

    @staticmethod
    def _pattern(dirs: dict[str, Path | None], form: Callable[[str], str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for label, d in dirs.items():
            if d is None:
                continue
            for path in {os.path.abspath(d), os.path.realpath(d)}:  # as given, and with links resolved
                if len(path) > 1:
                    out.setdefault(form(path), f"<{label}>")
        return out

    @staticmethod
    def _sub(text: str, labels: dict[str, str]) -> str:
        present = [p for p in labels if p in text]
        if not present:
            return text
        # longest first (the index may lie in the home directory); a path, not the start of a longer name
        pattern = "|".join(re.escape(p) for p in sorted(present, key=len, reverse=True))
        return re.sub(f"(?:{pattern})(?![\\w.-])", lambda m: labels[m.group(0)], text)

    def detail(self, text: str) -> str:
        """An error detail without the server's directories."""
        return self._sub(text, self.text)

    def result(self, rows: bytes) -> bytes:
        """Rows (one JSON array) without the index's and the state's directories."""
        if not any(p.encode() in rows for p in self.rows):
            return rows
        return self._sub(rows.decode(), self.rows).encode()


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


class Engine:
    """Runs user statements on a locked connection, bounded in time, rows and result bytes."""

    def __init__(self, con: duckdb.DuckDBPyConnection, *, timeout_s: float, max_rows: int,
                 max_result_bytes: int, index_dir: Path | None = None, state_dir: Path | None = None) -> None:
        """``index_dir``: read its takedown record again whenever it changes (the documents taken down
        leave every view at the next statement). ``index_dir``, ``state_dir`` and the home directory
        never appear in an answer (:class:`Redactor`)."""
        self.con, self.timeout_s, self.max_rows, self.max_result_bytes = con, timeout_s, max_rows, max_result_bytes
        self.index_dir = index_dir
        self.redact = Redactor({"index": index_dir, "state": state_dir})
        self._takedown: Any = None  # engine.takedown.RemovedSet of index_dir, made at the first statement
        self._takedown_sig: object = "unread"

    def _refresh_removed(self) -> None:
        """Register ``_removed`` again when the index's takedown record changed."""
        if self.index_dir is None:
            return
        if self._takedown is None:
            from prism_tda.engine import layout
            from prism_tda.engine.takedown import RemovedSet

            self._takedown = RemovedSet.of(self.index_dir, layout.read_manifest(self.index_dir))
        sig = self._takedown.signature()
        if sig != self._takedown_sig:
            self.con.register("_removed", removed_table(self._takedown.ids()))
            self._takedown_sig = sig

    def removed_ids(self) -> np.ndarray:
        """The global ids of the documents taken down."""
        self._refresh_removed()
        return np.zeros(0, np.int64) if self._takedown is None else self._takedown.ids()

    def run(self, sql: str, audit_results: Callable[[], pa.Table] | None = None,
            prototype_sets: Callable[[], pa.Table] | None = None,
            params: list[Any] | None = None) -> tuple[dict[str, Any], bytes]:
        """(header, rows as one JSON array) for one statement; raises :class:`SqlRefusal`. The state's
        tables (``audit_results``, ``prototype_sets``) are read when the statement names them;
        ``params``: the values of the statement's ``$1``, ``$2``, ... (never spliced into its text)."""
        try:
            header, rows = self._run(sql, audit_results, prototype_sets, params)
        except SqlRefusal as e:
            raise SqlRefusal(e.kind, self.redact.detail(e.detail)) from None
        return header, self.redact.result(rows)

    def _run(self, sql: str, audit_results: Callable[[], pa.Table] | None,
             prototype_sets: Callable[[], pa.Table] | None,
             params: list[Any] | None) -> tuple[dict[str, Any], bytes]:
        query = check_statement(sql)
        self._refresh_removed()
        t0 = time.perf_counter()
        # the connection itself (one statement at a time per worker): the shards' Arrow tables are
        # registered on it, and a cursor would not see them
        cur = self.con
        timer = threading.Timer(self.timeout_s, cur.interrupt)
        registered: list[str] = []
        try:
            for name, source in (("audit_results", audit_results), ("prototype_sets", prototype_sets)):
                if source is not None and name in query.lower():
                    cur.register(name, source())
                    registered.append(name)
            timer.start()
            # small batches: a batch of wide rows is what the result-size cap has to stop
            reader = cur.sql(query, params=params or None).limit(self.max_rows + 1).to_arrow_reader(64)
            columns = [{"name": f.name, "type": str(f.type)} for f in reader.schema]
            # the column names and types are part of the answer: they count against the result's size
            head = len(json.dumps(columns, ensure_ascii=False).encode())
            if head > self.max_result_bytes:
                raise SqlRefusal("sql-result-too-large", f"the result's columns alone ({len(columns)} columns, "
                                                         f"{head} bytes of names and types) are larger than "
                                                         f"{self.max_result_bytes} bytes; select fewer or simpler "
                                                         "columns")
            rows, n = self._encode(reader, t0, head)
        except duckdb.InterruptException:
            raise SqlRefusal("sql-timeout", f"the query ran longer than {self.timeout_s:g} s and was "
                                            "interrupted") from None
        except duckdb.OutOfMemoryException:
            raise SqlRefusal("sql-out-of-memory", "the query needs more memory than the service's SQL memory "
                                                  "limit") from None
        except duckdb.PermissionException as e:
            raise SqlRefusal("sql-forbidden", _first_line(e)) from None
        except duckdb.ParserException as e:
            raise SqlRefusal("sql-syntax", _first_line(e)) from None
        except duckdb.Error as e:
            raise SqlRefusal("sql-error", _first_line(e)) from None
        finally:
            timer.cancel()
            for name in registered:
                cur.unregister(name)
        return {"ok": True, "columns": columns, "row_count": n}, rows

    def _encode(self, reader: pa.RecordBatchReader, t0: float, head: int = 0) -> tuple[bytes, int]:
        parts, n, size = [b"["], 0, 2 + head
        for batch in reader:
            cols = [c.to_pylist() for c in batch.columns]
            for i in range(batch.num_rows):
                n += 1
                if n > self.max_rows:
                    raise SqlRefusal("sql-too-many-rows", f"the query returns more than {self.max_rows} rows; "
                                                          "add a LIMIT or aggregate")
                row = json.dumps([jsonable(c[i]) for c in cols], separators=(",", ":"), ensure_ascii=False,
                                 allow_nan=False).encode()
                size += len(row) + 1
                if size > self.max_result_bytes:
                    raise SqlRefusal("sql-result-too-large", f"the result is larger than "
                                                             f"{self.max_result_bytes} bytes of JSON; select "
                                                             "fewer or shorter columns, or add a LIMIT")
                parts.append(row if n == 1 else b"," + row)
            if time.perf_counter() - t0 > self.timeout_s:
                raise duckdb.InterruptException("timeout while encoding")
        parts.append(b"]")
        return b"".join(parts), n


# ----------------------------------------------------------------------------- framing
def write_frame(out: BinaryIO, payload: bytes) -> None:
    out.write(struct.pack(">I", len(payload)))
    out.write(payload)
    out.flush()


def read_frames(inp: BinaryIO) -> Iterator[bytes]:
    while True:
        head = inp.read(4)
        if len(head) < 4:
            return
        (n,) = struct.unpack(">I", head)
        body = inp.read(n)
        if len(body) < n:
            return
        yield body


def main(argv: list[str] | None = None) -> int:
    """A worker process: one locked engine over one index, requests on stdin, answers on stdout."""
    cfg = json.loads((argv or sys.argv[1:])[0])
    from prism_tda.service.state import mark_removed, read_audit_results, read_prototype_sets

    try:
        con = open_locked(Path(cfg["index_dir"]), memory_limit=cfg["duckdb_memory_limit"], threads=cfg["threads"])
    except (OSError, duckdb.Error) as e:
        print(f"SQL worker: {e}", file=sys.stderr)
        return 2
    engine = Engine(con, timeout_s=cfg["timeout_s"], max_rows=cfg["max_rows"],
                    max_result_bytes=cfg["max_result_bytes"], index_dir=Path(cfg["index_dir"]),
                    state_dir=Path(cfg["state_path"]).parent if cfg.get("state_path") else None)
    out, inp = sys.stdout.buffer, sys.stdin.buffer
    write_frame(out, json.dumps({"ready": True}).encode())
    for frame in read_frames(inp):
        req = json.loads(frame)
        audit = req.get("audit")
        source = sets = None
        if audit is not None and cfg.get("state_path"):
            def source(a: dict[str, Any] = audit) -> pa.Table:
                table = read_audit_results(Path(cfg["state_path"]), index_name=a["index_name"],
                                           principal=a.get("principal"))
                return mark_removed(table, engine.removed_ids())

            def sets(a: dict[str, Any] = audit) -> pa.Table:
                return read_prototype_sets(Path(cfg["state_path"]), index_name=a["index_name"],
                                           principal=a.get("principal"))
        try:
            header, rows = engine.run(req["sql"], source, sets, req.get("params"))
        except SqlRefusal as e:
            header, rows = {"ok": False, "kind": e.kind, "detail": e.detail}, b""
        write_frame(out, json.dumps(header).encode())
        write_frame(out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
