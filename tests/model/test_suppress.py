"""Prototype suppression at inference: suppressed prototypes contribute nothing to the logits."""

from __future__ import annotations

import torch

from prism_tda.model import PRISM
from tests.conftest import tiny_model_cfg


def test_suppressed_logits_are_the_logits_minus_the_suppressed_contributions():
    torch.manual_seed(0)
    model = PRISM(tiny_model_cfg()).eval()
    x = torch.randint(0, 400, (32,))
    with torch.no_grad():
        base = model(x[None], return_head=True)
    # suppress the two prototypes most often active in this sequence, and one never active
    counts = torch.bincount(base.head.proto_idx.reshape(-1), minlength=32)
    suppress = torch.cat([counts.topk(2).indices, (counts == 0).nonzero().flatten()[:1]])
    with torch.no_grad():
        sup = model(x[None], suppress=suppress).logits[0]  # (T, V)
    assert not torch.allclose(sup, base.logits[0])
    for tokens in (torch.randint(0, 400, (32,)), base.logits[0].argmax(-1)):
        d = model.decompose(x, tokens=tokens)
        hit = torch.isin(d.proto_idx, suppress)
        expected = d.logit - (d.contrib * hit).sum(-1)
        got = sup.gather(1, tokens[:, None])[:, 0]
        assert (got - expected).abs().max().item() < 1e-4
    # last_only agrees with the full pass, and generation with nothing suppressed is unchanged
    with torch.no_grad():
        last = model(x[None], last_only=True, suppress=suppress).logits[0, -1]
    assert torch.allclose(last, sup[-1], atol=1e-5)
    g0 = model.generate(x[None, :8], 6)
    assert torch.equal(model.generate(x[None, :8], 6, suppress=torch.tensor([], dtype=torch.long)), g0)
