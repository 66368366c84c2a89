"""POST /v1/attribute: which training documents drove an output."""

from __future__ import annotations

from fastapi import APIRouter

from .. import problems as p
from ..deps import ServicesDep
from ..schemas import AttributeRequest, AttributeResponse

router = APIRouter(prefix="/attribute", tags=["attribution"])


@router.post("", response_model=AttributeResponse,
             responses=p.responses(p.UnknownIndex, p.InvalidQuery, p.PromptTooLong, p.BodyTooLarge,
                                   p.ShardUnavailable))
async def attribute(body: AttributeRequest, services: ServicesDep) -> AttributeResponse:
    """Top training documents for one query (prompt + completion, a generation, or the prompt's own
    next-token predictions), with the per-token view of the prototypes behind each target token."""
    ix = services.registry.get(body.index)
    services.check_limits(top_k=body.top_k, max_new_tokens=body.max_new_tokens)
    res = await services.run(ix, ix.attribute, body.spec(), body.options())
    return AttributeResponse(index=ix.name, mode=res.mode, aggregation=res.aggregation, damping=res.damping,
                             query=res.query, documents=res.documents, per_token=res.per_token,
                             timings_ms=res.timings_ms, tokens_scored=res.tokens_scored, partial=res.partial,
                             missing_shards=res.missing_shards)
