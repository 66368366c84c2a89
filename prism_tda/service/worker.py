"""The background worker: audit items and background tasks (a discovery with selection by effect),
run in slices by key in turns.

One unit of work at a time runs: an audit item or a task, in a thread of its own, with a stop event it
checks at each step (each generated token, each batch of an exact pass, each stage; each candidate of a
discovery). After ``slice_s`` of work, when another key has work waiting, the worker pauses the unit at
its next check (it waits there, in memory) and gives that key its turn: the key served longest ago goes
first, and each key runs its own units one at a time, items and tasks alternately. So one key's long task
or item delays another key's next item by about one slice, whatever it queued. An item that has used
``item_max_s`` of compute is stopped and failed; an owner's cancellation stops the unit at its next check.

Only one process per state directory runs it (an exclusive ``flock`` on ``audit-worker.lock``; the
kernel releases it when the holder dies, and another server process takes over). :meth:`AuditWorker.stop`
stops the units in hand at their next check and puts them back, their starts not counted.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

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


class Pausable(threading.Event):
    """A unit's stop event that can also hold it: while paused, the unit's next check (``is_set``) waits
    until it is resumed or stopped. ``stop(reason)`` stops it; ``parked`` is set while it waits.
    ``yield_to(max_wait_s)``: called at each check first (the live requests' light computations finish
    before background work goes on)."""

    def __init__(self, yield_to: Callable[[float], None] | None = None) -> None:
        super().__init__()
        self.yield_to = yield_to
        self.reason: str | None = None
        self.parked = threading.Event()
        self._go = threading.Event()

    def pause(self) -> None:
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    def stop(self, reason: str) -> None:
        if not super().is_set():
            self.reason = reason
        self.set()
        self._go.set()

    def is_set(self) -> bool:
        if self.yield_to is not None and not super().is_set():
            self.yield_to(0.5)
        if not self._go.is_set() and not super().is_set():
            self.parked.set()
            try:
                self._go.wait()
            finally:
                self.parked.clear()
        return super().is_set()


@dataclass
class Unit:
    """One item or task in hand: the thread running it and what it came to."""

    key: str
    kind: str  # "item" or "task"
    row: dict[str, Any]
    stop: Pausable = field(default_factory=Pausable)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    used_s: float = 0.0
    t0: float = field(default_factory=time.perf_counter)

    @property
    def name(self) -> str:
        return self.row["id"] if self.kind == "task" else f"{self.row['job_id']}#{self.row['item_no']}"


STOPPING = "the server is stopping"
CANCELLED = "its owner cancelled it"


class AuditWorker:
    """``max_attempts``: starts of one item (or task) before it is failed; ``retention_s``: how long
    finished audits and tasks are kept (0: for ever), purged at most once a minute; ``slice_s``: the work a
    unit does before another key gets its turn; ``item_max_s``: the most compute one item may take;
    ``threads``: torch threads of each unit (None: torch's default); ``yield_to``: see :class:`Pausable`."""

    CANCEL_POLL_S = 0.25

    def __init__(self, state: StateDB, registry: Registry, metrics: Metrics, poll_s: float, *,
                 max_attempts: int = 3, retention_s: float = 0.0, slice_s: float = 1.0, item_max_s: float = 300.0,
                 threads: int | None = None, yield_to: Callable[[float], None] | None = None) -> None:
        self.state, self.registry, self.metrics, self.poll_s = state, registry, metrics, poll_s
        self.max_attempts, self.retention_s = max_attempts, retention_s
        self.slice_s, self.item_max_s, self.threads, self.yield_to = slice_s, item_max_s, threads, yield_to
        self._purged_at = 0.0
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="audit-worker", daemon=True)
        self._lock_fd: int | None = None
        self._units: dict[str, Unit] = {}  # the unit in hand of each key (at most one a key)
        self._last_kind: dict[str, str] = {}

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
        """Stop the units in hand at their next check (waiting at most ``timeout`` seconds) and put them
        back for the next start, then stop."""
        self._stop.set()
        for unit in list(self._units.values()):
            unit.stop.stop(STOPPING)
        self.wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the audit worker did not put its work down in time; it stays pending and is "
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
        for unit in list(self._units.values()):  # put down what is in hand
            unit.stop.stop(STOPPING)
            unit.done.wait()
            self._settle(unit)

    # ------------------------------------------------------------------------ turns
    def step(self) -> bool:
        """Give the key whose turn it is one slice of work; False when no key has work (or the worker is
        stopping)."""
        if self._stop.is_set():
            return False
        self._reap()
        names = list(self.registry.indexes)
        key = self.state.next_key(names)
        if key is None:
            return False
        self.state.served(key)
        unit = self._units.get(key) or self._start(key, names)
        if unit is not None:
            self._slice(unit, names)
        return True

    def _active(self, unit: Unit) -> bool:
        """Whether the unit's audit or task still wants it (not cancelled meanwhile)."""
        if unit.kind == "item":
            return self.state.item_active(unit.row["job_id"], unit.row["item_no"])
        found = self.state.task(unit.row["id"])
        return found is not None and found["status"] == "running"

    def _reap(self) -> None:
        """Stop the units put down whose audit or task was cancelled meanwhile."""
        for unit in list(self._units.values()):
            if not unit.done.is_set() and not self._active(unit):
                unit.stop.stop(CANCELLED)
                unit.done.wait()
            if unit.done.is_set():
                self._settle(unit)

    def _start(self, key: str, names: list[str]) -> Unit | None:
        """The key's next unit, started paused: an item or a task, taking the other kind than last time
        when the key has both."""
        kinds = ["task", "item"] if self._last_kind.get(key) == "item" else ["item", "task"]
        for kind in kinds:
            row = (self.state.next_item(names, self.max_attempts, principal=key) if kind == "item"
                   else self.state.next_task(names, self.max_attempts, principal=key))
            if row is not None:
                self._last_kind[key] = kind
                unit = Unit(key, kind, row, Pausable(self.yield_to))
                work = self._item_work(unit) if kind == "item" else self._task_work(unit)
                unit.stop.pause()
                threading.Thread(target=self._body, args=(unit, work), name=f"work-{unit.name}", daemon=True).start()
                self._units[key] = unit
                return unit
        return None

    def _body(self, unit: Unit, work: Callable[[], Any]) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            unit.stop.is_set()  # started paused: waits here for its first slice
            if unit.stop.is_set():
                raise Cancelled(f"the work was stopped: {unit.stop.reason}")
            unit.result = work()
        except BaseException as e:  # settled by the worker's thread
            unit.error = e
        finally:
            unit.done.set()

    def _slice(self, unit: Unit, names: list[str]) -> None:
        """Run ``unit`` for one slice (longer while no other key has work), then pause it at its next check;
        settle it once it is done."""
        unit.stop.resume()
        t0 = time.perf_counter()
        end = t0 + self.slice_s
        while not unit.done.wait(self.CANCEL_POLL_S):
            now = time.perf_counter()
            if self._stop.is_set():
                unit.stop.stop(STOPPING)
            elif not self._active(unit):
                unit.stop.stop(CANCELLED)
            elif unit.kind == "item" and unit.used_s + now - t0 > self.item_max_s:
                unit.stop.stop(f"it ran past the step budget of {self.item_max_s:g} s (audit_item_max_s)")
            elif now >= end:
                if self.state.next_key(names, exclude=unit.key) is None:
                    end = now + self.slice_s  # nobody else is waiting: go on
                    continue
                unit.stop.pause()
                # it parks at its next check; one that waits for a lock a paused unit holds never gets there,
                # so the wait is bounded (it goes on parking at its next check meanwhile)
                give_up = now + max(5.0, 5 * self.slice_s)
                while not (unit.stop.parked.wait(self.CANCEL_POLL_S) or unit.done.is_set()):
                    if self._stop.is_set():
                        unit.stop.stop(STOPPING)
                    if time.perf_counter() > give_up:
                        log.warning("a unit did not reach a check in time to be put down; the next key goes on "
                                    "beside it", extra={"unit": unit.name})
                        break
                break
        unit.used_s += time.perf_counter() - t0
        if unit.done.is_set():
            self._settle(unit)

    # ------------------------------------------------------------------------ the work
    def _item_work(self, unit: Unit) -> Callable[[], Any]:
        item = unit.row
        ix = self.registry.get(item["index_name"])
        spec = QuerySpec(item["prompt"], item["completion"], item["max_new_tokens"], item.get("target_index"))
        options = stored_options(item["params"])
        return lambda: outcome(ix.attribute(spec, options, stop=unit.stop), set(item["flag_prototypes"] or []))

    # the share of a discovery's work done when each stage starts and how much of the work it is
    STAGES = {"ranking": (0.0, 0.1), "model": (0.1, 0.4), "selection": (0.5, 0.5)}

    def _task_work(self, unit: Unit) -> Callable[[], Any]:
        task, last = unit.row, [0.0]
        tid = task["id"]

        def progress(stage: str, done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] < 0.25 and done < total:
                return
            last[0] = now
            start, share = self.STAGES.get(stage, (0.0, 0.0))
            self.state.task_progress(tid, stage, done, total, start + share * (done / total if total else 1.0))

        def work() -> dict[str, Any]:
            ix = self.registry.get(task["index_name"])
            if task["kind"] != "discover":
                raise PrismError(f"unknown task kind {task['kind']!r}")
            return {"index": ix.name, **ix.discover(**task["params"], stop=unit.stop, progress=progress)}

        return work

    def _settle(self, unit: Unit) -> None:
        """Record what a finished unit came to, and let it go."""
        self._units.pop(unit.key, None)
        if unit.kind == "item":
            self._settle_item(unit)
        else:
            self._settle_task(unit)

    def _settle_item(self, unit: Unit) -> None:
        item, e = unit.row, unit.error
        where = {"job_id": item["job_id"], "item_no": item["item_no"]}
        error, result = None, unit.result
        if isinstance(e, Cancelled):
            if unit.stop.reason in (STOPPING, None):
                self.state.requeue_item(item["job_id"], item["item_no"])
                log.info("audit item put down for the next start", extra=where)
                return
            if unit.stop.reason == CANCELLED:
                log.info("audit item stopped: its audit was cancelled", extra=where)
                return
            error = f"stopped: {unit.stop.reason}"
        elif isinstance(e, ShardUnavailable):  # the cluster, not the item: retried after a pause
            log.warning("audit item waits for its shards", extra={**where, "error": str(e)})
            self._stop.wait(self.poll_s)
            return
        elif isinstance(e, PrismError):
            error = str(e)
        elif e is not None:  # not the item's fault as far as we know: it stays pending, up to max_attempts
            log.error("audit item failed unexpectedly", exc_info=e, extra={**where, "attempt": item["attempts"]})
            if item["attempts"] < self.max_attempts:
                return
            error = f"internal error ({type(e).__name__}) in each of {item['attempts']} attempts"
        if self.state.finish_item(item["job_id"], item["item_no"], error=error,
                                  result=None if error else result):
            self.metrics.audit_items.labels(status="failed" if error else "done").inc()

    def _settle_task(self, unit: Unit) -> None:
        task, e, tid = unit.row, unit.error, unit.row["id"]
        error = None
        if isinstance(e, Cancelled):
            if unit.stop.reason in (STOPPING, None):
                self.state.requeue_task(tid)
                log.info("task put down for the next start", extra={"task_id": tid})
            else:
                log.info("task cancelled", extra={"task_id": tid})
            return
        if isinstance(e, PrismError):
            error = str(e)
        elif e is not None:  # not the task's fault as far as we know: it stays running and is started again
            log.error("task failed unexpectedly", exc_info=e, extra={"task_id": tid, "attempt": task["attempts"]})
            return
        if self.state.finish_task(tid, result=None if error else unit.result, error=error):
            self.metrics.tasks.labels(kind=task["kind"], status="failed" if error else "completed").inc()
        log.info("task finished", extra={"task_id": tid, "kind": task["kind"], "error": error,
                                         "seconds": round(time.perf_counter() - unit.t0, 3),
                                         "compute_s": round(unit.used_s, 3)})
