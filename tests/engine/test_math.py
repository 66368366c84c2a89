"""The engine's math on its own: token-vector codes, the count-sketch, the curvature basis."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prism_tda.engine.codec import TokenCodec, code_bytes, pack, unpack, unpack_torch
from prism_tda.engine.curvature import Curvature, damping_unit, fit_basis
from prism_tda.engine.sketch import Sketch, embed_sequences


@pytest.mark.parametrize("bits", [8, 12, 16])
def test_codes_pack_and_unpack(bits):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 1 << bits, (50, 16))
    packed = pack(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (50, code_bytes(16, bits))
    assert np.array_equal(unpack(packed, bits, 16), codes)
    assert np.array_equal(unpack_torch(packed, bits, 16).numpy(), codes)


@pytest.mark.parametrize("backend", ["faiss", "torch"])
@pytest.mark.parametrize("bits", [8, 12, 16])
def test_codes_are_each_sub_vector_s_nearest_centroid(bits, backend):
    """The encoder's codes equal a brute-force nearest-centroid search, sub-vector by sub-vector, with
    FAISS (a CPU's encoder) and with torch's batched products (an accelerator's)."""
    g = torch.Generator().manual_seed(2)
    V, d, N, n_sub = 30, 16, 300, 4
    W, Q = torch.randn(V, d, generator=g), torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    scale = torch.rand(d, generator=g) + 0.5
    cents = torch.randn(n_sub, 1 << bits, d // n_sub, generator=g)
    codec = TokenCodec(cents, scale, W, Q, bits)
    y = torch.randint(0, V, (N,), generator=g)
    ut = torch.randn(N, d, generator=g)
    x = ((ut + W[y] @ Q) * scale).view(N, n_sub, -1)
    want = torch.stack([torch.cdist(x[:, j], cents[j]).argmin(1) for j in range(n_sub)], 1).numpy()
    got = unpack(codec.encode(ut, y, backend=backend)[0], bits, n_sub)
    assert (got == want).mean() > 0.999  # float ties aside


def test_torch_encoder_chooses_the_codebooks_as_faiss_does(monkeypatch):
    """The accelerator's encoder (torch, in chunks of rows) and the CPU's (FAISS) give the same codes
    and the same choice between the m_t and direction codebooks, on tokens of both kinds (a codebook
    with fewer centroids than points: with more, many centroids are equally near)."""
    import prism_tda.engine.codec as codec_mod

    g = torch.Generator().manual_seed(5)
    V, d, N = 50, 16, 3000
    W, Q = torch.randn(V, d, generator=g), torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    y = torch.randint(0, V, (N,), generator=g)
    m = torch.randn(N, d, generator=g) * 0.3
    small = torch.arange(N) % 3 == 0
    ut = torch.where(small[:, None], 1e-3 * torch.randn(N, d, generator=g), m - W[y] @ Q)
    codec = TokenCodec.train(ut + W[y] @ Q, torch.rand(d, generator=g) + 0.5, W, Q, n_sub=4, bits=8, seed=0, u=ut)
    monkeypatch.setattr(codec_mod, "ENCODE_BLOCK_BYTES", 4 * 4 * 256 * 700)  # chunks of 700 rows
    c_f, dir_f = codec.encode(ut, y, backend="faiss")
    c_t, dir_t = codec.encode(ut, y, backend="torch")
    assert dir_f[small.numpy()].mean() > 0.9 and dir_f[~small.numpy()].mean() < 0.1  # both codebooks in use
    assert (dir_f == dir_t).mean() > 0.998
    assert (unpack(c_f, 8, 4) == unpack(c_t, 8, 4)).all(1).mean() > 0.998  # float ties aside
    with pytest.raises(ValueError, match="backend"):
        codec.encode(ut, y, backend="cuda")


def test_codec_keeps_the_target_row_exact_and_the_rest_close():
    g = torch.Generator().manual_seed(0)
    V, d, N = 50, 16, 4000
    W, Q = torch.randn(V, d, generator=g), torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    y = torch.randint(0, V, (N,), generator=g)
    m = torch.randn(N, d, generator=g) * 0.3  # the expected embeddings, in the Q basis
    ut = m - W[y] @ Q  # Q^T u = Q^T (W^T p - W[y])
    codec = TokenCodec.train(m, torch.ones(d), W, Q, n_sub=4, bits=8, seed=0)
    codes, is_dir = codec.encode(ut, y)
    assert not is_dir.any()  # no direction codebook: every token stores m_t
    dec = codec.decode(codes, y.numpy())
    # the error is the quantisation error of m alone, far below the size of u
    err = (dec - ut).norm(dim=1) / ut.norm(dim=1)
    assert float(err.mean()) < 0.15
    assert float(((dec - ut) - (m - m)).norm(dim=1).mean()) <= float((m - 0).norm(dim=1).mean())


def test_direction_codes_keep_the_direction_of_small_token_vectors():
    """Confidently predicted tokens (u_t tiny beside m_t) store their direction; the m_t codes would
    leave an error larger than u_t itself. With the length the reader restores, their vectors stay
    close; large vectors keep the m_t codes."""
    g = torch.Generator().manual_seed(3)
    V, d, N = 50, 16, 4000
    W, Q = torch.randn(V, d, generator=g), torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    y = torch.randint(0, V, (N,), generator=g)
    m = torch.randn(N, d, generator=g) * 0.3
    small = torch.arange(N) % 2 == 0  # half the tokens: u_t = 1e-3 x a random direction (memorised)
    ut = torch.where(small[:, None], 1e-3 * torch.randn(N, d, generator=g), m - W[y] @ Q)
    m = ut + W[y] @ Q
    plain = TokenCodec.train(m, torch.ones(d), W, Q, n_sub=4, bits=8, seed=0)
    mixed = TokenCodec.train(m, torch.ones(d), W, Q, n_sub=4, bits=8, seed=0, u=ut)
    codes, is_dir = mixed.encode(ut, y)
    assert is_dir[small.numpy()].mean() > 0.99 and is_dir[~small.numpy()].mean() < 0.05
    dec = mixed.decode(codes, y.numpy(), is_dir)
    at = torch.from_numpy(is_dir)
    norms = dec[at].norm(dim=1)  # about unit length (the reader sets the length from the stored I(t, t))
    assert abs(float(norms.mean()) - 1) < 0.1 and float((norms - 1).abs().max()) < 0.35
    dec[at] *= (ut[at].norm(dim=1) / norms)[:, None]
    cos_mixed = torch.nn.functional.cosine_similarity(dec[small], ut[small], dim=1)
    cos_plain = torch.nn.functional.cosine_similarity(plain.decode(plain.encode(ut, y)[0], y.numpy())[small],
                                                      ut[small], dim=1)
    assert float(cos_mixed.mean()) > 0.9 and float(cos_plain.mean()) < 0.5
    # the large vectors are coded as before
    big = ~small & ~at
    assert torch.equal(dec[big], plain.decode(plain.encode(ut, y)[0], y.numpy())[big])


def test_identity_sketch_is_exact():
    """With an identity projection and one bucket per prototype, <e(x), e(y)> = sum_i v_i(x) . v_i(y)."""
    g = torch.Generator().manual_seed(1)
    K, d, n_seq, rows = 6, 5, 4, 40
    sk = Sketch(K, d, d, K, seed=0)
    sk.R, sk.bucket, sk.sign = torch.eye(d), torch.arange(K), torch.ones(K)
    seq = torch.randint(0, n_seq, (rows,), generator=g)
    proto = torch.randint(0, K, (rows,), generator=g)
    act = torch.rand(rows, generator=g)
    ut = torch.randn(rows, d, generator=g)
    inv_sqrt = torch.rand(K, d, generator=g) + 0.5
    e = embed_sequences(sk, seq, proto, act, torch.arange(rows), ut, inv_sqrt, n_seq)
    V = torch.zeros(n_seq, K, d)
    for r in range(rows):
        V[seq[r], proto[r]] += act[r] * ut[r] * inv_sqrt[proto[r]]
    exact = torch.einsum("xkd,ykd->xy", V, V)
    assert torch.allclose(e @ e.T, exact, atol=1e-4)
    assert Sketch(32, 32, 16, 8, 0).dim == 128


def test_basis_is_orthonormal_sorted_and_sign_fixed():
    g = torch.Generator().manual_seed(2)
    X = torch.randn(200, 8, generator=g)
    S = X.T @ X
    Q, ev = fit_basis(S)
    assert torch.allclose(Q.T @ Q, torch.eye(8), atol=1e-5) and (ev[:-1] >= ev[1:]).all()
    Q2, _ = fit_basis(S * (1 + 1e-12))
    assert torch.allclose(Q, Q2, atol=1e-5)  # equal inputs, equal bases (no sign flips)
    assert (Q.gather(0, Q.abs().argmax(0, keepdim=True)) > 0).all()


def test_per_prototype_damping_unit_shrinks_rare_prototypes_toward_the_mean():
    """``damping_unit``: each prototype's mean eigenvalue, shrunk toward the mean over used prototypes
    by a pseudo-count of a tenth of their mean usage; the global unit is that mean for every block."""
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1.0, 1e-3, 0.5, 1e-2, 0.0])
    lam = torch.rand(5, 4, generator=g) * scales[:, None]
    count = torch.tensor([1000.0, 20000.0, 2.0, 0.0, 0.0])  # 3 and 4 never active
    m_i = lam.double().mean(1)
    m = m_i[:3].mean()
    n0 = 0.1 * count[:3].double().mean()
    want = (count.double() * m_i + n0 * m) / (count.double() + n0)
    got = damping_unit(lam, count, "prototype")
    assert got.shape == (5, 1)
    assert torch.allclose(got[:, 0].double(), want, rtol=1e-6)
    assert float(got[3, 0]) == pytest.approx(float(m), rel=1e-6)  # unused: the global mean
    assert float(got[2, 0]) == pytest.approx(float(m), rel=0.05)  # 2 tokens: mostly the global mean
    glob = damping_unit(lam, count, "global")
    assert glob.shape == (1, 1) and float(glob) == pytest.approx(float(m), rel=1e-6)
    # a well-used block of small eigenvalues gets far less damping than the global unit, so it is whitened
    assert float(got[1, 0]) < 0.1 * float(glob)
    c = 0.03
    whitened = lambda unit: float((lam[1] / (lam[1] + c * unit)).mean())  # noqa: E731
    assert whitened(got[1]) > 5 * whitened(glob[0])
    with pytest.raises(ValueError, match="damping scope"):
        damping_unit(lam, count, "token")


def test_curvature_reads_a_global_damping_of_older_calibrations():
    """Calibrations written before per-prototype damping hold one damping value: it damps every block."""
    lam = torch.rand(3, 2)
    c = Curvature(torch.eye(2), lam, torch.tensor([0.25]), 10)
    assert torch.allclose(c.inv(), 1.0 / (lam + 0.25))
    per = Curvature(torch.eye(2), lam, torch.tensor([0.1, 0.2, 0.3]), 10)
    assert torch.allclose(per.inv_sqrt(), (lam + torch.tensor([[0.1], [0.2], [0.3]])).rsqrt())


def test_best_first_is_the_full_sorts_head_with_ties_by_the_lower_key():
    from prism_tda.engine.arrays import best_first

    rng = np.random.default_rng(0)
    for _ in range(300):
        m, n = int(rng.integers(0, 200)), int(rng.integers(0, 220))
        value = rng.choice(rng.normal(size=12), size=m)  # many equal values
        tie = rng.permutation(10 * m + 1)[:m]
        assert np.array_equal(best_first(value, tie, n), np.lexsort((tie, -value))[:n])
