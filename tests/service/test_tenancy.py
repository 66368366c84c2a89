"""Audits belong to the key that created them; failed authentication is rate-limited per address."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import ADMIN, A, B, assert_problem, auth, service_settings, serving


@pytest.fixture(scope="module")
def keyed(index, tmp_path_factory):
    settings = service_settings(index, tmp_path_factory.mktemp("state-keyed"), api_keys=[A, B],
                                admin_api_keys=[ADMIN], auth_failures_per_minute=10)
    with serving(settings) as live:
        yield live


def _audit(url: str, key: str, item_id: str) -> str:
    body = {"items": [{"id": item_id, "prompt": "A computer", "completion": " is a"}], "top_k": 2}
    r = httpx.post(url + "/v1/audits", json=body, headers=auth(key), timeout=30)
    assert r.status_code == 202, r.text
    job = r.json()["id"]
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/v1/audits/{job}", headers=auth(key)).json()["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return job


def _audit_jobs_seen(url: str, key: str) -> set[str]:
    r = httpx.post(url + "/v1/sql", json={"sql": "SELECT DISTINCT job_id FROM audit_results"}, headers=auth(key))
    assert r.status_code == 200, r.text
    return {row[0] for row in r.json()["rows"]}


def test_an_audit_belongs_to_its_key(keyed):
    url = keyed.url
    job_a, job_b = _audit(url, A, "from-a"), _audit(url, B, "from-b")
    for path in ("", "/items", "/results", "/results?format=parquet"):
        assert httpx.get(f"{url}/v1/audits/{job_a}{path}", headers=auth(A)).status_code == 200
        assert httpx.get(f"{url}/v1/audits/{job_a}{path}", headers=auth(ADMIN)).status_code == 200
        # to another key the audit does not exist: the same answer as for an unknown id
        other = httpx.get(f"{url}/v1/audits/{job_a}{path}", headers=auth(B))
        unknown = httpx.get(f"{url}/v1/audits/aud_0000000000000000{path}", headers=auth(B))
        assert_problem(other, 404, "audit-not-found")
        assert other.json()["detail"].replace(job_a, "ID") == unknown.json()["detail"].replace(
            "aud_0000000000000000", "ID")
    assert_problem(httpx.post(f"{url}/v1/audits/{job_a}/cancel", headers=auth(B)), 404, "audit-not-found")
    # the same Idempotency-Key from two keys makes two audits
    body = {"items": [{"prompt": "Love is", "completion": " a"}]}
    ra = httpx.post(url + "/v1/audits", json=body, headers={**auth(A), "Idempotency-Key": "same"})
    rb = httpx.post(url + "/v1/audits", json=body, headers={**auth(B), "Idempotency-Key": "same"})
    assert ra.json()["id"] != rb.json()["id"]
    # SQL: each key sees its own audits' rows; the admin key sees every audit
    seen_a, seen_b = _audit_jobs_seen(url, A), _audit_jobs_seen(url, B)
    assert job_a in seen_a <= {job_a, ra.json()["id"]}
    assert job_b in seen_b <= {job_b, rb.json()["id"]}
    assert _audit_jobs_seen(url, ADMIN) >= {job_a, job_b}


def _client(address: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30)


def test_failed_authentication_is_rate_limited_per_address(keyed):
    url = keyed.url + "/v1/prototypes?limit=1"
    statuses, limited = [], None
    with _client("127.0.0.3") as attacker, _client("127.0.0.2") as bystander:
        for _ in range(80):
            r = attacker.get(url, headers=auth("wrong"))
            statuses.append(r.status_code)
            if r.status_code == 429:
                limited = r
        assert statuses[:10] == [401] * 10 and set(statuses[10:]) == {429}, statuses
        body = assert_problem(limited, 429, "rate-limited")
        assert f"retry in {limited.headers['retry-after']} s" in body["detail"]
        # locked out for wrong keys only: a valid key from the same address is answered ...
        assert attacker.get(url, headers=auth(A)).status_code == 200
        assert attacker.get(url, headers=auth("wrong")).status_code == 429
        # ... and another address is not affected at all
        assert bystander.get(url, headers=auth("wrong")).status_code == 401
