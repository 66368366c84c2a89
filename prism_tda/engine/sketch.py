"""The count-sketch of DESIGN §2 ("Cached / fast"): fixed-size embeddings ``e(x)`` of
prototype-space gradients.

For each prototype i active in x, the preconditioned column ``v_i = (H_i + lam I)^{-1/2} g_i(x)``
(in the Q basis) is projected to ``r`` dimensions by a Gaussian JL matrix and added into one of
``B`` buckets with a random sign (a count-sketch over the prototype axis). Then
``<e(q), e(x)>`` is an unbiased estimate of ``sum_i v_i(q) . v_i(x) = I(q, x)``. Embeddings are
L2-normalised, so inner-product search ranks by the cosine of preconditioned gradients.
"""

from __future__ import annotations

import numpy as np
import torch

ROW_CHUNK = 65536


class Sketch:
    def __init__(self, n_prototypes: int, u_dim: int, r: int, buckets: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.R = torch.randn(u_dim, r, generator=g) / r**0.5  # (u_dim, r), JL
        self.bucket = torch.randint(0, buckets, (n_prototypes,), generator=g)
        self.sign = torch.randint(0, 2, (n_prototypes,), generator=g).float() * 2 - 1
        self.r, self.buckets = r, buckets

    @property
    def dim(self) -> int:
        return self.r * self.buckets

    def embed_rows(self, group: torch.Tensor, proto: torch.Tensor, w: torch.Tensor, n_groups: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Add the preconditioned per-row gradients ``w`` (rows, u_dim) of prototype ``proto`` into
        ``n_groups`` sketches (n_groups, B * r), in ``out`` when given."""
        if out is None:
            out = torch.zeros(n_groups, self.dim)
        flat = out.view(n_groups * self.buckets, self.r)
        for c in range(0, len(group), ROW_CHUNK):
            sl = slice(c, c + ROW_CHUNK)
            proj = (w[sl] @ self.R) * self.sign[proto[sl]].unsqueeze(1)  # (rows, r)
            flat.index_add_(0, group[sl] * self.buckets + self.bucket[proto[sl]], proj)
        return out


def normalise(e: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(e, axis=1, keepdims=True)
    return (e / np.maximum(n, 1e-12)).astype(np.float32)


def embed_sequences(sketch: Sketch, seq: torch.Tensor, proto: torch.Tensor, act: torch.Tensor, tok: torch.Tensor,
                    ut: torch.Tensor, inv_sqrt: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """Sketch embeddings e(x) (n_seqs, D), unnormalised, of the sequences of a batch of activation rows
    (sequence, prototype, activation, token index into ``ut``, the token vectors ``Q^T u_t``).
    ``G_i(x) = sum_t a_{t,i} Q^T u_t`` is summed per (sequence, prototype) pair first, so
    preconditioning and projection run once per pair."""
    K = inv_sqrt.shape[0]
    pair, owner = torch.unique(seq * K + proto, return_inverse=True)
    G = torch.zeros(len(pair), ut.shape[1], dtype=torch.float32)
    for c in range(0, len(seq), ROW_CHUNK):
        sl = slice(c, c + ROW_CHUNK)
        G.index_add_(0, owner[sl], act[sl, None].float() * ut[tok[sl]].float())
    pair_proto = pair % K
    G *= inv_sqrt[pair_proto]  # (pairs, d) preconditioned columns v_i(x)
    return sketch.embed_rows(pair // K, pair_proto, G, n_seqs)
