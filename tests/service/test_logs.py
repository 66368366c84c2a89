"""An unhandled error's log line carries the traceback and the request id, in both log formats."""

from __future__ import annotations

import json
import logging

from prism_tda.logs import JsonFormatter, TextFormatter
from prism_tda.service.indexes import LoadedIndex

from .conftest import assert_problem


def test_an_unhandled_error_is_logged_with_traceback_and_request_id(client, monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise RuntimeError("boom in the prototype page")

    monkeypatch.setattr(LoadedIndex, "prototype", boom)
    with caplog.at_level(logging.ERROR, logger="prism.service"):
        r = client.get("/v1/prototypes/0")
    body = assert_problem(r, 500, "internal-error")
    assert body["instance"] == "/v1/prototypes/0"
    assert "boom" not in r.text  # internals never reach the client
    [record] = [rec for rec in caplog.records if rec.getMessage() == "unhandled error"]
    text = TextFormatter().format(record)
    assert f"request_id={body['request_id']}" in text
    assert "Traceback (most recent call last)" in text and "RuntimeError: boom in the prototype page" in text
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == body["request_id"] and "RuntimeError: boom" in line["exc"]


def test_logs_follow_stderr_after_it_is_replaced(monkeypatch):
    """The handler writes to the stderr of the moment: after the stream it was set up under is closed
    and replaced, records reach the new one and nothing fails."""
    import io
    import sys

    from prism_tda.logs import setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    first, second = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", first)
        setup_logging("info", "text")
        logging.getLogger("prism.test").info("one")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("prism.test").info("two")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert "prism.test: two" in second.getvalue()
