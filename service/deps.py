"""Dependencies shared by the routers, as ``Annotated`` aliases."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from . import problems
from .indexes import LoadedIndex, Registry
from .metrics import Metrics
from .security import Guard, Principal
from .settings import Settings
from .state import StateDB
from .worker import AuditWorker

T = TypeVar("T")


@dataclass
class Services:
    """What the lifespan loads once and every request shares."""

    settings: Settings
    registry: Registry
    state: StateDB
    worker: AuditWorker
    metrics: Metrics
    guard: Guard
    limiters: dict[str, anyio.CapacityLimiter] = field(default_factory=dict)

    async def run(self, ix: LoadedIndex, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run CPU-bound work in a worker thread, at most ``compute_concurrency`` at once per index."""
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self.limiters[ix.name])

    async def io(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking I/O (the state database) in a worker thread."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    def check_limits(self, *, where: str = "", top_k: int | None = None, max_new_tokens: int | None = None,
                     n_items: tuple[str, int] | None = None) -> None:
        """Refuse a request over the server's limits, naming the field (``where`` prefixes it)."""
        s = self.settings
        if top_k is not None and top_k > s.max_top_k:
            raise problems.InvalidRequest(f"{where}top_k: {top_k} is over the server's limit of {s.max_top_k}")
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
