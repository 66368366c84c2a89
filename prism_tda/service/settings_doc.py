"""``docs/settings.md``: the settings reference, generated from :class:`Settings` so it cannot drift.

``prism settings-doc`` (or ``python -m prism_tda.service.settings_doc``) writes it; a test fails
when the committed file differs from :func:`render`.
"""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic_core import PydanticUndefined

from .settings import Settings

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "settings.md"  # the repository's docs/

HEADER = """# Settings reference

The service reads its settings from environment variables with the prefix `PRISM_` (for example
`PRISM_API_KEYS`), and nowhere else (`service/settings.py`). Lists and mappings are JSON:
`PRISM_INDEXES='{"demo": "/data/runs/demo/index"}'`, `PRISM_API_KEYS='["k1", "k2"]'`.
`prism serve` sets `PRISM_INDEXES`, `PRISM_DEFAULT_INDEX`, `PRISM_HOST`, `PRISM_PORT`,
`PRISM_WORKERS`, `PRISM_STATE_DIR`, `PRISM_LOG_LEVEL` and `PRISM_LOG_FORMAT` from its options;
the others come from the environment (in Docker Compose: the env file, see `deploy/README.md`).
Secrets (`SecretStr`) never appear in logs or responses.

This file is generated from the settings class by `prism settings-doc`; a test fails when it
drifts.

"""


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or str(annotation).replace("typing.", "").replace("pydantic.types.", "")
    return text.replace("pathlib.", "").replace("NoneType", "None")


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, Path):
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def render() -> str:
    """The settings reference as Markdown: one row per setting."""
    prefix = Settings.model_config.get("env_prefix", "")
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        typ = _type(field.annotation).replace("|", "\\|")
        rows.append(f"| `{(prefix + name).upper()}` | `{typ}` | {_default(field)} | {desc} |")
    return HEADER + "\n".join(rows) + "\n"


def write(path: str | Path = DEFAULT_PATH) -> Path:
    path = Path(path)
    path.write_text(render())
    return path


if __name__ == "__main__":
    print(write(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_PATH))
