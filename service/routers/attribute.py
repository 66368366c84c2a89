"""POST /v1/attribute: which training documents drove an output."""

from __future__ import annotations

from fastapi import APIRouter

from .. import problems as p
from ..deps import ServicesDep
from ..schemas import AttributeRequest, AttributeResponse

router = APIRouter(prefix="/attribute", tags=["attribution"])


@router.post("", response_model=AttributeResponse,
             responses=p.responses(p.UnknownIndex, p.InvalidQuery, p.PromptTooLong, p.BodyTooLarge))
async def attribute(body: AttributeRequest, services: ServicesDep) -> AttributeResponse:
    """Top training documents for one query (prompt + completion, a generation, or the prompt's own
    next-token predictions), with the per-token view of the prototypes behind each target token."""
    ix = services.registry.get(body.index)
    s = services.settings
    if body.top_k > s.max_top_k:
        raise p.InvalidRequest(f"top_k: {body.top_k} is over the server's limit of {s.max_top_k}")
    if body.max_new_tokens is not None and body.max_new_tokens > s.max_new_tokens:
        raise p.InvalidRequest(f"max_new_tokens: {body.max_new_tokens} is over the server's limit of "
                               f"{s.max_new_tokens}")
    res = await services.run(ix, ix.attribute, body.prompt, body.completion, max_new_tokens=body.max_new_tokens,
                             target_index=body.target_index, top_k=body.top_k, mode=body.mode,
                             n_candidates=body.n_candidates, opponents=body.opponents)
    for rank, d in enumerate(res["documents"], 1):
        d["rank"] = rank
    return AttributeResponse.model_validate({"index": ix.name, **res})
