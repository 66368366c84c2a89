"""Liveness, readiness and Prometheus metrics (outside /v1, no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import problems as p
from ..deps import get_services
from ..schemas import Health, Ready

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up and answering."""
    return Health(status="ok")


@router.get("/readyz", response_model=Ready, responses={503: p.responses(p.NotReady)[503]})
async def readyz(request: Request) -> Ready:
    """Every index is loaded, the state database answers and the audit worker runs."""
    services = get_services(request)
    try:
        await services.io(services.state.ping)
    except Exception as e:
        raise p.NotReady(f"the state database does not answer: {type(e).__name__}") from None
    if not services.worker.alive:
        raise p.NotReady("the audit worker thread has stopped")
    return Ready(status="ready", default_index=services.registry.default,
                 indexes=[ix.info() for ix in services.registry.indexes.values()],
                 audit_worker="leader" if services.worker.leader else "standby")


@router.get("/metrics", response_class=Response,
            responses={200: {"description": "Prometheus text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    """Prometheus metrics: requests, latency, audit items, SQL refusals, index load times."""
    services = get_services(request)
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)
