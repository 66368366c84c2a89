"""The LDS levers' measurements rest on two facts checked here on the tiny index: the last block's
projection gradients of one batch are each token's own gradient (``delta_t h_t^T``, as autograd gives
it for that token's loss alone), the per-document aggregations over contiguous token runs equal
their direct definitions, and the true Fisher's closed-form diagonal is the expectation of ``u u^T``
over targets drawn from the model's prediction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.attribution.levers import ProjectionCurvature, Segments, projection_grads, true_fisher_diag
from prism_tda.engine import Attributor


def test_projection_gradients_are_each_tokens_own(index):
    att = Attributor.open(index)
    model = att.model
    seqs = [att.reader.sequence_tokens(s) for s in range(min(3, att.reader.n_seqs))]
    toks, tgts = [t for t, _ in seqs], [g for _, g in seqs]
    pg = projection_grads(model, toks, tgts)
    assert len(pg["mlp"][0]) == sum(len(t) for t in toks)
    last = model.blocks[-1]
    checked = 0
    offset = 0
    for tk, tg in zip(toks, tgts, strict=True):
        for t in sorted({0, len(tk) // 2, len(tk) - 1}):
            z = model.hidden(torch.tensor([tk]))
            loss = F.cross_entropy((z[0, t] @ model.W.T)[None], torch.tensor([tg[t]]))
            for name, weight in (("mlp", last.mlp.proj.weight), ("attn", last.attn.proj.weight)):
                g = torch.autograd.grad(loss, weight, retain_graph=True)[0]
                delta, h = pg[name][0][offset + t], pg[name][1][offset + t]
                assert torch.allclose(torch.outer(delta, h), g, atol=1e-5, rtol=1e-4)
                checked += 1
        offset += len(tk)
    assert checked >= 6


def test_projection_curvature_self_influence_is_the_quadratic_form():
    torch.manual_seed(0)
    d, h = torch.randn(200, 6), torch.randn(200, 10)
    pc = ProjectionCurvature.fit(d, h)
    dr, hr = pc.rotate(d[:3], h[:3])
    for i in range(3):
        g = torch.outer(dr[i], hr[i])
        assert pc.self_influence(dr[i : i + 1], hr[i : i + 1])[0] == pytest.approx(float((g * g * pc.inv).sum()), rel=1e-5)


def test_segment_aggregations_match_their_definitions():
    rng = np.random.default_rng(0)
    docs = np.sort(rng.choice([0, 2, 3, 7], 60))
    v = rng.normal(size=60)
    seg = Segments(docs, 9)
    for d in range(9):
        mine = v[docs == d]
        assert seg.max(v)[d] == (mine.max() if len(mine) else 0.0)
        assert seg.sum(v)[d] == pytest.approx(mine.sum())
        top = seg.top_m_signed(v, (2,))[2][d]
        pos, neg = np.sort(mine[mine > 0])[::-1][:2], np.sort(mine[mine < 0])[:2]
        assert top == pytest.approx(pos.sum() + neg.sum())
    with pytest.raises(AssertionError):
        Segments(docs[::-1].copy(), 9)


def test_true_fisher_diagonal_is_the_expectation_over_predicted_targets():
    torch.manual_seed(0)
    V, d = 11, 5
    W, z = torch.randn(V, d), torch.randn(3, d)
    Q = torch.linalg.qr(torch.randn(d, d))[0]
    got = true_fisher_diag(z, W, Q)
    p = torch.softmax(z.double() @ W.double().T, -1)
    for t in range(3):  # sum over every target y of p(y) (Q^T u_y)^2, u_y = W^T (p - e_y)
        u = (p[t][None, :] - torch.eye(V, dtype=torch.float64)) @ W.double()  # (V, d): one row per y
        want = (p[t][:, None] * (u @ Q.double()).pow(2)).sum(0)
        assert torch.allclose(got[t].double(), want, rtol=1e-5, atol=1e-7)
