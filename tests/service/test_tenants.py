"""Tenants that cannot hurt each other: each test performs the attack against a running app (two or
more keys where tenants matter) and asserts the bound: status, bytes, time, memory."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi import Request

from prism_tda.procmem import status_bytes
from prism_tda.service.security import LOCAL, TokenBuckets

from .conftest import ADMIN, A, B, assert_problem, auth, free_port, service_settings, serving


@pytest.fixture(scope="module")
def tenants(index, tmp_path_factory):
    settings = service_settings(index, tmp_path_factory.mktemp("state-tenants"), api_keys=[A, B],
                                admin_api_keys=[ADMIN], auth_failures_per_minute=10,
                                prototype_sets={"seeded": [1, 2]}, max_active_audits_per_key=2,
                                max_active_tasks_per_key=1)
    with serving(settings) as live:
        yield live


def _client(address: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60)


# ---------------------------------------------------------------------------- 1. prototype sets
def _sql_sets(url: str, key: str) -> set[tuple[str, bool]]:
    r = httpx.post(url + "/v1/sql", json={"sql": "SELECT DISTINCT name, shared FROM prototype_sets"}, headers=auth(key))
    assert r.status_code == 200, r.text
    return {(n, s) for n, s in r.json()["rows"]}


def test_prototype_sets_belong_to_their_key(tenants):
    url = tenants.url
    put = httpx.put(url + "/v1/prototype-sets/mine", json={"prototypes": [3, 4], "description": "A's"}, headers=auth(A))
    assert put.status_code == 200 and put.json()["shared"] is False
    # B neither sees nor changes A's set: the same name is B's own set
    assert_problem(httpx.get(url + "/v1/prototype-sets/mine", headers=auth(B)), 404, "prototype-set-not-found")
    assert "mine" not in {s["name"] for s in httpx.get(url + "/v1/prototype-sets", headers=auth(B)).json()["sets"]}
    assert ("mine", False) not in _sql_sets(url, B)
    assert_problem(httpx.delete(url + "/v1/prototype-sets/mine", headers=auth(B)), 404, "prototype-set-not-found")
    assert httpx.put(url + "/v1/prototype-sets/mine", json={"prototypes": [9]}, headers=auth(B)).status_code == 200
    assert httpx.delete(url + "/v1/prototype-sets/mine", headers=auth(B)).status_code == 204
    assert httpx.get(url + "/v1/prototype-sets/mine", headers=auth(A)).json()["prototypes"] == [3, 4]
    # A's generation suppresses A's set, whatever B does with the name
    httpx.put(url + "/v1/prototype-sets/mine", json={"prototypes": [7]}, headers=auth(B))
    gen = httpx.post(url + "/v1/generate", json={"prompt": "The", "max_new_tokens": 2, "suppress": "mine"},
                     headers=auth(A))
    assert gen.json()["suppressed"] == [3, 4]
    # the operator's seeded set and an admin's set are shared: every key reads them, only admins write them
    for key in (A, B):
        seen = {s["name"]: s["shared"] for s in httpx.get(url + "/v1/prototype-sets", headers=auth(key)).json()["sets"]}
        assert seen["seeded"] is True
    assert httpx.put(url + "/v1/prototype-sets/house", json={"prototypes": [5]}, headers=auth(ADMIN)).json()["shared"]
    assert_problem(httpx.delete(url + "/v1/prototype-sets/house", headers=auth(B)), 403, "forbidden", mentions="shared")
    assert httpx.get(url + "/v1/prototype-sets/house", headers=auth(A)).json()["prototypes"] == [5]
    assert ("house", True) in _sql_sets(url, A) and ("house", True) in _sql_sets(url, B)
    # the admin sees every key's sets, in the API and in SQL
    admin_names = [s["name"] for s in httpx.get(url + "/v1/prototype-sets", headers=auth(ADMIN)).json()["sets"]]
    assert admin_names.count("mine") == 2 and {"seeded", "house"} <= set(admin_names)
    assert ("mine", False) in _sql_sets(url, ADMIN)
    # audit flags resolve the name as the auditing key sees it
    r = httpx.post(url + "/v1/audits", json={"items": [{"prompt": "A computer", "completion": " is"}], "flag": "mine"},
                   headers=auth(A))
    assert r.status_code == 202 and r.json()["params"]["flag_prototypes"] == [3, 4]


# ---------------------------------------------------------------------------- 2. auth limiter
def test_a_flood_of_wrong_keys_never_locks_out_a_valid_key(tenants):
    url = tenants.url + "/v1/prototypes?limit=1"
    with _client("127.0.0.7") as shared_address:
        statuses = [shared_address.get(url, headers=auth("wrong")).status_code for _ in range(40)]
        assert statuses[:10] == [401] * 10 and set(statuses[10:]) == {429}, statuses
        # the same address, a valid key: answered
        assert [shared_address.get(url, headers=auth(k)).status_code for k in (A, B, ADMIN)] == [200, 200, 200]
        # no key at all is 401 (never 429: there is nothing to guess with)
        assert_problem(shared_address.get(url), 401, "unauthorized")
        assert shared_address.get(url, headers=auth("wrong-again")).status_code == 429


def test_the_client_address_comes_only_from_trusted_proxies(index, tmp_path):
    settings = service_settings(index, tmp_path / "state", api_keys=[A], auth_failures_per_minute=3,
                                forwarded_allow_ips=["127.0.0.9"])
    url_path = "/v1/prototypes?limit=1"
    with serving(settings) as live:
        url = live.url + url_path
        with _client("127.0.0.9") as gateway, _client("127.0.0.10") as direct:
            # behind the trusted gateway each real client has its own failure budget
            for _ in range(6):
                gateway.get(url, headers={**auth("wrong"), "X-Forwarded-For": "198.51.100.1"})
            assert gateway.get(url, headers={**auth("wrong"), "X-Forwarded-For": "198.51.100.1"}).status_code == 429
            assert gateway.get(url, headers={**auth("wrong"), "X-Forwarded-For": "198.51.100.2"}).status_code == 401
            # a peer that is not a trusted proxy cannot pick its address by header
            for n in range(6):
                direct.get(url, headers={**auth("wrong"), "X-Forwarded-For": f"203.0.113.{n}"})
            assert direct.get(url, headers={**auth("wrong"), "X-Forwarded-For": "203.0.113.99"}).status_code == 429


def test_rate_limit_tables_stay_bounded():
    buckets = TokenBuckets(60, 1, prune_above=100, max_keys=500)
    for i in range(20_000):  # 20k clients, each spending its one token
        buckets.take(f"addr:{i}")
    assert len(buckets) <= 500
    refill = TokenBuckets(6000, 1, prune_above=10, max_keys=10_000)  # refills in 10 ms
    for i in range(1000):
        refill.take(f"addr:{i}")
    time.sleep(1.1)
    refill.take("addr:last")
    assert len(refill) <= 2  # every refilled bucket was dropped


# ---------------------------------------------------------------------------- 3. metrics
def test_metrics_stay_bounded_under_invented_methods(tenants):
    url = tenants.url
    before = len(httpx.get(url + "/metrics").content)
    with httpx.Client(timeout=30) as c:
        for i in range(300):
            c.request(f"X{i:04d}METHOD", url + "/v1/sql")
            c.request("GET", url + f"/no/such/path/{i}")
    text = httpx.get(url + "/metrics").text
    assert len(text.encode()) - before < 8_000, len(text.encode()) - before
    assert 'method="other"' in text and "X0001METHOD" not in text and "/no/such/path" not in text


# ---------------------------------------------------------------------------- 4. error amplification
def test_validation_errors_do_not_amplify(index, tmp_path):
    settings = service_settings(index, tmp_path / "state", max_body_bytes=2_000_000)
    with serving(settings) as live:
        body = json.dumps({"ids": [-1] * 150_000}).encode()
        t0 = time.perf_counter()
        r = httpx.post(live.url + "/v1/documents/batch", content=body, headers={"content-type": "application/json"},
                       timeout=60)
        assert_problem(r, 422, "validation-error")
        assert len(r.content) < 2_000 and time.perf_counter() - t0 < 5, (len(body), len(r.content))
        # a list within the cap whose every item is wrong: 20 errors listed, the rest counted
        r = httpx.post(live.url + "/v1/documents/batch", json={"ids": [-1] * 9_000}, timeout=60)
        problem = assert_problem(r, 422, "validation-error", mentions="and 8995 more errors")
        assert len(problem["errors"]) == 20 and len(r.content) < 10_000


# ---------------------------------------------------------------------------- 5. long work
@pytest.mark.slow
def test_discovery_scan_is_capped_and_the_logit_corpus_pass_cached(index, tmp_path):
    settings = service_settings(index, tmp_path / "state", discover_max_tokens=1_000)
    with serving(settings) as live:
        body = {"topic": {"doc_ids": list(range(20))}, "measure": "logit", "min_support": 1, "min_docs": 1}
        t0 = time.perf_counter()
        problem = assert_problem(httpx.post(live.url + "/v1/prototypes/discover", json=body, timeout=60), 422,
                                 "invalid-query", mentions="over the limit of 1,000")
        assert "the corpus" in problem["detail"] and time.perf_counter() - t0 < 2
    settings = service_settings(index, tmp_path / "state2")
    with serving(settings) as live:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            r = httpx.post(live.url + "/v1/prototypes/discover", json=body, timeout=120)
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        assert times[1] < times[0], times  # the corpus pass is read once


def test_work_stops_when_its_client_leaves(index, tmp_path):
    """The service's cancellation, end to end: a computation that would run 30 s stops within a second
    of its client's disconnect (the engine's own checks are tested in tests/engine)."""
    from prism_tda.service import create_app

    settings = service_settings(index, tmp_path / "state")
    app = create_app(settings)
    seen: dict[str, float] = {}

    def slow(stop: threading.Event) -> str:
        seen["started"] = time.monotonic()
        stop.wait(30)
        seen["stopped"] = time.monotonic()
        return "done"

    async def long_work(request: Request) -> dict:
        services = request.app.state.services
        return {"result": await services.run_cancellable(request, services.registry.get(None), LOCAL, slow)}

    app.add_api_route("/test/long", long_work, methods=["POST"])
    with serving(settings, app) as live:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/test/long", timeout=0.5)
        deadline = time.monotonic() + 5
        while "stopped" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "stopped" in seen and seen["stopped"] - seen["started"] < 2.0, seen


# ---------------------------------------------------------------------------- 6. the rest
def test_sql_result_cap_counts_column_names_and_types(index, tmp_path):
    settings = service_settings(index, tmp_path / "state", sql_max_result_bytes=32_768)
    with serving(settings) as live:
        cols = ", ".join(f"1 AS column_with_a_long_name_{i:05d}" for i in range(1500))
        r = httpx.post(live.url + "/v1/sql", json={"sql": f"SELECT {cols} WHERE false"}, timeout=60)
        assert_problem(r, 422, "sql-result-too-large", mentions="columns")
        assert len(r.content) < 2_000
        struct = "{" + ", ".join(f"'field_with_a_long_name_{i:05d}': 1" for i in range(1500)) + "}"
        r = httpx.post(live.url + "/v1/sql", json={"sql": f"SELECT {struct} AS s WHERE false"}, timeout=60)
        assert_problem(r, 422, "sql-result-too-large")


@pytest.mark.slow
def test_slow_sql_does_not_stall_readiness_audits_or_sets(index, tmp_path):
    settings = service_settings(index, tmp_path / "state", sql_timeout_s=3.0, sql_workers=2,
                                sql_queue_timeout_s=20)
    slow = {"sql": "SELECT sum(hash(i)) FROM range(100000000000) t(i)"}
    with serving(settings) as live, ThreadPoolExecutor(16) as pool:
        burst = [pool.submit(httpx.post, live.url + "/v1/sql", json=slow, timeout=60) for _ in range(12)]
        time.sleep(0.5)  # every SQL thread is now waiting on a worker
        waits = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert httpx.get(live.url + "/readyz", timeout=10).status_code == 200
            assert httpx.put(live.url + "/v1/prototype-sets/quick", json={"prototypes": [1]}, timeout=10).status_code == 200
            waits.append(time.perf_counter() - t0)
        assert max(waits) < 2.5, waits  # a SQL statement takes 3-4.5 s: none of them was waited for
        statuses = {f.result().status_code for f in burst}
        assert statuses <= {422, 503}, statuses  # each timed out or was refused: none stalled the rest


def test_audit_quota_fairness_and_listing(tenants):
    url = tenants.url
    for status in ("queued", "running"):  # A's earlier audits of this module, if still active
        for j in httpx.get(url + "/v1/audits", params={"status": status}, headers=auth(A)).json()["audits"]:
            httpx.post(f"{url}/v1/audits/{j['id']}/cancel", headers=auth(A))
    big = {"items": [{"id": f"a{i}", "prompt": "Love is", "completion": " a"} for i in range(30)], "top_k": 2}
    jobs = [httpx.post(url + "/v1/audits", json=big, headers=auth(A)) for _ in range(2)]
    assert all(j.status_code == 202 for j in jobs), [j.text for j in jobs]
    third = httpx.post(url + "/v1/audits", json=big, headers=auth(A))
    assert_problem(third, 429, "too-many-audits", mentions="limit is 2")
    # B is not held back by A's 60 items: its one item is done before A's audits are
    small = httpx.post(url + "/v1/audits", json={"items": [{"prompt": "A computer", "completion": " is"}]},
                       headers=auth(B)).json()
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/v1/audits/{small['id']}", headers=auth(B)).json()["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    a_done = sum(httpx.get(f"{url}/v1/audits/{j.json()['id']}", headers=auth(A)).json()["n_done"] for j in jobs)
    assert a_done < 30, a_done
    # listing: each key its own, newest first, a page at a time; admins everyone's
    mine = httpx.get(url + "/v1/audits", params={"limit": 1}, headers=auth(A)).json()
    assert mine["total"] >= 2 and len(mine["audits"]) == 1 and mine["next_offset"] == 1
    everything = httpx.get(url + "/v1/audits", params={"limit": 200}, headers=auth(A)).json()["audits"]
    assert [j["created_at"] for j in everything] == sorted((j["created_at"] for j in everything), reverse=True)
    ids_a = {j["id"] for j in everything}
    ids_b = {j["id"] for j in httpx.get(url + "/v1/audits", headers=auth(B)).json()["audits"]}
    assert small["id"] in ids_b and not ids_a & ids_b
    admin = {j["id"] for j in httpx.get(url + "/v1/audits", params={"limit": 200}, headers=auth(ADMIN)).json()["audits"]}
    assert ids_a | ids_b <= admin
    done = httpx.get(url + "/v1/audits", params={"status": "completed"}, headers=auth(B)).json()["audits"]
    assert small["id"] in {j["id"] for j in done} and all(j["status"] == "completed" for j in done)
    for j in jobs:
        httpx.post(f"{url}/v1/audits/{j.json()['id']}/cancel", headers=auth(A))


def test_a_poison_item_fails_after_its_attempts_and_the_queue_moves_on(index, tmp_path, monkeypatch):
    from prism_tda.service.indexes import LoadedIndex

    real = LoadedIndex.attribute

    def flaky(self, spec, options, stop=None):
        if spec.prompt == "POISON":
            raise RuntimeError("a bug this item triggers")
        return real(self, spec, options, stop)

    monkeypatch.setattr(LoadedIndex, "attribute", flaky)
    settings = service_settings(index, tmp_path / "state", audit_max_attempts=3)
    with serving(settings) as live:
        items = [{"id": "bad", "prompt": "POISON", "completion": " x"}, {"id": "good", "prompt": "Love is", "completion": " a"}]
        job = httpx.post(live.url + "/v1/audits", json={"items": items}).json()
        deadline = time.monotonic() + 60
        while (j := httpx.get(f"{live.url}/v1/audits/{job['id']}").json())["status"] != "completed":
            assert time.monotonic() < deadline, j
            time.sleep(0.05)
        got = {i["id"]: i for i in httpx.get(f"{live.url}/v1/audits/{job['id']}/items").json()["items"]}
        assert got["bad"]["status"] == "failed" and got["bad"]["attempts"] == 3 and "internal error" in got["bad"]["error"]
        assert got["good"]["status"] == "done"


def test_finished_audits_are_purged_after_the_retention_time(tmp_path):
    from prism_tda.service.state import StateDB

    db = StateDB(tmp_path)
    old, _ = db.create_job("ix", {}, [{"prompt": "p"}], principal="k", idempotency_key=None, req_hash="h")
    active, _ = db.create_job("ix", {}, [{"prompt": "p"}], principal="k", idempotency_key=None, req_hash="h2")
    item = db.next_item(["ix"])
    db.finish_item(item["job_id"], item["item_no"], result={"documents": [{"doc_id": 1, "score": 0.5}]})
    assert db.job(old["id"])["status"] == "completed"
    assert db.purge_finished(3600) == 0  # finished just now
    time.sleep(0.05)
    assert db.purge_finished(0.01) == 1
    assert db.job(old["id"]) is None and db.items(old["id"]) == [] and db.audit_results(job_id=old["id"]).num_rows == 0
    assert db.job(active["id"]) is not None  # still queued: kept


@pytest.mark.slow
def test_keyless_server_answers_only_loopback_names_and_sockets(index, tmp_path):
    settings = service_settings(index, tmp_path / "state")
    with serving(settings) as live:
        assert httpx.get(live.url + "/readyz").status_code == 200
        assert httpx.get(live.url + "/readyz", headers={"Host": f"localhost:{settings.port}"}).status_code == 200
        rebound = httpx.get(live.url + "/v1/prototypes", headers={"Host": f"attacker.example:{settings.port}"})
        assert_problem(rebound, 403, "host-not-allowed")
    # bound beyond loopback by hand (uvicorn's own --host), with the settings still saying loopback
    import uvicorn

    from prism_tda.service import create_app
    from prism_tda.service.app import server_options

    addr = next((a for a in os.popen("hostname -I").read().split() if "." in a and not a.startswith("127.")), None)
    if addr is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    port = free_port()
    config = uvicorn.Config(create_app(settings), lifespan="on", **{**server_options(settings), "host": "0.0.0.0",
                                                                     "port": port})
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert_problem(httpx.get(f"http://{addr}:{port}/v1/prototypes", timeout=10), 403, "host-not-allowed",
                       mentions="PRISM_API_KEYS")
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).status_code == 200
    finally:
        server.should_exit = True
        thread.join(30)


def test_cross_origin_state_changes_are_refused(live):
    url = live.url
    reload = url + "/v1/admin/indexes/tiny/reload"
    assert_problem(httpx.post(reload, headers={"Origin": "https://attacker.example"}), 403, "cross-origin-request")
    assert_problem(httpx.post(reload, headers={"Sec-Fetch-Site": "cross-site"}), 403, "cross-origin-request")
    assert_problem(httpx.post(url + "/v1/audits/aud_0000000000000000/cancel", headers={"Origin": "null"}), 403,
                   "cross-origin-request")
    # the page's own origin, and reads from anywhere, are served as before
    assert httpx.get(url + "/v1/prototypes?limit=1", headers={"Origin": "https://attacker.example"}).status_code == 200
    same = httpx.put(url + "/v1/prototype-sets/same-origin", json={"prototypes": [1]}, headers={"Origin": url})
    assert same.status_code == 200


def test_sql_workers_do_not_inherit_the_keys(index, tmp_path, monkeypatch):
    from prism_tda.service import create_app

    monkeypatch.setenv("PRISM_API_KEYS", json.dumps([A]))
    monkeypatch.setenv("SOME_SERVICE_TOKEN", "t0ps3cret")
    settings = service_settings(index, tmp_path / "state", api_keys=[A])
    app = create_app(settings)
    with serving(settings, app):
        pool = app.state.services.registry.get("tiny").sql
        pids = [w.pid for w in pool._all]
        assert pids
        for pid in pids:
            env = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
            assert A not in env and "t0ps3cret" not in env and "PRISM_API_KEYS" not in env


def test_cost_knobs_are_capped(index, tmp_path):
    settings = service_settings(index, tmp_path / "state", max_rerank_tokens=2048)  # the tiny context is 32
    with serving(settings) as live:
        url = live.url + "/v1/attribute"
        base = {"prompt": "A computer", "completion": " is a"}
        assert_problem(httpx.post(url, json={**base, "n_candidates": 16_384}), 422, "validation-error",
                       mentions="n_candidates")
        assert_problem(httpx.post(url, json={**base, "exact_rerank": 1024}), 422, "validation-error",
                       mentions="exact_rerank")
        assert_problem(httpx.post(url, json={**base, "exact_rerank": 128, "exact_tokens": None}), 422,
                       "validation-error", mentions="128 x null")
        assert_problem(httpx.post(url, json={**base, "exact_rerank": 128, "exact_tokens": 32}), 422,
                       "validation-error", mentions="2048")
        assert_problem(httpx.post(url, json={**base, "exact_rerank": 64, "exact_tokens": None}), 422,
                       "validation-error", mentions="x 2")  # its rows elsewhere count too
        assert httpx.post(url, json={**base, "exact_rerank": 32, "exact_tokens": None}, timeout=60).status_code == 200


def test_a_default_over_the_limits_comes_down_to_them(index, tmp_path):
    """``opponents`` searches FAISS for 256 sequences unless told otherwise: a server whose
    ``max_candidates`` is lower asks for its limit, in an attribution and in an audit's stored options."""
    from prism_tda.service import create_app

    settings = service_settings(index, tmp_path / "state", max_candidates=64)
    app = create_app(settings)
    with serving(settings, app) as live:
        att = app.state.services.registry.get("tiny").attributor
        asked: list[int] = []
        searched = att.candidate_sequences

        def spy(q, n_candidates, *a, **kw):
            asked.append(n_candidates)
            return searched(q, n_candidates, *a, **kw)

        att.candidate_sequences = spy
        base = {"prompt": "A computer", "completion": " is a", "top_k": 3}
        for extra, want in (({"opponents": True}, 64), ({}, 0), ({"opponents": True, "n_candidates": 32}, 32)):
            r = httpx.post(live.url + "/v1/attribute", json={**base, **extra}, timeout=60)
            assert r.status_code == 200, r.text
            assert asked[-1] == want, (extra, asked)
        job = httpx.post(live.url + "/v1/audits", json={"items": [{"prompt": "A computer", "completion": " is a"}],
                                                        "opponents": True}, timeout=60)
        assert job.status_code == 202, job.text
        assert job.json()["params"]["n_candidates"] == 64


@pytest.mark.slow
def test_damping_cache_is_bounded(index, tmp_path):
    from prism_tda.service import create_app

    settings = service_settings(index, tmp_path / "state")
    app = create_app(settings)
    with serving(settings, app) as live:
        ix = app.state.services.registry.get("tiny")
        rss0 = status_bytes(os.getpid(), "RssAnon")
        for i in range(60):
            r = httpx.post(live.url + "/v1/attribute", json={"prompt": "A computer", "completion": " is",
                                                             "damping": 0.5 + i * 0.01, "top_k": 1}, timeout=60)
            assert r.status_code == 200, r.text
        assert len(ix.attributor._pre) <= 8  # the process's one cache (the shard side is given the object)
        assert not hasattr(ix.attributor.shards.worker, "_pre")
        assert status_bytes(os.getpid(), "RssAnon") - rss0 < 64 * 2**20


# ---------------------------------------------------------------------------- background tasks
def test_background_tasks_belong_to_their_key(tenants):
    url, tasks = tenants.url, "/v1/prototypes/discover/tasks"
    slow = {"topic": {"sql": "SELECT doc_id FROM documents"}, "top_n": 300, "min_support": 1, "min_docs": 1,
            "select": "effect", "max_selected": 200, "max_ppl_ratio": 10}
    r = httpx.post(url + tasks, json=slow, headers=auth(A))
    assert r.status_code == 202, r.text
    mine = r.json()["id"]
    # one active task per key here: A's second is refused, B's first is not
    assert_problem(httpx.post(url + tasks, json=slow, headers=auth(A)), 429, "too-many-tasks", mentions="limit is 1")
    theirs = httpx.post(url + tasks, json={"topic": {"texts": ["a picture of a cat"]}, "min_docs": 1}, headers=auth(B))
    assert theirs.status_code == 202, theirs.text
    # B can neither read nor cancel A's task: 404, as for a task that does not exist
    assert_problem(httpx.get(f"{url}{tasks}/{mine}", headers=auth(B)), 404, "task-not-found")
    assert_problem(httpx.delete(f"{url}{tasks}/{mine}", headers=auth(B)), 404, "task-not-found")
    assert httpx.get(f"{url}{tasks}/{mine}", headers=auth(A)).json()["status"] in ("queued", "running")
    assert httpx.get(f"{url}{tasks}/{theirs.json()['id']}", headers=auth(ADMIN)).status_code == 200
    assert httpx.get(f"{url}{tasks}/{mine}").status_code == 401
    # listing: each key its own; admins everyone's
    listed_b = {t["id"] for t in httpx.get(url + tasks, headers=auth(B)).json()["tasks"]}
    assert theirs.json()["id"] in listed_b and mine not in listed_b
    listed_admin = {t["id"] for t in httpx.get(url + tasks, params={"limit": 200}, headers=auth(ADMIN)).json()["tasks"]}
    assert {mine, theirs.json()["id"]} <= listed_admin
    # A cancels its own; then it may start another
    assert httpx.delete(f"{url}{tasks}/{mine}", headers=auth(A)).json()["status"] == "cancelled"
    again = httpx.post(url + tasks, json={"topic": {"texts": ["a picture of a dog"]}, "min_docs": 1}, headers=auth(A))
    assert again.status_code == 202, again.text
