"""User SQL in worker processes that are killed when they overrun.

DuckDB's own limits do not hold for every statement: its interrupt is checked only between some
operations (``SELECT unnest(range(100000000))`` ran 24 s past a 5 s limit) and its memory limit
covers its buffer manager, not every allocation (``SELECT repeat('x', 2000000000)`` took 5.7 GB
under a 1 GB limit). So each statement runs in a worker process (``service/sqlengine.py``) and
this side enforces every limit from the outside:

- time: the worker interrupts DuckDB at the limit; a worker still busy at 1.5x the limit is
  killed (``sql-timeout``);
- memory: the worker's anonymous memory is sampled every 10 ms and the worker is killed when it
  has grown by more than its share of the limit (``sql-out-of-memory``); DuckDB's own limit is set
  below that share so most statements are refused before that;
- result size: the worker encodes rows as JSON and stops at ``max_result_bytes``
  (``sql-result-too-large``), so the server never holds a larger result;
- concurrency: at most ``workers`` statements run at once; the memory limit is shared between
  them, so all SQL together stays within it.

A killed worker is replaced in the background; requests wait for a free worker (at most
``queue_timeout_s``, then ``sql-busy``).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_tda.errors import PrismError
from prism_tda.procmem import status_bytes

from .settings import Settings, parse_bytes
from .sqlengine import SqlRefusal

log = logging.getLogger("prism.service.sql")

_SECRET_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "CREDENTIAL")


def worker_env() -> dict[str, str]:
    """The environment of a SQL worker: the server's, without its secrets (API keys and anything named like
    a key, secret, token, password or credential): a worker runs user SQL and needs none of them."""
    return {k: v for k, v in os.environ.items() if not any(w in k.upper() for w in _SECRET_WORDS)}


class _Worker:
    """One worker process and the bytes read from it so far."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "prism_tda.service.sqlengine", json.dumps(config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=worker_env())
        self.buf = bytearray()
        self.base = 0  # anonymous memory once ready

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, payload: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack(">I", len(payload)) + payload)
        self.proc.stdin.flush()

    def read_frames(self, n: int, deadline: float, max_anon: int | None) -> list[bytes]:
        """Read ``n`` frames; raises ``TimeoutError`` past ``deadline``, ``MemoryError`` when the worker's
        anonymous memory passes ``max_anon``, ``EOFError`` when it exits."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        frames: list[bytes] = []
        while len(frames) < n:
            while len(frames) < n and len(self.buf) >= 4:
                (size,) = struct.unpack(">I", self.buf[:4])
                if len(self.buf) < 4 + size:
                    break
                frames.append(bytes(self.buf[4 : 4 + size]))
                del self.buf[: 4 + size]
            if len(frames) == n:
                break
            if time.monotonic() > deadline:
                raise TimeoutError
            if max_anon is not None and status_bytes(self.pid, "RssAnon") > max_anon:
                raise MemoryError
            poller = select.poll()  # not select(): it fails once the process has 1,024 descriptors open
            poller.register(fd, select.POLLIN)
            if poller.poll(10):
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise EOFError
                self.buf += chunk
        return frames

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    def close(self, timeout: float = 2.0) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the worker exits at end of input
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


@dataclass(frozen=True)
class SqlLimits:
    timeout_s: float = 5.0
    max_rows: int = 10_000
    max_result_bytes: int = 16 * 2**20
    memory_limit_bytes: int = 2**30  # all workers together
    workers: int = 2
    threads: int = 1  # DuckDB threads per worker
    queue_timeout_s: float = 30.0

    @classmethod
    def from_settings(cls, settings: Settings) -> SqlLimits:
        """The server's limits (``PRISM_SQL_*``)."""
        return cls(timeout_s=settings.sql_timeout_s, max_rows=settings.sql_max_rows,
                   max_result_bytes=settings.sql_max_result_bytes,
                   memory_limit_bytes=parse_bytes(settings.sql_memory_limit), workers=settings.sql_workers,
                   threads=settings.sql_threads, queue_timeout_s=settings.sql_queue_timeout_s)


class SqlPool:
    """A fixed number of SQL worker processes over one index; :meth:`query` runs one statement."""

    START_TIMEOUT_S = 60.0

    def __init__(self, index_dir: Path, limits: SqlLimits, state_path: Path | None = None) -> None:
        from prism_tda.engine.reads import read_complete_manifest

        read_complete_manifest(Path(index_dir))
        self.limits = limits
        self.share = limits.memory_limit_bytes // limits.workers
        self.config = {
            "index_dir": str(Path(index_dir).resolve()), "timeout_s": limits.timeout_s,
            "max_rows": limits.max_rows, "max_result_bytes": limits.max_result_bytes,
            "threads": limits.threads, "state_path": str(state_path) if state_path else None,
            # DuckDB refuses by itself below the kill threshold, with a clean error, for most statements
            "duckdb_memory_limit": f"{max(16, int(0.7 * self.share) >> 20)}MiB",
        }
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        starting = [_Worker(self.config) for _ in range(limits.workers)]
        try:
            for w in starting:
                self._ready(w)
        except BaseException:
            for w in starting:
                w.kill()
            raise

    def _ready(self, w: _Worker) -> None:
        """Wait for a new worker's ready message, then make it available."""
        try:
            w.read_frames(1, time.monotonic() + self.START_TIMEOUT_S, None)
        except (TimeoutError, EOFError):
            w.kill()
            raise PrismError(f"{self.config['index_dir']}: the SQL worker did not start (exit code "
                             f"{w.proc.returncode}); see the log above") from None
        w.base = status_bytes(w.pid, "RssAnon")
        with self._lock:
            if self._closed:
                w.close()
                return
            self._all.add(w)
        self._idle.put(w)

    def _replace(self, old: _Worker) -> None:
        old.kill()
        with self._lock:
            self._all.discard(old)
            if self._closed:
                return

        def start() -> None:
            for attempt in range(5):
                try:
                    self._ready(_Worker(self.config))
                    return
                except Exception:
                    log.exception("SQL worker restart failed", extra={"attempt": attempt + 1})
                    time.sleep(min(2**attempt, 10))

        threading.Thread(target=start, name="sql-worker-start", daemon=True).start()

    @property
    def alive(self) -> int:
        with self._lock:
            return sum(w.proc.poll() is None for w in self._all)

    def doc_ids(self, sql: str, audit: dict[str, Any] | None = None, *, field: str = "sql",
                params: list[Any] | None = None) -> list[int]:
        """The document ids of one statement whose first column is ``doc_id`` (a document filter):
        :class:`SqlRefusal` as :meth:`query` raises it, ``QueryError`` naming ``field`` for a result of
        another shape."""
        from prism_tda.errors import QueryError

        header, rows = self.query(sql, audit, params)
        cols = [c["name"] for c in header["columns"]]
        if not cols or cols[0] != "doc_id":
            raise QueryError(f"{field}: the first column must be doc_id (got {cols[:3]})")
        ids = [r[0] for r in json.loads(rows)]
        if not ids or not all(isinstance(i, int) for i in ids):
            raise QueryError(f"{field}: no document ids (or ids that are not integers)")
        return ids

    def query(self, sql: str, audit: dict[str, Any] | None = None,
              params: list[Any] | None = None) -> tuple[dict[str, Any], bytes]:
        """Run one statement; (header with ``columns`` and ``row_count``, rows as a JSON array).
        ``audit``: ``{"index_name", "principal"}`` restricting ``audit_results`` (principal None: all);
        ``params``: values of ``$1``, ``$2``, ... Raises :class:`SqlRefusal` for every refusal and overrun."""
        try:
            w = self._idle.get(timeout=self.limits.queue_timeout_s)
        except queue.Empty:
            raise SqlRefusal("sql-busy", f"every SQL worker stayed busy for {self.limits.queue_timeout_s:g} s; "
                                         "try again later") from None
        t0 = time.monotonic()
        healthy = False
        try:
            w.send(json.dumps({"sql": sql, "audit": audit, "params": params}).encode())
            head, rows = w.read_frames(2, t0 + 1.5 * self.limits.timeout_s, w.base + self.share)
            healthy = True
        except TimeoutError:
            log.warning("SQL worker killed: time limit", extra={"pid": w.pid, "timeout_s": self.limits.timeout_s})
            raise SqlRefusal("sql-timeout", f"the query ran longer than {self.limits.timeout_s:g} s and was "
                                            "stopped") from None
        except MemoryError:
            log.warning("SQL worker killed: memory limit", extra={"pid": w.pid, "limit_bytes": self.share})
            raise SqlRefusal("sql-out-of-memory", f"the query needed more than {self.share >> 20} MiB of memory "
                                                  "and was stopped") from None
        except (EOFError, OSError):
            log.error("SQL worker died", extra={"pid": w.pid, "exit_code": w.proc.poll()})
            raise SqlRefusal("sql-error", "the query stopped the SQL worker; it is being restarted") from None
        finally:
            if healthy:
                self._idle.put(w)
            else:
                self._replace(w)
        header = json.loads(head)
        if not header["ok"]:
            raise SqlRefusal(header["kind"], header["detail"])
        return header, rows

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        for w in workers:
            w.close()
