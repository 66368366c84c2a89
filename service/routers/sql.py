"""POST /v1/sql: read-only SQL over the store's tables and audit results."""

from __future__ import annotations

from fastapi import APIRouter

from .. import problems as p
from ..deps import ServicesDep
from ..schemas import SqlRequest, SqlResponse

router = APIRouter(prefix="/sql", tags=["sql"])


@router.post("", response_model=SqlResponse,
             responses=p.responses(p.UnknownIndex, p.SqlSyntax, p.SqlOneStatement, p.SqlForbidden, p.SqlError,
                                   p.SqlTimeout, p.SqlTooManyRows, p.SqlOutOfMemory, p.BodyTooLarge))
async def run_sql(body: SqlRequest, services: ServicesDep) -> SqlResponse:
    """Run one SELECT over `documents`, `sequences`, `activations`, `token_grads`, `prototypes`, `vocab`
    and `audit_results`. No file, network or extension access; time, row and memory limits."""
    ix = services.registry.get(body.index)
    try:
        res = await services.run(ix, ix.store.query, body.sql,
                                 lambda: services.state.audit_results(index_name=ix.name))
    except p.ServiceError as e:
        services.metrics.sql_refused.labels(kind=e.kind).inc()
        raise
    return SqlResponse(index=ix.name, **res)
