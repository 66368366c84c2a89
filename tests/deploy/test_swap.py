"""Live index swap against a real `prism serve`: requests keep flowing while the served index is
replaced (by SIGHUP after moving a symlink, and by the admin endpoint), none fails, answers come
from the new version once the swap returns, and an index of another model is refused while the
old version keeps serving."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.service.conftest import assert_problem

from .conftest import external_ids

QUERY = {"prompt": "A computer", "completion": " is a machine", "top_k": 5, "mode": "exact"}


class Load:
    """Client threads sending attribution requests in a loop; every outcome is recorded."""

    def __init__(self, url: str, n_threads: int = 2) -> None:
        self.url, self.results = url, []  # (t_start, t_end, status or exception name, external ids)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n_threads)]

    def _loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    r = c.post("/v1/attribute", json=QUERY)
                    ok = r.status_code == 200
                    ids = {d["external_id"] for d in r.json()["documents"]} if ok else set()
                    self.results.append((t0, time.monotonic(), r.status_code, ids, "" if ok else r.text[:500]))
                except Exception as e:  # noqa: BLE001 - a transport error is a failed request here
                    self.results.append((t0, time.monotonic(), type(e).__name__, set(), repr(e)))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.results) < n:
            assert time.monotonic() < deadline, "the load made no progress"
            time.sleep(0.05)

    def started_after(self, t: float) -> list[tuple]:
        return [r for r in list(self.results) if r[0] > t]


def version_of(ids: set[str], a: set[str], b: set[str]) -> str:
    assert ids, "an answer without documents"
    if ids <= a:
        return "a"
    if ids <= b:
        return "b"
    raise AssertionError(f"an answer mixes both versions: {ids}")


@pytest.mark.slow
def test_swap_under_load_fails_no_request_and_refuses_another_model(index_a, index_b, index_other_model, halves,
                                                                    server_factory, tmp_path):
    ids_a, ids_b = external_ids(halves[0]), external_ids(halves[1])
    current = tmp_path / "current"
    current.symlink_to(index_a)
    server = server_factory([f"tiny={current}"])
    server.wait_ready()
    with Load(server.url) as load:
        load.wait_for(5)
        failed = [r for r in load.results if r[2] != 200]
        assert not failed, f"{failed[:3]}\n" + server.log()
        assert {version_of(r[3], ids_a, ids_b) for r in load.results} == {"a"}

        # 1. SIGHUP after the symlink moved to v2: the server reloads it in place.
        tmp_link = tmp_path / "current.new"
        tmp_link.symlink_to(index_b)
        os.replace(tmp_link, current)
        t_hup = time.monotonic()
        server.signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while not any(version_of(r[3], ids_a, ids_b) == "b" for r in load.started_after(t_hup) if r[2] == 200):
            assert time.monotonic() < deadline, "SIGHUP did not switch to the new version:\n" + server.log()
            time.sleep(0.1)
        t_switched = time.monotonic()
        load.wait_for(len(load.results) + 4)
        assert {version_of(r[3], ids_a, ids_b) for r in load.started_after(t_switched)} == {"b"}

        # 2. The admin endpoint, with an explicit directory: back to v1.
        r = httpx.post(server.url + "/v1/admin/indexes/tiny/reload", json={"dir": str(index_a)}, timeout=120)
        t_swapped = time.monotonic()
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["index"] == "tiny" and body["current"]["dir"] == str(index_a)
        assert body["previous"]["dir"] == str(current)
        assert body["current"]["corpus_fingerprint"] != body["previous"]["corpus_fingerprint"]
        load.wait_for(len(load.results) + 4)
        assert {version_of(r[3], ids_a, ids_b) for r in load.started_after(t_swapped)} == {"a"}

        # 3. An index of another model is refused; v1 keeps serving.
        r = httpx.post(server.url + "/v1/admin/indexes/tiny/reload", json={"dir": str(index_other_model)},
                       timeout=120)
        assert_problem(r, 409, "index-mismatch", mentions="checkpoint_sha256")
        assert str(index_other_model) in r.json()["detail"]
        # ... and neither is a directory that is not an index, nor an unknown index name.
        assert_problem(httpx.post(server.url + "/v1/admin/indexes/tiny/reload", json={"dir": str(tmp_path)}),
                       422, "invalid-index", mentions="not a complete index")
        assert_problem(httpx.post(server.url + "/v1/admin/indexes/nope/reload"), 404, "unknown-index")
        t_refused = time.monotonic()
        load.wait_for(len(load.results) + 4)
        assert {version_of(r[3], ids_a, ids_b) for r in load.started_after(t_refused)} == {"a"}
        # SIGHUP with an unchanged directory reloads the same version and fails nothing either.
        server.signal(signal.SIGHUP)
        deadline = time.monotonic() + 60  # the reload runs in the background: wait for it under load
        while server.log_path.read_text().count("index swapped") < 3:
            assert time.monotonic() < deadline, "SIGHUP with an unchanged directory did not reload:\n" + server.log()
            time.sleep(0.1)
        load.wait_for(len(load.results) + 6)

    failed = [r for r in load.results if r[2] != 200]
    assert not failed, f"{len(failed)} of {len(load.results)} requests failed: {failed[:5]}\n" + server.log()
    assert len(load.results) >= 20
    ready = httpx.get(server.url + "/readyz").json()
    assert ready["indexes"][0]["documents"] == 300
    assert server.log_path.read_text().count("index swapped") >= 3  # SIGHUP, admin, SIGHUP


@pytest.mark.slow
def test_admin_keys_guard_the_admin_endpoint(index_a, server_factory):
    server = server_factory([f"tiny={index_a}"], PRISM_API_KEYS='["user-key"]', PRISM_ADMIN_API_KEYS='["admin-key"]')
    server.wait_ready()
    url = server.url + "/v1/admin/indexes/tiny/reload"
    assert_problem(httpx.post(url), 401, "unauthorized")
    assert_problem(httpx.post(url, headers={"Authorization": "Bearer user-key"}), 401, "unauthorized",
                   mentions="PRISM_ADMIN_API_KEYS")
    r = httpx.post(url, headers={"Authorization": "Bearer admin-key"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["current"]["dir"] == r.json()["previous"]["dir"]
    # an admin key also works on the other endpoints (where it sees every key's audits)
    r = httpx.post(server.url + "/v1/attribute", json=QUERY, headers={"Authorization": "Bearer admin-key"}, timeout=60)
    assert r.status_code == 200, r.text
