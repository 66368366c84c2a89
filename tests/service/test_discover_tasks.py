"""Discovery as a background task: the same answer as the request, progress, cancellation that stops the
work, and a task that survives its server's crash (started again, at most a bounded number of times)."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from prism_tda.service.state import StateDB

from .conftest import Server, assert_problem

SQL = "SELECT doc_id FROM documents WHERE external_id LIKE 'art/%' ORDER BY doc_id LIMIT 200"
TASKS = "/v1/prototypes/discover/tasks"


def wait(client: httpx.Client, task_id: str, until=lambda t: t["status"] not in ("queued", "running"),
         timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        t = client.get(f"{TASKS}/{task_id}").json()
        if until(t):
            return t
        assert time.monotonic() < deadline, t
        time.sleep(0.05)


def test_a_background_discovery_answers_as_the_request_does(client):
    body = {"topic": {"sql": SQL}, "top_n": 8, "select": "effect", "max_selected": 3, "max_ppl_ratio": 1.5}
    r = client.post(TASKS, json=body)
    assert r.status_code == 202, r.text
    task = r.json()
    assert r.headers["location"] == f"{TASKS}/{task['id']}" and task["status"] in ("queued", "running")
    assert task["result"] is None
    done = wait(client, task["id"])
    assert done["status"] == "completed" and done["error"] is None and done["attempts"] == 1, done
    assert done["progress"] == 1.0 and done["stage"] == "selection" and 0 < done["stage_done"] <= done["stage_total"]
    sync = client.post("/v1/prototypes/discover", json=body).json()
    res = done["result"]
    assert res["index"] == sync["index"] and res["topic"] == sync["topic"] and res["contrast"] == sync["contrast"]
    assert [p["proto_id"] for p in res["prototypes"]] == [p["proto_id"] for p in sync["prototypes"]]
    assert res["selection"]["prototypes"] == sync["selection"]["prototypes"]
    assert [s["effect"] for s in res["selection"]["steps"]] == [s["effect"] for s in sync["selection"]["steps"]]
    # a plain discovery runs in the background too; unknown tasks are 404
    plain = wait(client, client.post(TASKS, json={"topic": {"sql": SQL}, "top_n": 5}).json()["id"])
    assert plain["status"] == "completed" and plain["result"]["selection"] is None
    assert [p["proto_id"] for p in plain["result"]["prototypes"]] == [p["proto_id"] for p in sync["prototypes"]][:5]
    assert_problem(client.get(f"{TASKS}/task_0000"), 404, "task-not-found")
    assert_problem(client.post(TASKS, json={"topic": {"sql": "DROP TABLE documents"}}), 403, "sql-forbidden")


def test_cancelling_a_running_task_stops_its_work(client):
    # every document against a budget of 200: tens of thousands of candidate evaluations if left to run
    slow = client.post(TASKS, json={"topic": {"sql": "SELECT doc_id FROM documents WHERE doc_id % 2 = 0"},
                                    "top_n": 300, "min_support": 1, "min_docs": 1, "select": "effect",
                                    "max_selected": 200, "max_ppl_ratio": 10}).json()
    running = wait(client, slow["id"], until=lambda t: t["status"] != "queued" and t["stage"] is not None)
    assert running["status"] == "running", running
    t0 = time.monotonic()
    r = client.delete(f"{TASKS}/{slow['id']}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    again = client.delete(f"{TASKS}/{slow['id']}")  # cancelling again answers the cancelled task
    assert again.status_code == 200 and again.json()["status"] == "cancelled", again.text
    # the worker is free again soon: a task submitted after the cancel completes
    quick = wait(client, client.post(TASKS, json={"topic": {"sql": SQL}, "top_n": 3}).json()["id"])
    assert quick["status"] == "completed"
    assert time.monotonic() - t0 < 30
    after = client.get(f"{TASKS}/{slow['id']}").json()
    assert after["status"] == "cancelled" and after["result"] is None and after["progress"] < 1.0
    assert_problem(client.delete(f"{TASKS}/{quick['id']}"), 409, "task-finished", mentions="completed")
    # listed newest first, filtered by status, without results
    listed = client.get(TASKS, params={"limit": 200}).json()
    ids = [t["id"] for t in listed["tasks"]]
    assert ids.index(quick["id"]) < ids.index(slow["id"]) and all(t["result"] is None for t in listed["tasks"])
    assert [t["created_at"] for t in listed["tasks"]] == sorted((t["created_at"] for t in listed["tasks"]), reverse=True)
    cancelled = client.get(TASKS, params={"status": "cancelled"}).json()["tasks"]
    assert slow["id"] in {t["id"] for t in cancelled} and all(t["status"] == "cancelled" for t in cancelled)
    page = client.get(TASKS, params={"limit": 1}).json()
    assert len(page["tasks"]) == 1 and page["next_offset"] == 1 and page["total"] == listed["total"]


def test_a_task_outlives_a_crash_a_bounded_number_of_times(tmp_path):
    db = StateDB(tmp_path)
    t = db.create_task("discover", "tiny", "key:a", {"topic": {"texts": ["a b c"]}})
    first = db.next_task(["tiny"], max_attempts=2)
    assert first["id"] == t["id"] and first["status"] == "running" and first["attempts"] == 1
    assert db.next_task(["other"], max_attempts=2) is None  # not an index this server serves
    # the process died while running it: the next worker starts it again, and then gives up
    second = db.next_task(["tiny"], max_attempts=2)
    assert second["id"] == t["id"] and second["attempts"] == 2
    assert db.next_task(["tiny"], max_attempts=2) is None
    failed = db.task(t["id"])
    assert failed["status"] == "failed" and "started 2 times" in failed["error"]
    # a worker stopping on purpose puts its task back without counting the start
    u = db.create_task("discover", "tiny", "key:a", {})
    assert db.next_task(["tiny"], 2)["attempts"] == 1
    db.requeue_task(u["id"])
    assert db.task(u["id"])["status"] == "queued" and db.next_task(["tiny"], 2)["attempts"] == 1
    # progress is kept; a cancelled task's late result is not stored
    assert db.task_progress(u["id"], "model", 3, 10, 0.22) == "running"
    assert db.cancel_task(u["id"]) and not db.cancel_task(u["id"])
    assert db.task_progress(u["id"], "selection", 1, 10, 0.55) == "cancelled"
    assert not db.finish_task(u["id"], result={"x": 1})
    gone = db.task(u["id"])
    assert gone["status"] == "cancelled" and gone["result"] is None and gone["stage"] == "model"
    assert db.active_tasks("key:a") == 0
    assert db.purge_finished(0.0) == 2 and db.task(u["id"]) is None


@pytest.mark.slow
def test_a_task_survives_sigkill_and_a_stop(index, tmp_path):
    """Killed while running: started again after the restart and completed, its starts counted; stopped
    on purpose (SIGTERM) while running: put back without counting the start."""
    state = tmp_path / "state"
    body = {"topic": {"sql": "SELECT doc_id FROM documents"}, "top_n": 60, "min_support": 1, "min_docs": 1,
            "select": "effect", "max_selected": 12, "max_ppl_ratio": 10}

    def running(server: Server, task_id: str) -> dict:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            return wait(c, task_id, until=lambda t: t["status"] == "running" and t["stage"] in ("model", "selection"))

    first = Server([f"tiny={index}"], state, tmp_path / "first.log")
    try:
        first.wait_ready()
        task_id = httpx.post(first.url + TASKS, json=body, timeout=30).json()["id"]
        assert running(first, task_id)["attempts"] == 1
        first.signal(signal.SIGKILL)
        first.proc.wait(10)
    finally:
        first.stop()
    second = Server([f"tiny={index}"], state, tmp_path / "second.log")
    try:
        second.wait_ready()
        assert running(second, task_id)["attempts"] == 2
        second.signal(signal.SIGTERM)
        second.proc.wait(60)
    finally:
        second.stop()
    put_back = StateDB(state).task(task_id)
    assert put_back["status"] == "queued" and put_back["attempts"] == 1, put_back
    third = Server([f"tiny={index}"], state, tmp_path / "third.log")
    try:
        third.wait_ready()
        with httpx.Client(base_url=third.url, timeout=60) as c:
            done = wait(c, task_id, timeout=300)
            assert done["status"] == "completed" and done["attempts"] == 2, done  # killed (counted), stopped (not counted), completed
            sync = c.post("/v1/prototypes/discover", json=body, timeout=300).json()
        assert done["result"]["selection"]["prototypes"] == sync["selection"]["prototypes"]
    finally:
        third.stop()
