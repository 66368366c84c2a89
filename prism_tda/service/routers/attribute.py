"""POST /v1/attribute: which training documents drove an output."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .. import problems as p
from ..deps import PrincipalDep, ServicesDep
from ..schemas import AttributeRequest, AttributeResponse

router = APIRouter(prefix="/attribute", tags=["attribution"])


@router.post("", response_model=AttributeResponse,
             responses=p.responses(p.UnknownIndex, p.InvalidQuery, p.PromptTooLong, p.BodyTooLarge, p.KeyBusy,
                                   p.ShardUnavailable))
async def attribute(body: AttributeRequest, request: Request, services: ServicesDep,
                    principal: PrincipalDep) -> AttributeResponse:
    """Top training documents for one query (prompt + completion, a generation, or the prompt's own
    next-token predictions), with the per-token view of the prototypes behind each target token.
    `mode: exact` is refused when its estimate (the index's tokens at this server's measured rate) is over
    `exact_max_seconds` (send it as an audit item instead). A query that generates its target, asks for
    `influence` or `mode: exact` is heavy: a key runs at most `max_heavy_per_key` of them at once (429
    `key-busy`). The work stops at its next step when the client disconnects."""
    ix = services.registry.get(body.index)
    options = body.options()
    services.check_limits(max_new_tokens=body.max_new_tokens, options=options, context=ix.attributor.encoder.context)
    options = services.bounded(options)
    if options.mode == "exact":
        await services.run(ix, principal, ix.check_exact_time, services.settings.exact_max_seconds)
    heavy = options.mode == "exact" or options.influence or body.max_new_tokens is not None
    res = await services.run_cancellable(request, ix, principal, ix.attribute, body.spec(), options, heavy=heavy)
    return AttributeResponse.of(ix.name, res)
