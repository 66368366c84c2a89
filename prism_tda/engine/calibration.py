"""What one calibration sample fixes for every shard of an index (``calibration.safetensors``).

- The **index curvature**: the basis ``Q`` and the per-prototype corrections ``lambda_i`` of
  DESIGN §2, estimated on the sample (``index.calibration_tokens`` tokens spread over the corpus's
  work units; the whole corpus when it is smaller). Every shard is scored under it, so shards are
  built independently and appended later without touching the others; the summed statistics of
  every shard are kept too (``stats.safetensors``), and the summary reports how far the sample's
  corrections are from the full corpus's.
- The **token-vector codec** (``engine/codec.py``): its codebooks (of ``m_t`` and of the direction
  of ``u_t``) and diagonal scale.
- The **posting cells**: ``C`` unit directions (spherical k-means of the scaled token vectors);
  each prototype's posting list is split by the cell of its tokens' direction.
- The **activation scale**: per prototype, the range of log activations stored in 8 bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from .codec import TokenCodec
from .curvature import Curvature
from .layout import atomic_write_bytes

ACT_LEVELS = 255  # stored activation codes 1..255 (0: inactive)


@dataclass
class IndexCalibration:
    curvature: Curvature
    codec_centroids: torch.Tensor  # (n_sub, 2^bits, d_sub)
    codec_scale: torch.Tensor  # (d,) D^{-1/2}
    codec_bits: int
    cells: torch.Tensor  # (C, d) unit directions of D^{-1/2} Q^T u
    act_lo: torch.Tensor  # (K,) log activation at code 1
    act_hi: torch.Tensor  # (K,) log activation at code 255
    codec_dir_centroids: torch.Tensor | None = None  # (n_sub, 2^bits, d_sub) the direction codebook

    def codec(self, W: torch.Tensor) -> TokenCodec:
        return TokenCodec(self.codec_centroids, self.codec_scale, W, self.curvature.Q, self.codec_bits,
                          self.codec_dir_centroids)

    # ---------------------------------------------------------------------------- activations
    def quantize_acts(self, acts: torch.Tensor, proto: torch.Tensor) -> np.ndarray:
        """(N, k) activations of prototypes ``proto`` -> uint8 codes (0 where inactive)."""
        lo, hi = self.act_lo[proto], self.act_hi[proto]
        x = (torch.log(acts.clamp_min(1e-30)) - lo) / (hi - lo).clamp_min(1e-6)
        q = (1 + torch.round(x.clamp(0, 1) * (ACT_LEVELS - 1))).to(torch.uint8)
        return torch.where(acts > 0, q, torch.zeros_like(q)).cpu().numpy()

    def act_table(self) -> np.ndarray:
        """(K, 256) float32: the activation each code stands for, per prototype (row 0: inactive)."""
        steps = torch.arange(ACT_LEVELS, dtype=torch.float32) / (ACT_LEVELS - 1)
        vals = torch.exp(self.act_lo[:, None] + steps[None, :] * (self.act_hi - self.act_lo)[:, None])
        return torch.cat([torch.zeros(len(vals), 1), vals], dim=1).numpy().astype(np.float32)

    # ---------------------------------------------------------------------------- cells
    def cell_of(self, ut: torch.Tensor) -> torch.Tensor:
        """(N,) the cell of each token vector ``Q^T u_t`` (N, d): its nearest direction."""
        x = ut.float() * self.codec_scale.to(ut.device)
        return (x @ self.cells.to(ut.device).T).argmax(1)

    # ---------------------------------------------------------------------------- files
    def save(self, path: Path) -> None:
        c = self.curvature
        t = {"Q": c.Q, "lam": c.lam, "damping": c.damping.reshape(-1).float(),
             "n_tokens": torch.tensor([c.n_tokens], dtype=torch.float64), "codec_centroids": self.codec_centroids,
             "codec_scale": self.codec_scale, "codec_bits": torch.tensor([self.codec_bits]), "cells": self.cells,
             "act_lo": self.act_lo, "act_hi": self.act_hi}
        if self.codec_dir_centroids is not None:
            t["codec_dir_centroids"] = self.codec_dir_centroids
        atomic_write_bytes(path, save({k: v.contiguous() for k, v in t.items()}))

    @classmethod
    def load(cls, path: Path) -> IndexCalibration:
        t = load_file(str(path))
        curv = Curvature(t["Q"].float(), t["lam"].float(), t["damping"].float(), int(t["n_tokens"][0]))  # (1,): global
        return cls(curv, t["codec_centroids"].float(), t["codec_scale"].float(), int(t["codec_bits"][0]),
                   t["cells"].float(), t["act_lo"].float(), t["act_hi"].float(),
                   t["codec_dir_centroids"].float() if "codec_dir_centroids" in t else None)
