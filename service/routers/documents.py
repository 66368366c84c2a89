"""Training documents: one by id, or many at once."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from .. import problems as p
from ..deps import IndexQuery, Services, ServicesDep
from ..schemas import Document, DocumentBatch, DocumentBatchRequest

router = APIRouter(prefix="/documents", tags=["documents"])


async def _batch(services: Services, index: str | None, ids: list[int]) -> DocumentBatch:
    ix = services.registry.get(index)
    if len(ids) > services.settings.max_batch_items:
        raise p.TooManyItems(f"ids: {len(ids)} ids; the limit is {services.settings.max_batch_items}")
    found = await services.run(ix, ix.store.documents, ids)
    uniq = list(dict.fromkeys(ids))
    return DocumentBatch(index=ix.name, documents=[Document(**found[i]) for i in uniq if i in found],
                         missing=[i for i in uniq if i not in found])


@router.get("", response_model=DocumentBatch, responses=p.responses(p.UnknownIndex, p.TooManyItems))
async def list_documents(ids: Annotated[str, Query(max_length=200_000, pattern=r"^\s*\d+(\s*,\s*\d+)*\s*$",
                                                   description="Comma-separated document ids.")],
                         services: ServicesDep, index: IndexQuery = None) -> DocumentBatch:
    """Fetch several documents by id (`?ids=3,17,42`); unknown ids are listed in `missing`."""
    parsed = [int(x) for x in ids.split(",")]
    if any(i > 2**31 - 1 for i in parsed):
        raise p.InvalidRequest("ids: every id must be below 2^31")
    return await _batch(services, index, parsed)


@router.post("/batch", response_model=DocumentBatch,
             responses=p.responses(p.UnknownIndex, p.TooManyItems, p.BodyTooLarge))
async def fetch_documents(body: DocumentBatchRequest, services: ServicesDep) -> DocumentBatch:
    """Fetch many documents by id in one request; unknown ids are listed in `missing`."""
    return await _batch(services, body.index, body.ids)


@router.get("/{doc_id}", response_model=Document, responses=p.responses(p.UnknownIndex, p.DocumentNotFound))
async def get_document(doc_id: Annotated[int, Path(ge=0, le=2**31 - 1)], services: ServicesDep,
                       index: IndexQuery = None) -> Document:
    """One training document: its corpus id, source, title/url when known, text and token count."""
    ix = services.registry.get(index)
    found = await services.run(ix, ix.store.documents, [doc_id])
    if doc_id not in found:
        raise p.DocumentNotFound(f"document {doc_id} does not exist in index {ix.name!r}")
    return Document(**found[doc_id])
