"""Small array helpers of the query path."""

from __future__ import annotations

import numpy as np


def unique(x: np.ndarray) -> np.ndarray:
    """The sorted distinct values of a 1-D array: ``np.unique`` by a sort (numpy's own hashes first,
    which is over ten times slower on the id arrays a query handles)."""
    y = np.sort(np.asarray(x).reshape(-1))
    if len(y) < 2:
        return y
    keep = np.empty(len(y), dtype=bool)
    keep[0] = True
    np.not_equal(y[1:], y[:-1], out=keep[1:])
    return y[keep]


def best_first(value: np.ndarray, tie: np.ndarray, n: int) -> np.ndarray:
    """Positions of the ``n`` largest ``value`` in order (equal values: the lower ``tie`` first), what
    ``np.lexsort((tie, -value))[:n]`` gives, sorting only the elements at or above the n-th largest."""
    at = np.arange(len(value))
    if len(value) > n > 0:
        at = at[value >= np.partition(value, len(value) - n)[len(value) - n]]
    return at[np.lexsort((tie[at], -value[at]))][:n]


def index_in(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The position in ``keys`` (distinct, any order) of each of ``values`` (each one of the keys)."""
    order = np.argsort(keys, kind="stable")
    return order[np.searchsorted(keys[order], values)]
