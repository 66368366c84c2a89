"""Compiled scoring of stored tokens from their codes (numba): the inner loop of the fast path.

A query column's product with a stored token vector is a sum of table lookups (asymmetric scoring,
``engine/scoring.py``: ``approx_scores``). Done with numpy gathers it builds several temporary
arrays per hit; here one pass over the rows reads each token's prototypes, activation codes, packed
codes and direction bit straight from the shard's memory maps and writes the (n, k) terms of its
score. Equal to the decoded token vectors' scores up to float32 rounding
(tests/engine/test_kernels.py). Large row sets are cut across threads (:func:`over_rows`: as many as
torch's intra-op threads).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

MIN_ROWS_PER_THREAD = 4096


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="prism-kernels")


def over_rows(n: int, fn: Callable[[slice], None], threads: int) -> None:
    """``fn`` over ``n`` rows, cut into up to ``threads`` contiguous slices run at once (the kernels
    release the GIL), at least ``MIN_ROWS_PER_THREAD`` rows each."""
    parts = max(1, min(threads, n // MIN_ROWS_PER_THREAD))
    if parts == 1:
        fn(slice(0, n))
        return
    bounds = np.linspace(0, n, parts + 1).astype(int)
    for f in [_pool().submit(fn, slice(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]:
        f.result()


@njit(cache=True, nogil=True)
def _unpack_row(codes: np.ndarray, r: int, bits: int, n_sub: int, out: np.ndarray) -> None:
    """Row ``r`` of packed codes (N, code_bytes) uint8 into ``out`` (n_sub,) int64."""
    if bits == 8:
        for s in range(n_sub):
            out[s] = codes[r, s]
    elif bits == 16:
        for s in range(n_sub):
            out[s] = codes[r, 2 * s] | (np.int64(codes[r, 2 * s + 1]) << 8)
    else:  # 12: two codes in three bytes, little-endian
        for h in range(n_sub // 2):
            v = np.int64(codes[r, 3 * h]) | (np.int64(codes[r, 3 * h + 1]) << 8) | (np.int64(codes[r, 3 * h + 2]) << 16)
            out[2 * h] = v & 0xFFF
            out[2 * h + 1] = v >> 12


@njit(cache=True, nogil=True)
def code_terms(local: np.ndarray, protos: np.ndarray, act_codes: np.ndarray, act_table: np.ndarray,
               codes: np.ndarray, code_dir: np.ndarray, t_self: np.ndarray, targets: np.ndarray, bits: int,
               n_sub: int, n_cent: int, col: np.ndarray, m_tab: np.ndarray, y_tab: np.ndarray, d_tab: np.ndarray,
               dir_cent: np.ndarray, inv: np.ndarray, out_protos: np.ndarray, out_acts: np.ndarray,
               out_terms: np.ndarray) -> None:
    """For the shard rows ``local`` (n,), with their stored ``I(t, t)`` (``t_self``) and targets: each
    one's active prototypes (``out_protos``), activations (``out_acts``, from the codes through
    ``act_table`` (K, 256)) and each slot's term ``a_{t,i} Wq_i . Q^T u_t`` of its score
    (``out_terms``; 0 where the prototype is not one of the query's: ``col`` (K,) its column in the
    tables, or -1).

    ``m_tab``, ``d_tab`` (n_sub, P, n_cent): each query column's product with every centroid of each
    sub-quantiser. A token coded by ``m_t`` scores ``sum_s m_tab[s, c, code_s] - y_tab[c, y_t]``; one
    coded by its direction (bit set in ``code_dir``, packed big-endian per byte; empty: none) scores
    ``length * sum_s d_tab[s, c, code_s]``, the length being the one that gives its decoded direction
    (``dir_cent`` (n_sub * n_cent, d_sub)) the stored ``I(t, t)`` under ``inv`` (K, d)."""
    n, k = len(local), protos.shape[1]
    ds = dir_cent.shape[1] if dir_cent.shape[0] else 0
    has_dirs = code_dir.shape[0] > 0
    code = np.empty(n_sub, np.int64)
    for i in range(n):
        r = local[i]
        hit = False
        for j in range(k):
            p = np.int64(protos[r, j])
            a = act_table[p, act_codes[r, j]]
            out_protos[i, j] = p
            out_acts[i, j] = a
            out_terms[i, j] = 0.0
            if col[p] >= 0 and a > 0:
                hit = True
        if not hit:
            continue
        _unpack_row(codes, r, bits, n_sub, code)
        is_dir = has_dirs and ((code_dir[r >> 3] >> (7 - (r & 7))) & 1) == 1
        tab = d_tab if is_dir else m_tab
        length = 1.0
        if is_dir:  # the direction's I(t, t) at unit length, over every active prototype
            i_unit = 0.0
            for j in range(k):
                a = out_acts[i, j]
                if a <= 0:
                    continue
                p = out_protos[i, j]
                part = 0.0
                for s in range(n_sub):
                    for e in range(ds):
                        x = dir_cent[s * n_cent + code[s], e]
                        part += x * x * inv[p, s * ds + e]
                i_unit += a * a * part
            length = np.sqrt(t_self[i] / max(i_unit, 1e-30))
        for j in range(k):
            p = out_protos[i, j]
            c = col[p]
            a = out_acts[i, j]
            if c < 0 or a <= 0:
                continue
            v = 0.0
            for s in range(n_sub):
                v += tab[s, c, code[s]]
            v = v * length if is_dir else v - y_tab[c, targets[i]]
            out_terms[i, j] = a * v


@njit(cache=True, nogil=True)
def best_in_runs(groups: np.ndarray, value: np.ndarray, tie: np.ndarray) -> np.ndarray:
    """Position of each run's best element of ``groups`` (non-decreasing): the highest ``value``, then
    the highest ``tie``, then the first (NaN below every number): what a stable sort by (group, -value,
    -tie) puts first in each group."""
    n = len(groups)
    out = np.empty(n, np.int64)
    m = 0
    i = 0
    while i < n:
        best = i
        j = i + 1
        while j < n and groups[j] == groups[i]:
            v, b = value[j], value[best]
            same = v == b or (np.isnan(v) and np.isnan(b))
            t, tb = tie[j], tie[best]
            if v > b or (np.isnan(b) and not np.isnan(v)) or (same and (t > tb or (np.isnan(tb) and not np.isnan(t)))):
                best = j
            j += 1
        out[m] = best
        m += 1
        i = j
    return out[:m]
