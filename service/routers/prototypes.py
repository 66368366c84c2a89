"""Prototypes: browse them (usage, signature, top training contexts) and keep named sets of them."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Response

from .. import problems as p
from ..deps import IndexQuery, ServicesDep
from ..schemas import (
    Prototype,
    PrototypeList,
    PrototypeSet,
    PrototypeSetIn,
    PrototypeSets,
    PrototypeSummary,
    SetName,
)

router = APIRouter(prefix="/prototypes", tags=["prototypes"])
sets_router = APIRouter(prefix="/prototype-sets", tags=["prototypes"])


@router.get("", response_model=PrototypeList, responses=p.responses(p.UnknownIndex))
async def list_prototypes(services: ServicesDep, index: IndexQuery = None,
                          order: Annotated[Literal["mass", "n_tokens", "proto_id"], Query()] = "mass",
                          limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                          offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0) -> PrototypeList:
    """Prototypes ordered by activation mass (default), token count or id."""
    ix = services.registry.get(index)
    total, rows = await services.run(ix, ix.catalog.prototypes, limit, offset, order)
    return PrototypeList(index=ix.name, total=total,
                         prototypes=[PrototypeSummary(**{**r, "top_tokens": list(r["top_tokens"] or [])})
                                     for r in rows])


@router.get("/{proto_id}", response_model=Prototype, responses=p.responses(p.UnknownIndex, p.PrototypeNotFound))
async def get_prototype(proto_id: Annotated[int, Path(ge=0, le=2**31 - 1)], services: ServicesDep,
                        index: IndexQuery = None,
                        contexts: Annotated[int, Query(ge=0, le=100, description="Top contexts to return.")] = 10,
                        signature: Annotated[int, Query(ge=1, le=100, description="Signature tokens.")] = 10,
                        ) -> Prototype:
    """One prototype: usage, its token-logit signature `W p_i`, and the training contexts that activate it most."""
    ix = services.registry.get(index)
    out = await services.run(ix, ix.prototype, proto_id, contexts, signature)
    return Prototype(index=ix.name, **out)


async def _set(services, index: str | None, name: str) -> tuple[str, dict]:
    ix = services.registry.get(index)
    found = await services.io(services.state.get_set, ix.name, name)
    if found is None:
        raise p.PrototypeSetNotFound(f"no prototype set {name!r} in index {ix.name!r}")
    return ix.name, found


@sets_router.get("", response_model=PrototypeSets, responses=p.responses(p.UnknownIndex))
async def list_prototype_sets(services: ServicesDep, index: IndexQuery = None) -> PrototypeSets:
    """The named prototype sets of an index (for suppression and audit flags)."""
    ix = services.registry.get(index)
    return PrototypeSets(index=ix.name, sets=await services.io(services.state.list_sets, ix.name))


@sets_router.put("/{name}", response_model=PrototypeSet,
                 responses=p.responses(p.UnknownIndex, p.InvalidPrototype, p.TooManyItems, p.BodyTooLarge))
async def put_prototype_set(name: Annotated[SetName, Path()], body: PrototypeSetIn,
                            services: ServicesDep) -> PrototypeSet:
    """Create or replace a named prototype set."""
    ix = services.registry.get(body.index)
    services.check_limits(n_items=("prototypes", len(body.prototypes)))
    ix.check_prototypes(body.prototypes, "prototypes")
    return PrototypeSet(**await services.io(services.state.put_set, ix.name, name, body.prototypes, body.description))


@sets_router.get("/{name}", response_model=PrototypeSet, responses=p.responses(p.UnknownIndex, p.PrototypeSetNotFound))
async def get_prototype_set(name: Annotated[SetName, Path()], services: ServicesDep,
                            index: IndexQuery = None) -> PrototypeSet:
    """One named prototype set."""
    _, found = await _set(services, index, name)
    return PrototypeSet(**found)


@sets_router.delete("/{name}", status_code=204, response_class=Response,
                    responses=p.responses(p.UnknownIndex, p.PrototypeSetNotFound))
async def delete_prototype_set(name: Annotated[SetName, Path()], services: ServicesDep,
                               index: IndexQuery = None) -> Response:
    """Delete a named prototype set."""
    ix_name, _ = await _set(services, index, name)
    await services.io(services.state.delete_set, ix_name, name)
    return Response(status_code=204)
