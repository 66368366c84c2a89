"""POST /v1/generate: generation, optionally with prototypes suppressed."""

from __future__ import annotations

from fastapi import APIRouter

from .. import problems as p
from ..deps import PrincipalDep, ServicesDep
from ..schemas import GenerateRequest, GenerateResponse
from .prototypes import find_set

router = APIRouter(prefix="/generate", tags=["generation"])


@router.post("", response_model=GenerateResponse,
             responses=p.responses(p.UnknownIndex, p.InvalidQuery, p.PromptTooLong, p.InvalidPrototype,
                                   p.PrototypeSetNotFound, p.TooManyItems, p.BodyTooLarge))
async def generate(body: GenerateRequest, services: ServicesDep, principal: PrincipalDep) -> GenerateResponse:
    """Continue a prompt. `suppress` (prototype ids, or a stored set's name) zeroes those prototypes'
    activations, so they contribute nothing to the logits (the active sets and residual stay as they are)."""
    ix = services.registry.get(body.index)
    n_new = min(32, services.settings.max_new_tokens) if body.max_new_tokens is None else body.max_new_tokens
    services.check_limits(max_new_tokens=n_new)
    set_name = body.suppress if isinstance(body.suppress, str) else None
    if set_name is not None:
        ids = (await find_set(services, ix.name, set_name, principal, "suppress: "))["prototypes"]
    else:
        ids = list(body.suppress or [])
        services.check_limits(n_items=("suppress", len(ids)))
        ix.check_prototypes(ids, "suppress")
    gen, n_prompt = await services.run(ix, ix.generate, body.prompt, max_new_tokens=n_new,
                                       temperature=body.temperature, sample_top_k=body.sample_top_k, seed=body.seed,
                                       suppress=ids)
    return GenerateResponse(index=ix.name, completion=gen.text, token_ids=gen.token_ids, n_prompt_tokens=n_prompt,
                            stopped=gen.stopped, suppressed=sorted(set(ids)), suppress_set=set_name)
