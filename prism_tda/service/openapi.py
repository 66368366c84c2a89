"""The committed ``openapi.yaml``: generated from the app, compared by a test."""

from __future__ import annotations

from pathlib import Path

import yaml

from .app import create_app
from .settings import Settings

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "openapi.yaml"  # the repository's root


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None  # multi-line descriptions as literal blocks
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render() -> str:
    """The OpenAPI document of the app as YAML (independent of the environment's settings)."""
    schema = create_app(Settings.model_construct()).openapi()
    return yaml.dump(schema, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=110)


def write(path: str | Path = DEFAULT_PATH) -> Path:
    path = Path(path)
    path.write_text(render())
    return path
