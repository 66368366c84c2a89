"""Bearer API keys, who a request is (its principal), and the rate limits.

- With ``api_keys`` set, every ``/v1`` request needs one of them (or an admin key). The principal
  is the key (as a hash); audits belong to the key that created them, and only admin keys
  (``admin_api_keys``) see everyone's. Without keys (loopback only) the server is single-tenant:
  every request is the same principal, which sees every audit.
- Requests are rate-limited per principal (per client address without keys), and failed
  authentications per client address: past ``auth_failures_per_minute`` (burst as many) an address
  gets 429 for every further *wrong* key until its bucket refills, so keys cannot be guessed at
  speed. A valid key is never refused by that limiter (behind a proxy or NAT many users share one
  address, and one of them must not lock the others out); a request without a key is 401, never 429.
- The client address is the connection's peer, or, from the proxies listed in
  ``forwarded_allow_ips`` only, the address their ``X-Forwarded-For`` names (uvicorn's proxy headers).
- Without keys the server is for this machine only: a request must arrive on a loopback socket from a
  loopback peer, with a loopback ``Host`` (or one of ``allowed_hosts``): a page that rebinds its DNS
  name to 127.0.0.1 still sends its own name as Host, and is refused.
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
from .state import SHARED


@dataclass(frozen=True)
class Principal:
    """Who sent a request: ``id`` owns audits and prototype sets; ``admin`` sees every audit and set,
    and writes the shared sets."""

    id: str
    admin: bool

    @property
    def owner(self) -> str:
        """The owner of the prototype sets this principal writes: its own, or the shared ones for admins."""
        return SHARED if self.admin else self.id


LOCAL = Principal("local", admin=True)


class TokenBuckets:
    """``rate`` requests per minute per key with bursts of ``burst``; thread-safe.

    A bucket that has refilled holds no information, so it is dropped: the table is pruned of them
    at most once a second once it holds more than ``prune_above`` keys, and never holds more than
    ``max_keys`` (the buckets closest to full go first), whatever the number of clients."""

    def __init__(self, per_minute: int, burst: int, *, prune_above: int = 1024, max_keys: int = 100_000) -> None:
        self.rate, self.burst = per_minute / 60.0, float(burst)
        self._state: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self.prune_above, self.max_keys = prune_above, max_keys
        self._pruned_at = 0.0

    def __len__(self) -> int:
        return len(self._state)

    def _prune(self, now: float) -> None:
        """Drop full buckets; past ``max_keys``, the fullest ones too (called with the lock held)."""
        if len(self._state) <= self.prune_above or (now - self._pruned_at < 1.0 and len(self._state) < self.max_keys):
            return
        self._pruned_at = now
        full = [k for k in self._state if self._tokens(k, now) >= self.burst]
        for k in full:
            del self._state[k]
        excess = len(self._state) - self.max_keys + 1
        if excess > 0:
            for k in sorted(self._state, key=lambda k: -self._tokens(k, now))[:excess]:
                del self._state[k]

    def _tokens(self, key: str, now: float) -> float:
        tokens, last = self._state.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - last) * self.rate)

    def take(self, key: str) -> float:
        """0 when the request may go ahead (and charge it), else the seconds until it may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            self._prune(now)
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
        """The given key when it is one of ``keys``. A missing key is 401; a wrong one is 401 and counts
        against the client address, which gets 429 for wrong keys once it has made too many. A valid
        key is checked first and never meets that limiter."""
        given = credentials.credentials.encode() if credentials is not None else b""
        if self._matches(given, keys):
            return given
        unauthorized = problems.Unauthorized(f"send `Authorization: Bearer <key>` with a valid {what}",
                                             headers={"WWW-Authenticate": "Bearer"})
        if not given:
            raise unauthorized
        wait = self.failures.take("addr:" + client)
        if wait > 0:
            raise _rate_limited("too many failed authentications from this address", wait)
        raise unauthorized

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
