"""API keys, rate limits, body limits, CORS, request ids, and refusing to serve beyond loopback without keys."""

from __future__ import annotations

import httpx
import pytest

from prism_tda.errors import ConfigError
from prism_tda.service import Settings

from .conftest import assert_problem, service_settings, serving


@pytest.fixture(scope="module")
def guarded(index, tmp_path_factory):
    settings = service_settings(index, tmp_path_factory.mktemp("state-guarded"), api_keys=["k-one", "k-two"],
                                rate_limit_per_minute=60, rate_limit_burst=3, max_body_bytes=2048,
                                cors_origins=["https://app.example"])
    with serving(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def test_api_keys_and_rate_limit(guarded):
    body = {"sql": "SELECT 1"}
    assert_problem(guarded.post("/v1/sql", json=body), 401, "unauthorized")
    r = guarded.post("/v1/sql", json=body, headers={"Authorization": "Bearer wrong"})
    assert_problem(r, 401, "unauthorized")
    assert r.headers["www-authenticate"] == "Bearer"
    ok = {"Authorization": "Bearer k-one"}
    for _ in range(3):  # the burst
        assert guarded.post("/v1/sql", json=body, headers=ok).status_code == 200
    limited = guarded.post("/v1/sql", json=body, headers=ok)
    problem = assert_problem(limited, 429, "rate-limited")
    assert int(limited.headers["retry-after"]) >= 1
    assert f"retry in {limited.headers['retry-after']} s" in problem["detail"]  # the detail and the header agree
    # the other key has its own bucket; health endpoints need no key
    assert guarded.post("/v1/sql", json=body, headers={"Authorization": "Bearer k-two"}).status_code == 200
    assert guarded.get("/healthz").status_code == 200


def test_body_limit_cors_and_request_id(guarded):
    headers = {"Authorization": "Bearer k-two"}
    big = {"sql": "SELECT '" + "x" * 4000 + "'"}
    assert_problem(guarded.post("/v1/sql", json=big, headers=headers), 413, "body-too-large", mentions="2048")

    def chunks():
        yield b'{"sql": "SELECT 1 --'
        yield b"x" * 4000
        yield b'"}'

    assert_problem(guarded.post("/v1/sql", content=chunks(), headers={**headers, "content-type": "application/json"}),
                   413, "body-too-large")
    r = guarded.get("/healthz", headers={"X-Request-ID": "trace-123", "Origin": "https://app.example"})
    assert r.headers["x-request-id"] == "trace-123"
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = guarded.get("/healthz", headers={"X-Request-ID": "bad id\twith spaces", "Origin": "https://evil.example"})
    assert r.headers["x-request-id"] != "bad id\twith spaces" and "access-control-allow-origin" not in r.headers


def test_beyond_loopback_needs_api_keys(index, tmp_path):
    with pytest.raises(ConfigError, match="PRISM_API_KEYS"):
        Settings(indexes={"tiny": index}, host="0.0.0.0", state_dir=tmp_path).check_serving()
    Settings(indexes={"tiny": index}, host="0.0.0.0", api_keys=["k"], state_dir=tmp_path).check_serving()
    Settings(indexes={"tiny": index}, host="::1", state_dir=tmp_path).check_serving()
    with pytest.raises(ConfigError, match="PRISM_INDEXES"):
        Settings(state_dir=tmp_path).check_serving()
    with pytest.raises(ValueError, match="default_index"):
        Settings(indexes={"tiny": index}, default_index="other")


def test_settings_are_documented():
    for name, field in Settings.model_fields.items():
        assert field.description and len(field.description) > 15, name
