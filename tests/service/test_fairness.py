"""Fair compute between tenants: each test performs the attack with two keys (A, B) against a real
server and asserts A's bound (time, status), as docs/service.md ("Fair compute between keys") reports."""

from __future__ import annotations

import json
import logging
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import pytest
from fastapi.security import HTTPAuthorizationCredentials

from prism_tda.service import create_app
from prism_tda.service.fairness import Busy, FairLimiter

from .conftest import ADMIN, A, B, assert_problem, auth, service_settings, serving

pytestmark = pytest.mark.slow  # live servers under attack for seconds each: the slow tier

TASKS = "/v1/prototypes/discover/tasks"
# a discovery that runs for a while on the test index (selection by effect over every document)
LONG_TASK = {"topic": {"sql": "SELECT doc_id FROM documents"}, "top_n": 60, "min_support": 1, "min_docs": 1,
             "select": "effect", "max_selected": 12, "max_ppl_ratio": 10}
QUERY = {"prompt": "A computer", "completion": " is a", "n_documents": 5}
ITEM = {"prompt": "A computer", "completion": " is a"}
EXACT = {"prompt": "A computer", "completion": " is a", "mode": "exact", "n_documents": 5}


@pytest.fixture(scope="module")
def fair(index, tmp_path_factory):
    settings = service_settings(index, tmp_path_factory.mktemp("state-fair"), api_keys=[A, B], admin_api_keys=[ADMIN],
                                max_active_tasks_per_key=4, work_slice_s=0.5, max_waiting_per_key=4,
                                sql_workers=2, sql_timeout_s=3.0)
    app = create_app(settings)
    with serving(settings, app) as live:
        yield live, app


def _audit(c: httpx.Client, key: str, body: dict) -> str:
    r = c.post("/v1/audits", json=body, headers=auth(key))
    assert r.status_code == 202, r.text
    return r.json()["id"]


def _wait_audit(c: httpx.Client, key: str, job: str, timeout: float = 120) -> tuple[dict, float]:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        got = c.get(f"/v1/audits/{job}", headers=auth(key)).json()
        if got["status"] not in ("queued", "running"):
            return got, time.perf_counter() - t0
        time.sleep(0.05)
    raise AssertionError(f"audit {job} did not finish in {timeout} s")


def _timed_audit(c: httpx.Client, key: str) -> float:
    t0 = time.perf_counter()
    job = _audit(c, key, {"items": [ITEM]})
    got, _ = _wait_audit(c, key, job)
    assert (got["status"], got["n_done"]) == ("completed", 1), got
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- 1. background work in turns
def test_a_key_s_tasks_and_exact_item_do_not_hold_back_another_key_s_audit(fair):
    live, app = fair
    with httpx.Client(base_url=live.url, timeout=60) as c:
        idle = _timed_audit(c, A)
        tasks = [c.post(TASKS, json=LONG_TASK, headers=auth(B)) for _ in range(4)]
        assert all(r.status_code == 202 for r in tasks), [r.text for r in tasks]
        b_exact = _audit(c, B, {"items": [{"prompt": "Love is", "max_new_tokens": 16}], "mode": "exact"})
        deadline = time.monotonic() + 60
        while c.get(f"{TASKS}/{tasks[0].json()['id']}", headers=auth(B)).json()["status"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        waits = [_timed_audit(c, A) for _ in range(3)]
        logging.getLogger(__name__).info("A's 1-item audit: idle %.2f s, beside B's 4 tasks and exact item %s",
                                         idle, [round(w, 2) for w in waits])
        assert max(waits) < 5.0, (idle, waits)
        # B's work went on meanwhile and still completes
        assert c.get(f"{TASKS}/{tasks[0].json()['id']}", headers=auth(B)).json()["status"] in ("running", "completed")
        for r in tasks:
            assert c.delete(f"{TASKS}/{r.json()['id']}", headers=auth(B)).status_code in (200, 409)
        c.post(f"/v1/audits/{b_exact}/cancel", headers=auth(B))
    print(f"\nA's 1-item audit: idle {idle:.2f} s; beside B's 4 tasks + exact item: {[round(w, 2) for w in waits]}")


def test_cancelling_a_running_item_stops_it_at_its_next_check(index, tmp_path, caplog):
    """B's audit item (an exact pass over every token, which checks its stop at each batch) is cancelled while
    it runs: the work stops within a fraction of the pass, and an item over its step budget is failed."""
    settings = service_settings(index, tmp_path / "s1", api_keys=[A, B], work_slice_s=0.5)
    with serving(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c, \
            caplog.at_level(logging.INFO, logger="prism.service.audits"):
        t0 = time.perf_counter()
        assert c.post("/v1/attribute", json=EXACT, headers=auth(B)).status_code == 200
        pass_s = time.perf_counter() - t0
        items = [{"prompt": "Love is", "max_new_tokens": 8} for _ in range(3)]
        job = _audit(c, B, {"items": items, "mode": "exact"})
        while c.get(f"/v1/audits/{job}", headers=auth(B)).json()["status"] != "running":
            time.sleep(0.01)
        time.sleep(min(0.2, pass_s / 4))
        caplog.clear()
        t_cancel = time.perf_counter()
        assert c.post(f"/v1/audits/{job}/cancel", headers=auth(B)).status_code == 200
        deadline = time.monotonic() + 30
        while not any("stopped: its audit was cancelled" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.01)
        stopped_s = time.perf_counter() - t_cancel
        done = c.get(f"/v1/audits/{job}", headers=auth(B)).json()
        assert done["status"] == "cancelled" and done["n_done"] + done["n_failed"] < len(items), done
    print(f"\nexact pass {pass_s:.2f} s; the running item stopped {stopped_s:.2f} s after the cancel")
    assert stopped_s < 1.0 + pass_s / 2, (stopped_s, pass_s)


def test_exact_audits_over_the_step_budget_are_refused_at_submission(index, tmp_path):
    settings = service_settings(index, tmp_path, api_keys=[A, B], audit_item_max_s=1e-3)
    with serving(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        body = assert_problem(c.post("/v1/audits", json={"items": [ITEM], "mode": "exact"}, headers=auth(B)), 422,
                              "invalid-query", mentions="audit_item_max_s")
        assert "tokens/s" in body["detail"]
        job = _audit(c, B, {"items": [ITEM]})  # fast mode is not affected
        assert _wait_audit(c, B, job)[0]["n_done"] == 1


# ---------------------------------------------------------------------------- 2. live requests
def _p50(c: httpx.Client, key: str, n: int = 7) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = c.post("/v1/attribute", json=QUERY, headers=auth(key))
        assert r.status_code == 200, r.text
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _in_flight(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return float(re.search(r"^prism_http_requests_in_flight (\S+)$", text, re.M).group(1))


def test_heavy_requests_of_one_key_leave_another_its_share_and_stop_when_their_client_leaves(index, server_factory):
    """`prism serve` in its own process, as deployed (B's clients in this process must not share its
    interpreter lock), with the default request rate limit. B's 6 clients send exact passes back to back and
    leave each after 0.3 s: first retrying after a 429 when its Retry-After says (A's p50 within 3x its idle
    value), then ignoring every 429 in a tight loop (A still served within a second). Every computation
    whose client left stops."""
    server = server_factory([f"tiny={index}"], PRISM_API_KEYS=json.dumps([A, B]), PRISM_RATE_LIMIT_PER_MINUTE="600")
    server.wait_ready()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        _p50(c, A, 3)  # warm
        idle = _p50(c, A, 9)
        busy = {}
        for polite in (True, False):
            stop = threading.Event()
            codes: list[int | str] = []

            def heavy(stop: threading.Event, codes: list[int | str], polite: bool) -> None:
                with httpx.Client(base_url=server.url, timeout=0.3) as b:
                    while not stop.is_set():
                        try:
                            r = b.post("/v1/attribute", json=EXACT, headers=auth(B))
                            codes.append(r.status_code)
                            if polite and r.status_code == 429:
                                stop.wait(float(r.headers["retry-after"]))
                        except httpx.TimeoutException:
                            codes.append("gone")

            threads = [threading.Thread(target=heavy, args=(stop, codes, polite)) for _ in range(6)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            time.sleep(0.5)
            busy[polite] = _p50(c, A, 9)
            stop.set()
            for t in threads:
                t.join(30)
            rate = len(codes) / (time.perf_counter() - t0)
            print(f"\nA's /v1/attribute p50: idle {1e3 * idle:.0f} ms, beside B's 6 heavy clients "
                  f"({'retrying when told' if polite else 'ignoring 429s'}, {rate:.0f} requests/s) "
                  f"{1e3 * busy[polite]:.0f} ms; B's answers {sorted(set(map(str, codes)))}")
            assert 429 in codes and "gone" in codes, codes
        deadline = time.monotonic() + 5
        while _in_flight(server.url) > 1 and time.monotonic() < deadline:  # 1: this /metrics request
            time.sleep(0.05)
        left = _in_flight(server.url)
    assert left == 1, f"{left - 1} requests still running after B's clients left"
    assert busy[True] <= 3 * idle + 0.05, (idle, busy)
    assert busy[False] <= 1.0, (idle, busy)


def test_a_flood_of_one_key_is_refused_over_its_share_and_another_key_is_served(fair):
    live, _ = fair
    with httpx.Client(base_url=live.url, timeout=60) as c:
        idle = _p50(c, A, 3)

        def one(_: int) -> int:
            return httpx.post(live.url + "/v1/attribute", json=QUERY, headers=auth(B), timeout=60).status_code

        with ThreadPoolExecutor(100) as pool:
            flood = pool.map(one, range(100))
            time.sleep(0.2)
            t0 = time.perf_counter()
            assert c.post("/v1/attribute", json=QUERY, headers=auth(A)).status_code == 200
            a_s = time.perf_counter() - t0
            codes = list(flood)
        r = c.post("/v1/attribute", json=QUERY, headers=auth(B))
        assert r.status_code == 200, r.text
    print(f"\nA's call beside B's 100: {a_s:.2f} s (idle {idle:.2f} s); B: {codes.count(200)} x 200, "
          f"{codes.count(429)} x 429")
    assert set(codes) <= {200, 429} and codes.count(429) > 0, codes
    assert a_s < max(2.0, 10 * idle), (a_s, idle)


def test_a_refused_request_says_when_to_retry(fair):
    live, app = fair
    services = app.state.services
    b = services.guard(HTTPAuthorizationCredentials(scheme="Bearer", credentials=B), "127.0.0.1")
    services.heavy[b.id] += 1  # B's one heavy request is running
    try:
        with httpx.Client(base_url=live.url, timeout=60) as c:
            r = c.post("/v1/generate", json={"prompt": "The", "max_new_tokens": 2}, headers=auth(B))
            assert_problem(r, 429, "key-busy", mentions="heavy requests")
            assert int(r.headers["retry-after"]) >= 1
            assert c.post("/v1/generate", json={"prompt": "The", "max_new_tokens": 2},
                          headers=auth(A)).status_code == 200
            assert c.post("/v1/generate", json={"prompt": "The", "max_new_tokens": 2},
                          headers=auth(ADMIN)).status_code == 200
    finally:
        services.heavy[b.id] -= 1
        if services.heavy[b.id] <= 0:
            del services.heavy[b.id]


# ---------------------------------------------------------------------------- 3. SQL
def test_a_sql_flood_of_one_key_leaves_another_key_a_worker(fair):
    live, _ = fair
    slow = "SELECT count(*) FROM range(20000000000) t(i) WHERE i % 7 = 3"

    def one(_: int) -> int:
        return httpx.post(live.url + "/v1/sql", json={"sql": slow}, headers=auth(B), timeout=120).status_code

    with httpx.Client(base_url=live.url, timeout=60) as c:
        t0 = time.perf_counter()
        assert c.post("/v1/sql", json={"sql": "SELECT count(*) FROM prototypes"}, headers=auth(A)).status_code == 200
        idle = time.perf_counter() - t0
        with ThreadPoolExecutor(14) as pool:
            flood = pool.map(one, range(14))
            time.sleep(0.5)
            t0 = time.perf_counter()
            r = c.post("/v1/sql", json={"sql": "SELECT count(*) FROM prototypes"}, headers=auth(A))
            a_s = time.perf_counter() - t0
            codes = list(flood)
    print(f"\nA's small SQL: idle {1e3 * idle:.0f} ms, beside B's 14 slow statements {1e3 * a_s:.0f} ms; B: "
          f"{sorted(set(codes))}")
    assert r.status_code == 200, r.text
    assert a_s < 2.0, a_s
    assert 429 in codes, codes


# ---------------------------------------------------------------------------- the limiter itself
def test_the_fair_limiter_serves_keys_in_turns_and_bounds_each_key():
    order: list[str] = []

    async def main() -> None:
        lim = FairLimiter(1, per_key=1, max_waiting=3)
        await lim.acquire("b")  # b holds the only slot

        async def take(key: str) -> None:
            await lim.acquire(key)
            order.append(key)
            await anyio.sleep(0.01)
            lim.release(key)

        async with anyio.create_task_group() as tg:
            for key in ("b", "b", "b", "a", "c"):
                tg.start_soon(take, key)
                await anyio.sleep(0.001)
            with pytest.raises(Busy):
                await lim.acquire("b")  # 1 held + 3 waiting: at its bound
            lim.release("b")
        assert lim.borrowed_tokens == 0 and lim.waiting() == 0

    anyio.run(main)
    assert order == ["b", "a", "c", "b", "b"], order  # a and c do not wait behind b's queue
