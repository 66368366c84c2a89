"""Offline indexer: runs a trained PRISM model over its training corpus and writes the store.

See :func:`prism_tda.indexer.run.build_index` and ``docs/indexer.md``.
"""

from .config import IndexConfig

__all__ = ["IndexConfig"]
