"""Index versions for the deployment tests.

``index_a`` and ``index_b`` come from the session's tiny checkpoint over two disjoint halves of the
tiny corpus, so every answer tells which version produced it; ``index_other_model`` comes from
another tiny checkpoint (another seed), so a server of the first must refuse it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism_tda.indexer.run import build_index
from prism_tda.model.train import Trainer
from tests.conftest import index_cfg, tiny_model_cfg, tiny_train_cfg
from tests.service.conftest import Server, server_factory  # noqa: F401  (the fixture, for these tests)


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
