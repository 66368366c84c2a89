"""SQL limits hold whatever the statement: time, the server's memory (the whole process tree's
anonymous memory, sampled every 10 ms) and the size of the answer, for statements built to break
them, one at a time and four at once, against a real `prism serve`."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from prism_tda.procmem import PeakSampler

from .conftest import PROBLEM, Server

TIMEOUT_S = 2.0
MEMORY_LIMIT = 512 * 2**20
MAX_RESULT = 4 * 2**20
MARGIN = 256 * 2**20  # sampling interval overshoot, the answer's bytes, allocator slack

LIMIT_KINDS = {"sql-timeout", "sql-out-of-memory", "sql-result-too-large", "sql-too-many-rows"}
HOSTILE = {
    # 800 MB list materialised before the unnest: neither DuckDB's interrupt nor its memory limit stopped it
    "SELECT unnest(range(100000000))": {"sql-out-of-memory", "sql-timeout", "sql-too-many-rows"},
    # one 2 GB string
    "SELECT repeat('x', 2000000000)": {"sql-out-of-memory", "sql-result-too-large"},
    # a 1 GB answer made of ordinary rows
    "SELECT repeat('x', 100000) FROM range(10000)": {"sql-result-too-large", "sql-out-of-memory"},
}


@pytest.fixture(scope="module")
def server(index, tmp_path_factory):
    d = tmp_path_factory.mktemp("sql-limits")
    s = Server([f"tiny={index}"], d / "state", d / "server.log", PRISM_SQL_TIMEOUT_S=str(TIMEOUT_S),
               PRISM_SQL_MEMORY_LIMIT=f"{MEMORY_LIMIT}B", PRISM_SQL_MAX_RESULT_BYTES=str(MAX_RESULT),
               PRISM_SQL_WORKERS="2", PRISM_SQL_MAX_ROWS="10000")
    s.wait_ready()
    yield s
    s.stop()


def _benign(url: str) -> None:
    assert httpx.get(url + "/readyz", timeout=10).status_code == 200
    r = httpx.post(url + "/v1/sql", json={"sql": "SELECT count(*) FROM documents"}, timeout=30)
    assert r.status_code == 200 and r.json()["rows"] == [[600]], r.text


def _refused(r: httpx.Response, kinds: set[str]) -> str:
    assert r.status_code in (422, 503) and r.headers["content-type"].startswith("application/problem+json"), r.text
    kind = r.json()["type"].removeprefix(PROBLEM)
    assert kind in kinds, (kind, r.text)
    return kind


@pytest.mark.parametrize("sql", list(HOSTILE))
def test_each_limit_holds(server, sql):
    _benign(server.url)  # the workers are up, so the baseline includes them
    with PeakSampler(server.proc.pid, field="RssAnon") as mem:
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/sql", json={"sql": sql}, timeout=60)
        elapsed = time.perf_counter() - t0
    kind = _refused(r, HOSTILE[sql])
    grown = mem.peak - mem.base
    print(f"\n{sql}: {kind} in {elapsed:.2f} s, server tree RssAnon +{grown / 2**20:.0f} MiB")
    assert elapsed < 2 * TIMEOUT_S + 1.0, elapsed  # answered within twice the limit (plus HTTP)
    assert grown < MEMORY_LIMIT + MARGIN, grown / 2**20
    assert len(r.content) < 10_000
    _benign(server.url)


def test_four_at_once(server):
    _benign(server.url)
    statements = [*HOSTILE, "SELECT unnest(range(100000000))"]
    with PeakSampler(server.proc.pid, field="RssAnon") as mem, ThreadPoolExecutor(4) as pool:
        t0 = time.perf_counter()
        answers = list(pool.map(lambda q: httpx.post(server.url + "/v1/sql", json={"sql": q}, timeout=120),
                                statements))
        elapsed = time.perf_counter() - t0
    kinds = [_refused(r, LIMIT_KINDS | {"sql-busy"}) for r in answers]
    grown = mem.peak - mem.base
    print(f"\n4 at once: {kinds} in {elapsed:.2f} s, server tree RssAnon +{grown / 2**20:.0f} MiB")
    # two workers share the limit, so four statements at once stay within it too
    assert grown < MEMORY_LIMIT + MARGIN, grown / 2**20
    assert elapsed < 4 * 2 * TIMEOUT_S + 10
    _benign(server.url)


def test_a_result_just_under_the_cap_is_served_whole(server):
    n = MAX_RESULT // 2 // 1010
    r = httpx.post(server.url + "/v1/sql", json={"sql": f"SELECT repeat('x', 1000) AS s FROM range({n})"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["row_count"] == n and len(body["rows"]) == n and body["rows"][0] == ["x" * 1000]
    assert body["columns"] == [{"name": "s", "type": "string"}] and body["index"] == "tiny"
