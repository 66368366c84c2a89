"""Process life: SIGHUP reloads every index in place; shutdown waits for running computations.

SIGHUP (``kill -HUP <pid>``, ``docker compose kill -s SIGHUP api``) reloads each served index from
the directory it is served from, one at a time, in a background thread, with the same checks as
``POST /v1/admin/indexes/{name}/reload``; an index that fails them keeps its old version and the
failure is logged. With ``--workers N > 1`` uvicorn's parent process handles SIGHUP itself: it
replaces the worker processes one by one, each new one ready before the old one stops.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

import anyio

from prism_tda.errors import PrismError

from .deps import Services

log = logging.getLogger("prism.service")


def reload_all(services: Services) -> dict[str, str]:
    """Reload every index from its directory; return {name: "swapped" | the reason it was kept}."""
    out: dict[str, str] = {}
    for name in list(services.registry.indexes):
        try:
            _, new = services.registry.swap(name)
            services.metrics.index_loaded(new)
            out[name] = "swapped"
        except PrismError as e:
            log.error("index reload refused; the old version keeps serving", extra={"index": name, "error": str(e)})
            out[name] = str(e)
        except Exception as e:  # never let a reload take the server down
            log.exception("index reload failed; the old version keeps serving", extra={"index": name})
            out[name] = f"{type(e).__name__}: {e}"
    return out


def install_sighup(services: Services) -> Callable[[], None]:
    """Reload every index on SIGHUP (main thread only); returns the function that uninstalls it."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_hup(signum: int, frame: object) -> None:
        log.info("SIGHUP: reloading every index")
        threading.Thread(target=reload_all, args=(services,), name="index-reload", daemon=True).start()

    previous = signal.signal(signal.SIGHUP, on_hup)

    def uninstall() -> None:
        signal.signal(signal.SIGHUP, previous)

    return uninstall


async def drain(services: Services, timeout_s: float) -> bool:
    """Wait until no model/attribution computation runs (at most ``timeout_s``); True when none does.

    uvicorn stops accepting connections and waits for open requests before the lifespan ends; a
    request cancelled by its graceful timeout may still have a computation in a worker thread, so
    the indexes are closed only after those have returned."""
    deadline = time.monotonic() + timeout_s
    while any(lim.borrowed_tokens for lim in services.limiters.values()):
        if time.monotonic() > deadline:
            log.warning("shutting down with computations still running",
                        extra={"running": sum(lim.borrowed_tokens for lim in services.limiters.values())})
            return False
        await anyio.sleep(0.05)
    return True
