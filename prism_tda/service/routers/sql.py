"""POST /v1/sql: read-only SQL over the store's tables and audit results."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Response

from .. import problems as p
from ..deps import PrincipalDep, ServicesDep
from ..schemas import SqlRequest, SqlResponse
from ..sqlengine import SqlRefusal

router = APIRouter(prefix="/sql", tags=["sql"])


@router.post("", response_model=SqlResponse,
             responses=p.responses(p.UnknownIndex, p.SqlSyntax, p.SqlOneStatement, p.SqlForbidden, p.SqlError,
                                   p.SqlTimeout, p.SqlTooManyRows, p.SqlOutOfMemory, p.SqlResultTooLarge,
                                   p.SqlBusy, p.KeyBusy, p.BodyTooLarge))
async def run_sql(body: SqlRequest, services: ServicesDep, principal: PrincipalDep) -> Response:
    """Run one SELECT over `documents`, `sequences`, `tokens`, `activations`, `prototypes`, `vocab`,
    `shards`, `audit_results` (your own audits; every audit for admin keys) and `prototype_sets` (one row per set
    and prototype: your own sets and the shared ones; every set for admin keys). No file, network or extension
    access; time, row, result-size and memory limits, enforced from outside the statement's process."""
    ix = services.registry.get(body.index)
    audit = {"index_name": ix.name, "principal": None if principal.admin else principal.id}
    t0 = time.perf_counter()
    try:
        header, rows = await services.sql(ix, principal, ix.sql.query, body.sql, audit)
    except SqlRefusal as e:
        services.metrics.sql_refused.labels(kind=e.kind).inc()
        raise p.BY_KIND[e.kind](e.detail) from None
    # The rows arrive as JSON bytes (at most sql_max_result_bytes) and are passed through as they are.
    head = json.dumps({"index": ix.name, "columns": header["columns"]})[:-1]
    tail = json.dumps({"row_count": header["row_count"], "elapsed_ms": 1e3 * (time.perf_counter() - t0)})[1:]
    return Response(head.encode() + b',"rows":' + rows + b"," + tail.encode(), media_type="application/json")
