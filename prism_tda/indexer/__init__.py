"""Offline indexer: runs a trained PRISM model over its training corpus and writes a sharded index.

See :func:`prism_tda.indexer.run.build_index` and ``docs/indexer.md``. The layout it writes, and the
configuration it takes (``IndexConfig``), are defined in ``prism_tda.engine.layout``.
"""

from prism_tda.engine.layout import IndexConfig

__all__ = ["IndexConfig"]
