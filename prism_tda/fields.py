"""A dataclass's fields as the edges present them: the HTTP schema (``service/schemas.py``) and the
command line (``cli``) are built from the engine's own types by looping over their fields, so an
option exists, is named, bounded and described in one place.

A field's description is its attribute docstring (the string right below it); its bounds are
``Annotated`` metadata (pydantic ``Field(ge=..., le=...)``), which the dataclass itself ignores.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldSpec:
    name: str
    type: Any  # the annotation without its Annotated metadata
    default: Any  # dataclasses.MISSING when the field is required
    description: str
    metadata: tuple[Any, ...]  # Annotated metadata (bounds)


@functools.cache
def attribute_docstrings(cls: type) -> dict[str, str]:
    """{field name: the docstring written below it} of a class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            out[a.target.id] = inspect.cleandoc(b.value.value)
    return out


def field_specs(cls: type) -> list[FieldSpec]:
    """The fields of dataclass ``cls``, in order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = attribute_docstrings(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp, meta = hints[f.name], ()
        if typing.get_origin(tp) is typing.Annotated:
            tp, *rest = typing.get_args(tp)
            meta = tuple(rest)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        out.append(FieldSpec(f.name, tp, default, docs.get(f.name, ""), meta))
    return out
