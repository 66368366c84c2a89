"""The PRISM-TDA HTTP service: attribution, audits, SQL over the store, prototypes, generation."""

from .app import create_app
from .settings import Settings

__all__ = ["Settings", "create_app"]
