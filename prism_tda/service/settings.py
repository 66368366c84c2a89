"""Service settings: read from ``PRISM_*`` environment variables, here and nowhere else.

Every field carries a description; ``docs/service.md`` lists them. Lists and mappings are given as
JSON, e.g. ``PRISM_INDEXES='{"demo": "runs/demo/index"}'``, ``PRISM_API_KEYS='["k1", "k2"]'``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prism_tda.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"512MB"``, ``"1GiB"``, ``"2000000"`` -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ConfigError(f"{text!r} is not a size (e.g. 512MB, 1GiB)")
    return int(value * _UNITS[unit])


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PRISM_", extra="forbid", validate_default=True)

    indexes: dict[str, Path] = Field(
        default_factory=dict,
        description="Indexes to serve, by name: a JSON object {name: index directory}. Requests pick "
                    "one with their `index` field or query parameter.")
    default_index: str | None = Field(
        None, description="Index used when a request names none (default: the first of `indexes`).")
    host: str = Field("127.0.0.1", description="Address the server binds to. Any address that is not "
                                               "loopback requires `api_keys`.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port the server listens on.")
    workers: int = Field(1, ge=1, description="Server processes. Each loads every index; one of them "
                                              "(holding a file lock) runs the audit worker.")
    state_dir: Path = Field(Path("prism-state"), description="Directory of the durable state: audit jobs, "
                                                             "items and results, prototype sets (SQLite, WAL).")
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Accepted bearer tokens (JSON list). Empty: no authentication, allowed only on loopback.")
    admin_api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Admin bearer tokens, JSON list: the only keys the admin endpoints (`/v1/admin`, e.g. index "
                    "reload) accept when set (empty: they accept `api_keys` like every other endpoint); accepted "
                    "on every other endpoint too, where they see every key's audits.")
    graceful_shutdown_s: float = Field(
        30.0, gt=0, description="On SIGTERM, how long requests in flight may take to finish before they are "
                                "cancelled; the audit worker finishes its current item within the same time.")
    rate_limit_per_minute: int = Field(
        600, ge=0, description="Requests per minute per API key (per client address without keys); 0 = off. "
                               "Counted per server process.")
    rate_limit_burst: int = Field(60, ge=1, description="Requests a client may make at once before the rate "
                                                        "limit spaces them out.")
    auth_failures_per_minute: int = Field(
        10, ge=0, description="Failed authentications allowed per client address and minute (as many at once); "
                              "past that the address gets 429 for every request until it may try again. 0 = off.")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Largest request body accepted, in bytes.")
    max_batch_items: int = Field(1000, ge=1, description="Most items in one audit, documents in one batch "
                                                         "fetch, or prototypes in one set.")
    max_new_tokens: int = Field(128, ge=1, description="Most tokens one request may generate.")
    max_top_k: int = Field(100, ge=1, description="Most documents one attribution may return.")
    cors_origins: list[str] = Field(default_factory=list, description="Origins allowed by CORS (JSON list); "
                                                                      "empty: CORS off. State-changing requests "
                                                                      "from any other web origin are refused.")
    forwarded_allow_ips: list[str] = Field(
        default_factory=list,
        description="Reverse proxies trusted to name the client (JSON list of addresses or networks, e.g. the "
                    "compose gateway's): from them, `X-Forwarded-For` and `X-Forwarded-Proto` set the client "
                    "address that rate limits and failed-authentication limits count by. Empty: proxy headers "
                    "are ignored and the client is the connection's peer.")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Without API keys, Host names answered besides localhost, 127.0.0.1 and [::1] (JSON list); "
                    "any other Host is refused (DNS rebinding). Ignored when API keys are set.")
    compute_concurrency: int = Field(2, ge=1, description="Model/attribution computations that run at once "
                                                          "per index; more requests wait their turn, which "
                                                          "comes to each API key in rotation.")
    max_waiting_per_key: int = Field(
        8, ge=0, description="Requests one API key may have waiting for a computation (or a SQL worker) of one "
                             "index beyond those running; more are refused at once with 429 `key-busy` and "
                             "`Retry-After`, so one key's burst never queues in front of another key (admin keys "
                             "and keyless loopback use are not limited).")
    max_heavy_per_key: int = Field(
        1, ge=1, description="Heavy requests one API key may run at once: generation (`/v1/generate`, a query "
                             "with `max_new_tokens`), the `influence` option, `mode: exact` and discovery; more "
                             "are refused with 429 `key-busy` (admin keys and keyless loopback use are not "
                             "limited).")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads of each computation (the compiled scoring uses as many). "
                                "Default: each computation takes this process's cores (the machine's over `workers`) "
                                "divided by the computations running when it starts, at least 1: one alone uses every "
                                "core, two at once do not oversubscribe them.")
    exact_max_tokens: int = Field(
        2_000_000, ge=0, description="Largest index (in tokens) on which `mode: exact` is answered: it runs the model "
                                     "over every training token. Larger indexes answer 422 `invalid-query`.")
    exact_max_seconds: float = Field(
        60.0, gt=0, description="Longest `mode: exact` answered within one request, by its estimate (the index's "
                                "tokens at this process's measured rate); longer ones answer 422 `invalid-query` "
                                "with the estimate, and run as audit items, in the background.")
    sql_timeout_s: float = Field(5.0, gt=0, description="Time limit of one SQL query; the query is "
                                                        "interrupted when it runs out.")
    sql_max_rows: int = Field(10_000, ge=1, description="Most rows a SQL query may return; larger results "
                                                        "are refused (add a LIMIT).")
    sql_memory_limit: str = Field(
        "1GB", description="Memory all SQL statements of one index may use together (e.g. `512MB`, `2GiB`): "
                           "each of the `sql_workers` processes gets an equal share and is killed when it "
                           "grows past it.")
    sql_workers: int = Field(2, ge=1, le=64, description="SQL worker processes per index: statements that run at "
                                                         "once (more wait for a free worker).")
    sql_threads: int = Field(1, ge=1, description="DuckDB threads per SQL worker process.")
    sql_max_result_bytes: int = Field(16 * 2**20, ge=1024, description="Largest SQL result, in bytes of JSON; a "
                                                                      "larger one is refused (`sql-result-too-large`).")
    sql_queue_timeout_s: float = Field(30.0, gt=0, description="How long a SQL statement may wait for a free worker "
                                                              "before it is refused (`sql-busy`).")
    sql_max_per_key: int = Field(
        1, ge=1, description="SQL statements of one API key that run at once per index (capped at `sql_workers`); "
                             "more wait their turn, which comes to each key in rotation, so another key's "
                             "statement gets the next free worker (admin keys and keyless loopback use may use "
                             "every worker).")
    audit_poll_s: float = Field(1.0, gt=0, description="How often an idle audit worker looks for new work.")
    max_active_audits_per_key: int = Field(
        16, ge=1, description="Queued or running audits one API key may have at once (admin keys and keyless "
                              "loopback use are not limited); more are refused with 429 `too-many-audits`.")
    max_active_tasks_per_key: int = Field(
        4, ge=1, description="Queued or running background tasks (discoveries run with `POST "
                             "/v1/prototypes/discover/tasks`) one API key may have at once (admin keys and keyless "
                             "loopback use are not limited); more are refused with 429 `too-many-tasks`.")
    audit_max_attempts: int = Field(
        3, ge=1, description="Times an audit item is started before it is marked failed (an item that keeps "
                             "failing unexpectedly, or crashing the server, never blocks the queue).")
    work_slice_s: float = Field(
        1.0, gt=0, description="Background work (audit items and discovery tasks) runs in slices of this many "
                               "seconds: after each, the worker gives the next API key with work its turn (the "
                               "unit it put down waits, in memory, for its key's next turn), so one key's long "
                               "task or item delays another key's next item by about one slice.")
    audit_item_max_s: float = Field(
        300.0, gt=0, description="Most compute time one audit item may take (its slices together): past it the "
                                 "item is stopped and failed. An audit whose `mode: exact` estimate (as for one "
                                 "request, `exact_max_seconds`) is over it is refused at submission (422).")
    audit_retention_days: float = Field(
        30.0, ge=0, description="Finished (completed or cancelled) audits are deleted, with their items and "
                                "results, this many days after they finished; 0 keeps them for ever.")
    max_candidates: int = Field(4096, ge=1, description="Most candidate sequences (`n_candidates`) one "
                                                        "attribution may ask the fast path for; a default "
                                                        "above it (256 under `opponents`) comes down to it.")
    max_exact_rerank: int = Field(256, ge=1, description="Most documents (`exact_rerank`) one fast attribution "
                                                         "may re-score with the model.")
    max_rerank_tokens: int = Field(
        32_768, ge=1, description="Most training tokens one fast attribution may re-score with the model: "
                                  "`exact_rerank` x `exact_tokens` (x the context length when `exact_tokens` is "
                                  "null) x 2 (a document's best sequence, and as many of its best rows in its "
                                  "other sequences).")
    discover_max_tokens: int = Field(
        2_000_000, ge=0, description="Most stored tokens one prototype discovery may read (its documents, and "
                                     "for `measure: logit` the corpus pass behind the default contrast until "
                                     "its totals are cached); larger requests answer 422 `invalid-query`.")
    prototype_sets: dict[str, list[int]] = Field(
        default_factory=dict,
        description="Named prototype sets created in every index at start-up (JSON {name: [ids]}), for "
                    "generation suppression and audit flags; more can be stored with PUT /v1/prototype-sets.")
    ray_address: str | None = Field(
        None, description="Serve every index's shards from Ray actors of this cluster: `auto` (the cluster this "
                          "machine is part of), `ray://HOST:10001`, or `local` (a Ray started by the server on "
                          "this machine). Unset: the server process holds every shard itself.")
    ray_actors: int | None = Field(None, ge=1, description="Shard-holding actors per index when served from Ray "
                                                           "(placed by size; default: one per shard).")
    ray_actor_cpus: float = Field(0.5, gt=0, description="CPUs Ray reserves for each shard actor (fractional "
                                                         "values let several share a core).")
    ray_call_timeout_s: float = Field(30.0, gt=0, description="Longest wait for one shard actor's answer, a "
                                                              "restart included; past it (and one retry) the "
                                                              "request answers 503 `shard-unavailable`.")
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time a connection has to send a request's headers, from its opening or, on a "
                                "kept-alive connection, from the end of the previous response; past it the "
                                "connection is closed without an answer.")
    body_timeout_s: float = Field(
        30.0, gt=0, description="Time a request has to send its whole body once its headers are in; past it the "
                                "request answers 408 `request-timeout` and its connection is closed.")
    idle_timeout_s: float = Field(
        5.0, gt=0, description="Time a kept-alive connection may stay idle between requests before it is "
                               "closed.")
    max_connections: int = Field(
        512, ge=1, description="Connections one server process answers at once: a request that arrives while "
                               "this many connections are open (its own, idle and slow ones included) or this "
                               "many requests are running is answered a bare 503 and its connection closed. Per "
                               "server process (`workers`).")
    log_level: str = Field("info", description="Log level: debug, info, warning or error.")
    log_format: str = Field("json", description="Log format: json (one object per line) or text.")

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        if v not in ("debug", "info", "warning", "error"):
            raise ValueError("must be debug, info, warning or error")
        return v

    @field_validator("log_format")
    @classmethod
    def _format(cls, v: str) -> str:
        if v not in ("json", "text"):
            raise ValueError("must be json or text")
        return v

    @field_validator("sql_memory_limit")
    @classmethod
    def _size(cls, v: str) -> str:
        try:
            parse_bytes(v)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.default_index is not None and self.indexes and self.default_index not in self.indexes:
            raise ValueError(f"default_index {self.default_index!r} is not one of indexes {sorted(self.indexes)}")
        return self

    def cluster(self) -> Any:
        """The engine's cluster spec when shards are served from Ray, else None."""
        if not self.ray_address:
            return None
        from prism_tda.engine.cluster import ClusterSpec

        return ClusterSpec(address=None if self.ray_address == "local" else self.ray_address, actors=self.ray_actors,
                           num_cpus=self.ray_actor_cpus, call_timeout_s=self.ray_call_timeout_s)

    @property
    def default(self) -> str | None:
        return self.default_index or next(iter(self.indexes), None)

    def check_serving(self) -> None:
        """Refuse configurations that must not serve: no index, or no API key beyond loopback."""
        if not self.indexes:
            raise ConfigError("PRISM_INDEXES: no index to serve (give at least one name -> directory)")
        if not is_loopback(self.host) and not self.api_keys:
            raise ConfigError(f"PRISM_API_KEYS: required when binding to {self.host!r} (not loopback)")
