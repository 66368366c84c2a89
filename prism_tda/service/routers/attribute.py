"""POST /v1/attribute: which training documents drove an output."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .. import problems as p
from ..deps import ServicesDep
from ..schemas import AttributeRequest, AttributeResponse

router = APIRouter(prefix="/attribute", tags=["attribution"])


@router.post("", response_model=AttributeResponse,
             responses=p.responses(p.UnknownIndex, p.InvalidQuery, p.PromptTooLong, p.BodyTooLarge,
                                   p.ShardUnavailable))
async def attribute(body: AttributeRequest, request: Request, services: ServicesDep) -> AttributeResponse:
    """Top training documents for one query (prompt + completion, a generation, or the prompt's own
    next-token predictions), with the per-token view of the prototypes behind each target token.
    `mode: exact` is refused when its estimate (the index's tokens at this server's measured rate) is over
    `exact_max_seconds` (send it as an audit item instead), and stops when the client disconnects."""
    ix = services.registry.get(body.index)
    options = body.options()
    services.check_limits(max_new_tokens=body.max_new_tokens, options=options, context=ix.attributor.encoder.context)
    options = services.bounded(options)
    if options.mode == "exact":
        await services.run(ix, ix.check_exact_time, services.settings.exact_max_seconds)
        res = await services.run_cancellable(request, ix, ix.attribute, body.spec(), options)
    else:
        res = await services.run(ix, ix.attribute, body.spec(), options)
    return AttributeResponse.of(ix.name, res)
