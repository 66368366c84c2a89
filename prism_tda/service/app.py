"""The FastAPI application: ``create_app()`` and the lifespan that loads everything once."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import torch
from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from prism_tda import __version__
from prism_tda.logs import setup_logging

from . import lifecycle, problems
from .connections import http_protocol
from .deps import Services, ThreadShare, get_admin, get_principal
from .indexes import Registry
from .metrics import Metrics
from .middleware import BodyLimit, RequestContext, RequestOrigin, SecurityHeaders
from .routers import admin, attribute, audits, documents, generate, health, prototypes, sql, ui
from .security import Guard
from .settings import Settings
from .state import SHARED, StateDB
from .worker import AuditWorker

log = logging.getLogger("prism.service")

DESCRIPTION = """Training-data attribution for PRISM prototype language models: which training
documents drove an output, batch audits, read-only SQL over the activation store, prototype
browsing and generation with prototype suppression. Errors are `application/problem+json`
(RFC 9457) with a stable `type` per kind of error."""


def _operation_id(route: APIRoute) -> str:
    head, *rest = route.name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def process_cores(settings: Settings) -> int:
    """This server process's share of the machine's cores: all of them over ``workers``, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // settings.workers)


def compute_threads(settings: Settings) -> int:
    """torch's intra-op threads for work outside a request's computation (loading, the audit worker):
    ``torch_threads``, else this process's cores shared by every computation that can run at once
    (``compute_concurrency``), at least 1. A request's computation takes its share when it starts
    (:class:`~prism_tda.service.deps.ThreadShare`)."""
    if settings.torch_threads:
        return settings.torch_threads
    return max(1, process_cores(settings) // settings.compute_concurrency)


def _load(settings: Settings, metrics: Metrics) -> Services:
    torch.set_num_threads(compute_threads(settings))
    registry = Registry.load(settings)
    for ix in registry.indexes.values():
        metrics.index_loaded(ix)
    state = StateDB(settings.state_dir)
    for name, ids in settings.prototype_sets.items():
        for ix in registry.indexes.values():
            ix.check_prototypes(ids, f"PRISM_PROTOTYPE_SETS[{name!r}]")
            state.put_set(ix.name, SHARED, name, ids, "from the server's settings")
    threads = ThreadShare(process_cores(settings), settings.torch_threads)
    # background work yields to live requests' light computations at each of its checks
    worker = AuditWorker(state, registry, metrics, settings.audit_poll_s, max_attempts=settings.audit_max_attempts,
                         retention_s=settings.audit_retention_days * 86400, slice_s=settings.work_slice_s,
                         item_max_s=settings.audit_item_max_s, threads=settings.torch_threads,
                         yield_to=threads.yield_to_light)
    return Services(settings=settings, registry=registry, state=state, worker=worker, metrics=metrics,
                    threads=threads, guard=Guard(settings))


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service app. ``settings`` default to the ``PRISM_*`` environment."""
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.check_serving()
        services = await anyio.to_thread.run_sync(_load, settings, metrics)
        # computations and SQL waits are admitted per index by key in turns (service/fairness.py); the state
        # database's reads have threads of their own, so a burst of slow statements never stalls readiness,
        # audits or sets
        services.admit(list(services.registry.indexes))
        services.io_limiter = anyio.CapacityLimiter(16)
        services.worker.start()
        app.state.services = services
        uninstall_sighup = lifecycle.install_sighup(services)
        log.info("serving", extra={"indexes": list(services.registry.indexes), "default": services.registry.default,
                                   "auth": bool(settings.api_keys)})
        try:
            yield
        finally:
            uninstall_sighup()
            await lifecycle.drain(services, settings.graceful_shutdown_s)
            app.state.services = None
            await anyio.to_thread.run_sync(services.worker.stop, settings.graceful_shutdown_s)
            services.registry.close()

    app = FastAPI(title="PRISM-TDA", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None,  # /docs is served with local assets (routers/ui.py)
                  generate_unique_id_function=_operation_id)
    app.state.services = None
    problems.install(app)
    guarded = [Depends(get_principal)]
    for r in (attribute.router, audits.router, sql.router, prototypes.router, prototypes.sets_router,
              documents.router, generate.router):
        app.include_router(r, prefix="/v1", dependencies=guarded)
    app.include_router(admin.router, prefix="/v1", dependencies=[Depends(get_admin)])
    app.include_router(health.router)
    app.include_router(ui.router)
    app.mount("/static", ui.static_files(), name="static")
    app.mount(ui.DOCS_ASSETS_URL, ui.docs_assets(), name="docs-assets")
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(RequestOrigin, keyless=not settings.api_keys, allowed_hosts=settings.allowed_hosts,
                       cors_origins=settings.cors_origins)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-ID", "Location", "Retry-After"])
    app.add_middleware(RequestContext, metrics=metrics)
    app.add_middleware(SecurityHeaders)  # outermost: every answer of the app carries its headers
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        comps["Problem"] = problems.Problem.model_json_schema(ref_template="#/components/schemas/{model}")
        for unused in ("HTTPValidationError", "ValidationError"):
            if not re.search(rf'"#/components/schemas/{unused}"', str(schema["paths"]).replace("'", '"')):
                comps.pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options for these settings. Proxy headers are read only from ``forwarded_allow_ips``
    (uvicorn's own default would trust any local peer's ``X-Forwarded-For``). Connections are bounded:
    the h11 protocol with a header time limit (``connections.py``; the body's is ``BodyLimit``'s), the
    keep-alive idle time, and the connections answered at once."""
    trusted = ",".join(settings.forwarded_allow_ips)
    return {"host": settings.host, "port": settings.port, "log_config": None, "access_log": False,
            "timeout_graceful_shutdown": settings.graceful_shutdown_s, "proxy_headers": bool(trusted),
            "forwarded_allow_ips": trusted or None,
            "http": http_protocol(settings.header_timeout_s), "timeout_keep_alive": settings.idle_timeout_s,
            "limit_concurrency": settings.max_connections,
            # the longest request line the API's own parameters make (16,000 characters of `ids`, each up
            # to 12 bytes percent-encoded); past it the HTTP parser answers a bare 400
            "h11_max_incomplete_event_size": 256 * 1024}


def create_app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory``: settings and logging from the ``PRISM_*`` environment."""
    settings = Settings()
    setup_logging(settings.log_level, settings.log_format)
    return create_app(settings)
