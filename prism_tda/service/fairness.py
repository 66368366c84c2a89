"""Fair admission of live work: slots handed out by key in turns, with per-key bounds.

Each index has one :class:`FairLimiter` for its model computations and one for its SQL workers. A slot
that frees goes to the key whose turn it is (round robin over the keys with a request waiting), so a
key that sends a hundred requests waits behind its own requests, never in front of another key's. A key
holds at most ``per_key`` slots at once and may have ``max_waiting`` more requests waiting; past that its
request is refused at once (429 with ``Retry-After``) instead of joining a queue that would make every
other key wait too. Every method runs on the event loop (one thread), so no lock is needed.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio


class Busy(Exception):
    """The key already holds and waits for as much as it may; ``retry_after_s``: when to try again."""

    def __init__(self, detail: str, retry_after_s: int = 1) -> None:
        super().__init__(detail)
        self.detail, self.retry_after_s = detail, retry_after_s


class _Waiter:
    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.granted = False


class FairLimiter:
    """``capacity`` slots, granted by key in turns; ``per_key``: the most one key holds at once;
    ``max_waiting``: the most requests one key may have waiting (more are refused with :class:`Busy`)."""

    def __init__(self, capacity: int, *, per_key: int, max_waiting: int, what: str = "computations") -> None:
        if capacity < 1 or per_key < 1 or max_waiting < 0:
            raise ValueError("capacity and per_key must be at least 1, max_waiting at least 0")
        self.capacity, self.per_key, self.max_waiting, self.what = capacity, min(per_key, capacity), max_waiting, what
        self.held: Counter[str] = Counter()
        self._waiting: dict[str, deque[_Waiter]] = {}
        self._turns: OrderedDict[str, None] = OrderedDict()  # keys with a waiter, the next to serve first
        self._cap: dict[str, int] = {}  # the slots each key with work may hold

    @property
    def borrowed_tokens(self) -> int:
        """Slots held now (the name anyio's CapacityLimiter gives it)."""
        return sum(self.held.values())

    def waiting(self, key: str | None = None) -> int:
        if key is not None:
            return len(self._waiting.get(key, ()))
        return sum(len(q) for q in self._waiting.values())

    def _dispatch(self) -> None:
        """Grant free slots to waiting keys in turn order; a key served goes to the end of the turns."""
        while self.borrowed_tokens < self.capacity:
            key = next((k for k in self._turns if self.held[k] < self._cap.get(k, self.per_key)), None)
            if key is None:
                return
            queue = self._waiting[key]
            w = queue.popleft()
            if not queue:
                del self._waiting[key]
                del self._turns[key]
            else:
                self._turns.move_to_end(key)
            w.granted = True
            self.held[key] += 1
            w.event.set()

    async def acquire(self, key: str, timeout: float | None = None, *, bounded: bool = True) -> None:
        """Take a slot for ``key``: at once when one is free and no other key is waiting for it, else in
        the key's turn. :class:`Busy` when the key is at its bounds; ``TimeoutError`` past ``timeout``.
        ``bounded`` False (admin keys, keyless loopback use): the key may hold every slot and wait without
        bound, still in turns with the other keys."""
        queued = len(self._waiting.get(key, ()))
        self._cap[key] = self.per_key if bounded else self.capacity
        if bounded and self.held[key] + queued >= self.per_key + self.max_waiting:
            raise Busy(f"this key already has {self.held[key]} {self.what} running and {queued} waiting (at most "
                       f"{self.per_key} running and {self.max_waiting} waiting per key); wait for one to finish")
        w = _Waiter()
        self._waiting.setdefault(key, deque()).append(w)
        self._turns.setdefault(key, None)
        self._dispatch()
        if w.granted:
            return
        try:
            with anyio.fail_after(timeout):
                await w.event.wait()
        except BaseException:  # timed out or cancelled: leave the queue, or give back a slot granted meanwhile
            if w.granted:
                self.release(key)
            else:
                queue = self._waiting.get(key)
                if queue is not None and w in queue:
                    queue.remove(w)
                    if not queue:
                        del self._waiting[key]
                        del self._turns[key]
                        if not self.held[key]:
                            self._cap.pop(key, None)
            raise

    def release(self, key: str) -> None:
        self.held[key] -= 1
        if self.held[key] <= 0:
            del self.held[key]
            if key not in self._waiting:
                self._cap.pop(key, None)
        self._dispatch()

    @asynccontextmanager
    async def hold(self, key: str, timeout: float | None = None, *, bounded: bool = True) -> AsyncIterator[None]:
        await self.acquire(key, timeout, bounded=bounded)
        try:
            yield
        finally:
            self.release(key)
