"""Held-out evaluation: loss, grounding (R1bar, R2), reconstruction and prototype usage."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from .data import eval_batches
from .model import PRISM


def usage_stats(mass: torch.Tensor) -> dict[str, float]:
    """Effective number of prototypes ``exp(H(mass share))``, dead count, top-10 share."""
    mass = mass.double()
    total = float(mass.sum())
    if total <= 0:
        return {"effective_prototypes": 0.0, "dead_prototypes": int(mass.numel()), "top10_mass_share": 0.0}
    p = mass / total
    nz = p[p > 0]
    return {
        "effective_prototypes": float(torch.exp(-(nz * nz.log()).sum())),
        "dead_prototypes": int((mass == 0).sum()),
        "top10_mass_share": float(p.topk(min(10, p.numel())).values.sum()),
    }


@torch.no_grad()
def evaluate(
    model: PRISM, val: np.ndarray, *, batch_size: int = 16, max_tokens: int = 65536,
    device: str | torch.device = "cpu", autocast: contextlib.AbstractContextManager | None = None,
) -> dict[str, float]:
    """Mean validation loss and, for PRISM, R1bar, R2, L_REC and prototype usage on ``val``."""
    was_training = model.training
    model.eval()
    block = model.cfg.block_size
    ce_sum, n_tok = 0.0, 0
    rec_sum, r2_sum = 0.0, 0.0
    K = model.cfg.n_prototypes if model.head is not None else 0
    best = torch.full((K,), -1.0, device=device)  # max_t cos(p_i, z_t)
    mass = torch.zeros(K, device=device)
    for x, y in eval_batches(val, block=block, batch_size=batch_size, max_tokens=max_tokens):
        x, y = x.to(device), y.to(device)
        with autocast or contextlib.nullcontext():
            out = model(x, y)
        n = y.numel()
        ce_sum += float(out.losses["ce"]) * n
        n_tok += n
        if model.head is not None:
            z = out.z.reshape(-1, out.z.shape[-1]).float()
            sim = model.head.similarities(z)
            best = torch.maximum(best, sim.amax(0))
            rec_sum += float(out.losses["rec"]) * n
            r2_sum += float(out.metrics["R2"]) * n
            mass += out.head.mass
    if was_training:
        model.train()
    ce = ce_sum / max(n_tok, 1)
    res: dict[str, float] = {"val_loss": ce, "val_ppl": math.exp(min(ce, 50)), "val_tokens": n_tok}
    if model.head is not None:
        res |= {"R1bar": float(best.mean()), "R2": r2_sum / n_tok, "rec": rec_sum / n_tok}
        res |= usage_stats(mass)
    return res
