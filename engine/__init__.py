"""The attribution engine: the math of DESIGN §2 (per-token quantities, curvature, sketches,
scoring), the index layout, and the query engine that answers "which training documents drove
this output?". The indexer writes with it; the CLI and the service query with it."""

from .attributor import Attributor
from .candidates import FirstStages
from .types import (
    AGGREGATIONS,
    Aggregation,
    Attribution,
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

__all__ = ["AGGREGATIONS", "Aggregation", "Attribution", "Attributor", "FirstStages", "Highlight", "Mode",
           "ProtoShare", "QueryInfo", "QueryOptions", "QuerySpec", "ScoredDocument", "Timings", "TokenPrototype",
           "TokenView"]
