"""Security headers on every kind of response, and SQL answers that never name the server's directories."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import assert_problem

SECURITY = {"x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "x-frame-options": "DENY"}


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/", 200),  # the page, with a policy of its own
    ("GET", "/docs", 200),
    ("GET", "/openapi.json", 200),
    ("GET", "/static/app.js", 200),
    ("GET", "/docs-assets/swagger-ui.css", 200),
    ("GET", "/healthz", 200),
    ("GET", "/v1/prototypes?limit=1", 200),
    ("GET", "/v1/no-such-endpoint", 404),
    ("DELETE", "/healthz", 405),
    ("POST", "/v1/sql", 413),
])
def test_every_response_carries_the_security_headers(client, method, path, status):
    body = b'{"sql": "' + b"x" * 300_000 + b'"}' if status == 413 else None
    r = client.request(method, path, content=body)
    assert r.status_code == status, (path, r.status_code, r.text[:300])
    for name, value in SECURITY.items():
        assert r.headers.get_list(name) == [value], (path, name, r.headers.get_list(name))
    policies = r.headers.get_list("content-security-policy")
    assert len(policies) == 1 and policies[0].count("frame-ancestors") == 1, (path, policies)
    assert "frame-ancestors 'none'" in policies[0]
    if path == "/":  # the page's own policy, kept whole
        assert policies[0].startswith("default-src 'self'; script-src 'self'"), policies[0]
    elif status >= 400:
        assert r.headers["content-type"].startswith("application/problem+json")


def _server_dirs(live) -> list[str]:
    dirs = {live.settings.indexes["tiny"], live.settings.state_dir, Path.home()}
    return sorted({str(p) for d in dirs for p in (Path(d).absolute(), Path(d).resolve())} - {"/"})


def test_sql_error_naming_a_file_shows_no_server_path(client, live):
    index = Path(live.settings.indexes["tiny"]).resolve()
    for sql, where in [(f"SELECT * FROM read_parquet('{index}/no-such-file.parquet')", "<index>/no-such-file.parquet"),
                       (f"SELECT * FROM read_csv('{live.settings.state_dir}/state.csv')", "<state>/state.csv"),
                       ("SELECT * FROM duckdb_extensions()", "<home>/")]:
        r = client.post("/v1/sql", json={"sql": sql})
        body = assert_problem(r, 403, "sql-forbidden")
        assert where in body["detail"], body["detail"]
        for d in _server_dirs(live):
            assert d not in r.text, (sql, d, r.text)


def test_the_catalog_shows_no_server_path(client, live):
    r = client.post("/v1/sql", json={"sql": "SELECT view_name, sql FROM duckdb_views() WHERE NOT internal"})
    assert r.status_code == 200, r.text
    views = dict(r.json()["rows"])
    assert "read_parquet('<index>/vocab.parquet')" in views["vocab"], views["vocab"]
    for d in _server_dirs(live):
        assert d not in r.text, d


@pytest.mark.parametrize("sql", [
    "SELECT current_setting('allowed_paths')",
    "SELECT current_setting('secret_directory')",
    "SELECT 'allowed_paths'.current_setting()",
    'SELECT "CURRENT_SETTING" /* a comment */ (\'allowed_paths\')',
    "SELECT current_setting('allowed_' || 'paths')",
    "SELECT 'Zürich 東京', current_setting('allowed_paths')",  # the tokens' offsets count bytes
    "SELECT name, value FROM duckdb_settings()",
    "SELECT * FROM duckdb_profiling_settings()",
    "SELECT * FROM query('SELECT current_setting(''allowed_paths'')')",
    "SELECT * FROM json_execute_serialized_sql(json_serialize_sql('SELECT current_setting(''allowed_paths'')'))",
])
def test_path_valued_settings_are_not_readable(client, live, sql):
    r = client.post("/v1/sql", json={"sql": sql})
    detail = assert_problem(r, 403, "sql-forbidden")["detail"]
    assert "is not allowed" in detail or "may read only" in detail, detail
    for d in _server_dirs(live):
        assert d not in r.text, (d, r.text)


def test_the_lock_down_settings_stay_readable(client):
    r = client.post("/v1/sql", json={"sql": "SELECT current_setting('enable_external_access'), "
                                            "current_setting('Lock_Configuration')"})
    assert r.status_code == 200 and r.json()["rows"] == [[False, True]], r.text


def test_names_in_strings_and_aliases_are_not_calls(client):
    r = client.post("/v1/sql", json={"sql": "SELECT 'current_setting(1)' AS query, count(*) AS duckdb_settings "
                                            "FROM documents -- query(x)"})
    assert r.status_code == 200 and r.json()["rows"] == [["current_setting(1)", 600]], r.text
