"""Prototypes: browse them (usage, signature, top training contexts) and keep named sets of them."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request, Response

from .. import problems as p
from ..deps import IndexQuery, PrincipalDep, Services, ServicesDep
from ..schemas import (
    DiscoverRequest,
    DiscoverResponse,
    DiscoverTask,
    DiscoverTaskList,
    Prototype,
    PrototypeList,
    PrototypeSet,
    PrototypeSetIn,
    PrototypeSets,
    PrototypeSummary,
    SetName,
    TextSource,
)
from ..security import Principal
from ..sqlengine import SqlRefusal

router = APIRouter(prefix="/prototypes", tags=["prototypes"])
sets_router = APIRouter(prefix="/prototype-sets", tags=["prototypes"])


@router.get("", response_model=PrototypeList, responses=p.responses(p.UnknownIndex, p.KeyBusy))
async def list_prototypes(services: ServicesDep, principal: PrincipalDep, index: IndexQuery = None,
                          order: Annotated[Literal["mass", "n_tokens", "proto_id"], Query()] = "mass",
                          limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                          offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                          q: Annotated[str | None, Query(max_length=200, description="Only prototypes whose label "
                                                         "or top tokens contain every word of this.")] = None,
                          ) -> PrototypeList:
    """Prototypes ordered by activation mass (default), token count or id; searchable by label."""
    ix = services.registry.get(index)
    total, rows = await services.run(ix, principal, ix.catalog.prototypes, limit, offset, order, q)
    return PrototypeList(index=ix.name, total=total,
                         prototypes=[PrototypeSummary(**{**r, "top_tokens": list(r["top_tokens"] or [])})
                                     for r in rows])


@router.get("/{proto_id:not_discover}", response_model=Prototype, responses=p.responses(p.UnknownIndex, p.KeyBusy, p.PrototypeNotFound))
async def get_prototype(proto_id: Annotated[int, Path(ge=0, le=2**31 - 1)], services: ServicesDep,
                        principal: PrincipalDep, index: IndexQuery = None,
                        contexts: Annotated[int, Query(ge=0, le=100, description="Top contexts to return.")] = 10,
                        signature: Annotated[int, Query(ge=1, le=100, description="Signature tokens.")] = 10,
                        ) -> Prototype:
    """One prototype: usage, its token-logit signature `W p_i`, and the training contexts that activate it most."""
    ix = services.registry.get(index)
    out = await services.run(ix, principal, ix.prototype, proto_id, contexts, signature)
    return Prototype(index=ix.name, **out)


async def _doc_ids(services, ix, src: TextSource | None, field: str, principal) -> dict | None:
    """A source as the engine takes it: texts, or document ids (a SQL source run through /v1/sql's pool)."""
    if src is None:
        return None
    if src.texts is not None:
        return {"texts": src.texts}
    if src.doc_ids is not None:
        return {"doc_ids": src.doc_ids}
    audit = {"index_name": ix.name, "principal": None if principal.admin else principal.id}
    try:
        return {"doc_ids": await services.sql(ix, principal, ix.sql.doc_ids, src.sql, audit, field=f"{field}.sql")}
    except SqlRefusal as e:
        services.metrics.sql_refused.labels(kind=e.kind).inc()
        raise p.BY_KIND[e.kind](f"{field}.sql: {e.detail}") from None


@router.post("/discover", response_model=DiscoverResponse,
                  responses=p.responses(p.UnknownIndex, p.KeyBusy, p.InvalidQuery, p.SqlSyntax, p.SqlOneStatement,
                                        p.SqlForbidden, p.SqlError, p.SqlTimeout, p.SqlTooManyRows, p.SqlBusy,
                                        p.BodyTooLarge))
async def discover_prototypes(body: DiscoverRequest, request: Request, services: ServicesDep,
                              principal: PrincipalDep) -> DiscoverResponse:
    """Rank prototypes by how specifically they carry a topic: example texts, documents, or a SQL filter of
    documents, against a contrast (default: the rest of the corpus). Each comes with its evidence (support,
    ratio, share of the topic's mass, strongest topic contexts); save the chosen ones with
    `PUT /v1/prototype-sets/{name}`. With `select: "effect"`, the model also measures what suppressing them
    does and picks the set that most raises its loss on the topic relative to the contrast, within a
    budget of prototypes and of contrast perplexity (`selection`). (`POST /v1/prototype-sets/discover`, its
    earlier address, still answers.)"""
    ix = services.registry.get(body.index)
    topic = await _doc_ids(services, ix, body.topic, "topic", principal)
    contrast = await _doc_ids(services, ix, body.contrast, "contrast", principal)
    out = await services.run_cancellable(
        request, ix, principal, ix.discover, heavy=True, topic=topic, contrast=contrast, top_n=body.top_n,
        min_support=body.min_support, min_docs=body.min_docs, smoothing=body.smoothing,
        include_untrained=body.include_untrained, contexts=body.contexts, measure=body.measure,
        max_tokens=services.settings.discover_max_tokens, select=body.select, max_selected=body.max_selected,
        max_ppl_ratio=body.max_ppl_ratio)
    return DiscoverResponse(index=ix.name, **out)


async def find_set(services: Services, ix_name: str, name: str, principal: Principal, field: str = "") -> dict:
    """The set ``name`` as ``principal`` sees it (its own, else a shared one), or 404."""
    found = await services.io(services.state.get_set, ix_name, name, principal.owner)
    if found is None:
        raise p.PrototypeSetNotFound(f"{field}no prototype set {name!r} in index {ix_name!r}")
    return found


@sets_router.get("", response_model=PrototypeSets, responses=p.responses(p.UnknownIndex))
async def list_prototype_sets(services: ServicesDep, principal: PrincipalDep, index: IndexQuery = None) -> PrototypeSets:
    """The named prototype sets of an index this key sees (for suppression and audit flags): its own and the
    shared ones (`shared: true`: seeded by the operator or written with an admin key); admin keys see every set."""
    ix = services.registry.get(index)
    reader = None if principal.admin else principal.id
    return PrototypeSets(index=ix.name, sets=await services.io(services.state.list_sets, ix.name, reader))


@sets_router.put("/{name}", response_model=PrototypeSet,
                 responses=p.responses(p.UnknownIndex, p.InvalidPrototype, p.TooManyItems, p.BodyTooLarge))
async def put_prototype_set(name: Annotated[SetName, Path()], body: PrototypeSetIn,
                            services: ServicesDep, principal: PrincipalDep) -> PrototypeSet:
    """Create or replace a named prototype set of this key (admin keys write the shared sets). Another key's
    set of the same name is another set; this key's own set comes before a shared one of that name."""
    ix = services.registry.get(body.index)
    services.check_limits(n_items=("prototypes", len(body.prototypes)))
    ix.check_prototypes(body.prototypes, "prototypes")
    return PrototypeSet(**await services.io(services.state.put_set, ix.name, principal.owner, name, body.prototypes,
                                            body.description))


@sets_router.get("/{name}", response_model=PrototypeSet, responses=p.responses(p.UnknownIndex, p.PrototypeSetNotFound))
async def get_prototype_set(name: Annotated[SetName, Path()], services: ServicesDep, principal: PrincipalDep,
                            index: IndexQuery = None) -> PrototypeSet:
    """One named prototype set: this key's own, else a shared one."""
    ix = services.registry.get(index)
    return PrototypeSet(**await find_set(services, ix.name, name, principal))


@sets_router.delete("/{name}", status_code=204, response_class=Response,
                    responses=p.responses(p.UnknownIndex, p.PrototypeSetNotFound, p.Forbidden))
async def delete_prototype_set(name: Annotated[SetName, Path()], services: ServicesDep, principal: PrincipalDep,
                               index: IndexQuery = None) -> Response:
    """Delete this key's named prototype set (admin keys: a shared one)."""
    ix = services.registry.get(index)
    found = await find_set(services, ix.name, name, principal)
    if found["shared"] and not principal.admin:
        raise p.Forbidden(f"prototype set {name!r} is shared: only admin keys may change or delete it")
    await services.io(services.state.delete_set, ix.name, principal.owner, name)
    return Response(status_code=204)


# The earlier address of discovery, kept for clients written against it; not in the schema, where
# /v1/prototype-sets/{name} owns that path for GET, PUT and DELETE.
sets_router.add_api_route("/discover", discover_prototypes, methods=["POST"], response_model=DiscoverResponse,
                          include_in_schema=False, deprecated=True)


# ---------------------------------------------------------------------------- discovery as a background task
TaskId = Annotated[str, Path(max_length=64, description="The task's id (from POST /v1/prototypes/discover/tasks).")]


def task_view(t: dict) -> DiscoverTask:
    return DiscoverTask(id=t["id"], index=t["index_name"], status=t["status"], created_at=t["created_at"],
                        updated_at=t["updated_at"], stage=t["stage"], stage_done=t["stage_done"],
                        stage_total=t["stage_total"], progress=t["progress"], attempts=t["attempts"], error=t["error"],
                        result=DiscoverResponse(**t["result"]) if t["result"] is not None else None)


async def _task(services: Services, task_id: str, principal: Principal) -> dict:
    """The task, if it exists and belongs to ``principal`` (admins see every task); else 404, so another
    key's tasks cannot be told apart from missing ones."""
    t = await services.io(services.state.task, task_id)
    if t is None or not (principal.admin or t["principal"] == principal.id):
        raise p.TaskNotFound(f"no background task {task_id!r}")
    return t


@router.post("/discover/tasks", status_code=202, response_model=DiscoverTask,
             responses=p.responses(p.UnknownIndex, p.InvalidQuery, p.SqlSyntax, p.SqlOneStatement, p.SqlForbidden,
                                   p.SqlError, p.SqlTimeout, p.SqlTooManyRows, p.SqlBusy, p.BodyTooLarge,
                                   p.TaskQuota))
async def create_discover_task(body: DiscoverRequest, services: ServicesDep, principal: PrincipalDep,
                               response: Response) -> DiscoverTask:
    """The discovery of `POST /v1/prototypes/discover`, run in the background (for `select: "effect"` on a
    large topic, which takes the model over the topic and the contrast): stored before the answer (202),
    run by the server's background worker, its progress and result at `GET
    /v1/prototypes/discover/tasks/{task_id}`. A SQL source is resolved to its documents now."""
    ix = services.registry.get(body.index)
    await services.check_active(principal, services.state.active_tasks, services.settings.max_active_tasks_per_key,
                                p.TaskQuota, "background tasks", 10)
    topic = await _doc_ids(services, ix, body.topic, "topic", principal)
    contrast = await _doc_ids(services, ix, body.contrast, "contrast", principal)
    params = dict(topic=topic, contrast=contrast, top_n=body.top_n, min_support=body.min_support,
                  min_docs=body.min_docs, smoothing=body.smoothing, include_untrained=body.include_untrained,
                  contexts=body.contexts, measure=body.measure, max_tokens=services.settings.discover_max_tokens,
                  select=body.select, max_selected=body.max_selected, max_ppl_ratio=body.max_ppl_ratio)
    t = await services.io(services.state.create_task, "discover", ix.name, principal.id, params)
    services.worker.wake.set()
    response.headers["Location"] = f"/v1/prototypes/discover/tasks/{t['id']}"
    return task_view(t)


@router.get("/discover/tasks", response_model=DiscoverTaskList, responses=p.responses())
async def list_discover_tasks(services: ServicesDep, principal: PrincipalDep,
                              status: Annotated[Literal["queued", "running", "completed", "failed", "cancelled"] | None,
                                                Query(description="Only tasks in this status.")] = None,
                              index: Annotated[str | None, Query(max_length=200, description="Only tasks of this "
                                                                 "index.")] = None,
                              offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                              limit: Annotated[int, Query(ge=1, le=200)] = 50) -> DiscoverTaskList:
    """This key's background discoveries (admin keys: everyone's), newest first, a page at a time."""
    total, tasks = await services.io(services.state.tasks, None if principal.admin else principal.id, status=status,
                                     index_name=index, offset=offset, limit=limit)
    nxt = offset + len(tasks)
    return DiscoverTaskList(total=total, tasks=[task_view(t) for t in tasks], next_offset=nxt if nxt < total else None)


@router.get("/discover/tasks/{task_id}", response_model=DiscoverTask, responses=p.responses(p.TaskNotFound))
async def get_discover_task(task_id: TaskId, services: ServicesDep, principal: PrincipalDep) -> DiscoverTask:
    """A background discovery: its status and progress, and its result once completed."""
    return task_view(await _task(services, task_id, principal))


@router.delete("/discover/tasks/{task_id}", response_model=DiscoverTask,
               responses=p.responses(p.TaskNotFound, p.TaskFinished))
async def cancel_discover_task(task_id: TaskId, services: ServicesDep, principal: PrincipalDep) -> DiscoverTask:
    """Cancel a queued or running background discovery (a running one stops at the model's next batch or
    candidate, within about a second); cancelling a cancelled task again answers it as it is."""
    await _task(services, task_id, principal)
    if not await services.io(services.state.cancel_task, task_id):
        t = await _task(services, task_id, principal)
        if t["status"] != "cancelled":
            raise p.TaskFinished(f"background task {task_id!r} has already finished ({t['status']}); only queued "
                                 "or running tasks can be cancelled")
    return task_view(await _task(services, task_id, principal))
