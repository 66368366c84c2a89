"""Bearer API keys, who a request is (its principal), and the rate limits.

- With ``api_keys`` set, every ``/v1`` request needs one of them (or an admin key). The principal
  is the key (as a hash); audits belong to the key that created them, and only admin keys
  (``admin_api_keys``) see everyone's. Without keys (loopback only) the server is single-tenant:
  every request is the same principal, which sees every audit.
- Requests are rate-limited per principal (per client address without keys), and failed
  authentications per client address: past ``auth_failures_per_minute`` (burst as many) an address
  gets 429 for every request until its bucket refills, whatever key it sends, so keys cannot be
  guessed at speed.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from dataclasses import dataclass

from fastapi.security import HTTPAuthorizationCredentials

from . import problems
from .settings import Settings


@dataclass(frozen=True)
class Principal:
    """Who sent a request: ``id`` owns audits; ``admin`` sees every audit."""

    id: str
    admin: bool


LOCAL = Principal("local", admin=True)


class TokenBuckets:
    """``rate`` requests per minute per key with bursts of ``burst``; thread-safe."""

    def __init__(self, per_minute: int, burst: int) -> None:
        self.rate, self.burst = per_minute / 60.0, float(burst)
        self._state: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def _tokens(self, key: str, now: float) -> float:
        tokens, last = self._state.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - last) * self.rate)

    def take(self, key: str) -> float:
        """0 when the request may go ahead (and charge it), else the seconds until it may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            tokens = self._tokens(key, now)
            if tokens >= 1.0:
                self._state[key] = (tokens - 1.0, now)
                return 0.0
            self._state[key] = (tokens, now)
            return (1.0 - tokens) / self.rate

    def wait(self, key: str) -> float:
        """Like :meth:`take` without charging: the seconds until ``key`` has a token again."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            tokens = self._tokens(key, time.monotonic())
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate


def _rate_limited(detail: str, wait: float) -> problems.ServiceError:
    seconds = max(1, math.ceil(wait))  # the detail and Retry-After say the same
    return problems.RateLimited(f"{detail}; retry in {seconds} s", headers={"Retry-After": str(seconds)})


def _digest(key: bytes) -> str:
    return "key:" + hashlib.sha256(key).hexdigest()[:16]


class Guard:
    """Authenticates a request, charges the rate limits, and returns its :class:`Principal`."""

    def __init__(self, settings: Settings) -> None:
        self._keys = [k.get_secret_value().encode() for k in settings.api_keys]
        self._admin_keys = [k.get_secret_value().encode() for k in settings.admin_api_keys]
        self.buckets = TokenBuckets(settings.rate_limit_per_minute, settings.rate_limit_burst)
        self.failures = TokenBuckets(settings.auth_failures_per_minute, settings.auth_failures_per_minute)

    @staticmethod
    def _matches(given: bytes, keys: list[bytes]) -> bool:
        return bool(given) and any(hmac.compare_digest(given, k) for k in keys)

    def _authenticate(self, credentials: HTTPAuthorizationCredentials | None, client: str,
                      keys: list[bytes], what: str) -> bytes:
        """The given key when it is one of ``keys``; 401 otherwise (429 while the address is locked out)."""
        wait = self.failures.wait("addr:" + client)
        if wait > 0:
            raise _rate_limited("too many failed authentications from this address", wait)
        given = credentials.credentials.encode() if credentials is not None else b""
        if not self._matches(given, keys):
            self.failures.take("addr:" + client)
            raise problems.Unauthorized(f"send `Authorization: Bearer <key>` with a valid {what}",
                                        headers={"WWW-Authenticate": "Bearer"})
        return given

    def __call__(self, credentials: HTTPAuthorizationCredentials | None, client: str) -> Principal:
        if self._keys:
            given = self._authenticate(credentials, client, self._keys + self._admin_keys,
                                       "key from PRISM_API_KEYS")
            principal = Principal(_digest(given), admin=self._matches(given, self._admin_keys))
            bucket = principal.id
        else:
            principal, bucket = LOCAL, "addr:" + client
        wait = self.buckets.take(bucket)
        if wait > 0:
            raise _rate_limited("rate limit exceeded", wait)
        return principal

    def admin(self, credentials: HTTPAuthorizationCredentials | None, client: str) -> Principal:
        """For the admin endpoints: with admin keys set, only those; otherwise as every endpoint."""
        if not self._admin_keys:
            return self(credentials, client)
        given = self._authenticate(credentials, client, self._admin_keys, "admin key from PRISM_ADMIN_API_KEYS")
        return Principal(_digest(given), admin=True)
