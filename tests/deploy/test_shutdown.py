"""SIGTERM while requests are in flight: every request that reached the server is answered, the
audit worker stops at an item boundary (no item started and left unfinished), and the server
exits cleanly."""

from __future__ import annotations

import re
import signal
import sqlite3
import threading
import time

import httpx
import pytest

N_REQUESTS = 8
# as slow as the tiny model allows (its context is 32 tokens), so that the queue of requests stays
# in flight long after the last one arrives
SLOW = {"prompt": "A computer", "max_new_tokens": 28, "top_k": 5, "mode": "exact"}


def in_flight(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return float(re.search(r"^prism_http_requests_in_flight (\S+)$", text, re.M).group(1))


@pytest.mark.slow
def test_sigterm_lets_in_flight_requests_finish(index_a, server_factory, tmp_path):
    # One computation at a time, so the requests queue up and are all in flight at the signal.
    server = server_factory([f"tiny={index_a}"], PRISM_COMPUTE_CONCURRENCY="1", PRISM_GRACEFUL_SHUTDOWN_S="60")
    server.wait_ready()
    items = [{"id": f"i{i}", "prompt": "Love is", "max_new_tokens": 8} for i in range(200)]
    r = httpx.post(server.url + "/v1/audits", json={"items": items, "top_k": 3, "mode": "exact"}, timeout=30)
    assert r.status_code == 202, r.text

    results: list[object] = [None] * N_REQUESTS
    # clients made (and connected) beforehand and a barrier: the requests leave together, so with one
    # computation at a time they queue up behind each other however fast each one is
    clients = [httpx.Client(base_url=server.url, timeout=120) for _ in range(N_REQUESTS)]
    for c in clients:
        assert c.get("/healthz").status_code == 200
    barrier = threading.Barrier(N_REQUESTS)

    def call(i: int) -> None:
        try:
            barrier.wait()
            results[i] = clients[i].post("/v1/attribute", json=SLOW).status_code
        except Exception as e:  # noqa: BLE001 - recorded, asserted below
            results[i] = type(e).__name__

    threads = [threading.Thread(target=call, args=(i,)) for i in range(N_REQUESTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while in_flight(server.url) < N_REQUESTS:  # the /metrics request itself is answered on the event loop
        assert time.monotonic() < deadline, "the requests never were all in flight"
        time.sleep(0.002)
    server.signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    for c in clients:
        c.close()
    assert results == [200] * N_REQUESTS, results
    # uvicorn re-raises the signal once shut down, so a clean exit reports SIGTERM (143 in a container)
    assert server.proc.wait(60) in (0, -signal.SIGTERM), server.log()
    log = server.log()
    assert log.index("Shutting down") < log.rindex("POST path=/v1/attribute status=200"), log  # answered after it
    assert "audit worker stopped" in log and "Application shutdown complete" in log, log

    with sqlite3.connect(tmp_path / "state0" / "state.sqlite3") as con:
        started, finished, pending = con.execute(
            "SELECT sum(attempts), sum(completions), sum(status = 'pending') FROM items").fetchone()
    assert started == finished, f"{started - finished} item(s) were started and not finished"
    assert 0 < pending < len(items), "the audit must be cut short by the signal; make it longer"
