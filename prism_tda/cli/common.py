"""What several commands share: naming the indexes they are given, and the service state's place."""

from __future__ import annotations

import os
from pathlib import Path

from prism_tda.errors import ConfigError


def index_args(items: list[str]) -> dict[str, str]:
    """``--index DIR`` or ``--index NAME=DIR`` items as {name: dir}; a bare DIR is named after its folder
    (its parent's name when the folder is called ``index``, e.g. runs/demo/index -> demo). Each must be
    a complete index (``engine.reads.read_complete_manifest`` says what to do otherwise)."""
    from prism_tda.engine.reads import read_complete_manifest

    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            p = Path(item).resolve()
            name, path = (p.parent.name if p.name == "index" else p.name), item
        if not name or name in out:
            raise ConfigError(f"--index {item!r}: " + ("empty name" if not name else f"name {name!r} given twice"))
        out[name] = str(Path(path).absolute())  # not resolved: a reload follows a moved symlink
        try:
            read_complete_manifest(Path(out[name]))
        except ConfigError:
            raise
        except Exception as e:  # the engine's error, named by the option that gave the directory
            raise ConfigError(f"--index {name}: {e}") from None
    return out


def index_arg(item: str) -> tuple[str, Path]:
    """One ``--index [NAME=]DIR``: (name, directory)."""
    ((name, path),) = index_args([item]).items()
    return name, Path(path)


def default_state_dir() -> Path:
    """The one default of the service state (audits, prototype sets) for demo, serve and sql."""
    return Path(os.environ.get("PRISM_STATE_DIR") or "prism-state")
