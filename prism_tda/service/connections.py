"""The server's HTTP connections: a request's headers must arrive in time.

uvicorn bounds the idle time between requests (``timeout_keep_alive``), not the time a client
takes to send a request's headers, so a client that sends nothing, or half a header line byte by
byte, would hold its connection for ever. :class:`HeaderTimeoutProtocol` is uvicorn's h11
protocol with that bound; :func:`http_protocol` is what ``server_options`` gives uvicorn as
``http``. The body's bound is the ``BodyLimit`` middleware's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("prism.service.connections")


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete within
    ``header_timeout_s`` of its opening or, on a kept-alive connection, of the end of the previous
    response. A request's headers are complete when uvicorn starts its request cycle."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._bytes_waited = 0  # bytes received since the timer started (counted for the log, never kept)

    def _start_header_timer(self) -> None:
        self._stop_header_timer()
        self._bytes_waited = 0
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        log.info("connection closed: request headers not complete in time",
                 extra={"timeout_s": self.header_timeout_s, "bytes_received": self._bytes_waited})
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is not None:
            self._bytes_waited += len(data)
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a new request cycle: its headers are in
            self._stop_header_timer()

    def handle_websocket_upgrade(self, event: Any) -> None:
        self._stop_header_timer()
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        # armed before uvicorn's own handling, which may start a pipelined request at once
        if not self.transport.is_closing():
            self._start_header_timer()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)


def http_protocol(header_timeout_s: float) -> Callable[..., asyncio.Protocol]:
    """uvicorn's ``http`` option: the protocol class with its header time limit (a ``partial``, which
    pickles for ``workers > 1``)."""
    return functools.partial(HeaderTimeoutProtocol, header_timeout_s=header_timeout_s)
