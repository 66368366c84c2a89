"""The PRISM-TDA HTTP service: attribution, audits, SQL over the store, prototypes, generation.

The names below load on first use, so a process that needs one module of the package (a SQL
worker runs ``service/sqlengine.py``) does not import the web framework and the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .settings import Settings

__all__ = ["Settings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "Settings":
        from .settings import Settings

        return Settings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
