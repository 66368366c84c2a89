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
