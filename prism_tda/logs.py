"""Structured logging: one JSON object per line on stderr (or key=value text for humans)."""

from __future__ import annotations

import json
import logging
import sys
import time

_RESERVED = set(vars(logging.makeLogRecord({})))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_")})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_"))
        line = f"{record.levelname.lower():7s} {record.name}: {record.getMessage()}" + (f"  {extra}" if extra else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is written, not when the handler was made:
    a server started while stderr was redirected (a captured test, a daemonising wrapper) keeps
    logging after the redirection ends, instead of failing on its closed stream."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger once: ``fmt`` is ``json`` (machines) or ``text`` (terminals)."""
    handler = _Stderr()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
