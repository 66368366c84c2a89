"""How many torch threads a server's computations get: the cores shared, unless set."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from prism_tda.service import Settings, create_app
from prism_tda.service.app import compute_threads

from .conftest import service_settings


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def test_computations_running_at_once_share_the_cores(tmp_path):
    def threads(**kw) -> int:
        return compute_threads(Settings(state_dir=tmp_path, **kw))

    assert threads(compute_concurrency=1) == cores()
    assert threads(compute_concurrency=2) == max(1, cores() // 2)
    assert threads(compute_concurrency=2, workers=2) == max(1, cores() // 4)
    assert threads(compute_concurrency=10 * cores()) == 1  # never 0
    assert threads(compute_concurrency=2, torch_threads=3) == 3  # set: used as is


def test_the_server_applies_them_when_it_loads(index, tmp_path):
    from fastapi.testclient import TestClient

    want = 1 if torch.get_num_threads() != 1 else 2
    app = create_app(service_settings(index, tmp_path, torch_threads=want))
    with TestClient(app):  # runs the lifespan, which loads the indexes
        # torch keeps the count per thread once a thread has used it; the server computes on threads
        # started after loading, so ask a fresh one
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(torch.get_num_threads).result() == want
