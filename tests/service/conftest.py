"""A live server (uvicorn in a thread) over the tiny session index, and an httpx client for it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
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
from prism_tda.service.app import server_options


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
def serving(settings: Settings, app=None) -> Iterator[Live]:
    """The app (default: a new one of ``settings``) under a real uvicorn server in a thread, for the
    duration of the block."""
    config = uvicorn.Config(app if app is not None else create_app(settings), lifespan="on",
                            **server_options(settings))
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
A, B, ADMIN = "key-a", "key-b", "key-admin"  # two tenants and an admin, for the tests where keys matter


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


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


class Server:
    """`prism serve` in a subprocess (the way it is deployed), logging to a file."""

    def __init__(self, indexes: list[str], state_dir: Path, log_path: Path, *options: str, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, "PRISM_RATE_LIMIT_PER_MINUTE": "0", "PRISM_TORCH_THREADS": "1",
                    "PRISM_AUDIT_POLL_S": "0.1", **env}
        args = [a for ix in indexes for a in ("--index", ix)]
        self.proc = subprocess.Popen([sys.executable, "-m", "prism_tda.cli", "--log-format", "text", "serve", *args,
                                      "--port", str(self.port), *options,
                                      "--state-dir", str(state_dir)], env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the server exited:\n" + self.log()
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("the server did not become ready:\n" + self.log())

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture
def server_factory(tmp_path) -> Iterator:
    started: list[Server] = []

    def make(indexes: list[str], *options: str, **env: str) -> Server:
        """A server of ``indexes``; ``options``: more `prism serve` options; ``env``: its PRISM_* settings."""
        s = Server(indexes, tmp_path / f"state{len(started)}", tmp_path / f"server{len(started)}.log", *options, **env)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
