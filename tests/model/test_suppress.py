"""Prototype suppression at inference: suppressed prototypes contribute nothing to the logits."""

from __future__ import annotations

import pytest
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


def test_graded_strength_scales_the_listed_prototypes_contributions():
    torch.manual_seed(0)
    model = PRISM(tiny_model_cfg()).eval()
    x = torch.randint(0, 400, (32,))
    with torch.no_grad():
        base = model(x[None], return_head=True)
        counts = torch.bincount(base.head.proto_idx.reshape(-1), minlength=32)
        ids = counts.topk(3).indices
        at = {a: model(x[None], suppress=ids, alpha=a).logits[0] for a in (0.0, 0.5, 1.0, 2.0)}
        # per id: the first at 0.5, the others at 2
        mixed = model(x[None], suppress=ids, alpha=torch.tensor([0.5, 2.0, 2.0])).logits[0]
    assert torch.allclose(at[1.0], base.logits[0], atol=1e-5)  # alpha 1 is the model as it is
    assert torch.allclose(at[0.0], model(x[None], suppress=ids).logits[0], atol=1e-6)  # 0 is suppression
    for a in (0.5, 2.0):  # the logits are affine in alpha: l(a) = l(1) + (a - 1) (l(1) - l(0))
        assert torch.allclose(at[a], at[1.0] + (a - 1.0) * (at[1.0] - at[0.0]), atol=1e-4)
    d = model.decompose(x, tokens=base.logits[0].argmax(-1))  # exact per prototype, as in the decomposition
    scale = torch.ones(32)
    scale[ids] = torch.tensor([0.5, 2.0, 2.0])
    expected = d.logit + (d.contrib * (scale[d.proto_idx] - 1.0)).sum(-1)
    got = mixed.gather(1, base.logits[0].argmax(-1)[:, None])[:, 0]
    assert (got - expected).abs().max().item() < 1e-4
    for bad, msg in ((dict(alpha=-0.1), "alpha"), (dict(alpha=float("nan")), "alpha"),
                     (dict(alpha=torch.tensor([1.0, 2.0])), "2 values for 3")):
        with pytest.raises(ValueError, match=msg):
            model(x[None], suppress=ids, **bad)
    with pytest.raises(ValueError, match="twice"):
        model(x[None], suppress=torch.tensor([1, 1]), alpha=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        model(x[None], suppress=torch.tensor([32]))


def test_projection_also_scales_the_residual_along_the_listed_prototypes():
    torch.manual_seed(0)
    model = PRISM(tiny_model_cfg()).eval()
    x = torch.randint(0, 400, (16,))
    ids = torch.tensor([3, 7, 11])
    with torch.no_grad():
        z = model.hidden(x[None])[0]
        h = model.head(z)
        P = model.head.prototypes.float()[ids]  # (3, d)
        r = z - h.zhat
        in_span = r @ torch.linalg.pinv(P) @ P  # the residual's part in the span of the listed prototypes
        for a in (0.0, 0.5):
            got = model(x[None], suppress=ids, alpha=a, project=True).logits[0]
            plain = model(x[None], suppress=ids, alpha=a).logits[0]
            assert torch.allclose(got, plain + (a - 1.0) * in_span @ model.W.T, atol=1e-4)
        with pytest.raises(ValueError, match="one alpha"):
            model(x[None], suppress=ids, alpha=torch.tensor([0.0, 0.5, 0.5]), project=True)


def test_rerouting_chooses_each_token_s_active_set_again_without_the_listed_prototypes():
    """Re-routed removal: no listed prototype is active, each token's new set is its k nearest among the
    others (checked against a brute-force ranking of every prototype), the residual is the unsteered
    model's, and tokens whose set held no listed prototype keep their logits exactly."""
    torch.manual_seed(0)
    model = PRISM(tiny_model_cfg()).eval()
    x = torch.randint(0, 400, (24,))
    with torch.no_grad():
        z = model.hidden(x[None])[0]
        h = model.head(z)
        counts = torch.bincount(h.proto_idx.reshape(-1), minlength=32)
        ids = counts.topk(3).indices
        got = model(x[None], suppress=ids, reroute=True).logits[0]
        h2 = model.head(z, exclude=ids)
        sim = torch.nn.functional.normalize(z, dim=-1) @ torch.nn.functional.normalize(model.head.prototypes, dim=-1).T
        sim[:, ids] = -float("inf")
        want_idx = sim.topk(model.head.k, dim=-1).indices
        r = z - h.zhat
        expected = (r + h2.zhat) @ model.W.T
    assert not torch.isin(h2.proto_idx, ids).any()
    assert torch.equal(h2.proto_idx.sort(-1).values, want_idx.sort(-1).values)
    assert torch.allclose(got, expected, atol=1e-5)
    untouched = ~torch.isin(h.proto_idx, ids).any(-1)
    assert untouched.any() and (~untouched).any()
    assert torch.allclose(got[untouched], model(x[None]).logits[0][untouched], atol=1e-5)
    # the decomposition stays exact: W r plus the new active prototypes' contributions
    contrib = (h2.acts[..., None] * model.head.prototypes[h2.proto_idx]).sum(1) @ model.W.T
    assert torch.allclose(got, r @ model.W.T + contrib, atol=1e-4)
    with torch.no_grad():  # generation takes it too
        g = model.generate(x[None, :8], 5, suppress=ids, reroute=True)
    assert g.shape == (1, 13)
    with pytest.raises(ValueError, match="alpha must be 0"):
        model(x[None], suppress=ids, alpha=0.5, reroute=True)
    with pytest.raises(ValueError, match="choose one"):
        model(x[None], suppress=ids, reroute=True, project=True)
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        model.head(z, exclude=torch.tensor([32]))
    with pytest.raises(ValueError, match="must stay"):
        model(x[None], suppress=torch.arange(32 - model.head.k + 1), reroute=True)
