"""The attribution engine: the math of DESIGN §2 (per-token quantities, curvature, sketches,
scoring), the index layout, and the query engine that answers "which training documents drove
this output?". The indexer writes with it; the CLI and the service query with it.

The names below load on first use, so a process that needs only the layout (a SQL worker reads
``engine/layout.py``) does not import the model and torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .attributor import Attributor
    from .candidates import FirstStages
    from .types import (
        AGGREGATIONS,
        Aggregation,
        Attribution,
        ExactEstimate,
        Highlight,
        Mode,
        ProtoShare,
        QueryInfo,
        QueryOptions,
        QuerySpec,
        ScoredDocument,
        Timings,
        TokenPrototype,
        TokenView,
    )

_WHERE = {"Attributor": "attributor", "FirstStages": "candidates",
          **{n: "types" for n in ("AGGREGATIONS", "Aggregation", "Attribution", "ExactEstimate", "Highlight", "Mode", "ProtoShare",
                                  "QueryInfo", "QueryOptions", "QuerySpec", "ScoredDocument", "Timings",
                                  "TokenPrototype", "TokenView")}}

__all__ = ["AGGREGATIONS", "Aggregation", "Attribution", "Attributor", "ExactEstimate", "FirstStages", "Highlight",
           "Mode",
           "ProtoShare", "QueryInfo", "QueryOptions", "QuerySpec", "ScoredDocument", "Timings", "TokenPrototype",
           "TokenView"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
