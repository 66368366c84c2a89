"""Sparse prototype controllers: the cached multiple-choice scores are the model's own, a controller's
scores are the model's with those alphas, the fit lowers its training loss with few prototypes, and a
controller file reads back the same (or names its fault)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
import torch.nn.functional as F

from prism_tda import demo_corpus_path
from prism_tda.engine.control import ChoiceCache, Controller, choice_items, fit, fit_random, random_scores
from prism_tda.errors import QueryError
from prism_tda.model.checkpoint import load_checkpoint


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    model, tok, _ = load_checkpoint(tiny_ckpt)
    with gzip.open(demo_corpus_path(), "rt") as fh:
        texts = [json.loads(line)["text"] for _, line in zip(range(300), fh)]
    items = choice_items([tok.encode(t).ids for t in texts], ending_tokens=4, min_context=6, max_context=24, seed=0)
    return model, items


def test_items_are_questions(setup):
    _, items = setup
    assert len(items) > 40
    for it in items[:20]:
        assert len(it.endings) == 4 and len({tuple(e) for e in it.endings}) == 4
        assert all(len(e) == 4 for e in it.endings) and 0 < len(it.context) <= 24
    assert {it.answer for it in items} == {0, 1, 2, 3}
    with pytest.raises(QueryError, match="a question needs"):
        choice_items([[1, 2, 3]] * 10, ending_tokens=4, min_context=6, max_context=24)


def test_cached_scores_are_the_models_log_probabilities(setup):
    model, items = setup
    cache = ChoiceCache.of(model, items[:6])
    ctrl = Controller(torch.ones(model.head.n_prototypes))
    ctrl.alpha[torch.tensor([1, 5, 9])] = torch.tensor([0.0, 2.0, 0.5])
    with torch.no_grad():
        base, steered = cache.scores(model), cache.scores(model, ctrl.shift(model, cache))
    for q in (0, 5):
        for c in range(4):
            ids = items[q].context + items[q].endings[c]
            x, y = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
            n = len(items[q].endings[c])
            with torch.no_grad():
                lp = -F.cross_entropy(model(x).logits[0], y, reduction="none")[-n:].sum()
                ids_ = torch.tensor(ctrl.prototypes)
                out = model(x, suppress=ids_, alpha=ctrl.alpha[ids_]).logits[0]
                lp_s = -F.cross_entropy(out, y, reduction="none")[-n:].sum()
            assert float(base[q, c]) == pytest.approx(float(lp), abs=1e-3)
            assert float(steered[q, c]) == pytest.approx(float(lp_s), abs=1e-3)


def test_fit_is_sparse_and_lowers_its_training_loss(setup, tmp_path):
    model, items = setup
    cache = ChoiceCache.of(model, items[:60])
    with torch.no_grad():
        before = F.cross_entropy(cache.scores(model), cache.answers)
    ctrl = fit(model, cache, l1=0.2, steps=60, lr=0.05)
    with torch.no_grad():
        after = F.cross_entropy(cache.scores(model, ctrl.shift(model, cache)), cache.answers)
    assert float(after) < float(before)
    assert 0 < len(ctrl.prototypes) < model.head.n_prototypes and bool((ctrl.alpha >= 0).all())
    R, w = fit_random(model, cache, len(ctrl.prototypes), l1=0.2, steps=20)
    assert R.shape == (cache.z.shape[1], len(ctrl.prototypes)) and random_scores(model, cache, R, w).shape == (60, 4)
    path = tmp_path / "c.json"
    ctrl.save(path)
    back = Controller.load(path, model.head.n_prototypes)
    assert torch.allclose(back.alpha, ctrl.alpha) and back.meta["items"] == 60
    with pytest.raises(QueryError, match="for 32 prototypes"):
        Controller.load(path, 64)
    path.write_text('{"kind": "prism-controller", "n_prototypes": 4, "alpha": {"9": 1.0}}')
    with pytest.raises(QueryError, match="c.json"):
        Controller.load(path)
