"""Batch audits: persisted jobs processed by the background worker; results as JSONL, Parquet or SQL."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

import numpy as np
import pyarrow.parquet as pq
from fastapi import APIRouter, Header, Path, Query, Response

from prism_tda.errors import QueryError

from .. import problems as p
from ..deps import PrincipalDep, Services, ServicesDep
from ..schemas import AuditItemOut, AuditItems, AuditJob, AuditList, AuditRequest
from ..security import Principal
from ..state import mark_removed, request_hash
from .prototypes import find_set

router = APIRouter(prefix="/audits", tags=["audits"])
AuditId = Annotated[str, Path(max_length=64, description="The audit's id (from POST /v1/audits).")]


def job_view(job: dict[str, Any]) -> AuditJob:
    n = job["n_items"]
    return AuditJob(id=job["id"], index=job["index_name"], status=job["status"], created_at=job["created_at"],
                    updated_at=job["updated_at"], n_items=n, n_done=job["n_done"], n_failed=job["n_failed"],
                    progress=(job["n_done"] + job["n_failed"]) / n if n else 1.0, params=job["params"])


# what a citation of a document taken down keeps: that it was cited, where and how strongly
CITATION_KEPT = ("doc_id", "external_id", "rank", "score", "raw_influence", "value", "influence", "trained")


def item_view(it: dict[str, Any], removed: Callable[[np.ndarray], np.ndarray] | None = None) -> AuditItemOut:
    """``removed``: which global document ids were taken down; their citations keep only
    ``CITATION_KEPT`` and say ``removed: true``."""
    flagged = it.get("flagged_prototypes") or []
    docs = it.get("documents") or []
    if removed is not None and docs:
        gone = removed(np.array([int(d.get("doc_id", -1)) for d in docs], np.int64))
        docs = [{**{k: d[k] for k in CITATION_KEPT if k in d}, "removed": True} if g else d
                for d, g in zip(docs, gone, strict=True)]
    return AuditItemOut(item_no=it["item_no"], id=it["item_id"], status=it["status"], attempts=it["attempts"],
                        completions=it["completions"], error=it["error"], target_text=it["target_text"],
                        flagged=bool(flagged), flagged_prototypes=flagged,
                        used_prototypes=it.get("used_prototypes") or [], documents=docs)


def _removed_of(services: Services, job: dict[str, Any]) -> Callable[[np.ndarray], np.ndarray] | None:
    """The taken-down test of the audit's index (None when the server no longer serves it)."""
    try:
        reader = services.registry.get(job["index_name"]).attributor.reader
    except p.UnknownIndex:
        return None

    def removed(docs: np.ndarray) -> np.ndarray:
        ok = (docs >= 0) & (docs < reader.n_docs)
        out = np.zeros(len(docs), dtype=bool)
        out[ok] = reader.removed(docs[ok])
        return out

    return removed


async def _job(services: Services, audit_id: str, principal: Principal) -> dict[str, Any]:
    """The audit, if it exists and belongs to ``principal`` (admins see every audit); else 404, so
    another key's audits cannot even be told apart from missing ones."""
    job = await services.io(services.state.job, audit_id)
    if job is None or not (principal.admin or job["principal"] == principal.id):
        raise p.AuditNotFound(f"no audit {audit_id!r}")
    return job


@router.post("", status_code=202, response_model=AuditJob,
             responses=p.responses(p.UnknownIndex, p.TooManyItems, p.InvalidQuery, p.PromptTooLong,
                                   p.InvalidPrototype, p.PrototypeSetNotFound, p.IdempotencyConflict,
                                   p.BodyTooLarge, p.AuditQuota, p.KeyBusy))
async def create_audit(body: AuditRequest, services: ServicesDep, principal: PrincipalDep, response: Response,
                       idempotency_key: Annotated[str | None, Header(max_length=200, description=(
                           "Resubmitting with the same key returns the same audit instead of a new one."))] = None,
                       ) -> AuditJob:
    """Submit a batch of (prompt, output) items. The job and its items are stored before the answer
    (202); the background worker attributes them; poll GET /v1/audits/{audit_id} for progress. The worker
    gives each key with work its turn, a slice at a time (`work_slice_s`); an item has at most
    `audit_item_max_s` of compute (`mode: exact` over that estimate is refused here, 422)."""
    ix = services.registry.get(body.index)
    options = body.options()
    services.check_limits(n_items=("items", len(body.items)), options=options, context=ix.attributor.encoder.context)
    options = services.bounded(options)
    if options.mode == "exact":  # an item over the step budget would only be stopped there: refused now
        await services.run(ix, principal, ix.check_exact_time, services.settings.audit_item_max_s, audit=True)
    if options.influence:  # refused now, not item by item in the background, where the index cannot serve it
        try:
            await services.io(ix.attributor.check_influence)
        except QueryError as e:
            raise p.from_query_error(e) from None
    services.check_limits(n_items=("flag_prototypes", len(body.flag_prototypes or [])))
    await services.check_active(principal, services.state.active_jobs, services.settings.max_active_audits_per_key,
                                p.AuditQuota, "audits", 30)
    sets: dict[str, list[int]] = {}

    async def resolve(name: str, field: str) -> list[int]:
        if name not in sets:
            sets[name] = (await find_set(services, ix.name, name, principal, f"{field}: "))["prototypes"]
        return sets[name]

    ix.check_prototypes(body.flag_prototypes or [], "flag_prototypes")
    job_flag = sorted(set(body.flag_prototypes or []) | set(await resolve(body.flag, "flag") if body.flag else []))
    items = []
    for n, it in enumerate(body.items):
        services.check_limits(where=f"items[{n}].", max_new_tokens=it.max_new_tokens)
        try:
            ix.check_query(it.spec())
        except QueryError as e:
            raise p.from_query_error(e, where=f"items[{n}].") from None
        flag = await resolve(it.flag, f"items[{n}].flag") if it.flag else job_flag
        items.append({**dataclasses.asdict(it.spec()), "id": it.id, "flag_set": it.flag or body.flag,
                      "flag_prototypes": flag})
    params = {**dataclasses.asdict(options), "flag": body.flag,
              "flag_prototypes": job_flag}
    req_hash = request_hash(body.model_dump(mode="json") | {"index": ix.name})
    job, created = await services.io(services.state.create_job, ix.name, params, items, principal=principal.id,
                                     idempotency_key=idempotency_key, req_hash=req_hash)
    if not created and job["request_hash"] != req_hash:
        raise p.IdempotencyConflict(f"Idempotency-Key {idempotency_key!r} was used for audit {job['id']} with a "
                                    "different request")
    if created:
        services.worker.wake.set()
    else:
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/v1/audits/{job['id']}"
    return job_view(job)


@router.get("", response_model=AuditList, responses=p.responses(p.UnknownIndex))
async def list_audits(services: ServicesDep, principal: PrincipalDep,
                      status: Annotated[Literal["queued", "running", "completed", "cancelled"] | None, Query(
                          description="Only audits in this status.")] = None,
                      index: Annotated[str | None, Query(max_length=200, description="Only audits of this index.")] = None,
                      offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                      limit: Annotated[int, Query(ge=1, le=200)] = 50) -> AuditList:
    """This key's audits, newest first (admin keys: every key's), a page at a time."""
    if index is not None:
        index = services.registry.get(index).name
    total, jobs = await services.io(services.state.jobs, None if principal.admin else principal.id, status=status,
                                    index_name=index, offset=offset, limit=limit)
    nxt = offset + len(jobs)
    return AuditList(total=total, audits=[job_view(j) for j in jobs], next_offset=nxt if nxt < total else None)


@router.get("/{audit_id}", response_model=AuditJob, responses=p.responses(p.AuditNotFound))
async def get_audit(audit_id: AuditId, services: ServicesDep, principal: PrincipalDep) -> AuditJob:
    """An audit's status and progress."""
    return job_view(await _job(services, audit_id, principal))


@router.get("/{audit_id}/items", response_model=AuditItems, responses=p.responses(p.AuditNotFound))
async def list_audit_items(audit_id: AuditId, services: ServicesDep, principal: PrincipalDep,
                           offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                           limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> AuditItems:
    """An audit's items: status, attempts, flags and top documents of each."""
    job = await _job(services, audit_id, principal)
    items = await services.io(services.state.items, audit_id, offset, limit)
    removed = _removed_of(services, job)
    return AuditItems(job=job_view(job), items=[item_view(i, removed) for i in items])


@router.post("/{audit_id}/cancel", response_model=AuditJob, responses=p.responses(p.AuditNotFound, p.AuditFinished))
async def cancel_audit(audit_id: AuditId, services: ServicesDep, principal: PrincipalDep) -> AuditJob:
    """Stop an audit: items not yet processed stay pending and are never processed."""
    await _job(services, audit_id, principal)
    if not await services.io(services.state.cancel, audit_id):
        job = await _job(services, audit_id, principal)
        if job["status"] != "cancelled":
            raise p.AuditFinished(f"audit {audit_id} is {job['status']}; only queued or running audits can be "
                                  "cancelled")
    return job_view(await _job(services, audit_id, principal))


@router.get("/{audit_id}/results", response_class=Response, responses={
    200: {"description": "JSONL (one item per line) or Parquet (the audit_results rows of this audit).",
          "content": {"application/x-ndjson": {"schema": {"type": "string"}},
                      "application/vnd.apache.parquet": {"schema": {"type": "string", "format": "binary"}}}},
    **p.responses(p.AuditNotFound)})
async def download_audit_results(audit_id: AuditId, services: ServicesDep, principal: PrincipalDep,
                                 format: Annotated[Literal["jsonl", "parquet"], Query()] = "jsonl") -> Response:
    """Download an audit's results so far: JSONL, one line per item, or Parquet, one row per
    (item, rank) as in the `audit_results` SQL table."""
    job = await _job(services, audit_id, principal)
    removed = _removed_of(services, job)
    if format == "parquet":
        table = await services.io(services.state.audit_results, job_id=audit_id)
        if removed is not None:
            cited = table.column("doc_id").to_numpy().astype(np.int64)
            table = mark_removed(table, cited[removed(cited)])
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        return Response(buf.getvalue(), media_type="application/vnd.apache.parquet",
                        headers={"Content-Disposition": f'attachment; filename="{audit_id}.parquet"'})
    items = await services.io(services.state.items, audit_id)
    lines = "".join(json.dumps(item_view(i, removed).model_dump()) + "\n" for i in items)
    return Response(lines, media_type="application/x-ndjson",
                    headers={"Content-Disposition": f'attachment; filename="{audit_id}.jsonl"'})
