"""Training documents: one by id, or many at once."""

from __future__ import annotations

import re
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Path, Query

from .. import problems as p
from ..deps import IndexQuery, PrincipalDep, Services, ServicesDep
from ..schemas import Document, DocumentBatch, DocumentBatchRequest
from ..security import Principal

router = APIRouter(prefix="/documents", tags=["documents"])
# stated in the schema; checked by parse_ids, whose errors name the offending item
IDS_PATTERN = r"^ *[0-9]{1,10} *( *, *[0-9]{1,10} *)*$"


async def _batch(services: Services, who: Principal, index: str | None, ids: list[int]) -> DocumentBatch:
    ix = services.registry.get(index)
    services.check_limits(n_items=("ids", len(ids)))
    found = await services.run(ix, who, ix.catalog.documents, ids)
    uniq = list(dict.fromkeys(ids))
    return DocumentBatch(index=ix.name, documents=[Document(**found[i]) for i in uniq if i in found],
                         missing=[i for i in uniq if i not in found])


@router.get("", response_model=DocumentBatch, responses=p.responses(p.UnknownIndex, p.KeyBusy, p.TooManyItems))
async def list_documents(ids: Annotated[str, Query(max_length=16_000, json_schema_extra={"pattern": IDS_PATTERN}, description=(
                             "Comma-separated document ids (ASCII digits, at most 10 each; ids past the index's "
                             "documents are listed in `missing`). For longer lists, POST /v1/documents/batch."))],
                         services: ServicesDep, principal: PrincipalDep, index: IndexQuery = None) -> DocumentBatch:
    """Fetch several documents by id (`?ids=3,17,42`); unknown and taken-down ids are listed in `missing`."""
    return await _batch(services, principal, index, parse_ids(ids))


_ID = re.compile(r"[0-9]{1,10}")


def parse_ids(text: str) -> list[int]:
    """``"3, 17,42"`` -> [3, 17, 42]; anything else (other digits, signs, over-long numbers) is a 422
    naming the field and the offending item, checked before any conversion. Ids of 10 digits past 2^31
    are kept (no document has them: they come back as missing)."""
    out = []
    for n, raw in enumerate(text.split(",")):
        item = raw.strip(" ")
        if not _ID.fullmatch(item):
            shown = item if len(item) <= 20 else item[:20] + f"... ({len(item)} characters)"
            raise p.InvalidRequest(f"ids: item {n} ({shown!r}) is not a document id: ASCII digits, at most "
                                   "10 of them")
        out.append(int(item))
    return out


@router.post("/batch", response_model=DocumentBatch,
             responses=p.responses(p.UnknownIndex, p.KeyBusy, p.TooManyItems, p.BodyTooLarge))
async def fetch_documents(body: DocumentBatchRequest, services: ServicesDep, principal: PrincipalDep) -> DocumentBatch:
    """Fetch many documents by id in one request; unknown ids are listed in `missing`."""
    return await _batch(services, principal, body.index, body.ids)


@router.get("/{doc_id:not_batch}", response_model=Document,
            responses=p.responses(p.UnknownIndex, p.KeyBusy, p.DocumentNotFound, p.DocumentRemoved))
async def get_document(doc_id: Annotated[int, Path(ge=0, le=2**31 - 1)], services: ServicesDep,
                       principal: PrincipalDep, index: IndexQuery = None) -> Document:
    """One training document: its corpus id, source, title/url when known, text and token count (410
    `document-removed` for a document taken down)."""
    ix = services.registry.get(index)
    found = await services.run(ix, principal, ix.catalog.documents, [doc_id])
    if doc_id not in found:
        if doc_id < ix.n_documents and ix.attributor.reader.removed(np.array([doc_id]))[0]:
            raise p.DocumentRemoved(f"document {doc_id} of index {ix.name!r} was taken down")
        raise p.DocumentNotFound(f"document {doc_id} does not exist in index {ix.name!r}")
    return Document(**found[doc_id])
