"""ASGI middleware: request ids, access logs and metrics; the request body size limit."""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import problems
from .context import request_id
from .metrics import Metrics

log = logging.getLogger("prism.service.access")
_ID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestContext:
    """Sets X-Request-ID (the client's, when well-formed, else a new one), logs and counts each request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _ID_OK.match(given) else uuid.uuid4().hex
        token = request_id.set(rid)
        status = 500
        started = False
        t0 = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            try:
                await self.app(scope, receive, send_with_id)
            except Exception as exc:
                # answered here, inside the request's context, so the log line and the problem
                # document carry its request id (the framework's last-resort handler runs outside it)
                if started:
                    raise
                await problems.internal_error(exc, None, scope["path"])(scope, receive, send_with_id)
        finally:
            dt = time.perf_counter() - t0
            self.metrics.in_flight.dec()
            endpoint = scope.get("endpoint")  # bounded label set: the handler's name, not the raw path
            op = getattr(endpoint, "__name__", None) or "unmatched"
            self.metrics.requests.labels(scope["method"], op, str(status)).inc()
            self.metrics.latency.labels(scope["method"], op).observe(dt)
            log.info("request", extra={"request_id": rid, "method": scope["method"], "path": scope["path"],
                                       "status": status, "duration_ms": round(1e3 * dt, 2)})
            request_id.reset(token)


class BodyLimit:
    """Refuses bodies over ``max_bytes`` with 413: by Content-Length, or by reading a chunked body first."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = problems.BodyTooLarge(f"the body exceeds the limit of {self.max_bytes} bytes")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit():
            if int(length) > self.max_bytes:
                await problems.error_response(too_big, None)(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server holds the body to its Content-Length
            return
        # no (valid) Content-Length: read the body here, up to the limit, then replay it
        messages: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                await problems.error_response(too_big, None)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
