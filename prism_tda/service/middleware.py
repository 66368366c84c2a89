"""ASGI middleware: request ids, access logs and metrics; the request body's size and time limits;
where requests may come from (loopback only without keys, no state change from another web origin);
the security headers of every response."""

from __future__ import annotations

import logging
import re
import time
import uuid

import anyio
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
    """Reads each request's body before the app does, then replays it: a body over ``max_bytes`` is
    refused with 413 (by Content-Length, or counted while reading a chunked one), and a body not
    complete ``timeout_s`` after the request's headers arrived with 408, closing the connection (a
    client sending a body slowly holds nothing longer than that)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = problems.BodyTooLarge(f"the body exceeds the limit of {self.max_bytes} bytes")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await problems.error_response(too_big, None)(scope, receive, send)
            return
        messages: list[Message] = []
        refusal: problems.ServiceError | None = None
        with anyio.move_on_after(self.timeout_s) as waiting:
            seen = 0
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request":
                    break
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # a chunked body (the server holds others to their Content-Length)
                    refusal = too_big
                    break
                if not message.get("more_body", False):
                    break
        if waiting.cancelled_caught:
            refusal = problems.RequestTimeout(f"the body did not arrive within {self.timeout_s:g} s of the "
                                              "request's headers", headers={"Connection": "close"})
        if refusal is not None:
            await problems.error_response(refusal, None)(scope, receive, send)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


# on every response: no MIME sniffing, no Referer to other sites, no framing
_SECURITY_HEADERS = ((b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
                     (b"x-frame-options", b"DENY"))
_CSP = b"content-security-policy"
_NO_FRAMING = b"frame-ancestors 'none'"


def secure_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` with the security headers a response lacks; a Content-Security-Policy of its own gets
    ``frame-ancestors 'none'`` appended unless it already names its frame ancestors."""
    out, names = [], set()
    for name, value in headers:
        name = name.lower()
        if name == _CSP and b"frame-ancestors" not in value.lower():
            value = value.rstrip(b"; ") + b"; " + _NO_FRAMING
        out.append((name, value))
        names.add(name)
    out += [(name, value) for name, value in _SECURITY_HEADERS if name not in names]
    if _CSP not in names:
        out.append((_CSP, _NO_FRAMING))
    return out


class SecurityHeaders:
    """Security headers on every response (API, problems, the page, ``/docs``, static files).

    - ``X-Content-Type-Options: nosniff``: a browser takes a body for its declared type only.
    - ``Referrer-Policy: no-referrer``: the page's fetches are same-origin and need no Referer, and a
      link it follows (a document's ``url``) tells the other site neither this server's address nor
      the page's route and query (``strict-origin-when-cross-origin`` would still send the origin).
    - no framing, against clickjacking: ``X-Frame-Options: DENY`` for older browsers, and CSP
      ``frame-ancestors 'none'``, appended to the response's own policy (the page's) when it lacks it.

    A header a response sets itself is kept.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = secure_headers([(bytes(k), bytes(v)) for k, v in message.get("headers", [])])
            await send(message)

        await self.app(scope, receive, send_secured)


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
