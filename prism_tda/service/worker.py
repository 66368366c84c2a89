"""The audit worker: a background thread that attributes pending audit items one at a time, and runs
background tasks (a discovery with selection by effect) between them, a task before an item.

Only one process per state directory runs it (an exclusive ``flock`` on ``audit-worker.lock``;
the kernel releases it when the holder dies, and another server process takes over). It stops at
an item boundary: :meth:`AuditWorker.stop` lets the item in hand commit, then takes no other.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import threading
import time
from typing import Any

from prism_tda.engine import Attribution, QueryOptions, QuerySpec
from prism_tda.errors import Cancelled, PrismError, ShardUnavailable

from .indexes import Registry
from .metrics import Metrics
from .state import StateDB

log = logging.getLogger("prism.service.audits")


def stored_options(params: dict[str, Any]) -> QueryOptions:
    """An audit's options as stored with it (every ``QueryOptions`` field by its name; audits stored
    before that kept ``top_k`` and the defaults of the rest)."""
    names = {f.name for f in dataclasses.fields(QueryOptions)}
    given = {k: v for k, v in params.items() if k in names}
    if "top_k" in params and "n_documents" not in given:
        given["n_documents"] = params["top_k"]
    return QueryOptions(**given)


def outcome(res: Attribution, flag: set[int]) -> dict[str, Any]:
    """An item's stored result: target, prototypes used by the target tokens, the flagged ones, documents."""
    used = sorted({p.proto_id for t in res.per_token for p in t.prototypes if p.act > 0})
    docs = [{"doc_id": d.doc_id, "score": d.score, "raw_influence": d.raw_influence, "value": d.value,
             "influence": d.influence, "trained": d.trained,
             "seq_id": d.seq_id, "external_id": d.external_id} for d in res.documents]
    return {"target_text": res.query.target_text, "used_prototypes": used,
            "flagged_prototypes": [p for p in used if p in flag], "documents": docs}


class AuditWorker:
    """``max_attempts``: starts of one item (or task) before it is failed; ``retention_s``: how long
    finished audits and tasks are kept (0: for ever), purged at most once a minute."""

    CANCEL_POLL_S = 0.5

    def __init__(self, state: StateDB, registry: Registry, metrics: Metrics, poll_s: float, *,
                 max_attempts: int = 3, retention_s: float = 0.0) -> None:
        self.state, self.registry, self.metrics, self.poll_s = state, registry, metrics, poll_s
        self.max_attempts, self.retention_s = max_attempts, retention_s
        self._purged_at = 0.0
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="audit-worker", daemon=True)
        self._lock_fd: int | None = None
        self._task_stop: threading.Event | None = None  # the running task's stop, set by :meth:`stop` too

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def leader(self) -> bool:
        """Whether this process holds the worker lock (and so processes audits)."""
        return self._lock_fd is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the item in hand (waiting at most ``timeout`` seconds), then stop."""
        self._stop.set()
        if self._task_stop is not None:
            self._task_stop.set()
        self.wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the audit worker did not finish its item in time; it stays pending and is "
                        "processed again after a restart", extra={"timeout_s": timeout})
        else:
            log.info("audit worker stopped")
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _try_lock(self) -> bool:
        if self._lock_fd is None:
            fd = os.open(self.state.dir / "audit-worker.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            self._lock_fd = fd
            log.info("this process runs the audit worker", extra={"pid": os.getpid()})
        return True

    def purge(self) -> int:
        """Delete finished audits past the retention time (at most once a minute); how many."""
        now = time.monotonic()
        if not self.retention_s or now - self._purged_at < 60:
            return 0
        self._purged_at = now
        n = self.state.purge_finished(self.retention_s)
        if n:
            log.info("finished audits purged", extra={"audits": n, "retention_s": self.retention_s})
        return n

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self._try_lock() and (self.purge() >= 0) and self.step()
            except Exception:  # keep the worker alive; the item stays pending and is retried
                log.exception("audit worker error")
                busy = False
            if not busy:
                self.wake.wait(self.poll_s)
                self.wake.clear()

    def step(self) -> bool:
        """Run one pending task, else process one pending item; False when there is neither (or the
        worker is stopping)."""
        if self._stop.is_set():
            return False
        if self.step_task():
            return True
        item = self.state.next_item(list(self.registry.indexes), self.max_attempts)
        if item is None:
            return False
        p = item["params"]
        ix = self.registry.get(item["index_name"])
        error, result = None, None
        try:
            res = ix.attribute(QuerySpec(item["prompt"], item["completion"], item["max_new_tokens"],
                                         item.get("target_index")), stored_options(p))
            result = outcome(res, set(item["flag_prototypes"] or []))
        except PrismError as e:
            if isinstance(e, ShardUnavailable):  # the cluster, not the item: retried after a pause
                log.warning("audit item waits for its shards", extra={"job_id": item["job_id"],
                                                                      "item_no": item["item_no"], "error": str(e)})
                self._stop.wait(self.poll_s)
                return True
            error = str(e)
        except Exception as e:  # not the item's fault as far as we know: it stays pending, up to max_attempts
            log.exception("audit item failed unexpectedly", extra={"job_id": item["job_id"], "item_no": item["item_no"],
                                                                   "attempt": item["attempts"]})
            if item["attempts"] < self.max_attempts:
                return True
            error = f"internal error ({type(e).__name__}) in each of {item['attempts']} attempts"
        done = self.state.finish_item(item["job_id"], item["item_no"], error=error, result=result)
        if done:
            self.metrics.audit_items.labels(status="failed" if error else "done").inc()
        return True

    # the share of a discovery's work done when each stage starts and how much of the work it is
    STAGES = {"ranking": (0.0, 0.1), "model": (0.1, 0.4), "selection": (0.5, 0.5)}

    def step_task(self) -> bool:
        """Run the oldest pending task to its end; False when there is none. Its owner's cancellation (seen
        within ``CANCEL_POLL_S``) or the worker's stop ends it at the engine's next check: a stopping
        worker leaves it queued for the next start."""
        task = self.state.next_task(list(self.registry.indexes), self.max_attempts)
        if task is None:
            return False
        tid = task["id"]
        stop = self._task_stop = threading.Event()
        if self._stop.is_set():
            stop.set()
        finished = threading.Event()

        def watch() -> None:  # the owner's DELETE, seen in the state database
            while not finished.wait(self.CANCEL_POLL_S):
                found = self.state.task(tid)
                if found is None or found["status"] != "running":
                    stop.set()
                    return

        last = [0.0]

        def progress(stage: str, done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] < 0.25 and done < total:
                return
            last[0] = now
            start, share = self.STAGES.get(stage, (0.0, 0.0))
            self.state.task_progress(tid, stage, done, total, start + share * (done / total if total else 1.0))

        watcher = threading.Thread(target=watch, name=f"task-watch-{tid}", daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        error, result = None, None
        try:
            ix = self.registry.get(task["index_name"])
            if task["kind"] != "discover":
                raise PrismError(f"unknown task kind {task['kind']!r}")
            result = {"index": ix.name, **ix.discover(**task["params"], stop=stop, progress=progress)}
        except Cancelled:
            if self._stop.is_set():
                self.state.requeue_task(tid)
                log.info("task put down for the next start", extra={"task_id": tid})
            else:
                log.info("task cancelled", extra={"task_id": tid})
            return True
        except PrismError as e:
            error = str(e)
        except Exception:  # not the task's fault as far as we know: it stays running and is started again
            log.exception("task failed unexpectedly", extra={"task_id": tid, "attempt": task["attempts"]})
            return True
        finally:
            finished.set()
            self._task_stop = None
        if self.state.finish_task(tid, result=result, error=error):
            self.metrics.tasks.labels(kind=task["kind"], status="failed" if error else "completed").inc()
        log.info("task finished", extra={"task_id": tid, "kind": task["kind"], "error": error,
                                         "seconds": round(time.perf_counter() - t0, 3)})
        return True
