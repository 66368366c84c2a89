"""Compiled scoring of stored tokens from their codes (numba): the inner loop of the fast path.

A query column's product with a stored token vector is a sum of table lookups (asymmetric scoring,
``engine/scoring.py``: ``approx_scores``). Done with numpy gathers it builds several temporary
arrays per hit; here one pass over the rows reads each token's prototypes, activation codes, packed
codes and direction bit straight from the shard's memory maps, and a second sums the table entries
of every (token, query column) pair one column at a time, writing the (n, k) terms of each score. Equal to the decoded token vectors' scores up to float32 rounding
(tests/engine/test_kernels.py). The rows of a call are shared across threads (:func:`over_parts`: as
many as torch's intra-op threads), whether they lie in one shard or a few in each of many.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

MIN_ROWS_PER_THREAD = 4096
GATHER_ROWS = 64  # rows whose stored bytes the scoring kernel copies out at once
# the scoring kernel copies rows out first in shards of at least this many tokens, whose codes (24
# bytes a token at the defaults) outgrow the cache (docs/benchmarks.md, "Queries over many shards")
GATHER_MIN_ROWS = 1 << 21


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="prism-kernels")


def over_parts(sizes: list[int], fn: Callable[[int, slice], None], threads: int) -> None:
    """``fn(part, rows)`` over parts of ``sizes`` rows each (one shard's rows each, say), run on up to
    ``threads`` threads at once: a part larger than ``MIN_ROWS_PER_THREAD`` rows per thread is cut into
    slices, then the pieces are dealt out largest first to the least loaded thread, so many small
    parts (a query's few hundred rows in each of many shards) share the threads as one large part
    does."""
    pieces = []
    for i, n in enumerate(sizes):
        cut = max(1, min(threads, n // MIN_ROWS_PER_THREAD))
        bounds = np.linspace(0, n, cut + 1).astype(int)
        pieces += [(int(b - a), i, slice(int(a), int(b))) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    total = sum(p[0] for p in pieces)
    workers = max(1, min(threads, len(pieces), total // MIN_ROWS_PER_THREAD))
    if workers == 1:
        for _, i, sl in pieces:
            fn(i, sl)
        return
    load = [0] * workers
    jobs: list[list[tuple[int, slice]]] = [[] for _ in range(workers)]
    for n, i, sl in sorted(pieces, key=lambda p: -p[0]):
        w = load.index(min(load))
        load[w] += n
        jobs[w].append((i, sl))

    def run(job: list[tuple[int, slice]]) -> None:
        for i, sl in job:
            fn(i, sl)

    for f in [_pool().submit(run, job) for job in jobs]:
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
               out_terms: np.ndarray, gather: bool = False) -> None:
    """For the shard rows ``local`` (n,), with their stored ``I(t, t)`` (``t_self``) and targets: each
    one's active prototypes (``out_protos``), activations (``out_acts``, from the codes through
    ``act_table`` (K, 256)) and each slot's term ``a_{t,i} Wq_i . Q^T u_t`` of its score
    (``out_terms``; 0 where the prototype is not one of the query's: ``col`` (K,) its column in the
    tables, or -1).

    ``m_tab``, ``d_tab`` (n_sub, P, n_cent): each query column's product with every centroid of each
    sub-quantiser. A token coded by ``m_t`` scores ``sum_s m_tab[s, c, code_s] - y_tab[c, y_t]``; one
    coded by its direction (bit set in ``code_dir``, packed big-endian per byte; empty: none) scores
    ``length * sum_s d_tab[s, c, code_s]``, the length being the one that gives its decoded direction
    (``dir_cent`` (n_sub * n_cent, d_sub)) the stored ``I(t, t)`` under ``inv`` (K, d).

    Two passes. The first reads each row once: its prototypes and activations, and for a row with a
    slot in a query column, its unpacked codes, its direction's length and one (row, slot) pair per such
    slot. The second sums the table entries of the pairs column by column (a counting sort by column
    and kind of code): one column's tables, ``n_sub * n_cent`` entries, stay in cache while every pair
    of that column is summed, where row order would draw each lookup from all P columns' tables. The
    sums run over s in the same order either way, so the terms are the same. ``gather``: in the first
    pass, copy each chunk of rows' stored bytes out before reading them (:data:`GATHER_MIN_ROWS`); the
    same result either way."""
    n, k = len(local), protos.shape[1]
    P = m_tab.shape[1]
    is_dir = np.zeros(n, np.bool_)
    if code_dir.shape[0] > 0:
        for i in range(n):
            is_dir[i] = _dir_bit(code_dir, local[i])
    code = np.empty(n_sub, np.int64)
    w = np.empty(inv.shape[1], np.float64)
    hit_codes = np.empty((n, n_sub), np.int32)  # the unpacked codes of the rows with a pair, in order
    length = np.ones(n, np.float64)
    pair_row = np.empty(n * k, np.int32)  # row i of the call
    pair_hit = np.empty(n * k, np.int32)  # its place in hit_codes
    pair_slot = np.empty(n * k, np.int8)
    pair_key = np.empty(n * k, np.int32)  # 2 * column + (1 when coded by direction)
    start = np.zeros(2 * P + 1, np.int64)
    state = np.zeros(2, np.int64)  # pairs, rows with a pair
    if not gather:  # a small shard: its arrays stay in cache, read them in place
        _first_pass(0, local, protos, act_codes, codes, is_dir, act_table, t_self, bits, n_sub, n_cent, col, dir_cent,
                    inv, out_protos, out_acts, out_terms, code, w, hit_codes, length, pair_row, pair_hit, pair_slot,
                    pair_key, start, state)
    else:
        # a large shard: rows are read in chunks, first each chunk's stored bytes copied into small local
        # buffers (a tight loop of independent loads, so many cache and TLB misses are in flight at once
        # when the rows lie far apart), then read from there
        gp = np.empty((GATHER_ROWS, k), protos.dtype)
        ga = np.empty((GATHER_ROWS, k), act_codes.dtype)
        gc = np.empty((GATHER_ROWS, codes.shape[1]), codes.dtype)
        at = np.arange(GATHER_ROWS)
        for c0 in range(0, n, GATHER_ROWS):
            m = min(GATHER_ROWS, n - c0)
            for h in range(m):
                r = local[c0 + h]
                for j in range(k):
                    gp[h, j] = protos[r, j]
                    ga[h, j] = act_codes[r, j]
                for b in range(codes.shape[1]):
                    gc[h, b] = codes[r, b]
            _first_pass(c0, at[:m], gp, ga, gc, is_dir, act_table, t_self, bits, n_sub, n_cent, col, dir_cent, inv,
                        out_protos, out_acts, out_terms, code, w, hit_codes, length, pair_row, pair_hit, pair_slot,
                        pair_key, start, state)
    n_pairs = state[0]
    # the pairs in order of (column, kind of code)
    for t in range(2 * P):
        start[t + 1] += start[t]
    order = np.empty(n_pairs, np.int64)
    for q in range(n_pairs):
        key = pair_key[q]
        order[start[key]] = q
        start[key] += 1
    for o in range(n_pairs):
        q = order[o]
        i, u, c = pair_row[q], pair_hit[q], pair_key[q] >> 1
        v = 0.0
        if pair_key[q] & 1:
            for s in range(n_sub):
                v += d_tab[s, c, hit_codes[u, s]]
            v = v * length[i]
        else:
            for s in range(n_sub):
                v += m_tab[s, c, hit_codes[u, s]]
            v = v - y_tab[c, targets[i]]
        j = pair_slot[q]
        out_terms[i, j] = out_acts[i, j] * v


@njit(cache=True, nogil=True, inline="always")
def _dir_bit(code_dir: np.ndarray, r: int) -> bool:
    """Whether row ``r`` stores the codes of its direction (``code_dir``: bits packed big-endian per byte)."""
    return ((code_dir[r >> 3] >> (7 - (r & 7))) & 1) == 1


@njit(cache=True, nogil=True)
def _first_pass(i0: int, rows: np.ndarray, gp: np.ndarray, ga: np.ndarray, gc: np.ndarray, is_dir: np.ndarray,
                act_table: np.ndarray, t_self: np.ndarray, bits: int, n_sub: int, n_cent: int, col: np.ndarray,
                dir_cent: np.ndarray, inv: np.ndarray, out_protos: np.ndarray, out_acts: np.ndarray,
                out_terms: np.ndarray, code: np.ndarray, w: np.ndarray, hit_codes: np.ndarray, length: np.ndarray,
                pair_row: np.ndarray, pair_hit: np.ndarray, pair_slot: np.ndarray, pair_key: np.ndarray,
                count: np.ndarray, state: np.ndarray) -> None:
    """:func:`code_terms`'s first pass over its rows ``i0, i0 + 1, ...``, whose stored bytes are the rows
    ``rows`` of ``gp``, ``ga``, ``gc`` (a chunk's buffers, or the shard's arrays themselves). ``state``:
    the pairs and the rows with a pair so far, updated; ``count[key + 1]`` counts each key's pairs."""
    k, d = gp.shape[1], inv.shape[1]
    ds = dir_cent.shape[1] if dir_cent.shape[0] else 0
    n_pairs, n_hit = state[0], state[1]
    for h in range(len(rows)):
        i, r = i0 + h, rows[h]
        hit = False
        for j in range(k):
            p = np.int64(gp[r, j])
            a = act_table[p, ga[r, j]]
            out_protos[i, j] = p
            out_acts[i, j] = a
            out_terms[i, j] = 0.0
            if col[p] >= 0 and a > 0:
                hit = True
        if not hit:
            continue
        _unpack_row(gc, r, bits, n_sub, code)
        for s in range(n_sub):
            hit_codes[n_hit, s] = code[s]
        if is_dir[i]:  # the direction's I(t, t) at unit length, over every active prototype: the
            # curvature's diagonal weighted by the squared activations first (independent sums, which
            # vectorise), then one product with the squared direction (two running sums)
            w[:] = 0.0
            for j in range(k):
                a = out_acts[i, j]
                if a <= 0:
                    continue
                p = out_protos[i, j]
                a2 = np.float64(a) * a
                for e in range(d):
                    w[e] += a2 * inv[p, e]
            q0 = 0.0
            q1 = 0.0
            for s in range(n_sub):
                base = s * n_cent + code[s]
                for e in range(0, ds - 1, 2):
                    x, y = dir_cent[base, e], dir_cent[base, e + 1]
                    q0 += x * x * w[s * ds + e]
                    q1 += y * y * w[s * ds + e + 1]
                if ds % 2:
                    x = dir_cent[base, ds - 1]
                    q0 += x * x * w[s * ds + ds - 1]
            length[i] = np.sqrt(t_self[i] / max(q0 + q1, 1e-30))
        for j in range(k):
            p = out_protos[i, j]
            c = col[p]
            if c < 0 or out_acts[i, j] <= 0:
                continue
            key = 2 * c + (1 if is_dir[i] else 0)
            pair_row[n_pairs] = i
            pair_hit[n_pairs] = n_hit
            pair_slot[n_pairs] = j
            pair_key[n_pairs] = key
            count[key + 1] += 1
            n_pairs += 1
        n_hit += 1
    state[0], state[1] = n_pairs, n_hit


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


@njit(cache=True, nogil=True)
def target_products(col: np.ndarray, protos: np.ndarray, acts: np.ndarray, M: np.ndarray, out: np.ndarray) -> None:
    """Add to ``out`` (n, n_targets) each token's influence with each target token's own gradient:
    for every slot ``s`` of row ``i`` whose prototype ``p`` is active on target ``j`` (``col[j, p]``,
    -1 where not), ``acts[i, s] * M[i, col[j, p]]``; slot by slot, as the numpy form adds them."""
    n, k = protos.shape
    T = col.shape[0]
    for i in range(n):
        for s in range(k):
            p = protos[i, s]
            a = acts[i, s]
            for j in range(T):
                c = col[j, p]
                if c >= 0:
                    out[i, j] += a * M[i, c]
