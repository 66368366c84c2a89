"""The per-token quantities of DESIGN §2 from one forward pass.

For every token t with next-token target y_t: the active prototypes and activations a_t, and the
error signal ``u_t = W^T (softmax(l_t) - onehot(y_t))``. Holding the residual and activations
fixed, ``a_{t,i} u_t`` is the gradient of token t's loss with respect to prototype i: no backward
pass through the network is needed, for a training token or for a query.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from prism_tda.model import PRISM


@dataclass
class TokenBatch:
    """Flattened valid tokens of a padded batch."""

    row: torch.Tensor  # (N,) sequence index within the batch
    pos: torch.Tensor  # (N,) position within the sequence
    token_ids: torch.Tensor  # (N,)
    targets: torch.Tensor  # (N,)
    proto_idx: torch.Tensor  # (N, k)
    acts: torch.Tensor  # (N, k)
    u: torch.Tensor  # (N, d) W^T delta_t
    loss: torch.Tensor  # (N,) next-token cross-entropy
    top_cos: torch.Tensor  # (N,) max_i cos(z_t, p_i)
    proto_max_cos: torch.Tensor  # (K,) max_t cos(p_i, z_t) over this batch
    z: torch.Tensor  # (N, d) the final hidden states


def pad_batch(tokens: list[list[int]], targets: list[list[int]],
              width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) token ids, targets and the mask of real tokens (T: ``width``, at least the
    longest sequence)."""
    B, T = len(tokens), max([width or 0, *(len(t) for t in tokens)])
    x = torch.zeros(B, T, dtype=torch.long)
    y = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (tk, tg) in enumerate(zip(tokens, targets, strict=True)):
        x[b, : len(tk)] = torch.as_tensor(tk)
        y[b, : len(tg)] = torch.as_tensor(tg)
        mask[b, : len(tk)] = True
    return x, y, mask


WIDTH_STEP = 16  # the indexer pads a sequence to its length rounded up to this (``width_batches``)
PER_CALL_TOKENS = 128  # a forward call's fixed cost, in padded tokens' worth (measured on 2 CPU cores)
# with ``positions``, run the last block only where a quantity is wanted (``PRISM.hidden_at``); off, the
# whole model runs on every position (the same numbers up to rounding: ``bench/rerank_forward_ab.py``)
LAST_BLOCK_AT_POSITIONS = True


def length_batches(lengths: np.ndarray, max_tokens: int, per_call: int = PER_CALL_TOKENS) -> list[np.ndarray]:
    """Positions of ``lengths`` grouped into padded batches that waste little: sorted by length and cut
    into contiguous runs minimising the padded tokens plus ``per_call`` per batch (dynamic programming
    over the cut points); a batch pads to at most ``max_tokens`` unless it holds one sequence."""
    lengths = np.asarray(lengths, np.int64)
    order = np.argsort(lengths, kind="stable")
    L = lengths[order]
    n = len(L)
    best = np.zeros(n + 1)
    cut = np.zeros(n + 1, np.int64)
    for j in range(1, n + 1):
        i = np.arange(j)  # the run i..j-1 pads to L[j - 1]
        cost = best[:j] + (j - i) * L[j - 1] + per_call
        cost[((j - i) * L[j - 1] > max_tokens) & (i < j - 1)] = np.inf
        cut[j] = int(np.argmin(cost))
        best[j] = cost[cut[j]]
    out, j = [], n
    while j > 0:
        out.append(order[cut[j] : j])
        j = int(cut[j])
    return out[::-1]


def width_batches(lengths: np.ndarray, batch_size: int, block: int) -> list[tuple[np.ndarray, int]]:
    """(positions of ``lengths``, padded width) of batches of at most ``batch_size`` sequences of one
    width each: a sequence's length rounded up to ``WIDTH_STEP`` (at most ``block``). A sequence
    is always computed at its own width, however the corpus is cut into shards or batches, so its
    results do not depend on its neighbours' lengths; padding is under ``WIDTH_STEP`` a sequence."""
    width = np.minimum(-(-np.asarray(lengths, np.int64) // WIDTH_STEP) * WIDTH_STEP, block)
    out = []
    for w in np.unique(width):
        at = np.nonzero(width == w)[0]
        out += [(at[b : b + batch_size], int(w)) for b in range(0, len(at), batch_size)]
    return out


@torch.no_grad()
def run_batch(
    model: PRISM, tokens: list[list[int]], targets: list[list[int]], *,
    device: torch.device | str = "cpu", autocast: contextlib.AbstractContextManager | None = None,
    positions: list[np.ndarray] | None = None, width: int | None = None,
) -> TokenBatch:
    """One forward pass over right-padded sequences (causal, so padding never leaks backwards).

    ``positions``: per sequence, the only positions whose quantities are wanted; the backbone then
    runs on each sequence up to its last wanted position, and the vocabulary-sized products (the
    larger part of the cost) only at the wanted positions. Causality makes the results equal.
    ``width``: pad to this many positions at least (a sequence computed at the same padded width
    rounds the same whatever else is in its batch)."""
    assert model.head is not None, "the indexer needs a PRISM model, not the dense baseline"
    if positions is not None:
        ends = [int(p.max()) + 1 if len(p) else 1 for p in positions]
        tokens = [t[:e] for t, e in zip(tokens, ends, strict=True)]
        targets = [t[:e] for t, e in zip(targets, ends, strict=True)]
    x, y, mask = pad_batch(tokens, targets, width)
    B, T = x.shape
    if positions is not None:
        keep = torch.zeros(B, T, dtype=torch.bool)
        at = np.concatenate([np.zeros(0, np.int64), *(np.asarray(p, np.int64) for p in positions)])
        keep[torch.from_numpy(np.repeat(np.arange(B), [len(p) for p in positions])), torch.from_numpy(at)] = True
        mask &= keep
    x, y, mask = x.to(device), y.to(device), mask.to(device)
    rows, pos = mask.nonzero(as_tuple=True)
    with autocast or contextlib.nullcontext():
        # with positions, the last block runs only where a quantity is wanted
        last_only = positions is not None and LAST_BLOCK_AT_POSITIONS
        zv = (model.hidden_at(x, rows, pos) if last_only else model.hidden(x)[rows, pos]).float()  # (N, d)
    yv = y[rows, pos]
    h = model.head(zv)
    W = model.W.float()
    logits = zv @ W.T  # (N, V)
    logp = torch.log_softmax(logits, dim=-1)
    at_y = torch.arange(len(yv), device=logp.device), yv
    loss = -logp[at_y]  # next-token cross-entropy
    delta = logp.exp_()  # softmax, in place
    delta[at_y] -= 1.0  # softmax - onehot
    u = delta @ W  # (N, d)
    sim = model.head.similarities(zv)
    return TokenBatch(rows, pos, x[rows, pos], yv, h.proto_idx, h.acts, u, loss, sim.amax(1), sim.amax(0), zv)
