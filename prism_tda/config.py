"""The base of every configuration dataclass: serialised with ``to_dict()``, read with a
``from_dict()`` that refuses unknown fields (a typo never passes silently) and names where the
data came from in its errors."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

from .errors import ConfigError

C = TypeVar("C", bound="Config")


class Config:
    """Mixin for frozen, validated config dataclasses (validation lives in ``__post_init__``)."""

    # field names of older versions: old name -> new name, or None for a field that was dropped
    LEGACY_FIELDS: ClassVar[dict[str, str | None]] = {}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any], *, where: str = "config") -> C:
        data = dict(data)
        for old, new in cls.LEGACY_FIELDS.items():
            if old in data:
                value = data.pop(old)
                if new is not None:
                    data.setdefault(new, value)
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown} for {cls.__name__}")
        try:
            return cls(**data)
        except (TypeError, ConfigError) as e:
            raise ConfigError(f"{where}: {e}") from e

    def replace(self: C, **changes: Any) -> C:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def check(cond: bool, msg: str) -> None:
    """Raise :class:`ConfigError` with ``msg`` unless ``cond``."""
    if not cond:
        raise ConfigError(msg)
