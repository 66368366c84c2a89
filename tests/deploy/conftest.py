"""Index versions for the deployment tests, and a real `prism serve` subprocess.

``index_a`` and ``index_b`` come from the session's tiny checkpoint over two disjoint halves of the
tiny corpus, so every answer tells which version produced it; ``index_other_model`` comes from
another tiny checkpoint (another seed), so a server of the first must refuse it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prism_tda.indexer.run import build_index
from prism_tda.model.train import Trainer
from tests.conftest import index_cfg, tiny_model_cfg, tiny_train_cfg
from tests.service.conftest import free_port


def _subset(src: Path, dst: Path, lines: range) -> Path:
    with open(src) as f:
        rows = [line for i, line in enumerate(f) if i in lines]
    dst.write_text("".join(rows))
    return dst


def external_ids(path: Path) -> set[str]:
    return {str(json.loads(line)["id"]) for line in open(path)}


@pytest.fixture(scope="session")
def halves(tiny_corpus, tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("halves")
    return _subset(tiny_corpus, d / "a.jsonl", range(0, 300)), _subset(tiny_corpus, d / "b.jsonl", range(300, 600))


@pytest.fixture(scope="session")
def index_a(tiny_ckpt, halves, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("versions") / "v1"
    build_index(tiny_ckpt, [halves[0]], out, index_cfg(), progress=False)
    return out


@pytest.fixture(scope="session")
def index_b(tiny_ckpt, halves, index_a) -> Path:
    out = index_a.parent / "v2"
    build_index(tiny_ckpt, [halves[1]], out, index_cfg(), progress=False)
    return out


@pytest.fixture(scope="session")
def index_other_model(tiny_corpus, tiny_tokenizer, halves, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("other")
    ckpt = Trainer(tiny_model_cfg(), tiny_train_cfg(max_steps=10, seed=7), [tiny_corpus], d / "run",
                   tokenizer_path=tiny_tokenizer, progress=False).setup().fit()
    build_index(ckpt, [halves[0]], d / "ix", index_cfg(), progress=False)
    return d / "ix"


class Server:
    """`prism serve` in a subprocess (the way it is deployed), logging to a file."""

    def __init__(self, indexes: list[str], state_dir: Path, log_path: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, "PRISM_RATE_LIMIT_PER_MINUTE": "0", "PRISM_TORCH_THREADS": "1",
                    "PRISM_AUDIT_POLL_S": "0.1", **env}
        args = [a for ix in indexes for a in ("--index", ix)]
        self.proc = subprocess.Popen([sys.executable, "-m", "prism_tda.cli", "serve", *args, "--port", str(self.port),
                                      "--state-dir", str(state_dir)], env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the server exited:\n" + self.log()
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("the server did not become ready:\n" + self.log())

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture
def server_factory(tmp_path) -> Iterator:
    started: list[Server] = []

    def make(indexes: list[str], **env: str) -> Server:
        s = Server(indexes, tmp_path / f"state{len(started)}", tmp_path / f"server{len(started)}.log", **env)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
