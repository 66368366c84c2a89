"""How many torch threads a server's computations get: the cores shared, unless set."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from prism_tda.service import create_app
from prism_tda.service.app import compute_threads, process_cores
from prism_tda.service.deps import ThreadShare

from .conftest import service_settings


def test_outside_a_computation_every_computation_that_can_run_at_once_shares_the_cores(index, tmp_path):
    def threads(**kw) -> int:
        return compute_threads(service_settings(index, tmp_path, **kw))

    cores = process_cores(service_settings(index, tmp_path))
    assert process_cores(service_settings(index, tmp_path, workers=2)) == max(1, cores // 2)
    assert threads(compute_concurrency=1) == cores
    assert threads(compute_concurrency=2) == max(1, cores // 2)
    assert threads(compute_concurrency=2, workers=2) == max(1, cores // 4)
    assert threads(compute_concurrency=10 * cores) == 1  # never 0
    assert threads(compute_concurrency=2, torch_threads=3) == 3  # set: used as is


def test_a_computation_takes_the_cores_shared_by_those_running_when_it_starts():
    share = ThreadShare(4)
    started, release = threading.Barrier(3), threading.Event()
    seen: list[int] = []

    def work() -> int:
        n = torch.get_num_threads()
        started.wait(5)
        release.wait(5)
        return n

    with ThreadPoolExecutor(3) as pool:
        assert pool.submit(share.run, lambda: torch.get_num_threads()).result() == 4  # alone: every core
        first = pool.submit(share.run, work)
        while share.active < 1:
            pass
        second = pool.submit(share.run, work)
        while share.active < 2:
            pass
        started.wait(5)  # both are running
        release.set()
        seen = [first.result(), second.result()]
    assert seen == [4, 2]  # the first started alone; the second shares with it
    assert share.active == 0
    assert ThreadPoolExecutor(1).submit(ThreadShare(4, fixed=3).run, torch.get_num_threads).result() == 3
    assert ThreadShare(1).run(lambda: 7) == 7


def test_the_server_applies_them_when_it_loads(index, tmp_path):
    from fastapi.testclient import TestClient

    want = 1 if torch.get_num_threads() != 1 else 2
    app = create_app(service_settings(index, tmp_path, torch_threads=want))
    with TestClient(app):  # runs the lifespan, which loads the indexes
        # torch keeps the count per thread once a thread has used it; the server computes on threads
        # started after loading, so ask a fresh one
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(torch.get_num_threads).result() == want
        assert app.state.services.threads.fixed == want
