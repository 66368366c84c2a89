"""The PRISM forward pass: exact logit decomposition, sparsity, sparse autograd, dense baseline."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prism_tda.model import PRISM
from prism_tda.model.sparse import gather_dot, sparse_mix
from tests.conftest import tiny_model_cfg


def _model(**kw) -> PRISM:
    torch.manual_seed(0)
    return PRISM(tiny_model_cfg(**kw)).eval()


def test_logit_decomposition_is_exact_over_the_whole_vocabulary():
    for act_scale in ("lsq", "none"):
        model = _model(act_scale=act_scale)
        x = torch.randint(0, 400, (1, 32))
        with torch.no_grad():
            out = model(x, return_head=True)
            z = out.z[0]  # (T, d)
            h = out.head
            W = model.W
            r = z - h.zhat
            P_sel = model.head.prototypes[h.proto_idx]  # (T, k, d)
            proto_logits = torch.einsum("tk,tkd,vd->tv", h.acts, P_sel, W)
            recon = r @ W.T + proto_logits
        err = (recon - out.logits[0]).abs().max().item()
        assert err < 1e-4, f"{act_scale}: max abs error {err}"


def test_decompose_adds_up_to_the_chosen_logit():
    model = _model()
    x = torch.randint(0, 400, (32,))
    tokens = torch.randint(0, 400, (32,))
    d = model.decompose(x, tokens=tokens)
    total = d.contrib.sum(-1) + d.residual
    assert (total - d.logit).abs().max().item() < 1e-4
    with torch.no_grad():
        logits = model(x[None]).logits[0]
    assert torch.allclose(d.logit, logits.gather(1, tokens[:, None])[:, 0], atol=1e-5)
    greedy = model.decompose(x, positions=torch.tensor([3, 7]))
    assert torch.allclose(greedy.logit, logits[[3, 7]].max(-1).values, atol=1e-5)


def test_activations_are_nonnegative_and_at_most_k_per_token():
    model = _model(n_prototypes=64, n_active=5)
    with torch.no_grad():
        out = model(torch.randint(0, 400, (4, 32)), return_head=True)
    acts, idx = out.head.acts, out.head.proto_idx
    assert acts.shape == (4 * 32, 5) and idx.shape == (4 * 32, 5)
    assert (acts >= 0).all()
    assert ((acts > 0).sum(-1) <= 5).all()
    # the active set is the top-k of the cosine similarities, without repeats
    sim = model.head.similarities(out.z.reshape(-1, 32))
    assert torch.equal(idx, sim.topk(5, dim=-1).indices)
    assert all(len(set(row.tolist())) == 5 for row in idx)
    # only positive similarities carry activation
    top = sim.gather(1, idx)
    assert ((top <= 0) <= (acts == 0)).all()


def test_sparse_primitives_match_dense_autograd():
    torch.manual_seed(1)
    N, K, d, k = 12, 10, 6, 3
    x = torch.randn(N, d, dtype=torch.float64, requires_grad=True)
    y = torch.randn(K, d, dtype=torch.float64, requires_grad=True)
    w = torch.rand(N, k, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(K)[:k] for _ in range(N)])
    values = (x @ y.T).gather(1, idx).detach()
    assert torch.autograd.gradcheck(lambda a, b: gather_dot(a, b, idx, (a @ b.T).gather(1, idx).detach()), (x, y))
    assert torch.autograd.gradcheck(lambda a, b: sparse_mix(a, b, idx), (w, y))
    # against the dense formulation
    g = torch.randn(N, k, dtype=torch.float64)
    (gather_dot(x, y, idx, values) * g).sum().backward()
    gx, gy = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    ((x @ y.T).gather(1, idx) * g).sum().backward()
    assert torch.allclose(gx, x.grad) and torch.allclose(gy, y.grad)


def test_head_gradients_match_a_dense_reference():
    """The sparse head's gradients equal those of a plain dense implementation of DESIGN §1."""
    model = _model()
    head = model.head
    z = torch.randn(64, 32, requires_grad=True)
    out = head(z, with_losses=True)
    loss = sum(out.losses.values()) + (out.acts * torch.randn_like(out.acts)).sum()
    torch.manual_seed(2)
    loss = out.losses["rec"] + out.losses["r1"] + out.losses["r2"] + out.zhat.pow(2).mean()
    gz, gp = torch.autograd.grad(loss, (z, head.prototypes))

    P = head.prototypes
    zn, pn = F.normalize(z, dim=-1), F.normalize(P, dim=-1)
    sim = zn @ pn.T
    top_i = sim.detach().topk(head.k, dim=-1).indices
    s = sim.gather(1, top_i).clamp_min(0)
    m = torch.einsum("nk,nkd->nd", s, P[top_i])
    c = (z * m).sum(-1).clamp_min(0) / (m.pow(2).sum(-1) + 1e-6)
    zhat = m * c[:, None]
    rec = ((z - zhat).pow(2).sum(-1) / (z.pow(2).sum(-1) + 1e-6)).mean()
    near = sim.detach().argmax(0)
    r1 = 1 - (pn * zn.detach()[near]).sum(-1).mean()
    r2 = 1 - sim.gather(1, top_i[:, :1]).mean()
    ref = rec + r1 + r2 + zhat.pow(2).mean()
    rz, rp = torch.autograd.grad(ref, (z, P))
    assert torch.allclose(loss, ref, atol=1e-6)
    assert torch.allclose(gz, rz, atol=1e-5) and torch.allclose(gp, rp, atol=1e-5)


def test_dense_baseline_shares_the_backbone_and_trains_on_ce_only():
    prism, dense = _model(), _model(head="dense")
    assert dense.head is None
    shared = {k for k in prism.state_dict() if not k.startswith("head.")}
    assert shared == set(dense.state_dict())
    x = torch.randint(0, 400, (2, 32))
    out = dense(x, x)
    assert set(out.losses) == {"ce"} and torch.equal(out.loss, out.losses["ce"])
    # same initial backbone, same logits: the head never changes the logits
    with torch.no_grad():
        assert torch.allclose(prism(x).logits, dense(x).logits)


def test_generate_is_greedy_and_deterministic():
    model = _model()
    x = torch.randint(0, 400, (1, 5))
    a = model.generate(x, 10)
    assert a.shape == (1, 15) and torch.equal(a[:, :5], x)
    with torch.no_grad():  # greedy: each new token is the argmax of the logits after the tokens before it
        for t in range(5, 15):
            assert int(a[0, t]) == int(model(a[:, :t]).logits[0, -1].argmax())
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    s1 = model.generate(x, 10, temperature=1.0, generator=g1)
    assert torch.equal(s1, model.generate(x, 10, temperature=1.0, generator=g2))
    assert not torch.equal(s1, a)  # sampling at temperature 1 leaves the greedy path
    top1 = model.generate(x, 10, temperature=1.0, sample_top_k=1, generator=torch.Generator().manual_seed(5))
    assert torch.equal(top1, a)  # sampling from the single most likely token is greedy


def test_configs_of_older_checkpoints_still_load():
    from prism_tda.model import ModelConfig, TrainConfig

    assert ModelConfig.from_dict({"top_k": 3, "n_prototypes": 8}).n_active == 3
    assert TrainConfig.from_dict({"extra": {}, "max_steps": 7}).max_steps == 7


def test_hidden_at_equals_the_full_forward_at_the_positions_asked_for():
    torch.manual_seed(3)
    model = PRISM(tiny_model_cfg()).eval()
    B, T = 5, model.cfg.block_size
    x = torch.randint(0, model.cfg.vocab_size, (B, T))
    keep = torch.zeros(B, T, dtype=torch.bool)
    keep[0, [0, 3, T - 1]] = True  # first and last positions
    keep[2, 7] = True  # sequence 1 asks for nothing
    keep[3, torch.arange(T)] = True  # every position of one sequence
    keep[4, [T // 2, T // 2 + 1]] = True
    rows, pos = keep.nonzero(as_tuple=True)
    with torch.no_grad():
        full = model.hidden(x)
        at = model.hidden_at(x, rows, pos)
    assert at.shape == (len(rows), model.cfg.d_model)
    torch.testing.assert_close(at, full[rows, pos], rtol=0, atol=1e-5)
    # causal: a later token's change moves only the positions after it
    x2 = x.clone()
    x2[0, 5] = (x2[0, 5] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        at2 = model.hidden_at(x2, rows, pos)
    first = rows == 0
    torch.testing.assert_close(at2[first][:2], at[first][:2], rtol=0, atol=0)
    assert not torch.allclose(at2[first][2], at[first][2])
