"""Connections that hold the server without finishing a request are closed in time: one that sends
nothing, one that sends its headers slowly, one that sends its body slowly, one kept alive and idle;
while dozens of them are held, a normal client is answered at once."""

from __future__ import annotations

import logging
import selectors
import socket
import time

import httpx
import pytest

from .conftest import PROBLEM, service_settings, serving

HEADER_S, BODY_S, IDLE_S = 2.0, 1.5, 1.0
MARGIN_S = 1.0  # the server's timer fires on time; this covers a busy machine's scheduling
MAX_CONNECTIONS = 48


@pytest.fixture(scope="module")
def bounded(index, tmp_path_factory):
    settings = service_settings(index, tmp_path_factory.mktemp("state-connections"), header_timeout_s=HEADER_S,
                                body_timeout_s=BODY_S, idle_timeout_s=IDLE_S, max_connections=MAX_CONNECTIONS)
    with serving(settings) as bounded:
        yield bounded


def connect(bounded) -> socket.socket:
    return socket.create_connection(("127.0.0.1", bounded.settings.port), timeout=10)


def request_head(method: str, path: str, **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_until_closed(sock: socket.socket, t0: float, limit_s: float, trickle: bytes = b"",
                      every_s: float = 0.2) -> tuple[float, bytes]:
    """Read until the server closes ``sock``, sending one byte of ``trickle`` every ``every_s`` meanwhile;
    (seconds from ``t0`` to the close, what the server sent). Fails past ``limit_s``."""
    received = bytearray()
    sock.setblocking(False)
    while time.monotonic() - t0 < limit_s:
        if trickle:
            try:
                sock.send(trickle[:1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0, bytes(received)
            trickle = trickle[1:]
        with selectors.DefaultSelector() as sel:
            sel.register(sock, selectors.EVENT_READ)
            if sel.select(every_s):
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    return time.monotonic() - t0, bytes(received)
                received += chunk
    raise AssertionError(f"the server kept the connection open for {limit_s} s (received {bytes(received)[:200]!r})")


def open_connections(bounded) -> int:
    return len(bounded.server.server_state.connections)


def wait_for_no_connections(bounded, limit_s: float = HEADER_S + BODY_S + 5) -> None:
    deadline = time.monotonic() + limit_s
    while open_connections(bounded) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_connections(bounded) == 0


def test_silent_connection_is_closed_at_the_header_timeout(bounded):
    with connect(bounded) as s:
        t0 = time.monotonic()
        elapsed, data = read_until_closed(s, t0, HEADER_S + 10)
    print(f"silent connection closed after {elapsed:.2f} s (header timeout {HEADER_S} s)")
    assert data == b"" and HEADER_S - 0.1 <= elapsed <= HEADER_S + MARGIN_S


def test_slow_headers_are_closed_at_the_header_timeout(bounded, caplog):
    line = b"GET /v1/documents?ids=slow-client-marker HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    with caplog.at_level(logging.INFO, logger="prism.service.connections"), connect(bounded) as s:
        t0 = time.monotonic()
        s.sendall(line[: len(line) // 2])
        # the rest of the line, then a header's value, a byte every 0.2 s: none finishes the headers
        elapsed, data = read_until_closed(s, t0, HEADER_S + 10, trickle=line[len(line) // 2:] + b"x" * 60)
    print(f"slow-header connection closed after {elapsed:.2f} s (header timeout {HEADER_S} s)")
    assert data == b"" and HEADER_S - 0.1 <= elapsed <= HEADER_S + MARGIN_S
    cut = [r for r in caplog.records if r.name == "prism.service.connections"]
    assert cut and cut[-1].getMessage().startswith("connection closed")
    assert all("slow-client-marker" not in r.getMessage() + str(vars(r)) for r in cut)  # no client data logged


def test_slow_body_is_answered_408_and_closed(bounded):
    body = b'{"sql": "SELECT 1"}'.ljust(1000)
    with connect(bounded) as s:
        s.sendall(request_head("POST", "/v1/sql", Content_Type="application/json", Content_Length="1000"))
        t0 = time.monotonic()
        elapsed, data = read_until_closed(s, t0, BODY_S + 10, trickle=body[:40])
    print(f"slow-body request answered and closed after {elapsed:.2f} s (body timeout {BODY_S} s)")
    assert BODY_S - 0.1 <= elapsed <= BODY_S + MARGIN_S
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data[:300]
    assert b"connection: close" in head.lower() and (PROBLEM + "request-timeout").encode() in payload


def test_kept_alive_idle_connection_is_closed_at_the_idle_timeout(bounded):
    with connect(bounded) as s:
        s.sendall(request_head("GET", "/healthz"))
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
            data += s.recv(65536)
        t0 = time.monotonic()  # the response is complete: the connection is idle from here
        assert data.startswith(b"HTTP/1.1 200 ")
        elapsed, rest = read_until_closed(s, t0, IDLE_S + 10)
    print(f"idle kept-alive connection closed after {elapsed:.2f} s (idle timeout {IDLE_S} s)")
    assert rest == b"" and IDLE_S - 0.1 <= elapsed <= IDLE_S + MARGIN_S < HEADER_S + MARGIN_S


def test_next_request_headers_are_timed_from_the_previous_response(bounded):
    with connect(bounded) as s:
        time.sleep(HEADER_S / 2)  # the first request's time runs from the connection's opening ...
        s.sendall(request_head("GET", "/healthz"))
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
            data += s.recv(65536)
        t0 = time.monotonic()  # ... the next one's from the end of this response
        s.sendall(b"G")  # one byte: no longer idle, but no headers either
        elapsed, rest = read_until_closed(s, t0, HEADER_S + 10)
    print(f"second request's headers cut {elapsed:.2f} s after the first response (header timeout {HEADER_S} s)")
    assert rest == b"" and HEADER_S - 0.1 <= elapsed <= HEADER_S + MARGIN_S


def test_normal_client_is_served_while_slow_ones_hold_connections(bounded):
    wait_for_no_connections(bounded)
    held: list[socket.socket] = []
    t0 = time.monotonic()
    try:
        for _ in range(12):
            held.append(connect(bounded))  # sends nothing
            s = connect(bounded)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHo")  # half a header line
            held.append(s)
            s = connect(bounded)
            s.sendall(request_head("POST", "/v1/sql", Content_Type="application/json", Content_Length="1000")
                      + b'{"sql": ')  # a few bytes of its body
            held.append(s)
        deadline = time.monotonic() + 5
        while open_connections(bounded) < len(held) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert open_connections(bounded) == len(held) == 36
        with httpx.Client(base_url=bounded.url, timeout=10) as c:
            t1 = time.monotonic()
            r = c.get("/healthz")
            health_s = time.monotonic() - t1
            t1 = time.monotonic()
            q = c.post("/v1/sql", json={"sql": "SELECT 42"})  # a normal body is untouched
            sql_s = time.monotonic() - t1
        print(f"with {len(held)} slow connections held: /healthz in {1e3 * health_s:.1f} ms, "
              f"POST /v1/sql in {1e3 * sql_s:.1f} ms")
        assert r.status_code == 200 and r.json() == {"status": "ok"} and health_s < 2
        assert q.status_code == 200 and q.json()["rows"] == [[42]] and sql_s < 2
        # then every held connection is closed by the server, within its timeout
        closes = [read_until_closed(s, t0, HEADER_S + 10) for s in held]
    finally:
        for s in held:
            s.close()
    slowest = max(t for t, _ in closes)
    print(f"all {len(held)} slow connections closed by {slowest:.2f} s")
    assert slowest <= max(HEADER_S, BODY_S) + MARGIN_S + 1  # + the time it took to open them all
    assert [data[:12] for _, data in closes[2::3]] == [b"HTTP/1.1 408"] * 12
    assert all(data == b"" for i, (_, data) in enumerate(closes) if i % 3 != 2)


def test_requests_past_max_connections_are_answered_503(bounded):
    wait_for_no_connections(bounded)
    held = [connect(bounded) for _ in range(MAX_CONNECTIONS - 1)]
    try:
        deadline = time.monotonic() + 5
        while open_connections(bounded) < len(held) and time.monotonic() < deadline:
            time.sleep(0.01)
        with httpx.Client(base_url=bounded.url, timeout=10) as c:
            assert c.get("/healthz").status_code == 503  # its own connection is the limit's last
            held.pop().close()
            time.sleep(0.2)
            assert c.get("/healthz").status_code == 200
    finally:
        for s in held:
            s.close()
