"""Local curvature in prototype space, stored EK-FAC style (DESIGN §2).

The per-prototype empirical Fisher block ``H_i = (1/N) sum_t a_{t,i}^2 u_t u_t^T`` is kept as a
shared eigenbasis ``Q`` (of ``S = sum_t u_t u_t^T``, fitted on the first ``basis_sequences``
sequences) and per-prototype eigenvalue corrections ``lambda_i = (1/N) sum_t a_{t,i}^2 (Q^T u_t)^2``,
so ``H_i ~= Q diag(lambda_i) Q^T``. Given Q, the corrections are additive over shards, and they
are exactly the best diagonal approximation of ``H_i`` in that basis.

Memory: ``Q`` is d x d, the corrections K x r_u (r_u = d unless ``u_rank`` truncates them), in
float32: ``4 (d^2 + K r_u)`` bytes, 1.3 MB at d=256, K=1024.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from .layout import atomic_write_bytes


@dataclass
class Curvature:
    Q: torch.Tensor  # (d, d) eigenbasis, columns by descending eigenvalue of the basis sample
    lam: torch.Tensor  # (K, r_u) per-prototype eigenvalue corrections, (1/N) sum a^2 (Q^T u)^2
    damping: torch.Tensor  # () the absolute damping lambda added to every eigenvalue
    n_tokens: int

    @property
    def u_dim(self) -> int:
        return self.lam.shape[1]

    def inv_sqrt(self) -> torch.Tensor:
        """(K, r_u) diagonal of (H_i + lambda I)^{-1/2} in the Q basis."""
        return (self.lam + self.damping).rsqrt()

    def inv(self) -> torch.Tensor:
        """(K, r_u) diagonal of (H_i + lambda I)^{-1} in the Q basis."""
        return 1.0 / (self.lam + self.damping)

    def save(self, path: Path, **extra: torch.Tensor) -> None:
        t = {"Q": self.Q, "lam": self.lam, "damping": self.damping.reshape(1),
             "n_tokens": torch.tensor([self.n_tokens], dtype=torch.float64), **extra}
        atomic_write_bytes(path, save({k: v.contiguous().float() if k != "n_tokens" else v for k, v in t.items()}))

    @classmethod
    def load(cls, path: Path) -> Curvature:
        t = load_file(str(path))
        return cls(t["Q"], t["lam"], t["damping"][0], int(t["n_tokens"][0]))


def fit_basis(S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenbasis of a symmetric PSD matrix, columns sorted by descending eigenvalue."""
    evals, evecs = torch.linalg.eigh(S.double())
    order = evals.argsort(descending=True)
    return evecs[:, order].float(), evals[order].float()


def finalize(Q: torch.Tensor, lam_sum: torch.Tensor, count: torch.Tensor, n_tokens: int, damping: float) -> Curvature:
    """Normalise the summed corrections and set the damping to ``damping`` x mean eigenvalue
    over prototypes that were active at least once."""
    lam = (lam_sum / max(n_tokens, 1)).float()
    used = count > 0
    mean_eig = lam[used].mean() if used.any() else lam.mean()
    return Curvature(Q.float(), lam, (damping * mean_eig).float(), n_tokens)
