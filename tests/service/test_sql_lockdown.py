"""Hostile SQL: none of it succeeds, each refusal is a clear 4xx problem, and the service keeps serving."""

from __future__ import annotations

import time

import pytest

from .conftest import PROBLEM

HOSTILE = [
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM read_csv_auto('/etc/passwd')",
    "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM read_blob('/etc/hostname')",
    "SELECT * FROM read_json('/etc/passwd')",
    "SELECT * FROM read_parquet('/tmp/anything.parquet')",
    "SELECT * FROM '/etc/passwd'",
    "SELECT * FROM glob('/*')",
    "SELECT * FROM sniff_csv('/etc/passwd')",
    "SELECT * FROM read_parquet('https://example.com/x.parquet')",
    "COPY (SELECT * FROM documents) TO '/tmp/stolen.csv'",
    "COPY documents FROM '/etc/passwd'",
    "EXPORT DATABASE '/tmp/prism-export'",
    "ATTACH '/tmp/evil.duckdb' AS evil",
    "ATTACH ':memory:' AS scratch",
    "DETACH memory",
    "INSTALL httpfs",
    "LOAD httpfs",
    "FORCE INSTALL httpfs FROM 'http://example.com'",
    "SET enable_external_access = true",
    "SET memory_limit = '100GB'",
    "RESET lock_configuration",
    "PRAGMA enable_profiling",
    "PRAGMA database_list",
    "CALL pragma_version()",
    "CREATE TABLE t AS SELECT 1 AS x",
    "CREATE VIEW documents2 AS SELECT * FROM documents",
    "CREATE MACRO m(x) AS x + 1",
    "DROP VIEW documents",
    "INSERT INTO documents SELECT * FROM documents",
    "UPDATE documents SET text = ''",
    "DELETE FROM documents",
    "SELECT 1; SELECT 2",
    "SELECT 1; DROP VIEW activations",
    "SELECT * FROM query('ATTACH ''/tmp/q.duckdb''')",
    "USE memory",
    "CHECKPOINT",
    "EXPLAIN ANALYZE SELECT 1",
    "SELECT * FROM duckdb_secrets()",
    "CREATE SECRET s (TYPE s3, KEY_ID 'x', SECRET 'y')",
    "SELECT getenv('HOME')",
    "SELECT * FROM range(100000)",  # over the row cap (1000 in these tests)
    "SELECT a.seq_id FROM activations a, activations b, activations c",  # over the cap as well
]


@pytest.mark.parametrize("sql", HOSTILE)
def test_hostile_statement_is_refused(client, sql):
    r = client.post("/v1/sql", json={"sql": sql})
    assert 400 <= r.status_code < 500, (sql, r.status_code, r.text)
    body = r.json()
    assert r.headers["content-type"].startswith("application/problem+json")
    assert body["type"].startswith(PROBLEM + "sql-") and body["detail"], body
    assert client.post("/v1/sql", json={"sql": "SELECT count(*) FROM documents"}).json()["rows"] == [[600]]


def test_runaway_query_is_interrupted_within_the_time_limit(client, live):
    t0 = time.perf_counter()
    r = client.post("/v1/sql", json={"sql": "SELECT count(*) FROM activations a, activations b, activations c "
                                            "WHERE a.act + b.act + c.act > 1e9"})
    elapsed = time.perf_counter() - t0
    assert r.status_code == 422 and r.json()["type"] == PROBLEM + "sql-timeout", r.text
    assert elapsed < live.settings.sql_timeout_s + 3
    # the engine is still usable, and no file was written by any statement above
    assert client.post("/v1/sql", json={"sql": "SELECT count(*) FROM prototypes"}).json()["rows"] == [[32]]


def test_nothing_was_written_or_changed(client, tmp_path):
    # the statements that would write, sent here (whatever ran before), to paths unique to this test
    targets = [tmp_path / "stolen.csv", tmp_path / "evil.duckdb", tmp_path / "export"]
    attach = f"ATTACH ''{targets[1]}''"
    for sql in (f"COPY (SELECT * FROM documents) TO '{targets[0]}'", f"ATTACH '{targets[1]}' AS evil",
                f"EXPORT DATABASE '{targets[2]}'", f"SELECT * FROM query('{attach}')"):
        assert client.post("/v1/sql", json={"sql": sql}).status_code in (400, 403), sql
    assert not any(t.exists() for t in targets)
    r = client.post("/v1/sql", json={"sql": "SELECT current_setting('enable_external_access') AS ext, "
                                            "current_setting('lock_configuration') AS locked"})
    assert r.json()["rows"] == [[False, True]]
    tables = client.post("/v1/sql", json={"sql": "SELECT table_name FROM information_schema.tables ORDER BY 1"})
    names = [t[0] for t in tables.json()["rows"]]
    n_shards = client.post("/v1/sql", json={"sql": "SELECT count(*) FROM shards"}).json()["rows"][0][0]
    assert names == sorted(["activations", "documents", "prototypes", "sequences", "shards", "tokens", "vocab",
                            "_removed", *(f"_tokens_{i}" for i in range(n_shards))])  # _removed: takedown


def test_too_many_rows_names_the_cap(client):
    r = client.post("/v1/sql", json={"sql": "SELECT * FROM range(1001)"})
    assert r.status_code == 422 and r.json()["type"] == PROBLEM + "sql-too-many-rows"
    assert "1000" in r.json()["detail"]
    assert client.post("/v1/sql", json={"sql": "SELECT * FROM range(1000)"}).json()["row_count"] == 1000
