"""Audits over the live app: persisted jobs, progress, idempotency, flags, cancel, downloads, SQL."""

from __future__ import annotations

import io
import json
import sqlite3
import time

import pyarrow.parquet as pq

from prism_tda.service.state import StateDB

from .conftest import assert_problem

ITEMS = [{"id": "a", "prompt": "A computer", "completion": " is a"},
         {"id": "b", "prompt": "Love is", "completion": " a"},
         {"id": "c", "prompt": "Never trust", "max_new_tokens": 3}]


def wait_done(client, job_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/audits/{job_id}").json()
        if job["status"] in ("completed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"audit {job_id} did not finish: {job}")


def test_audit_lifecycle(client):
    client.put("/v1/prototype-sets/watch", json={"prototypes": list(range(16))})
    body = {"items": ITEMS, "top_k": 3, "flag": "watch"}
    r = client.post("/v1/audits", json=body, headers={"Idempotency-Key": "lifecycle-1"})
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/audits/{job['id']}" and job["n_items"] == 3
    again = client.post("/v1/audits", json=body, headers={"Idempotency-Key": "lifecycle-1"})
    assert again.json()["id"] == job["id"] and again.headers["idempotent-replayed"] == "true"
    assert_problem(client.post("/v1/audits", json={**body, "top_k": 4}, headers={"Idempotency-Key": "lifecycle-1"}),
                   409, "idempotency-conflict", mentions=job["id"])
    done = wait_done(client, job["id"])
    assert (done["status"], done["n_done"], done["n_failed"], done["progress"]) == ("completed", 3, 0, 1.0)
    items = client.get(f"/v1/audits/{job['id']}/items").json()["items"]
    assert [i["id"] for i in items] == ["a", "b", "c"]
    for it in items:
        assert it["status"] == "done" and it["completions"] == 1 and len(it["documents"]) == 3
        assert set(it["flagged_prototypes"]) == {p for p in it["used_prototypes"] if p < 16}
        assert it["flagged"] == bool(it["flagged_prototypes"])
    # JSONL and Parquet downloads agree with the items
    lines = [json.loads(x) for x in client.get(f"/v1/audits/{job['id']}/results").text.splitlines()]
    assert [x["id"] for x in lines] == ["a", "b", "c"]
    raw = client.get(f"/v1/audits/{job['id']}/results", params={"format": "parquet"})
    table = pq.read_table(io.BytesIO(raw.content))
    assert table.num_rows == 9 and set(table["item_id"].to_pylist()) == {"a", "b", "c"}
    # each cited document's value is stored with it, as the item's answer gave it
    values = [d["value"] for it in items for d in it["documents"]]
    assert table["value"].to_pylist() == values and all(isinstance(v, float) for v in values)
    # audit_results is a SQL table joinable with the store
    sql = (f"SELECT r.item_id, r.rank, d.external_id FROM audit_results r JOIN documents d USING (doc_id) "
           f"WHERE r.job_id = '{job['id']}' ORDER BY r.item_no, r.rank")
    rows = client.post("/v1/sql", json={"sql": sql}).json()["rows"]
    assert len(rows) == 9 and rows[0][:2] == ["a", 1] and all(r[2] for r in rows)
    flagged = client.post("/v1/sql", json={"sql": f"SELECT DISTINCT item_id FROM audit_results WHERE flagged "
                                                  f"AND job_id = '{job['id']}' ORDER BY 1"}).json()["rows"]
    assert [r[0] for r in flagged] == [i["id"] for i in items if i["flagged"]]
    assert_problem(client.post(f"/v1/audits/{job['id']}/cancel"), 409, "audit-finished")


def test_cancel_stops_pending_items(client):
    items = [{"prompt": "A computer", "completion": " is a"}] * 40
    job = client.post("/v1/audits", json={"items": items, "mode": "exact"}).json()
    r = client.post(f"/v1/audits/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    time.sleep(0.5)
    after = client.get(f"/v1/audits/{job['id']}").json()
    assert after["status"] == "cancelled" and after["n_done"] < 40
    assert client.post(f"/v1/audits/{job['id']}/cancel").json()["status"] == "cancelled"  # idempotent


def test_audit_bad_inputs(client):
    url = "/v1/audits"
    assert_problem(client.post(url, json={"items": []}), 422, "validation-error", mentions="items")
    assert_problem(client.post(url, json={"items": [{"prompt": ""}]}), 422, "validation-error", mentions="prompt")
    assert_problem(client.post(url, json={"items": [{"prompt": "a"}] * 51}), 422, "too-many-items",
                   mentions="limit is 50")
    assert_problem(client.post(url, json={"items": [{"prompt": "a"}, {"prompt": "the cat " * 40}]}), 422,
                   "prompt-too-long", mentions="items[1]")
    assert_problem(client.post(url, json={"items": [{"prompt": "a"}], "flag": "nope"}), 404,
                   "prototype-set-not-found")
    assert_problem(client.post(url, json={"items": [{"prompt": "a"}], "flag_prototypes": [1000]}), 422,
                   "invalid-prototype")
    assert_problem(client.post(url, json={"items": "a"}), 422, "validation-error")
    assert_problem(client.post(url, content=b"{", headers={"content-type": "application/json"}), 400,
                   "malformed-request")
    for path in ("/v1/audits/aud_missing", "/v1/audits/aud_missing/items", "/v1/audits/aud_missing/results"):
        assert_problem(client.get(path), 404, "audit-not-found", mentions="aud_missing")
    assert_problem(client.post("/v1/audits/aud_missing/cancel"), 404, "audit-not-found")
    assert_problem(client.get("/v1/audits/x/results", params={"format": "xml"}), 422, "validation-error")


def test_exact_over_the_time_limit_is_refused_with_its_estimate_and_runs_as_an_audit(index, live, tmp_path):
    """A server whose one-request limit on exact mode is below the estimate refuses it before the pass
    (in a fraction of the pass's time), says how long it would take and how to run it anyway; the same
    query as an audit item runs in the background and gives the answer exact mode gives without the limit."""
    import re

    import httpx

    from .conftest import service_settings, serving

    q = {"prompt": "A computer", "completion": " is a", "mode": "exact", "top_k": 3}
    with httpx.Client(base_url=live.url, timeout=120) as free:
        t0 = time.perf_counter()
        want = free.post("/v1/attribute", json=q)
        pass_s = time.perf_counter() - t0
    assert want.status_code == 200, want.text
    with serving(service_settings(index, tmp_path, exact_max_seconds=1e-3)) as slow, \
            httpx.Client(base_url=slow.url, timeout=120) as c:
        t0 = time.perf_counter()
        body = assert_problem(c.post("/v1/attribute", json=q), 422, "invalid-query", mentions="POST /v1/audits")
        refused_s = time.perf_counter() - t0
        n_tokens = c.get("/readyz").json()["indexes"][0]["tokens"]
        m = re.search(r"all ([\d,]+) training tokens .* about ([\d,]+) s at this server's measured ([\d,]+) "
                      r"tokens/s: over its limit of 0.001 s", body["detail"])
        assert m and int(m[1].replace(",", "")) == n_tokens, body["detail"]
        assert refused_s < pass_s  # refused on the estimate, not after the pass
        job = c.post("/v1/audits", json={"items": [{"prompt": q["prompt"], "completion": q["completion"]}],
                                         "mode": "exact", "top_k": 3}).json()
        done = wait_done(c, job["id"])
        assert (done["status"], done["n_done"], done["n_failed"]) == ("completed", 1, 0)
        got = c.get(f"/v1/audits/{job['id']}/items").json()["items"][0]
    assert [d["doc_id"] for d in got["documents"]] == [d["doc_id"] for d in want.json()["documents"]]


def test_a_state_database_from_before_values_opens_with_them_null(tmp_path):
    con = sqlite3.connect(tmp_path / "state.sqlite3")
    con.executescript("CREATE TABLE results (job_id TEXT NOT NULL, item_no INTEGER NOT NULL, rank INTEGER NOT NULL, "
                      "doc_id INTEGER NOT NULL, score REAL NOT NULL, raw_influence REAL, seq_id INTEGER, "
                      "trained INTEGER, PRIMARY KEY (job_id, item_no, rank));"
                      "INSERT INTO results VALUES ('j', 0, 1, 7, 0.5, 1.5, 3, 1);")
    con.close()
    StateDB(tmp_path)
    con = sqlite3.connect(tmp_path / "state.sqlite3")
    assert con.execute("SELECT doc_id, score, value, influence FROM results").fetchall() == [(7, 0.5, None, None)]
    con.close()


def test_a_state_database_an_older_server_wrote_reads_without_migrating(tmp_path):
    """``prism sql --state-dir`` opens the database read-only: results from before the trained, value and
    influence columns read as their migration's defaults there, not as an error."""
    from prism_tda.service.state import read_audit_results

    StateDB(tmp_path)
    con = sqlite3.connect(tmp_path / "state.sqlite3")
    con.executescript("ALTER TABLE results DROP COLUMN influence; ALTER TABLE results DROP COLUMN value;"
                      "ALTER TABLE results DROP COLUMN trained;"
                      "INSERT INTO jobs (id, index_name, status, created_at, updated_at, params, n_items, principal, "
                      "request_hash) VALUES ('j', 'ix', 'completed', 0, 0, '{}', 1, 'p', 'h');"
                      "INSERT INTO items (job_id, item_no, item_id, prompt, flag_prototypes, status) "
                      "VALUES ('j', 0, 'a', 'x', '[]', 'done');"
                      "INSERT INTO results (job_id, item_no, rank, doc_id, score) VALUES ('j', 0, 1, 7, 0.5);")
    con.close()
    table = read_audit_results(tmp_path / "state.sqlite3")
    assert table.column("doc_id").to_pylist() == [7]
    assert table.column("value").to_pylist() == [None] and table.column("influence").to_pylist() == [None]
    assert table.column("trained").to_pylist() == [True]
