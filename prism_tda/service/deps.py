"""Dependencies shared by the routers, as ``Annotated`` aliases."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import anyio
import torch
from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from prism_tda.engine import QueryOptions

from . import problems
from .fairness import Busy, FairLimiter
from .indexes import LoadedIndex, Registry
from .metrics import Metrics
from .security import Guard, Principal
from .settings import Settings
from .state import StateDB
from .worker import AuditWorker

T = TypeVar("T")


class ThreadShare:
    """torch threads for each computation of this process: ``fixed`` when set, else this process's
    ``cores`` divided by the computations running when it starts (at least 1). One computation alone
    uses every core; two at once get half each rather than oversubscribing them. torch keeps the count
    per thread, so setting it in the computation's own worker thread touches no other."""

    def __init__(self, cores: int, fixed: int | None = None) -> None:
        self.cores, self.fixed = max(1, cores), fixed
        self.active = 0
        self.light = 0  # computations running that are not heavy
        self._lock = threading.Lock()
        self._light_done = threading.Condition(self._lock)

    def run(self, fn: Callable[[], T], heavy: bool = False) -> T:
        with self._lock:
            self.active += 1
            self.light += not heavy
            n = self.fixed or max(1, self.cores // self.active)
        try:
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)
            return fn()
        finally:
            with self._lock:
                self.active -= 1
                self.light -= not heavy
                if not self.light:
                    self._light_done.notify_all()

    def yield_to_light(self, max_wait_s: float) -> None:
        """Wait (at most ``max_wait_s``) while light computations run: a heavy one calls this at each of its
        checks, so a short query beside it runs alone instead of sharing the cores and the interpreter lock."""
        with self._lock:
            if self.light:
                self._light_done.wait_for(lambda: not self.light, max_wait_s)


class YieldingStop(threading.Event):
    """A heavy computation's stop event: each check first lets the light computations running beside it
    finish (:meth:`ThreadShare.yield_to_light`, at most ``max_wait_s`` a check, so it still advances)."""

    def __init__(self, share: ThreadShare, max_wait_s: float = 0.5) -> None:
        super().__init__()
        self.share, self.max_wait_s = share, max_wait_s

    def is_set(self) -> bool:
        if not super().is_set():
            self.share.yield_to_light(self.max_wait_s)
        return super().is_set()


@dataclass
class Services:
    """What the lifespan loads once and every request shares."""

    settings: Settings
    registry: Registry
    state: StateDB
    worker: AuditWorker
    metrics: Metrics
    guard: Guard
    # per index: its model computations and its SQL statements, admitted by key in turns (service/fairness.py)
    limiters: dict[str, FairLimiter] = field(default_factory=dict)
    sql_limiters: dict[str, FairLimiter] = field(default_factory=dict)
    threads: ThreadShare = field(default_factory=lambda: ThreadShare(1))
    io_limiter: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(16))
    heavy: Counter[str] = field(default_factory=Counter)  # heavy requests in flight, per key

    def admit(self, ix_names: list[str]) -> None:
        """The fair limiters of these indexes (at start-up and when an index is added)."""
        s = self.settings
        for name in ix_names:
            self.limiters.setdefault(name, FairLimiter(s.compute_concurrency, per_key=s.compute_concurrency,
                                                       max_waiting=s.max_waiting_per_key))
            self.sql_limiters.setdefault(name, FairLimiter(s.sql_workers, per_key=s.sql_max_per_key,
                                                           max_waiting=s.max_waiting_per_key,
                                                           what="SQL statements"))

    @staticmethod
    def _busy(e: Busy) -> problems.ServiceError:
        return problems.KeyBusy(e.detail, headers={"Retry-After": str(e.retry_after_s)})

    async def run(self, ix: LoadedIndex, who: Principal, fn: Callable[..., T], *args: Any, heavy: bool = False,
                  **kwargs: Any) -> T:
        """Run CPU-bound work in a worker thread, at most ``compute_concurrency`` at once per index, admitted
        by key in turns (:class:`FairLimiter`: a key over its share is refused with 429 ``key-busy``), with
        its share of the cores (:class:`ThreadShare`; ``heavy``: it yields to the light ones at its checks)."""
        limiter = self.limiters[ix.name]
        try:
            await limiter.acquire(who.id, bounded=not who.admin)
        except Busy as e:
            raise self._busy(e) from None
        try:
            work = functools.partial(self.threads.run, functools.partial(fn, *args, **kwargs), heavy)
            return await anyio.to_thread.run_sync(work)
        finally:
            limiter.release(who.id)

    @contextlib.contextmanager
    def heavy_request(self, who: Principal) -> Iterator[None]:
        """Count a heavy request (generation, the ``influence`` option, exact mode) of ``who`` while it runs:
        a key already running ``max_heavy_per_key`` of them is refused (429 ``key-busy``); admin keys and
        keyless loopback use are not limited."""
        limit = self.settings.max_heavy_per_key
        if not who.admin and self.heavy[who.id] >= limit:
            raise problems.KeyBusy(f"this key already runs {self.heavy[who.id]} heavy requests (generation, the "
                                   f"influence option or exact mode; at most {limit} at once per key); wait for "
                                   "one to finish", headers={"Retry-After": "2"})
        self.heavy[who.id] += 1
        try:
            yield
        finally:
            self.heavy[who.id] -= 1
            if self.heavy[who.id] <= 0:
                del self.heavy[who.id]

    async def run_cancellable(self, request: Request, ix: LoadedIndex, who: Principal, fn: Callable[..., T],
                              *args: Any, heavy: bool = False, **kwargs: Any) -> T:
        """:meth:`run` for work that takes a ``stop`` event: set when the client disconnects, so the work
        stops at its next check (the engine raises ``Cancelled``, answered 499). ``heavy``: counted against
        the key's heavy requests (:meth:`heavy_request`), and at each check the work first lets the light
        computations beside it finish (:class:`YieldingStop`)."""
        with self.heavy_request(who) if heavy else contextlib.nullcontext():
            return await self._run_cancellable(request, ix, who, fn, *args, heavy=heavy, **kwargs)

    async def _run_cancellable(self, request: Request, ix: LoadedIndex, who: Principal, fn: Callable[..., T],
                               *args: Any, heavy: bool, **kwargs: Any) -> T:
        stop = YieldingStop(self.threads) if heavy else threading.Event()

        async def watch() -> None:
            while not threading.Event.is_set(stop):  # never waits, whatever the stop's kind
                if await request.is_disconnected():
                    stop.set()
                    return
                await anyio.sleep(0.2)

        failed: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            try:
                result = await self.run(ix, who, fn, *args, stop=stop, heavy=heavy, **kwargs)
            except Exception as e:  # raised after the group, as itself (not wrapped in an exception group)
                failed = e
            finally:
                stop.set()
                tg.cancel_scope.cancel()
        if failed is not None:
            raise failed
        return result

    async def io(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking I/O (the state database) in a worker thread of its own pool."""
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self.io_limiter)

    async def sql(self, ix: LoadedIndex, who: Principal, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a SQL statement's wait in a thread, at most ``sql_workers`` at once per index, admitted by key
        in turns with at most ``sql_max_per_key`` of one key's at once (more wait, without holding a thread,
        up to ``sql_queue_timeout_s``; past ``max_waiting_per_key`` waiting they are refused at once)."""
        limiter = self.sql_limiters[ix.name]
        wait_s = self.settings.sql_queue_timeout_s
        try:
            await limiter.acquire(who.id, wait_s, bounded=not who.admin)
        except Busy as e:
            raise self._busy(e) from None
        except TimeoutError:
            raise problems.SqlBusy(f"every SQL worker stayed busy for {wait_s:g} s; try again later") from None
        try:
            return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
        finally:
            limiter.release(who.id)

    async def check_active(self, principal: Principal, count: Callable[[str], int], limit: int,
                           refusal: type[problems.ServiceError], what: str, retry_after_s: int) -> None:
        """Refuse (``refusal``, 429) a non-admin key that already has ``limit`` queued or running ``what``
        (``count``: the key's active ones, from the state database)."""
        if principal.admin:
            return
        active = await self.io(count, principal.id)
        if active >= limit:
            raise refusal(f"this key has {active} queued or running {what} (the limit is {limit}); wait for one "
                          "to finish or cancel one", headers={"Retry-After": str(retry_after_s)})

    def bounded(self, options: QueryOptions) -> QueryOptions:
        """``options`` as this server runs them: a default the client did not set that is over the
        server's limits comes down to them (the FAISS stage's 256 sequences under ``opponents``, with
        ``max_candidates`` below it); a value the client set over them is refused by :meth:`check_limits`."""
        if options.n_candidates is None and options.sketch_candidates > self.settings.max_candidates:
            return dataclasses.replace(options, n_candidates=self.settings.max_candidates)
        return options

    def check_limits(self, *, where: str = "", max_new_tokens: int | None = None,
                     n_items: tuple[str, int] | None = None, options: QueryOptions | None = None,
                     context: int | None = None) -> None:
        """Refuse a request over the server's limits, naming the field (``where`` prefixes it).
        ``options``: an attribution's cost knobs (candidates, re-ranked documents and tokens; ``context``
        bounds ``exact_tokens: null``)."""
        s = self.settings
        if options is not None:
            if options.n_candidates is not None and options.n_candidates > s.max_candidates:
                raise problems.InvalidRequest(f"{where}n_candidates: {options.n_candidates} is over the server's "
                                              f"limit of {s.max_candidates}")
            if options.exact_rerank > s.max_exact_rerank:
                raise problems.InvalidRequest(f"{where}exact_rerank: {options.exact_rerank} is over the server's "
                                              f"limit of {s.max_exact_rerank}")
            # each document's rows in its best sequence, and as many of its best rows elsewhere
            per_seq = options.exact_tokens if options.exact_tokens is not None else (context or 0)
            if options.mode == "fast" and 2 * options.exact_rerank * per_seq > s.max_rerank_tokens:
                shown = options.exact_tokens if options.exact_tokens is not None else f"null (the context, {context})"
                raise problems.InvalidRequest(f"{where}exact_rerank x exact_tokens: {options.exact_rerank} x {shown} "
                                              f"x 2 (a document's best sequence and its rows elsewhere) tokens "
                                              f"re-scored is over the server's limit of {s.max_rerank_tokens}")
        if options is not None and options.n_documents > s.max_top_k:
            raise problems.InvalidRequest(f"{where}n_documents: {options.n_documents} is over the server's limit of "
                                          f"{s.max_top_k}")
        if max_new_tokens is not None and max_new_tokens > s.max_new_tokens:
            raise problems.InvalidRequest(f"{where}max_new_tokens: {max_new_tokens} is over the server's limit of "
                                          f"{s.max_new_tokens}")
        if n_items is not None and n_items[1] > s.max_batch_items:
            raise problems.TooManyItems(f"{where}{n_items[0]}: {n_items[1]} items; the limit is {s.max_batch_items}")


def get_services(request: Request) -> Services:
    services = getattr(request.app.state, "services", None)
    if services is None:
        raise problems.NotReady("the service is still starting")
    return services


ServicesDep = Annotated[Services, Depends(get_services)]

_bearer = HTTPBearer(auto_error=False, description="An API key from PRISM_API_KEYS (required off loopback).")


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def get_principal(request: Request, services: ServicesDep,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
    return services.guard(credentials, client_address(request))


def get_admin(request: Request, services: ServicesDep,
              credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
    """With ``PRISM_ADMIN_API_KEYS`` set, only those keys; otherwise the same rule as every endpoint."""
    return services.guard.admin(credentials, client_address(request))


PrincipalDep = Annotated[Principal, Depends(get_principal)]
IndexQuery = Annotated[str | None, Query(max_length=200, description="Index to use (default: the server's "
                                                                    "default index).")]
