"""`prism serve` killed with SIGKILL in the middle of an audit: after a restart the audit completes and
every item is processed exactly once."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from .conftest import Server

N_ITEMS, TOP_K = 60, 4


@pytest.mark.slow
def test_sigkill_mid_audit_then_restart_processes_every_item_once(index, tmp_path):
    state = tmp_path / "state"
    env = {"PRISM_MAX_BATCH_ITEMS": "1000"}
    items = [{"id": f"item-{i}", "prompt": "A computer" if i % 2 else "Love is", "completion": " is a"}
             for i in range(N_ITEMS)]
    body = {"items": items, "top_k": TOP_K, "mode": "exact"}
    first = Server([f"tiny={index}"], state, tmp_path / "first.log", **env)
    try:
        first.wait_ready()
        r = httpx.post(first.url + "/v1/audits", json=body, headers={"Idempotency-Key": "crash-1"}, timeout=30)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        deadline = time.monotonic() + 60
        while (done_at_kill := httpx.get(f"{first.url}/v1/audits/{job_id}").json()["n_done"]) < 10:
            assert time.monotonic() < deadline, "the worker made no progress"
            time.sleep(0.02)
        first.signal(signal.SIGKILL)
        first.proc.wait(10)
        assert done_at_kill < N_ITEMS, "the audit finished before the kill; make it longer"
    finally:
        first.stop()

    second = Server([f"tiny={index}"], state, tmp_path / "second.log", **env)
    try:
        second.wait_ready()
        url = second.url
        again = httpx.post(url + "/v1/audits", json=body, headers={"Idempotency-Key": "crash-1"}, timeout=30)
        assert again.json()["id"] == job_id  # resubmitting after the restart returns the same job
        deadline = time.monotonic() + 300
        while (job := httpx.get(f"{url}/v1/audits/{job_id}").json())["status"] != "completed":
            assert time.monotonic() < deadline, f"the audit did not complete: {job}"
            time.sleep(0.2)
        assert (job["n_done"], job["n_failed"]) == (N_ITEMS, 0)
        got = httpx.get(f"{url}/v1/audits/{job_id}/items", params={"limit": 1000}).json()["items"]
        assert len(got) == N_ITEMS
        assert all(i["status"] == "done" and i["completions"] == 1 and len(i["documents"]) == TOP_K for i in got)
        assert sum(i["attempts"] for i in got) >= N_ITEMS
        sql = ("SELECT count(*), count(DISTINCT (item_no, rank)), count(DISTINCT item_id) FROM audit_results "
               f"WHERE job_id = '{job_id}'")
        rows = httpx.post(url + "/v1/sql", json={"sql": sql}).json()["rows"]
        assert rows == [[N_ITEMS * TOP_K, N_ITEMS * TOP_K, N_ITEMS]]
    finally:
        second.stop()
