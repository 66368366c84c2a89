"""Benchmarks of PRISM-TDA (see docs/benchmarks.md)."""

import prism_tda  # noqa: F401  (first: its OpenMP spin count is read when torch loads)
