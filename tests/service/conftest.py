"""A live server (uvicorn in a thread) over the tiny session index, and an httpx client for it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from prism_tda.service import Settings, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Live:
    url: str
    settings: Settings
    server: uvicorn.Server


@contextmanager
def serving(settings: Settings) -> Iterator[Live]:
    """The app under a real uvicorn server in a thread, for the duration of the block."""
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=settings.port, log_config=None,
                            access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield Live(f"http://127.0.0.1:{settings.port}", settings, server)
    finally:
        server.should_exit = True
        thread.join(30)


def service_settings(index: Path, state_dir: Path, **kw) -> Settings:
    base = dict(indexes={"tiny": index, "other": index}, state_dir=state_dir, port=free_port(),
                rate_limit_per_minute=0, sql_timeout_s=2.0, sql_max_rows=1000, max_batch_items=50,
                max_new_tokens=16, max_body_bytes=200_000, audit_poll_s=0.1)
    base.update(kw)
    return Settings(**base)


@pytest.fixture(scope="session")
def live(index, tmp_path_factory) -> Iterator[Live]:
    with serving(service_settings(index, tmp_path_factory.mktemp("state"))) as live:
        yield live


@pytest.fixture
def client(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


PROBLEM = "urn:prism-tda:problem:"


def assert_problem(r: httpx.Response, status: int, kind: str, *, mentions: str | None = None) -> dict:
    """The response is an RFC 9457 problem document of this status and kind."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers["content-type"]
    body = r.json()
    assert body["type"] == PROBLEM + kind and body["status"] == status, body
    assert body["title"] and body["detail"] and body["request_id"] == r.headers["x-request-id"]
    if mentions is not None:
        assert mentions in body["detail"], body["detail"]
    return body
