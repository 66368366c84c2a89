"""Autograd primitives for the prototype head that never build a dense (N, K) tensor.

Both treat the active set as a sparse (N, K) matrix with exactly ``k`` entries per row
(``idx`` (N, k), no repeated index within a row, as ``topk`` guarantees) and use CSR
sparse-dense products, so forward and backward cost O(N k d) rather than O(N K d).
"""

from __future__ import annotations

import warnings

import torch


def _csr(idx: torch.Tensor, values: torch.Tensor, n_cols: int) -> torch.Tensor:
    n, k = idx.shape
    crow = torch.arange(0, n * k + 1, k, device=idx.device)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore")
        return torch.sparse_csr_tensor(crow, idx.reshape(-1), values.reshape(-1), size=(n, n_cols))


def _coo_t(idx: torch.Tensor, values: torch.Tensor, n_cols: int) -> torch.Tensor:
    """The transpose (K, N) of the same sparse matrix, as COO."""
    n, k = idx.shape
    rows = torch.arange(n, device=idx.device).repeat_interleave(k)
    ind = torch.stack([idx.reshape(-1), rows])
    return torch.sparse_coo_tensor(ind, values.reshape(-1), size=(n_cols, n), check_invariants=False)


class _GatherDot(torch.autograd.Function):
    """out[t, j] = <x_t, y_{idx[t, j]}>, given the values already computed (e.g. by top-k)."""

    @staticmethod
    def forward(ctx, x, y, idx, values):  # x (N, d), y (K, d), idx (N, k), values (N, k)
        ctx.save_for_backward(x, y, idx)
        return values.clone()

    @staticmethod
    def backward(ctx, g):  # g (N, k)
        with torch.autocast(g.device.type, enabled=False):
            return _GatherDot._backward(ctx, g)

    @staticmethod
    def _backward(ctx, g):
        x, y, idx = ctx.saved_tensors
        g = g.contiguous().to(x.dtype)
        gx = _csr(idx, g, y.shape[0]) @ y if ctx.needs_input_grad[0] else None  # (N, d)
        gy = torch.sparse.mm(_coo_t(idx, g, y.shape[0]), x) if ctx.needs_input_grad[1] else None  # (K, d)
        return gx, gy, None, None


class _SparseMix(torch.autograd.Function):
    """out[t] = sum_j w[t, j] * y_{idx[t, j]}: a sparse (N, K) by dense (K, d) product."""

    @staticmethod
    def forward(ctx, w, y, idx):  # w (N, k), y (K, d), idx (N, k)
        ctx.save_for_backward(w, y, idx)
        return _csr(idx, w.contiguous(), y.shape[0]) @ y  # (N, d)

    @staticmethod
    def backward(ctx, g):  # g (N, d)
        with torch.autocast(g.device.type, enabled=False):
            return _SparseMix._backward(ctx, g)

    @staticmethod
    def _backward(ctx, g):
        w, y, idx = ctx.saved_tensors
        g = g.contiguous().to(y.dtype)
        gw = gy = None
        if ctx.needs_input_grad[0]:
            gw = _sampled_dot(g, y, idx)  # (N, k)
        if ctx.needs_input_grad[1]:
            gy = torch.sparse.mm(_coo_t(idx, w.contiguous(), y.shape[0]), g)  # (K, d)
        return gw, gy, None


def _sampled_dot(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """<x_t, y_{idx[t, j]}> (N, k), in row blocks so the (rows, k, d) gather stays in cache."""
    out = [
        (torch.nn.functional.embedding(idx[i : i + rows], y) * x[i : i + rows].unsqueeze(1)).sum(-1)
        for i in range(0, x.shape[0], rows)
    ]
    return torch.cat(out)


def gather_dot(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``<x_t, y_{idx[t, j]}>`` (N, k) with gradients to x and y; ``values`` must equal it."""
    return _GatherDot.apply(x, y, idx, values)


def sparse_mix(w: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``sum_j w[t, j] y_{idx[t, j]}`` (N, d) with gradients to w and y."""
    return _SparseMix.apply(w, y, idx)
