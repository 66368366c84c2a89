"""Shared fixtures: a tiny real-text corpus, a tiny tokenizer and tiny model configs."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from prism_tda import demo_corpus_path
from prism_tda.indexer import IndexConfig
from prism_tda.indexer.run import build_index
from prism_tda.model import ModelConfig, TrainConfig
from prism_tda.model.tokenizer import train_tokenizer
from prism_tda.model.train import Trainer

torch.set_num_threads(min(2, os.cpu_count() or 1))

REPO = Path(__file__).resolve().parents[1]


def assert_same_float16(a, b, *, what: str = "") -> None:
    """Two builds' stored float16 values (``self.npy``): equal, but for the rounding of a token whose
    float32 I(t, t) from the forward pass came out a last bit apart in the other process (a matrix
    product's order is not fixed across processes on every CPU): at most one float16 step apart, and
    no more than one value in a thousand at all."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype == np.float16 and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_max_ulp(a, b, maxulp=1)
    assert (a != b).mean() <= 1e-3, (what, int((a != b).sum()), a.size)


@pytest.fixture(autouse=True)
def _torch_threads():
    """A server started by a test sets torch's threads for its computations: give them back after it."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """600 documents of the bundled demo corpus, as JSONL."""
    path = tmp_path_factory.mktemp("corpus") / "tiny.jsonl"
    with gzip.open(demo_corpus_path(), "rt") as src, open(path, "w") as dst:
        for i, line in enumerate(src):
            if i >= 600:
                break
            dst.write(line)
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_corpus, tmp_path_factory) -> Path:
    texts = [json.loads(line)["text"] for line in open(tiny_corpus)]
    tok = train_tokenizer(texts, vocab_size=400)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def tiny_model_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=400, block_size=32, n_layer=2, n_head=2, d_model=32, n_prototypes=32, n_active=4)
    base.update(kw)
    return ModelConfig(**base)


def tiny_train_cfg(**kw) -> TrainConfig:
    base = dict(batch_size=8, max_steps=20, lr=3e-3, min_lr=3e-4, warmup_steps=5, eval_every=10,
                eval_tokens=2048, ckpt_every=10, reseed_every=5, val_fraction=0.1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_corpus, tiny_tokenizer, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    t = Trainer(tiny_model_cfg(), tiny_train_cfg(max_steps=40), [tiny_corpus], out / "run",
                tokenizer_path=tiny_tokenizer, progress=False).setup()
    return t.fit()


def index_cfg(**kw) -> IndexConfig:
    base = dict(shard_bytes=36_000, batch_size=16, embed_dim=16, sketch_buckets=8, posting_cells=16, code_bits=8)
    base.update(kw)
    return IndexConfig(**base)


@pytest.fixture(scope="session")
def index(tiny_ckpt, tiny_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("index") / "ix"
    build_index(tiny_ckpt, [tiny_corpus], out, index_cfg(), progress=False)
    return out




@pytest.fixture(scope="module")
def local_ray():
    """A Ray cluster on this machine for one test module. 2 cores: actors take half a CPU each
    (whole-CPU actors would wait for each other)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="prism-test",
             object_store_memory=96 * 1024**2)
    yield ray
    ray.shutdown()
