"""Local curvature in prototype space, stored EK-FAC style (DESIGN §2).

The per-prototype empirical Fisher block ``H_i = (1/N) sum_t a_{t,i}^2 u_t u_t^T`` is kept as a
shared eigenbasis ``Q`` (of ``S = sum_t u_t u_t^T``) and per-prototype eigenvalue corrections
``lambda_i = (1/N) sum_t a_{t,i}^2 (Q^T u_t)^2``, so ``H_i ~= Q diag(lambda_i) Q^T``. Given Q, the
corrections are additive over tokens (``CurvatureStats``), and they are exactly the best
diagonal approximation of ``H_i`` in that basis.

Damping (``index.damping`` x a unit, ``index.damping_scope``): ``prototype`` (the default) damps
each block relative to its own mean eigenvalue, ``lam_i = c m~_i`` with
``m~_i = (n_i m_i + n0 m) / (n_i + n0)``: ``m_i`` the mean of ``lambda_i``, ``n_i`` the tokens where
prototype i is active, ``m`` the mean of ``m_i`` over used prototypes and ``n0`` a tenth of their mean
``n_i`` (a pseudo-count that shrinks rarely used prototypes toward ``m``). ``global`` damps every block
by ``c m``. The corrections are divided by all N tokens, so under a global damping a rarely used
prototype's block sits below it and is hardly whitened; the per-prototype unit fixes that
(docs/attribution.md, "LDS levers").

Memory: ``Q`` is d x d and the corrections K x d, in float32: ``4 (d^2 + K d)`` bytes, 1.3 MB at
d=256, K=1024.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .tokens import TokenBatch


@dataclass
class Curvature:
    Q: torch.Tensor  # (d, d) eigenbasis, columns by descending eigenvalue
    lam: torch.Tensor  # (K, d) per-prototype eigenvalue corrections, (1/N) sum a^2 (Q^T u)^2
    damping: torch.Tensor  # (K, 1), or (1, 1) for one value: the absolute damping added to each block's eigenvalues
    n_tokens: int

    def __post_init__(self) -> None:
        self.damping = self.damping.float().reshape(-1, 1)

    @property
    def u_dim(self) -> int:
        return self.lam.shape[1]

    def inv_sqrt(self) -> torch.Tensor:
        """(K, d) diagonal of (H_i + lambda I)^{-1/2} in the Q basis."""
        return (self.lam + self.damping).rsqrt()

    def inv(self) -> torch.Tensor:
        """(K, d) diagonal of (H_i + lambda I)^{-1} in the Q basis."""
        return 1.0 / (self.lam + self.damping)


def fit_basis(S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenbasis of a symmetric PSD matrix, columns sorted by descending eigenvalue, each column's
    sign fixed (its largest entry positive) so that equal inputs give equal bases."""
    evals, evecs = torch.linalg.eigh(S.double())
    order = evals.argsort(descending=True)
    Q = evecs[:, order]
    sign = torch.sign(Q.gather(0, Q.abs().argmax(0, keepdim=True)))
    return (Q * sign).float(), evals[order].float()


SCOPES = ("prototype", "global")


def mean_eigenvalue(lam: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """() the mean eigenvalue over prototypes active at least once (over all, when none is)."""
    used = count > 0
    return lam[used].mean() if used.any() else lam.mean()


def damping_unit(lam: torch.Tensor, count: torch.Tensor, scope: str) -> torch.Tensor:
    """(K, 1) the unit ``index.damping`` multiplies (module docstring): each prototype's mean
    eigenvalue shrunk toward the global mean by a pseudo-count, or the global mean for every block."""
    if scope not in SCOPES:
        raise ValueError(f"damping scope must be one of {SCOPES}, got {scope!r}")
    lam, n = lam.double(), count.double()
    m = mean_eigenvalue(lam, n)
    if scope == "global":
        return m.reshape(1, 1).float()
    used = n > 0
    n0 = 0.1 * (n[used].mean() if used.any() else n.new_tensor(1.0))
    m_i = lam.mean(1)
    return ((n * m_i + n0 * m) / (n + n0)).reshape(-1, 1).float()


def finalize(Q: torch.Tensor, lam_sum: torch.Tensor, count: torch.Tensor, n_tokens: int, damping: float,
             scope: str = "global") -> Curvature:
    """Normalise the summed corrections and set the damping to ``damping`` x the unit of ``scope``."""
    lam = (lam_sum / max(n_tokens, 1)).float()
    return Curvature(Q.float(), lam, damping * damping_unit(lam, count, scope), n_tokens)


class CurvatureStats:
    """Additive (and one max-merged) statistics of a set of tokens: the curvature sums in the basis
    Q, prototype usage, and the grounding and loss sums the indexer reports."""

    def __init__(self, K: int, d: int) -> None:
        self.S = torch.zeros(d, d, dtype=torch.float64)  # sum_t u_t u_t^T
        self.lam = torch.zeros(K, d, dtype=torch.float64)  # sum_t a_{t,i}^2 (Q^T u_t)^2
        self.count = torch.zeros(K, dtype=torch.float64)  # tokens where i is active (a > 0)
        self.mass = torch.zeros(K, dtype=torch.float64)  # sum_t a_{t,i}
        self.max_cos = torch.full((K,), -1.0, dtype=torch.float64)  # max-merged
        self.scalars = torch.zeros(3, dtype=torch.float64)  # n_tokens, sum loss, sum top cos

    def add(self, tb: TokenBatch, ut: torch.Tensor) -> None:
        """Add a batch's tokens; ``ut`` (N, d) is ``Q^T u_t``."""
        u = tb.u.double().cpu()
        self.S += u.T @ u
        a = tb.acts.double().cpu()
        proto = tb.proto_idx.cpu()
        sq = ut.double().cpu().pow(2)  # (N, d)
        for j in range(a.shape[1]):  # k small: avoids an (N k, d) temporary
            self.lam.index_add_(0, proto[:, j], a[:, j : j + 1].pow(2) * sq)
        self.count.index_add_(0, proto.reshape(-1), (a.reshape(-1) > 0).double())
        self.mass.index_add_(0, proto.reshape(-1), a.reshape(-1))
        self.max_cos = torch.maximum(self.max_cos, tb.proto_max_cos.double().cpu())
        self.scalars += torch.tensor([len(tb.u), float(tb.loss.sum()), float(tb.top_cos.sum())], dtype=torch.float64)

    def merge(self, other: CurvatureStats) -> None:
        for name in ("S", "lam", "count", "mass", "scalars"):
            getattr(self, name).add_(getattr(other, name))
        self.max_cos = torch.maximum(self.max_cos, other.max_cos)

    @property
    def n_tokens(self) -> int:
        return int(self.scalars[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ("S", "lam", "count", "mass", "max_cos", "scalars")}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> CurvatureStats:
        self = cls.__new__(cls)
        for k, v in t.items():
            setattr(self, k, v.double())
        return self


def self_influence(U: torch.Tensor, protos: np.ndarray, acts: np.ndarray, inv: torch.Tensor) -> np.ndarray:
    """I(t, t) = sum_i a_{t,i}^2 sum_j u_j^2 / (lam_ij + lam) of tokens (n, d) with their prototypes."""
    u2 = U.float().pow(2)  # (n, d)
    P, A2 = torch.from_numpy(np.asarray(protos, np.int64)), torch.from_numpy(np.asarray(acts, np.float32)).pow(2)
    out = torch.zeros(len(u2), dtype=torch.float64)
    for j in range(P.shape[1]):  # one slot at a time: (n, d) gathers stay in cache (3x a (n, k, d) gather)
        out += (A2[:, j] * (u2 * inv.index_select(0, P[:, j])).sum(1)).double()
    return out.numpy()
