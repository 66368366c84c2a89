"""The bundled demo model: a checkpoint that loads with its files' digests checked, trained on the bundled
corpus (its training record's fingerprint is this installation's corpus), with a record of what it read."""

from __future__ import annotations

import math

import pytest
import torch

from prism_tda import demo_corpus_path, demo_model_path
from prism_tda.corpus import fingerprint
from prism_tda.model import checkpoint as ckpt

pytestmark = pytest.mark.skipif(demo_model_path() is None, reason="this tree bundles no demo model")


def test_bundled_model_loads_and_names_the_bundled_corpus():
    path = demo_model_path()
    assert path is not None
    model, tokenizer, config = ckpt.load_checkpoint(path)
    assert config["model"]["head"] == "prism"
    rec = ckpt.load_record(path)
    assert rec is not None and rec.corpus["corpus_fingerprint"] == fingerprint([demo_corpus_path()])
    assert rec.step == config["training"]["step"] > 0
    # the record holds the training split of the bundled corpus, almost all of it trained on
    data = config["training"]["data"]
    assert len(rec.keys) == data["train_documents"] and rec.n_trained > 0.9 * data["train_documents"]
    ids = torch.tensor([tokenizer.encode("The only way to get rid of a temptation is to yield to it.").ids])
    with torch.no_grad():
        out = model(ids[:, :-1], ids[:, 1:])
    assert out.logits is not None and out.logits.shape[-1] == config["model"]["vocab_size"]
    # a trained model: well below the uniform distribution's loss on a fortune
    assert out.losses["ce"].item() < 0.75 * math.log(config["model"]["vocab_size"])
