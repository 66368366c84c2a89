"""Administration: replace a served index with a new version while the server keeps answering; take
documents down."""

from __future__ import annotations

import os
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Path
from pydantic import BaseModel, ConfigDict, Field

from prism_tda.engine.takedown import remove_documents

from .. import problems as p
from ..deps import ServicesDep, get_admin
from ..indexes import LoadedIndex
from ..security import Principal

router = APIRouter(prefix="/admin", tags=["admin"])


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dir: str | None = Field(None, min_length=1, max_length=4096,
                            description="Directory of the new index version, as the server sees it (relative "
                                        "paths from its working directory). Default: the directory the index "
                                        "is served from, read again (e.g. after a symlink was moved).")


class IndexVersion(BaseModel):
    dir: str = Field(description="Index directory.")
    corpus_fingerprint: str | None = Field(description="Fingerprint of the corpus the index was built from.")
    documents: int = Field(description="Training documents in the index.")


class ReloadResponse(BaseModel):
    index: str = Field(description="The index name.")
    checkpoint_sha256: str = Field(description="The model checkpoint both versions were built from.")
    previous: IndexVersion = Field(description="The version served before; requests already running finish on it.")
    current: IndexVersion = Field(description="The version every new request uses.")
    load_seconds: float = Field(description="Time to load the new version.")
    pid: int = Field(description="The server process that swapped (each process of `--workers N` holds its own "
                                 "copy; see docs/service.md).")


def _version(ix: LoadedIndex) -> IndexVersion:
    return IndexVersion(dir=str(ix.dir), corpus_fingerprint=ix.manifest.identity.get("corpus_fingerprint"),
                        documents=ix.n_documents)


@router.post("/indexes/{name}/reload", response_model=ReloadResponse,
             responses=p.responses(p.UnknownIndex, p.IndexMismatch, p.InvalidIndex))
async def reload_index(name: Annotated[str, Path(max_length=200, description="The served index to replace.")],
                       services: ServicesDep, body: ReloadRequest | None = None) -> ReloadResponse:
    """Load a new version of a served index and switch to it without interrupting requests.

    The new version is loaded beside the old one (in a worker thread), must come from the same
    checkpoint and tokenizer (409 `index-mismatch` otherwise; the old version keeps serving), and
    then replaces it atomically: requests already running finish on the old version, every later
    request uses the new one. Reloads of one server run one at a time."""
    services.registry.get(name)
    old, new = await anyio.to_thread.run_sync(services.registry.swap, name, body.dir if body else None)
    services.metrics.index_loaded(new)
    return ReloadResponse(index=name, checkpoint_sha256=new.manifest.identity["checkpoint_sha256"],
                          previous=_version(old), current=_version(new), load_seconds=round(new.load_seconds, 3),
                          pid=os.getpid())


class TakedownRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    external_ids: list[Annotated[str, Field(min_length=1, max_length=1000)]] = Field(
        min_length=1, max_length=10_000, description="Corpus ids of the documents to take down (every document "
                                                     "with one of these ids).")
    reason: str = Field("", max_length=2000, description="Why (kept in the takedown report).")


class Removal(BaseModel):
    doc_id: int = Field(description="The document's global id when it was removed.")
    external_id: str = Field(description="Its corpus id.")
    unit: int = Field(description="The work unit of its shard.")
    removed_at: str = Field(description="When (ISO 8601, UTC).")
    by: str = Field(description="Who: `key:` and the first characters of the API key's hash, `local` without "
                                "keys, or `cli`.")
    reason: str = Field(description="Why.")


class TakedownResponse(BaseModel):
    index: str = Field(description="The index name.")
    removed: list[Removal] = Field(description="The documents this request took down.")
    already_removed: list[str] = Field(description="Ids whose documents were all taken down before.")
    not_found: list[str] = Field(description="Ids no document of the index has.")


class TakedownReport(BaseModel):
    index: str = Field(description="The index name.")
    removed_documents: int = Field(description="Documents taken down.")
    removals: list[Removal] = Field(description="Every removal, oldest first.")


def _removal(r) -> Removal:
    return Removal(doc_id=r.doc, external_id=r.external_id, unit=r.unit, removed_at=r.removed_at, by=r.by,
                   reason=r.reason)


@router.post("/indexes/{name}/takedown", response_model=TakedownResponse,
             responses=p.responses(p.UnknownIndex, p.BodyTooLarge))
async def take_down(name: Annotated[str, Path(max_length=200, description="The served index.")],
                    body: TakedownRequest, services: ServicesDep,
                    principal: Annotated[Principal, Depends(get_admin)]) -> TakedownResponse:
    """Take documents out of an index: from the next request on (on every server process serving
    this index directory) they appear in no answer, audit, SQL result, document read, prototype
    context or label; audits that cited one keep the citation, marked `removed`. The stored rows
    stay on disk until `prism index --compact` rewrites their shards."""
    ix = services.registry.get(name)
    by = "local" if principal.id == "local" else f"key:{principal.id[:12]}"
    res = await anyio.to_thread.run_sync(lambda: remove_documents(ix.dir, body.external_ids, by=by,
                                                                  reason=body.reason))
    return TakedownResponse(index=name, removed=[_removal(r) for r in res.removed], already_removed=res.already,
                            not_found=res.not_found)


@router.get("/indexes/{name}/takedown", response_model=TakedownReport, responses=p.responses(p.UnknownIndex))
async def takedown_report(name: Annotated[str, Path(max_length=200, description="The served index.")],
                          services: ServicesDep) -> TakedownReport:
    """What was taken down from an index: which documents, when, by which key and why."""
    ix = services.registry.get(name)
    rs = ix.attributor.reader.takedown.removals()
    return TakedownReport(index=name, removed_documents=len(rs), removals=[_removal(r) for r in rs])
