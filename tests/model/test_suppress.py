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


def test_gated_suppression_acts_where_the_set_held_its_share_over_the_window_and_nowhere_else():
    """Conditional steering: the gate at t is the listed prototypes' share of the activation mass averaged
    over the last ``window`` positions (checked against a loop over positions); where it is open the logits
    are the suppressed model's, elsewhere the model's own, exactly; the gate is causal, the last position
    of a shorter context gets the same logits as in the full pass, and generation takes it."""
    torch.manual_seed(0)
    model = PRISM(tiny_model_cfg()).eval()
    x = torch.randint(0, 400, (2, 30))
    with torch.no_grad():
        z = model.hidden(x)
        h = model.head(z.reshape(-1, z.shape[-1]))
        counts = torch.bincount(h.proto_idx.reshape(-1), minlength=32)
        ids = counts.topk(3).indices
        acts = h.acts.view(2, 30, -1)
        share = (acts * torch.isin(h.proto_idx.view(2, 30, -1), ids)).sum(-1) / acts.sum(-1)
        window = 5
        want_mean = torch.stack([share[:, max(0, t - window + 1) : t + 1].mean(1) for t in range(30)], 1)
        g = float(want_mean.median())  # about half the positions open
        want = want_mean >= g
        got = model.suppression_gate(z, ids, g, window)
        assert torch.equal(got, want) and want.any() and (~want).any()
        full, base = model(x, suppress=ids).logits, model(x).logits
        gated = model(x, suppress=ids, gate=g, gate_window=window).logits
        assert torch.allclose(gated[want], full[want], atol=1e-5)
        assert torch.equal(gated[~want], base[~want])
        assert torch.allclose(model(x, suppress=ids, gate=0.0).logits, full)  # gate 0: everywhere
        x2 = x.clone()
        x2[:, 20:] = 7  # later tokens never open or close an earlier gate
        assert torch.equal(model.suppression_gate(model.hidden(x2), ids, g, window)[:, :20], got[:, :20])
        for T in (1, 4, 13, 30):
            last = model(x[:, :T], suppress=ids, gate=g, gate_window=window, last_only=True).logits[:, -1]
            assert torch.allclose(last, gated[:, T - 1], atol=1e-5)
        out = model.generate(x[:1, :6], 4, suppress=ids, gate=g, gate_window=window)
        assert out.shape == (1, 10)
    for bad, msg in ((dict(gate=1.5), "gate"), (dict(gate=float("nan")), "gate"), (dict(gate=0.1, gate_window=0), "gate_window")):
        with pytest.raises(ValueError, match=msg):
            model(x, suppress=ids, **bad)
