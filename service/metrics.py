"""Prometheus metrics of one app (its own registry, so several apps in one process stay apart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("prism_http_requests_total", "HTTP requests answered",
                                ["method", "operation", "status"], registry=self.registry)
        self.latency = Histogram("prism_http_request_seconds", "HTTP request latency", ["method", "operation"],
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                                 registry=self.registry)
        self.in_flight = Gauge("prism_http_requests_in_flight", "HTTP requests being answered",
                               registry=self.registry)
        self.audit_items = Counter("prism_audit_items_total", "Audit items finished", ["status"],
                                   registry=self.registry)
        self.sql_refused = Counter("prism_sql_refused_total", "SQL queries refused", ["kind"],
                                   registry=self.registry)
        self.index_load_seconds = Gauge("prism_index_load_seconds", "Time to load an index at start-up",
                                        ["index"], registry=self.registry)
