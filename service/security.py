"""Bearer API keys and a per-key token-bucket rate limit."""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time

from fastapi.security import HTTPAuthorizationCredentials

from . import problems
from .settings import Settings


class TokenBuckets:
    """``rate`` requests per minute per principal with bursts of ``burst``; thread-safe."""

    def __init__(self, per_minute: int, burst: int) -> None:
        self.rate, self.burst = per_minute / 60.0, float(burst)
        self._state: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, principal: str) -> float:
        """0 when the request may go ahead, else the seconds until it may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            tokens, last = self._state.get(principal, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._state[principal] = (tokens - 1.0, now)
                return 0.0
            self._state[principal] = (tokens, now)
            return (1.0 - tokens) / self.rate


class Guard:
    """Authenticates a request and charges its principal's rate limit; returns the principal."""

    def __init__(self, settings: Settings) -> None:
        self._keys = [k.get_secret_value().encode() for k in settings.api_keys]
        self.buckets = TokenBuckets(settings.rate_limit_per_minute, settings.rate_limit_burst)

    def __call__(self, credentials: HTTPAuthorizationCredentials | None, client: str) -> str:
        if self._keys:
            given = credentials.credentials.encode() if credentials is not None else b""
            if not given or not any(hmac.compare_digest(given, k) for k in self._keys):
                raise problems.Unauthorized("send `Authorization: Bearer <API key>` with a valid key",
                                            headers={"WWW-Authenticate": "Bearer"})
            principal = "key:" + hashlib.sha256(given).hexdigest()[:16]
        else:
            principal = "addr:" + client
        wait = self.buckets.take(principal)
        if wait > 0:
            raise problems.RateLimited(f"rate limit exceeded; retry in {wait:.1f} s",
                                       headers={"Retry-After": str(math.ceil(wait))})
        return principal
