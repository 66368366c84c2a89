"""One exception hierarchy for the whole project; only the service maps it to HTTP."""

from __future__ import annotations


class PrismError(Exception):
    """Base class of every error PRISM-TDA raises on purpose."""


class ConfigError(PrismError, ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


class CheckpointError(PrismError):
    """A checkpoint directory is missing a file, corrupt, or inconsistent with itself."""


class CorpusError(PrismError):
    """A corpus path cannot be read at all (bad records inside a readable file are counted instead)."""


class QueryError(PrismError, ValueError):
    """An attribution query is empty, or asks for a target or an option that does not exist."""


class PromptTooLongError(QueryError):
    """The prompt and its target do not fit the model's context."""


class ShardUnavailable(PrismError):
    """Shards of an index served from a cluster did not answer (their holder died, is restarting past
    the wait, or timed out)."""

    def __init__(self, shards: list[int], why: str) -> None:
        self.shards = sorted(shards)
        super().__init__(f"shards {self.shards} did not answer ({why}); try again in a few seconds")


class Cancelled(PrismError):
    """Work stopped because its caller asked it to (the client that wanted it went away)."""


def check_stop(stop: object | None, what: str = "the work") -> None:
    """Raise :class:`Cancelled` when ``stop`` (a ``threading.Event``, or None) is set; the message gives
    the stop's ``reason`` when it has one (default: the client went away)."""
    if stop is not None and stop.is_set():  # type: ignore[attr-defined]
        raise Cancelled(f"{what} was stopped: {getattr(stop, 'reason', None) or 'its client went away'}")
