"""Errors as RFC 9457 problem documents: one stable ``type`` per kind, mapped in one place.

Route code raises :class:`ServiceError` subclasses (or lets the domain's ``PrismError`` through);
:func:`install` registers the one mapping to ``application/problem+json``. Internals never leak:
an unexpected error is logged with its traceback and answered with a bare 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from prism_tda import errors
from prism_tda.errors import PrismError, PromptTooLongError, QueryError

from .context import request_id

log = logging.getLogger("prism.service")

TYPE_PREFIX = "urn:prism-tda:problem:"
MEDIA_TYPE = "application/problem+json"


class Problem(BaseModel):
    """An RFC 9457 problem document."""

    type: str = Field(description="Stable identifier of the kind of problem, `urn:prism-tda:problem:<kind>`.")
    title: str = Field(description="Short summary of the kind of problem.")
    status: int = Field(description="The HTTP status code.")
    detail: str = Field(description="What went wrong with this request, naming the field or value.")
    instance: str | None = Field(None, description="The request path.")
    request_id: str | None = Field(None, description="The request's X-Request-ID.")
    errors: list[dict[str, Any]] | None = Field(None, description="Validation errors, one per field (the first 20; the detail counts them all).")


class ServiceError(PrismError):
    """An error a request caused; ``kind`` names its problem type."""

    kind = "bad-request"
    status = 400
    title = "Bad request"

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None,
                 errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers
        self.errors = errors


def _kind(name: str, kind: str, status: int, title: str) -> type[ServiceError]:
    return type(name, (ServiceError,), {"kind": kind, "status": status, "title": title, "__doc__": title + "."})


MalformedRequest = _kind("MalformedRequest", "malformed-request", 400, "The request body is not valid JSON")
InvalidRequest = _kind("InvalidRequest", "validation-error", 422, "A request field is missing or invalid")
Unauthorized = _kind("Unauthorized", "unauthorized", 401, "A valid bearer API key is required")
RateLimited = _kind("RateLimited", "rate-limited", 429, "Too many requests")
KeyBusy = _kind("KeyBusy", "key-busy", 429, "This key already has as much work running or waiting as it may")
BodyTooLarge = _kind("BodyTooLarge", "body-too-large", 413, "The request body is too large")
RequestTimeout = _kind("RequestTimeout", "request-timeout", 408, "The request body did not arrive in time")
RouteNotFound = _kind("RouteNotFound", "not-found", 404, "No such endpoint")
MethodNotAllowed = _kind("MethodNotAllowed", "method-not-allowed", 405, "Method not allowed on this endpoint")
UnknownIndex = _kind("UnknownIndex", "unknown-index", 404, "No such index")
DocumentNotFound = _kind("DocumentNotFound", "document-not-found", 404, "No such document")
DocumentRemoved = _kind("DocumentRemoved", "document-removed", 410, "The document was taken down")
PrototypeNotFound = _kind("PrototypeNotFound", "prototype-not-found", 404, "No such prototype")
PrototypeSetNotFound = _kind("PrototypeSetNotFound", "prototype-set-not-found", 404, "No such prototype set")
AuditNotFound = _kind("AuditNotFound", "audit-not-found", 404, "No such audit")
InvalidQuery = _kind("InvalidQuery", "invalid-query", 422, "The attribution query is invalid")
PromptTooLong = _kind("PromptTooLong", "prompt-too-long", 422, "The prompt is longer than the model's context")
TooManyItems = _kind("TooManyItems", "too-many-items", 422, "Too many items in one request")
InvalidPrototype = _kind("InvalidPrototype", "invalid-prototype", 422, "A prototype id is out of range")
IdempotencyConflict = _kind("IdempotencyConflict", "idempotency-conflict", 409,
                            "The Idempotency-Key was already used with another request")
AuditFinished = _kind("AuditFinished", "audit-finished", 409, "The audit has already finished")
TaskNotFound = _kind("TaskNotFound", "task-not-found", 404, "No such background task")
TaskFinished = _kind("TaskFinished", "task-finished", 409, "The background task has already finished")
SqlSyntax = _kind("SqlSyntax", "sql-syntax", 400, "The SQL does not parse")
SqlOneStatement = _kind("SqlOneStatement", "sql-one-statement", 400, "Exactly one SQL statement is allowed")
SqlForbidden = _kind("SqlForbidden", "sql-forbidden", 403, "The SQL does something that is not allowed")
SqlError = _kind("SqlError", "sql-error", 400, "The SQL query failed")
SqlTimeout = _kind("SqlTimeout", "sql-timeout", 422, "The SQL query ran out of time and was interrupted")
SqlTooManyRows = _kind("SqlTooManyRows", "sql-too-many-rows", 422, "The SQL query returns too many rows")
SqlOutOfMemory = _kind("SqlOutOfMemory", "sql-out-of-memory", 422, "The SQL query ran out of memory")
SqlResultTooLarge = _kind("SqlResultTooLarge", "sql-result-too-large", 422, "The SQL result is too large")
SqlBusy = _kind("SqlBusy", "sql-busy", 503, "Every SQL worker is busy")
Forbidden = _kind("Forbidden", "forbidden", 403, "This key may not do that")
HostNotAllowed = _kind("HostNotAllowed", "host-not-allowed", 403,
                       "Without API keys the server answers only requests to this machine by a loopback name")
CrossOrigin = _kind("CrossOrigin", "cross-origin-request", 403, "A state-changing request from another web origin")
AuditQuota = _kind("AuditQuota", "too-many-audits", 429, "Too many active audits for this key")
TaskQuota = _kind("TaskQuota", "too-many-tasks", 429, "Too many active background tasks for this key")
ClientClosed = _kind("ClientClosed", "client-closed-request", 499, "The client closed the request; its work stopped")
NotReady = _kind("NotReady", "not-ready", 503, "The service is not ready")
IndexMismatch = _kind("IndexMismatch", "index-mismatch", 409, "The index was built from another model than the served one")
InvalidIndex = _kind("InvalidIndex", "invalid-index", 422, "The directory is not a loadable index")
ShardUnavailable = _kind("ShardUnavailable", "shard-unavailable", 503,
                         "Some shards of the index did not answer; try again shortly")

ALL_KINDS: list[type[ServiceError]] = [v for v in list(globals().values())
                                       if isinstance(v, type) and issubclass(v, ServiceError) and v is not ServiceError]


BY_KIND: dict[str, type[ServiceError]] = {k.kind: k for k in ALL_KINDS}


def problem_response(status: int, kind: str, title: str, detail: str, request: Request | None, *,
                     headers: dict[str, str] | None = None, errors: list[dict[str, Any]] | None = None,
                     path: str | None = None) -> JSONResponse:
    body = Problem(type=TYPE_PREFIX + kind, title=title, status=status, detail=detail,
                   instance=request.url.path if request is not None else path, request_id=request_id.get(),
                   errors=errors)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, media_type=MEDIA_TYPE,
                        headers=headers)


def error_response(exc: ServiceError, request: Request | None) -> JSONResponse:
    return problem_response(exc.status, exc.kind, exc.title, exc.detail, request, headers=exc.headers,
                            errors=exc.errors)


def _field(loc: tuple | list) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


MAX_ERRORS = 20  # validation errors listed in one answer; the detail counts the rest


def _jsonable_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"field": _field(e.get("loc", ())), "message": str(e.get("msg", ""))[:300], "type": str(e.get("type", ""))}
            for e in errors[:MAX_ERRORS]]


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    """The one mapping from exceptions to problem documents."""
    if isinstance(exc, ServiceError):
        return error_response(exc, request)
    if isinstance(exc, RequestValidationError):
        errs = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errs):
            msg = next(e for e in errs if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
            return error_response(MalformedRequest(f"the body is not valid JSON: {msg}".rstrip(": ")), request)
        items = _jsonable_errors(list(errs))
        detail = "; ".join(f"{i['field']}: {i['message']}" for i in items[:5])
        if len(errs) > 5:
            detail += f" (and {len(errs) - 5} more errors" + (f"; the first {MAX_ERRORS} are listed)"
                                                               if len(errs) > MAX_ERRORS else ")")
        return error_response(InvalidRequest(detail, errors=items), request)
    if isinstance(exc, QueryError):
        return error_response(from_query_error(exc), request)
    if isinstance(exc, errors.ShardUnavailable):
        return error_response(ShardUnavailable(str(exc), headers={"Retry-After": "5"}), request)
    if isinstance(exc, errors.Cancelled):  # nobody reads it: the client left; logged and counted as 499
        return error_response(ClientClosed(str(exc)), request)
    if isinstance(exc, StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(RouteNotFound(f"no endpoint at {request.url.path}"), request)
        if exc.status_code == 400:  # the framework could not read the body (not UTF-8, nested too deep)
            return error_response(MalformedRequest(f"the body cannot be read as JSON: {exc.detail}"), request)
        if exc.status_code == 405:
            allowed = ", ".join(allowed_methods(request)) or dict(exc.headers or {}).get("Allow", "")
            return error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}; "
                                                   f"allowed: {allowed}", headers={"Allow": allowed}), request)
        return problem_response(exc.status_code, "http-error", "HTTP error", str(exc.detail), request,
                                headers=dict(exc.headers or {}))
    return internal_error(exc, request)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app answers at this path (the framework's 405 names only the first
    route's): the methods for which the router finds a route that matches in full."""
    from starlette.routing import Match

    out = []
    for method in ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        scope: dict[str, Any] = {"type": "http", "path": request.url.path, "method": method, "root_path": "", "headers": [],
                 "query_string": b""}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
            out.append(method)
    return out


def internal_error(exc: BaseException, request: Request | None, path: str | None = None) -> JSONResponse:
    """Log an unexpected error with its traceback and the request id; answer a bare 500."""
    path = request.url.path if request is not None else path
    log.error("unhandled error", exc_info=exc, extra={"request_id": request_id.get(), "path": path})
    return problem_response(500, "internal-error", "Internal server error",
                            "the server failed to answer this request; the log has the details", request,
                            path=path)


def from_query_error(exc: QueryError, *, where: str = "") -> ServiceError:
    """The problem for the engine's refusal of a query (``where`` prefixes the field it names)."""
    kind = PromptTooLong if isinstance(exc, PromptTooLongError) else InvalidQuery
    return kind(where + str(exc))


def install(app: FastAPI) -> None:
    for exc_type in (ServiceError, RequestValidationError, QueryError, errors.ShardUnavailable, errors.Cancelled,
                     StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, _on_error)


def responses(*kinds: type[ServiceError]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entry documenting the problem kinds a route may answer."""
    out: dict[int | str, dict[str, Any]] = {}
    by_status: dict[int, list[type[ServiceError]]] = {}
    for k in (*kinds, InvalidRequest, MalformedRequest, Unauthorized, RateLimited, CrossOrigin, HostNotAllowed):
        by_status.setdefault(k.status, []).append(k)
    for status, ks in sorted(by_status.items()):
        names = ", ".join(f"`{TYPE_PREFIX}{k.kind}`" for k in dict.fromkeys(ks))
        out[status] = {"description": f"Problem document: {names}",
                       "content": {MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}}
    return out
