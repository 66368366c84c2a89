"""The audit worker: a background thread that attributes pending audit items one at a time.

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
from prism_tda.errors import PrismError, ShardUnavailable

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
    docs = [{"doc_id": d.doc_id, "score": d.score, "raw_influence": d.raw_influence, "trained": d.trained,
             "seq_id": d.seq_id, "external_id": d.external_id} for d in res.documents]
    return {"target_text": res.query.target_text, "used_prototypes": used,
            "flagged_prototypes": [p for p in used if p in flag], "documents": docs}


class AuditWorker:
    """``max_attempts``: starts of one item before it is failed; ``retention_s``: how long finished
    audits are kept (0: for ever), purged at most once a minute."""

    def __init__(self, state: StateDB, registry: Registry, metrics: Metrics, poll_s: float, *,
                 max_attempts: int = 3, retention_s: float = 0.0) -> None:
        self.state, self.registry, self.metrics, self.poll_s = state, registry, metrics, poll_s
        self.max_attempts, self.retention_s = max_attempts, retention_s
        self._purged_at = 0.0
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="audit-worker", daemon=True)
        self._lock_fd: int | None = None

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
        """Process one pending item; False when there is none (or the worker is stopping)."""
        if self._stop.is_set():
            return False
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
