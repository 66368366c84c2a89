"""Prometheus metrics of one app (its own registry, so several apps in one process stay apart)."""

from __future__ import annotations

from typing import Any

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
        self.tasks = Counter("prism_tasks_total", "Background tasks finished", ["kind", "status"],
                             registry=self.registry)
        self.sql_refused = Counter("prism_sql_refused_total", "SQL queries refused", ["kind"],
                                   registry=self.registry)
        self.index_load_seconds = Gauge("prism_index_load_seconds", "Time to load an index at start-up",
                                        ["index"], registry=self.registry)
        # an index served from a cluster: each shard holder (a Ray actor; one shard each by default)
        self.shard_queue = Histogram("prism_shard_queue_seconds", "From a call's sending to its start on the shard "
                                     "holder", ["index", "holder", "method"], registry=self.registry,
                                     buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
        self.shard_seconds = Histogram("prism_shard_call_seconds", "Time a shard holder spent on a call (searching, "
                                       "reading and scoring)", ["index", "holder", "method"], registry=self.registry,
                                       buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5))
        self.shard_rows = Counter("prism_shard_rows_scored_total", "Training tokens a shard holder scored",
                                  ["index", "holder"], registry=self.registry)
        self.shard_holder = Gauge("prism_shard_holder_shards", "Shards held by each holder (label: their positions)",
                                  ["index", "holder", "shards"], registry=self.registry)

    def index_loaded(self, ix: Any) -> None:
        """Record a (re)loaded index: its load time and, served from a cluster, its shard holders."""
        self.index_load_seconds.labels(ix.name).set(ix.load_seconds)
        shards = ix.attributor.shards
        if not hasattr(shards, "groups"):
            return
        for g, held in enumerate(shards.groups):
            self.shard_holder.labels(ix.name, str(g), ",".join(map(str, held))).set(len(held))

        def observe(holder: int, method: str, queued: float, stats: Any) -> None:
            h = str(holder)
            self.shard_queue.labels(ix.name, h, method).observe(queued)
            self.shard_seconds.labels(ix.name, h, method).observe(stats.seconds)
            if stats.rows:
                self.shard_rows.labels(ix.name, h).inc(stats.rows)

        shards.observer = observe
