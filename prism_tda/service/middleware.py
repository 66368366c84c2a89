"""ASGI middleware: request ids, access logs and metrics; the request body size limit; where
requests may come from (loopback only without keys, no state change from another web origin)."""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import problems
from .context import request_id
from .metrics import Metrics
from .settings import is_loopback

log = logging.getLogger("prism.service.access")
_ID_OK = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# metric labels come from closed sets: an invented method is counted as "other"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
UNSAFE = frozenset({"POST", "PUT", "DELETE", "PATCH"})


def _status_label(status: int) -> str:
    return str(status) if 100 <= status <= 599 else "other"


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
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.requests.labels(method, op, _status_label(status)).inc()
            self.metrics.latency.labels(method, op).observe(dt)
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


def _host_name(host: str) -> str:
    """``"localhost:8000"`` -> ``"localhost"``, ``"[::1]:8000"`` -> ``"::1"``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class RequestOrigin:
    """Where a request may come from.

    - Without API keys (``keyless``) the server is for this machine only: the connection must arrive
      on a loopback address from a loopback peer (whatever host the settings name: the socket is the
      truth), and its ``Host`` must be a loopback name or one of ``allowed_hosts``. That stops a page
      whose DNS name rebinds to 127.0.0.1 (its requests carry its own name as Host).
    - A state-changing request (POST, PUT, DELETE, PATCH) that a browser sends from another web origin
      (``Origin`` not this server's and not in ``cors_origins``, or ``Sec-Fetch-Site: cross-site``) is
      refused, so a page cannot make a visitor's browser act on a local server (bodyless POSTs such as
      an index reload or an audit cancel need no CORS preflight).
    """

    def __init__(self, app: ASGIApp, *, keyless: bool, allowed_hosts: list[str], cors_origins: list[str]) -> None:
        self.app, self.keyless = app, keyless
        self.allowed_hosts = {_host_name(h) for h in allowed_hosts}
        self.cors_origins = {o.rstrip("/").lower() for o in cors_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        refusal: problems.ServiceError | None = None
        if self.keyless:
            server = (scope.get("server") or ("", 0))[0] or ""
            client = (scope.get("client") or ("", 0))[0] or ""
            name = _host_name(host)
            if not (is_loopback(server) and is_loopback(client)):
                refusal = problems.HostNotAllowed("this server has no API keys, so it answers only connections "
                                                  "from this machine; set PRISM_API_KEYS to serve others")
            elif not (is_loopback(name) or name in self.allowed_hosts):
                refusal = problems.HostNotAllowed(f"Host {host[:100]!r} is not a loopback name; without API keys "
                                                  "only localhost, 127.0.0.1 and [::1] (or PRISM_ALLOWED_HOSTS) "
                                                  "are answered")
        if refusal is None and scope["method"] in UNSAFE:
            origin = headers.get("origin")
            site = headers.get("sec-fetch-site", "")
            scheme = scope.get("scheme", "http")
            same = origin is not None and origin.rstrip("/").lower() == f"{scheme}://{host}".lower()
            allowed = origin is not None and (same or origin.rstrip("/").lower() in self.cors_origins)
            if (origin is not None and not allowed) or (site == "cross-site" and not allowed):
                refusal = problems.CrossOrigin(f"{scope['method']} from origin {(origin or 'unknown')[:100]!r} "
                                               "is refused: not this server's origin nor in PRISM_CORS_ORIGINS")
        if refusal is not None:
            await problems.error_response(refusal, None)(scope, receive, send)
            return
        await self.app(scope, receive, send)
