"""The request side of the HTTP edge: JSON's own types, strict request models, and request fields
generated from the engine's dataclasses (``prism_tda.fields``), so an option is defined once."""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from typing import Annotated, Any

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    model_validator,
)

from prism_tda.engine.types import QueryOptions, QuerySpec
from prism_tda.fields import field_specs


def _json_int(v: Any) -> Any:
    """An integer as JSON Schema has it: a number without a fraction (5 or 5.0), never a boolean or a string."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError("must be an integer")
    return int(v)


def _json_number(v: Any) -> Any:
    """A number as JSON Schema has it: never a boolean or a string."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number")
    return v


# Request fields take JSON's own types only (pydantic's lax mode would turn true into 1 and "5" into 5,
# which the schema refuses): the server accepts exactly what openapi.yaml describes.
JInt = Annotated[int, BeforeValidator(_json_int)]
JFloat = Annotated[float, BeforeValidator(_json_number)]
ProtoId = Annotated[JInt, Field(ge=0, le=2**31 - 1)]
DocId = Annotated[JInt, Field(ge=0, le=2**31 - 1)]
SetName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_LIST = 10_000  # the longest list any request may carry (the server's own limits are lower)


class OneTarget(Strict):
    """A query's target: ``completion`` or ``max_new_tokens``, never both (not even one of them null), as
    the schema says (``not: required [completion, max_new_tokens]``)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"not": {"required": ["completion", "max_new_tokens"]}})

    @model_validator(mode="before")
    @classmethod
    def _one_target(cls, data: Any) -> Any:
        if isinstance(data, dict) and "completion" in data and "max_new_tokens" in data:
            raise ValueError("give either completion or max_new_tokens, not both")
        return data


# ---------------------------------------------------------------------------- from the engine's types
def _json_type(tp: Any) -> Any:
    """The request type of an engine field's type: JSON's own integers, numbers and booleans."""
    if tp is bool:
        return StrictBool
    if tp is int:
        return JInt
    if tp is float:
        return JFloat
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, [_json_type(a) for a in typing.get_args(tp)])
    return tp


def fields_of(cls: type, *, request: bool = True) -> dict[str, Any]:
    """``create_model`` fields for dataclass ``cls``: each of its fields with its type (JSON's own types in
    a ``request``), bounds, default and description, as the engine defines them (``prism_tda.fields``)."""
    out: dict[str, Any] = {}
    for f in field_specs(cls):
        tp = _json_type(f.type) if request else f.type
        if f.metadata:
            tp = Annotated[(tp, *f.metadata)]
        default = ... if f.default is dataclasses.MISSING else f.default
        out[f.name] = (tp, Field(default, description=f.description or None))
    return out


def option_fields() -> dict[str, Any]:
    out = fields_of(QueryOptions)
    tp, info = out["n_documents"]
    # `top_k`, the earlier name, still accepted (`top_k` also names generation's sampling cut-off)
    out["n_documents"] = (tp, Field(info.default, description=info.description,
                                    validation_alias=AliasChoices("n_documents", "top_k")))
    return out


class QueryRequest(OneTarget):
    """A request carrying a query's fields; the engine's values are made by looping over its types'
    fields (``spec``, ``options``), so every field reaches the engine under its own name."""

    def spec(self) -> QuerySpec:
        return QuerySpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(QuerySpec)})

    def options(self) -> QueryOptions:
        return QueryOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(QueryOptions)})


