"""Durable service state in SQLite (WAL): audit jobs, their items and results, prototype sets, and
single-step background tasks (a discovery with selection by effect).

An audit is written (job + every item) in one transaction before the server answers 202. Keys take
turns at the worker (``turns``), an item is started at most a bounded number of times, and finished
audits are purged after the retention time. The
worker finishes an item in one transaction too: its results rows, its ``done`` status and the
job's progress commit together, guarded by ``status = 'pending'``, so a server killed at any
moment and restarted processes every item exactly once (``completions`` counts the commits;
``attempts`` counts the starts, so it shows work lost to a crash).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, index_name TEXT NOT NULL, status TEXT NOT NULL,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, params TEXT NOT NULL,
    n_items INTEGER NOT NULL, n_done INTEGER NOT NULL DEFAULT 0, n_failed INTEGER NOT NULL DEFAULT 0,
    principal TEXT NOT NULL, idempotency_key TEXT, request_hash TEXT NOT NULL,
    UNIQUE (principal, idempotency_key)
);
CREATE TABLE IF NOT EXISTS items (
    job_id TEXT NOT NULL, item_no INTEGER NOT NULL, item_id TEXT, prompt TEXT NOT NULL, completion TEXT,
    max_new_tokens INTEGER, target_index INTEGER, flag_set TEXT, flag_prototypes TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
    completions INTEGER NOT NULL DEFAULT 0, error TEXT, target_text TEXT, used_prototypes TEXT,
    flagged_prototypes TEXT, documents TEXT, updated_at REAL,
    PRIMARY KEY (job_id, item_no)
);
CREATE INDEX IF NOT EXISTS items_by_status ON items (status, job_id, item_no);
CREATE TABLE IF NOT EXISTS results (
    job_id TEXT NOT NULL, item_no INTEGER NOT NULL, rank INTEGER NOT NULL, doc_id INTEGER NOT NULL,
    score REAL NOT NULL, raw_influence REAL, seq_id INTEGER, trained INTEGER, value REAL, influence REAL,
    PRIMARY KEY (job_id, item_no, rank)
);
CREATE TABLE IF NOT EXISTS prototype_sets (
    index_name TEXT NOT NULL, owner TEXT NOT NULL, name TEXT NOT NULL, prototypes TEXT NOT NULL,
    description TEXT, updated_at REAL NOT NULL, PRIMARY KEY (index_name, owner, name)
);
CREATE INDEX IF NOT EXISTS jobs_by_principal ON jobs (principal, created_at);
CREATE TABLE IF NOT EXISTS turns (principal TEXT PRIMARY KEY, served_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY, kind TEXT NOT NULL, index_name TEXT NOT NULL, principal TEXT NOT NULL,
    status TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL, params TEXT NOT NULL,
    stage TEXT, stage_done INTEGER NOT NULL DEFAULT 0, stage_total INTEGER NOT NULL DEFAULT 0,
    progress REAL NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0, result TEXT, error TEXT
);
CREATE INDEX IF NOT EXISTS tasks_by_status ON tasks (status, created_at);
"""

# The owner of the prototype sets that every key reads and only admins write: sets seeded from the
# settings (PRISM_PROTOTYPE_SETS) and sets written with an admin key (or keyless, on loopback).
SHARED = "*"

ACTIVE = ("queued", "running")

AUDIT_RESULTS_SCHEMA = pa.schema([
    ("job_id", pa.string()), ("item_no", pa.int32()), ("item_id", pa.string()), ("rank", pa.int32()),
    ("doc_id", pa.int32()), ("score", pa.float64()), ("raw_influence", pa.float64()), ("seq_id", pa.int32()),
    ("trained", pa.bool_()), ("value", pa.float64()),
    ("influence", pa.float64()),  # the full-model influence, for audits run with the `influence` option
    ("target_text", pa.string()), ("flagged", pa.bool_()), ("flagged_prototypes", pa.list_(pa.int32())),
    ("used_prototypes", pa.list_(pa.int32())),
    ("removed", pa.bool_()),  # the cited document was taken down since (set by the reader of the table)
])


def mark_removed(table: pa.Table, removed_ids: np.ndarray) -> pa.Table:
    """``table`` (audit_results rows) with ``removed`` set where ``doc_id`` is in ``removed_ids``."""
    import pyarrow.compute as pc

    flag = pc.is_in(table.column("doc_id").cast(pa.int64()), value_set=pa.array(np.asarray(removed_ids, np.int64)))
    return table.set_column(table.schema.get_field_index("removed"), "removed", flag)


def request_hash(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class StateDB:
    """Every read and write of the state database (one short-lived connection per operation)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "state.sqlite3"
        with self._connect() as con:
            con.execute("PRAGMA journal_mode = WAL")
            sets = {r["name"] for r in con.execute("PRAGMA table_info(prototype_sets)")}
            if sets and "owner" not in sets:  # sets from before owners: they become shared (admins write them)
                con.execute("ALTER TABLE prototype_sets RENAME TO prototype_sets_unowned")
            con.executescript(SCHEMA)
            if sets and "owner" not in sets:
                con.execute("INSERT INTO prototype_sets SELECT index_name, ?, name, prototypes, description, updated_at "
                            "FROM prototype_sets_unowned", (SHARED,))
                con.execute("DROP TABLE prototype_sets_unowned")
            cols = {r["name"] for r in con.execute("PRAGMA table_info(results)")}
            if "trained" not in cols:  # a state database from before the column: results then count as trained
                con.execute("ALTER TABLE results ADD COLUMN trained INTEGER")
            if "value" not in cols:  # from before documents' values: their results have none (null)
                con.execute("ALTER TABLE results ADD COLUMN value REAL")
            if "influence" not in cols:  # from before audits kept the `influence` option's values (null)
                con.execute("ALTER TABLE results ADD COLUMN influence REAL")
            if "target_index" not in {r["name"] for r in con.execute("PRAGMA table_info(items)")}:
                con.execute("ALTER TABLE items ADD COLUMN target_index INTEGER")

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        con = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        con.row_factory = sqlite3.Row
        con.execute("PRAGMA synchronous = FULL")
        try:
            yield con
        finally:
            con.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    def ping(self) -> None:
        with self._connect() as con:
            con.execute("SELECT 1").fetchone()

    # ------------------------------------------------------------------------ audits
    def create_job(self, index_name: str, params: dict[str, Any], items: list[dict[str, Any]], *,
                   principal: str, idempotency_key: str | None, req_hash: str) -> tuple[dict[str, Any], bool]:
        """Persist a job and its items; return (job, created). A known idempotency key returns its job."""
        now = time.time()
        job_id = "aud_" + secrets.token_hex(8)
        with self._tx() as con:
            if idempotency_key is not None:
                row = con.execute("SELECT * FROM jobs WHERE principal = ? AND idempotency_key = ?",
                                  (principal, idempotency_key)).fetchone()
                if row is not None:
                    return _job(row), False
            con.execute("INSERT INTO jobs (id, index_name, status, created_at, updated_at, params, n_items, "
                        "principal, idempotency_key, request_hash) VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?)",
                        (job_id, index_name, now, now, json.dumps(params), len(items), principal,
                         idempotency_key, req_hash))
            con.executemany(
                "INSERT INTO items (job_id, item_no, item_id, prompt, completion, max_new_tokens, target_index, "
                "flag_set, flag_prototypes, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(job_id, n, it.get("id"), it["prompt"], it.get("completion"), it.get("max_new_tokens"),
                  it.get("target_index"), it.get("flag_set"), json.dumps(it.get("flag_prototypes", [])), now)
                 for n, it in enumerate(items)])
            row = con.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row), True

    def job(self, job_id: str) -> dict[str, Any] | None:
        with self._connect() as con:
            row = con.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row is not None else None

    def cancel(self, job_id: str) -> bool:
        with self._tx() as con:
            cur = con.execute("UPDATE jobs SET status = 'cancelled', updated_at = ? WHERE id = ? AND status IN "
                              "('queued', 'running')", (time.time(), job_id))
            return cur.rowcount == 1

    def items(self, job_id: str, offset: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        with self._connect() as con:
            rows = con.execute("SELECT * FROM items WHERE job_id = ? ORDER BY item_no LIMIT ? OFFSET ?",
                               (job_id, -1 if limit is None else limit, offset)).fetchall()
        return [_item(r) for r in rows]

    def jobs(self, principal: str | None, *, status: str | None = None, index_name: str | None = None,
             offset: int = 0, limit: int = 50) -> tuple[int, list[dict[str, Any]]]:
        """(total, page) of the audits of ``principal`` (None: everyone's), newest first."""
        cond, args = _filter(principal=principal, status=status, index_name=index_name)
        with self._connect() as con:
            total = con.execute(f"SELECT count(*) FROM jobs{cond}", args).fetchone()[0]
            rows = con.execute(f"SELECT * FROM jobs{cond} ORDER BY created_at DESC, id DESC LIMIT ? OFFSET ?",
                               [*args, limit, offset]).fetchall()
        return int(total), [_job(r) for r in rows]

    def active_jobs(self, principal: str) -> int:
        """Queued or running audits of ``principal``."""
        with self._connect() as con:
            return int(con.execute("SELECT count(*) FROM jobs WHERE principal = ? AND status IN ('queued', 'running')",
                                   (principal,)).fetchone()[0])

    # ------------------------------------------------------------------------ turns
    def next_key(self, index_names: list[str], *, exclude: str | None = None) -> str | None:
        """The key whose turn it is among those with background work on one of ``index_names`` (a pending
        item of an active audit, or a queued or running task): the one served longest ago (or never) first.
        ``exclude``: a key not to count (to ask whether any other key is waiting)."""
        marks = ", ".join("?" * len(index_names))
        with self._connect() as con:
            row = con.execute(
                "SELECT k.principal FROM (SELECT j.principal, min(j.created_at) AS since FROM jobs j "
                f"WHERE j.status IN ('queued', 'running') AND j.index_name IN ({marks}) AND EXISTS "
                "(SELECT 1 FROM items i WHERE i.job_id = j.id AND i.status = 'pending') GROUP BY j.principal "
                "UNION ALL SELECT principal, min(created_at) FROM tasks WHERE status IN ('queued', 'running') "
                f"AND index_name IN ({marks}) GROUP BY principal) k LEFT JOIN turns t ON t.principal = k.principal "
                "WHERE k.principal IS NOT ? ORDER BY coalesce(t.served_at, 0), k.since LIMIT 1",
                [*index_names, *index_names, exclude]).fetchone()
        return None if row is None else str(row[0])

    def served(self, principal: str) -> None:
        """Record that ``principal`` had its turn now."""
        with self._tx() as con:
            con.execute("INSERT INTO turns (principal, served_at) VALUES (?, ?) ON CONFLICT (principal) "
                        "DO UPDATE SET served_at = excluded.served_at", (principal, time.time()))

    def next_item(self, index_names: list[str], max_attempts: int | None = None, *,
                  principal: str | None = None) -> dict[str, Any] | None:
        """The next pending item of an active job on one of ``index_names`` (of ``principal``'s jobs when
        given); counts the attempt.

        Keys take turns: the key served longest ago (or never) goes first, and within a key its oldest
        audit, so one key's large audit does not hold back another's. An item already started
        ``max_attempts`` times (it failed unexpectedly, or the server died on it) is marked failed
        instead of being started again."""
        marks = ", ".join("?" * len(index_names))
        while True:
            with self._tx() as con:
                who = (principal,) if principal is not None else con.execute(
                    "SELECT j.principal FROM jobs j LEFT JOIN turns t ON t.principal = j.principal "
                    f"WHERE j.status IN ('queued', 'running') AND j.index_name IN ({marks}) AND EXISTS "
                    "(SELECT 1 FROM items i WHERE i.job_id = j.id AND i.status = 'pending') "
                    "ORDER BY coalesce(t.served_at, 0), j.created_at LIMIT 1", index_names).fetchone()
                if who is None:
                    return None
                row = con.execute(
                    "SELECT i.*, j.index_name, j.params FROM items i JOIN jobs j ON j.id = i.job_id "
                    f"WHERE i.status = 'pending' AND j.status IN ('queued', 'running') AND j.index_name IN ({marks}) "
                    "AND j.principal = ? ORDER BY j.created_at, i.job_id, i.item_no LIMIT 1",
                    [*index_names, who[0]]).fetchone()
                if row is None:
                    return None
                now = time.time()
                con.execute("INSERT INTO turns (principal, served_at) VALUES (?, ?) ON CONFLICT (principal) "
                            "DO UPDATE SET served_at = excluded.served_at", (who[0], now))
                if max_attempts is not None and row["attempts"] >= max_attempts:
                    self._finish(con, row["job_id"], row["item_no"], now,
                                 error=f"internal error: the item was started {row['attempts']} times without "
                                       "finishing; it is not tried again")
                    continue
                con.execute("UPDATE items SET attempts = attempts + 1 WHERE job_id = ? AND item_no = ?",
                            (row["job_id"], row["item_no"]))
                con.execute("UPDATE jobs SET status = 'running', updated_at = ? WHERE id = ? AND status = 'queued'",
                            (now, row["job_id"]))
            out = _item(row)
            out["attempts"] = row["attempts"] + 1
            out["index_name"], out["params"] = row["index_name"], json.loads(row["params"])
            return out

    def requeue_item(self, job_id: str, item_no: int) -> None:
        """An item the worker put down unfinished (it is stopping): pending again, the start not counted."""
        with self._tx() as con:
            con.execute("UPDATE items SET attempts = max(attempts - 1, 0) WHERE job_id = ? AND item_no = ? "
                        "AND status = 'pending'", (job_id, item_no))

    def item_active(self, job_id: str, item_no: int) -> bool:
        """Whether the item is still to be done: pending, in an audit that is neither cancelled nor finished."""
        with self._connect() as con:
            row = con.execute("SELECT 1 FROM items i JOIN jobs j ON j.id = i.job_id WHERE i.job_id = ? AND "
                              "i.item_no = ? AND i.status = 'pending' AND j.status IN ('queued', 'running')",
                              (job_id, item_no)).fetchone()
        return row is not None

    def purge_finished(self, older_than_s: float) -> int:
        """Delete finished audits (completed or cancelled) last updated more than ``older_than_s`` ago,
        with their items and results, and finished tasks; the number of audits and tasks deleted."""
        cutoff = time.time() - older_than_s
        with self._tx() as con:
            ids = [r[0] for r in con.execute("SELECT id FROM jobs WHERE status IN ('completed', 'cancelled') "
                                             "AND updated_at < ?", (cutoff,)).fetchall()]
            for i in range(0, len(ids), 500):
                part = ids[i:i + 500]
                marks = ", ".join("?" * len(part))
                for table, col in (("results", "job_id"), ("items", "job_id"), ("jobs", "id")):
                    con.execute(f"DELETE FROM {table} WHERE {col} IN ({marks})", part)
            tasks = con.execute("DELETE FROM tasks WHERE status IN ('completed', 'failed', 'cancelled') "
                                "AND updated_at < ?", (cutoff,)).rowcount
        return len(ids) + tasks

    def finish_item(self, job_id: str, item_no: int, *, error: str | None = None,
                    result: dict[str, Any] | None = None) -> bool:
        """Commit an item's outcome, results and the job's progress in one transaction."""
        with self._tx() as con:
            return self._finish(con, job_id, item_no, time.time(), error=error, result=result)

    @staticmethod
    def _finish(con: sqlite3.Connection, job_id: str, item_no: int, now: float, *, error: str | None = None,
                result: dict[str, Any] | None = None) -> bool:
        status = "failed" if error is not None else "done"
        r = result or {}
        cur = con.execute(
            "UPDATE items SET status = ?, error = ?, completions = completions + 1, target_text = ?, "
            "used_prototypes = ?, flagged_prototypes = ?, documents = ?, updated_at = ? "
            "WHERE job_id = ? AND item_no = ? AND status = 'pending'",
            (status, error, r.get("target_text"), json.dumps(r.get("used_prototypes", [])),
             json.dumps(r.get("flagged_prototypes", [])), json.dumps(r.get("documents", [])), now,
             job_id, item_no))
        if cur.rowcount != 1:
            return False
        con.executemany(
            "INSERT INTO results (job_id, item_no, rank, doc_id, score, raw_influence, seq_id, trained, value, "
            "influence) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(job_id, item_no, rank, d["doc_id"], d["score"], d.get("raw_influence"), d.get("seq_id"),
              int(d.get("trained", True)), d.get("value"), d.get("influence"))
             for rank, d in enumerate(r.get("documents", []), 1)])
        col = "n_failed" if error is not None else "n_done"
        con.execute(f"UPDATE jobs SET {col} = {col} + 1, updated_at = ?, status = CASE WHEN "
                    "n_done + n_failed + 1 >= n_items AND status IN ('queued', 'running') THEN 'completed' "
                    "ELSE status END WHERE id = ?", (now, job_id))
        return True

    def audit_results(self, index_name: str | None = None, job_id: str | None = None,
                      principal: str | None = None) -> pa.Table:
        """The ``audit_results`` table (see :func:`read_audit_results`)."""
        with self._connect() as con:
            return _audit_results(con, index_name, job_id, principal)

    # ------------------------------------------------------------------------ tasks
    # One unit of work each (not items): queued -> running -> completed | failed | cancelled. Only the
    # worker's process runs them, one at a time, so a task found 'running' by the worker was cut short by
    # a crash: it is started again, at most ``max_attempts`` times.
    def create_task(self, kind: str, index_name: str, principal: str, params: dict[str, Any]) -> dict[str, Any]:
        now = time.time()
        task_id = "task_" + secrets.token_hex(8)
        with self._tx() as con:
            con.execute("INSERT INTO tasks (id, kind, index_name, principal, status, created_at, updated_at, params) "
                        "VALUES (?, ?, ?, ?, 'queued', ?, ?, ?)",
                        (task_id, kind, index_name, principal, now, now, json.dumps(params)))
            row = con.execute("SELECT * FROM tasks WHERE id = ?", (task_id,)).fetchone()
        return _task(row)

    def task(self, task_id: str) -> dict[str, Any] | None:
        with self._connect() as con:
            row = con.execute("SELECT * FROM tasks WHERE id = ?", (task_id,)).fetchone()
        return _task(row) if row is not None else None

    def tasks(self, principal: str | None, *, status: str | None = None, index_name: str | None = None,
              offset: int = 0, limit: int = 50) -> tuple[int, list[dict[str, Any]]]:
        """(total, page) of the tasks of ``principal`` (None: everyone's), newest first, without results."""
        cond, args = _filter(principal=principal, status=status, index_name=index_name)
        with self._connect() as con:
            total = con.execute(f"SELECT count(*) FROM tasks{cond}", args).fetchone()[0]
            rows = con.execute(f"SELECT id, kind, index_name, principal, status, created_at, updated_at, params, "
                               f"stage, stage_done, stage_total, progress, attempts, NULL AS result, error FROM "
                               f"tasks{cond} ORDER BY created_at DESC, id DESC LIMIT ? OFFSET ?",
                               [*args, limit, offset]).fetchall()
        return int(total), [_task(r) for r in rows]

    def active_tasks(self, principal: str) -> int:
        """Queued or running tasks of ``principal``."""
        with self._connect() as con:
            return int(con.execute("SELECT count(*) FROM tasks WHERE principal = ? AND status IN "
                                   "('queued', 'running')", (principal,)).fetchone()[0])

    def next_task(self, index_names: list[str], max_attempts: int, *,
                  principal: str | None = None) -> dict[str, Any] | None:
        """The oldest unfinished task on one of ``index_names`` (of ``principal`` when given), marked running
        and its start counted; a task already started ``max_attempts`` times is failed instead."""
        marks = ", ".join("?" * len(index_names))
        mine, who = ("AND principal = ?", [principal]) if principal is not None else ("", [])
        with self._connect() as con:  # the idle worker's poll: a read, no write lock
            if con.execute(f"SELECT 1 FROM tasks WHERE status IN ('queued', 'running') AND index_name IN ({marks}) "
                           f"{mine} LIMIT 1", [*index_names, *who]).fetchone() is None:
                return None
        while True:
            with self._tx() as con:
                row = con.execute(f"SELECT * FROM tasks WHERE status IN ('queued', 'running') AND index_name IN "
                                  f"({marks}) {mine} ORDER BY created_at, id LIMIT 1", [*index_names, *who]).fetchone()
                if row is None:
                    return None
                now = time.time()
                if row["attempts"] >= max_attempts:
                    con.execute("UPDATE tasks SET status = 'failed', error = ?, updated_at = ? WHERE id = ?",
                                (f"internal error: the task was started {row['attempts']} times without finishing; "
                                 "it is not tried again", now, row["id"]))
                    continue
                con.execute("UPDATE tasks SET status = 'running', attempts = attempts + 1, updated_at = ? "
                            "WHERE id = ?", (now, row["id"]))
                row = con.execute("SELECT * FROM tasks WHERE id = ?", (row["id"],)).fetchone()
            return _task(row)

    def task_progress(self, task_id: str, stage: str, done: int, total: int, progress: float) -> str | None:
        """Record a running task's progress; its status (``cancelled`` tells the worker to stop)."""
        with self._tx() as con:
            con.execute("UPDATE tasks SET stage = ?, stage_done = ?, stage_total = ?, progress = ?, updated_at = ? "
                        "WHERE id = ? AND status = 'running'", (stage, done, total, progress, time.time(), task_id))
            row = con.execute("SELECT status FROM tasks WHERE id = ?", (task_id,)).fetchone()
        return None if row is None else str(row[0])

    def finish_task(self, task_id: str, *, result: dict[str, Any] | None = None, error: str | None = None) -> bool:
        """Store a task's result (or its error); False when it was cancelled (or removed) meanwhile."""
        status = "failed" if error is not None else "completed"
        with self._tx() as con:
            cur = con.execute("UPDATE tasks SET status = ?, result = ?, error = ?, progress = CASE WHEN ? = "
                              "'completed' THEN 1 ELSE progress END, updated_at = ? WHERE id = ? AND status = "
                              "'running'", (status, None if result is None else json.dumps(result), error,
                                            status, time.time(), task_id))
            return cur.rowcount == 1

    def requeue_task(self, task_id: str) -> None:
        """A running task the worker put down unfinished (it is stopping): queued again, the start not counted."""
        with self._tx() as con:
            con.execute("UPDATE tasks SET status = 'queued', attempts = max(attempts - 1, 0), updated_at = ? "
                        "WHERE id = ? AND status = 'running'", (time.time(), task_id))

    def cancel_task(self, task_id: str) -> bool:
        with self._tx() as con:
            cur = con.execute("UPDATE tasks SET status = 'cancelled', updated_at = ? WHERE id = ? AND status IN "
                              "('queued', 'running')", (time.time(), task_id))
            return cur.rowcount == 1

    # ------------------------------------------------------------------------ prototype sets
    # A set belongs to the key that wrote it (``owner``: the principal id) or is shared (``SHARED``:
    # seeded from the settings or written by an admin). A key sees its own sets and the shared ones;
    # by name, its own set comes first. Admins read every set and write the shared ones.
    def put_set(self, index_name: str, owner: str, name: str, prototypes: list[int],
                description: str | None) -> dict[str, Any]:
        with self._tx() as con:
            con.execute("INSERT INTO prototype_sets (index_name, owner, name, prototypes, description, updated_at) "
                        "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (index_name, owner, name) DO UPDATE SET "
                        "prototypes = excluded.prototypes, description = excluded.description, "
                        "updated_at = excluded.updated_at",
                        (index_name, owner, name, json.dumps(sorted(set(prototypes))), description, time.time()))
        return self.get_set(index_name, name, owner)  # type: ignore[return-value]

    def get_set(self, index_name: str, name: str, reader: str) -> dict[str, Any] | None:
        """The set ``name`` as ``reader`` sees it: its own, else the shared one."""
        with self._connect() as con:
            row = con.execute("SELECT * FROM prototype_sets WHERE index_name = ? AND name = ? AND owner IN (?, ?) "
                              "ORDER BY owner = ? LIMIT 1", (index_name, name, reader, SHARED, SHARED)).fetchone()
        return _set(row) if row is not None else None

    def list_sets(self, index_name: str, reader: str | None) -> list[dict[str, Any]]:
        """The sets ``reader`` sees (its own and the shared ones); ``None``: every set (admins)."""
        with self._connect() as con:
            if reader is None:
                rows = con.execute("SELECT * FROM prototype_sets WHERE index_name = ? ORDER BY name, owner != ?",
                                   (index_name, SHARED)).fetchall()
            else:
                rows = con.execute("SELECT * FROM prototype_sets WHERE index_name = ? AND owner IN (?, ?) "
                                   "ORDER BY name, owner = ?", (index_name, reader, SHARED, SHARED)).fetchall()
        return [_set(r) for r in rows]

    def delete_set(self, index_name: str, owner: str, name: str) -> bool:
        with self._tx() as con:
            return con.execute("DELETE FROM prototype_sets WHERE index_name = ? AND owner = ? AND name = ?",
                               (index_name, owner, name)).rowcount == 1


PROTOTYPE_SETS_SCHEMA = pa.schema([("name", pa.string()), ("proto_id", pa.int32()), ("description", pa.string()),
                                   ("updated_at", pa.float64()), ("shared", pa.bool_())])


def read_prototype_sets(path: Path, *, index_name: str, principal: str | None = None) -> pa.Table:
    """The ``prototype_sets`` SQL table of one index as ``principal`` sees it (its own sets and the
    shared ones; None: every set): one row per (set, prototype), from a state database opened
    read-only (empty when it does not exist yet)."""
    if not Path(path).is_file():
        return PROTOTYPE_SETS_SCHEMA.empty_table()
    con = sqlite3.connect(f"file:{Path(path).absolute()}?mode=ro", uri=True, timeout=30)
    try:
        if principal is None:
            rows = con.execute("SELECT name, prototypes, description, updated_at, owner FROM prototype_sets "
                               "WHERE index_name = ? ORDER BY name, owner", (index_name,)).fetchall()
        else:
            rows = con.execute("SELECT name, prototypes, description, updated_at, owner FROM prototype_sets "
                               "WHERE index_name = ? AND owner IN (?, ?) ORDER BY name, owner",
                               (index_name, principal, SHARED)).fetchall()
    finally:
        con.close()
    flat = [(n, int(p), d, u, o == SHARED) for n, ps, d, u, o in rows for p in json.loads(ps)]
    return pa.table({f.name: [r[i] for r in flat] for i, f in enumerate(PROTOTYPE_SETS_SCHEMA)},
                    schema=PROTOTYPE_SETS_SCHEMA)


def read_audit_results(path: Path, *, index_name: str | None = None, job_id: str | None = None,
                       principal: str | None = None) -> pa.Table:
    """The ``audit_results`` table from a state database opened read-only (empty when it does not
    exist yet): one row per (job, item, rank), item fields repeated; only the jobs of ``index_name``,
    ``job_id`` and ``principal`` when given."""
    if not Path(path).is_file():
        return AUDIT_RESULTS_SCHEMA.empty_table()
    con = sqlite3.connect(f"file:{Path(path).absolute()}?mode=ro", uri=True, timeout=30)
    con.row_factory = sqlite3.Row
    try:
        return _audit_results(con, index_name, job_id, principal)
    finally:
        con.close()


def _audit_results(con: sqlite3.Connection, index_name: str | None, job_id: str | None,
                   principal: str | None) -> pa.Table:
    where, args = [], []
    for col, val in (("j.index_name", index_name), ("r.job_id", job_id), ("j.principal", principal)):
        if val is not None:
            where.append(f"{col} = ?")
            args.append(val)
    # a database opened read-only is not migrated: a column an older server did not write reads as its
    # migration's default (results count as trained; no value, no influence)
    have = {r["name"] for r in con.execute("PRAGMA table_info(results)")}
    late = ", ".join((f"coalesce(r.{c}, {d})" if c in have else d) + f" AS {c}"
                     for c, d in (("trained", "1"), ("value", "NULL"), ("influence", "NULL")))
    sql = ("SELECT r.job_id, r.item_no, i.item_id, r.rank, r.doc_id, r.score, r.raw_influence, r.seq_id, "
           f"{late}, "
           "i.target_text, i.flagged_prototypes, i.used_prototypes FROM results r "
           "JOIN items i ON i.job_id = r.job_id AND i.item_no = r.item_no JOIN jobs j ON j.id = r.job_id"
           + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY r.job_id, r.item_no, r.rank")
    rows = con.execute(sql, args).fetchall()
    cols: dict[str, list[Any]] = {f.name: [] for f in AUDIT_RESULTS_SCHEMA}
    for r in rows:
        flagged = json.loads(r["flagged_prototypes"] or "[]")
        for k in ("job_id", "item_no", "item_id", "rank", "doc_id", "score", "raw_influence", "seq_id",
                  "value", "influence", "target_text"):
            cols[k].append(r[k])
        cols["trained"].append(bool(r["trained"]))
        cols["flagged"].append(bool(flagged))
        cols["flagged_prototypes"].append(flagged)
        cols["used_prototypes"].append(json.loads(r["used_prototypes"] or "[]"))
        cols["removed"].append(False)
    return pa.table(cols, schema=AUDIT_RESULTS_SCHEMA)


def _filter(**equal: str | None) -> tuple[str, list[str]]:
    """A ``WHERE`` clause (or nothing) requiring each column given a value to equal it, and its arguments."""
    given = {col: val for col, val in equal.items() if val is not None}
    return (" WHERE " + " AND ".join(f"{col} = ?" for col in given)) if given else "", list(given.values())


def _job(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    d["params"] = json.loads(d["params"])
    return d


def _item(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    for k in ("flag_prototypes", "used_prototypes", "flagged_prototypes", "documents"):
        if k in d:
            d[k] = json.loads(d[k]) if d[k] is not None else None
    return d


def _task(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    d["params"] = json.loads(d["params"])
    d["result"] = json.loads(d["result"]) if d["result"] is not None else None
    return d


def _set(row: sqlite3.Row) -> dict[str, Any]:
    return {"index": row["index_name"], "name": row["name"], "prototypes": json.loads(row["prototypes"]),
            "description": row["description"], "updated_at": row["updated_at"], "shared": row["owner"] == SHARED}
