"""POST /v1/generate: generation, optionally with prototypes suppressed or scaled."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .. import problems as p
from ..deps import PrincipalDep, ServicesDep
from ..schemas import GenerateRequest, GenerateResponse, SteerApplied
from .prototypes import find_set

router = APIRouter(prefix="/generate", tags=["generation"])


@router.post("", response_model=GenerateResponse,
             responses=p.responses(p.UnknownIndex, p.InvalidQuery, p.PromptTooLong, p.InvalidPrototype,
                                   p.PrototypeSetNotFound, p.TooManyItems, p.BodyTooLarge, p.KeyBusy))
async def generate(body: GenerateRequest, request: Request, services: ServicesDep,
                   principal: PrincipalDep) -> GenerateResponse:
    """Continue a prompt. `suppress` (prototype ids, or a stored set's name) scales those prototypes'
    activations by `alpha` before mixing: 0, the default, removes their part of the logits; 1 leaves the
    model as it is; above 1 boosts them. `steer` adds more sets, each at its own alpha. The active sets and
    the residual stay those of the unscaled model, so the logit decomposition stays exact. With `gate`, every
    scaled prototype is scaled only at positions where their joint share of the activation mass, averaged over
    the last `gate_window` positions, is at least `gate` (conditional steering: the model is left as it is
    where the context does not carry them). Generation is heavy: a key runs at most `max_heavy_per_key`
    generations at once (429 `key-busy`); it stops at the next token when the client disconnects."""
    ix = services.registry.get(body.index)
    n_new = min(32, services.settings.max_new_tokens) if body.max_new_tokens is None else body.max_new_tokens
    services.check_limits(max_new_tokens=n_new)

    async def resolve(value: list[int] | str, field: str) -> tuple[list[int], str | None]:
        if isinstance(value, str):
            return list((await find_set(services, ix.name, value, principal, f"{field}: "))["prototypes"]), value
        services.check_limits(n_items=(field, len(value)))
        ix.check_prototypes(list(value), field)
        return list(value), None

    terms: list[tuple[str, SteerApplied]] = []  # (request field, term)
    suppressed, set_name = await resolve(body.suppress, "suppress") if body.suppress is not None else ([], None)
    if suppressed:
        terms.append(("suppress", SteerApplied(prototypes=sorted(set(suppressed)), set=set_name, alpha=body.alpha)))
    for i, term in enumerate(body.steer or []):
        ids, name = await resolve(term.prototypes, f"steer[{i}].prototypes")
        terms.append((f"steer[{i}]", SteerApplied(prototypes=sorted(set(ids)), set=name, alpha=term.alpha)))
    if body.prototype_alphas:
        alphas = {int(k): v for k, v in body.prototype_alphas.items()}
        ix.check_prototypes(sorted(alphas), "prototype_alphas")
        for pid in sorted(alphas):
            terms.append(("prototype_alphas", SteerApplied(prototypes=[pid], set=None, alpha=alphas[pid])))
    scale: dict[int, float] = {}
    for field, t in terms:
        for pid in t.prototypes:
            if scale.setdefault(pid, t.alpha) != t.alpha:
                raise p.InvalidQuery(f"{field}: prototype {pid} is given alpha {t.alpha:g} here and "
                                     f"{scale[pid]:g} in an earlier term")
    services.check_limits(n_items=("steer", len(scale)))
    if body.gate is not None and not scale:
        raise p.InvalidQuery("gate: needs prototypes to scale (suppress, steer or prototype_alphas)")
    gen, n_prompt = await services.run_cancellable(
        request, ix, principal, ix.generate, body.prompt, heavy=True, max_new_tokens=n_new,
        temperature=body.temperature, sample_top_k=body.sample_top_k, seed=body.seed, scale=scale, gate=body.gate,
        gate_window=body.gate_window)
    return GenerateResponse(index=ix.name, completion=gen.text, token_ids=gen.token_ids, n_prompt_tokens=n_prompt,
                            stopped=gen.stopped, suppressed=sorted(set(suppressed)), suppress_set=set_name,
                            alpha=body.alpha, steered=[t for _, t in terms], gate=body.gate if scale else None,
                            gate_window=body.gate_window if scale and body.gate is not None else None)
