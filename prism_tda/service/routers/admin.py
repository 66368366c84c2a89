"""Administration: replace a served index with a new version while the server keeps answering."""

from __future__ import annotations

import os
from typing import Annotated

import anyio
from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from .. import problems as p
from ..deps import ServicesDep
from ..indexes import LoadedIndex

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
