"""Request and response bodies, one family per resource."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictBool, create_model, model_validator

from prism_tda.engine.types import (
    Attribution,
    QueryOptions,
    QuerySpec,
)

from .requests import (
    MAX_LIST,
    DocId,
    JFloat,
    JInt,
    ProtoId,
    QueryRequest,
    SetName,
    Strict,
    fields_of,
    option_fields,
)

MAX_ALPHA = 4.0  # the largest strength a prototype set may be given (boosting beyond it degenerates)
MAX_STEER = 16  # terms of one generation's `steer`

IndexName = Annotated[str | None, Field(None, max_length=200, description="Index to use (default: the server's "
                                                                          "default index).")]
Prompt = Annotated[str, Field(min_length=1, max_length=20_000, description="The prompt text.")]


# ---------------------------------------------------------------------------- attribute
class AttributeRequest(create_model("AttributeFields", __base__=QueryRequest, index=(IndexName, None),  # type: ignore[misc]
                                    **fields_of(QuerySpec), **option_fields())):
    """One query: `QuerySpec` and `QueryOptions` of the engine (``prism_tda.engine.types``)."""


class AttributeResponse(create_model("AttributeResponseFields", index=(str, ...),  # type: ignore[misc]
                                     **fields_of(Attribution, request=False),
                                     partial=(bool, Field(False, description="Some shards did not answer (only "
                                                          "with `allow_partial`): the documents are the best of "
                                                          "the other shards.")))):
    """The engine's answer (``prism_tda.engine.Attribution``) and the index that gave it."""

    @classmethod
    def of(cls, index: str, res: Attribution) -> AttributeResponse:
        return cls(index=index, partial=res.partial,
                   **{f.name: getattr(res, f.name) for f in dataclasses.fields(Attribution)})


# ---------------------------------------------------------------------------- generate
class SteerTerm(Strict):
    prototypes: Annotated[list[ProtoId], Field(max_length=MAX_LIST)] | SetName = Field(
        description="Prototype ids, or the name of a stored prototype set.")
    alpha: JFloat = Field(ge=0.0, le=MAX_ALPHA, description="Their activations are multiplied by this: 0 "
                          "removes them, 1 leaves them, above 1 boosts them.")


class GenerateRequest(Strict):
    index: IndexName
    prompt: Prompt
    max_new_tokens: JInt | None = Field(None, ge=1, le=4096, description="Tokens to generate (at most the "
                                       "server's max_new_tokens; default 32 or that limit when lower).")
    temperature: JFloat = Field(0.0, ge=0.0, le=10.0, description="0: greedy; below 0.001 counts as greedy "
                                                                  "(dividing by it would overflow).")
    sample_top_k: JInt | None = Field(None, ge=1, le=100_000, validation_alias=AliasChoices("sample_top_k", "top_k"),
                                      description="Sample from this many most likely tokens only (`top_k`, "
                                                  "its earlier name, is still accepted).")
    seed: JInt = Field(0, ge=0, le=2**63 - 1)
    suppress: Annotated[list[ProtoId], Field(max_length=MAX_LIST)] | SetName | None = Field(
        None, description="Prototypes whose activations are scaled by `alpha` (by default they contribute "
                          "nothing to the logits): a list of ids, or the name of a stored prototype set.")
    alpha: JFloat = Field(0.0, ge=0.0, le=MAX_ALPHA, description="Strength of the `suppress` prototypes: their "
                          "activations are multiplied by it before mixing. 0 (the default) removes their part "
                          f"of the logits, 1 leaves the model as it is, above 1 (up to {MAX_ALPHA:g}) boosts them.")
    steer: Annotated[list[SteerTerm], Field(max_length=MAX_STEER)] | None = Field(
        None, description="More prototype sets, each at its own strength (a slider per set). A prototype may "
                          "appear in several terms only with the same alpha.")
    prototype_alphas: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                                     Annotated[JFloat, Field(ge=0.0, le=MAX_ALPHA)]],
                                Field(max_length=MAX_LIST)] | None = Field(
        None, description="A strength per prototype id, e.g. a controller of `prism control fit` (its file's "
                          "`alpha`). Applied after `suppress` and `steer`, with the same rule for a prototype "
                          "given twice.")
    gate: JFloat | None = Field(None, ge=0.0, le=1.0, description="Conditional steering: scale the prototypes "
                                "above only at positions where their joint share of the activation mass, averaged "
                                "over the last `gate_window` positions, is at least this (elsewhere the model is "
                                "left as it is). Null (the default): everywhere.")
    gate_window: JInt = Field(16, ge=1, le=4096, description="Positions the `gate` share is averaged over (the "
                              "position itself and the ones before it).")


class SteerApplied(BaseModel):
    prototypes: list[int]
    set: str | None = Field(description="The stored set the prototypes came from, if a name was given.")
    alpha: float


class GenerateResponse(BaseModel):
    index: str
    completion: str
    token_ids: list[int]
    n_prompt_tokens: int
    stopped: bool = Field(description="Generation ended at the end-of-text token.")
    suppressed: list[int] = Field(description="The `suppress` prototypes (at `alpha`).")
    suppress_set: str | None
    alpha: float = Field(description="The strength the `suppress` prototypes had.")
    steered: list[SteerApplied] = Field(description="Every term applied: `suppress` first, then `steer`'s.")
    gate: float | None = Field(None, description="The `gate` the terms were applied under (null: everywhere).")
    gate_window: int | None = Field(None, description="Its window, when `gate` is set.")


# ---------------------------------------------------------------------------- audits
class AuditItemIn(create_model("AuditItemFields", __base__=QueryRequest, **fields_of(QuerySpec))):  # type: ignore[misc]
    """One (prompt, output) item: a `QuerySpec`, your id for it, and the prototype set flagging it."""

    id: str | None = Field(None, max_length=200, description="Your id for the item (kept in the results).")
    flag: SetName | None = Field(None, description="Prototype set flagging this item (overrides the audit's).")


class AuditRequest(create_model("AuditFields", __base__=Strict, index=(IndexName, None),  # type: ignore[misc]
                                **option_fields())):
    """A batch of items, attributed with one set of `QueryOptions`."""

    items: list[AuditItemIn] = Field(min_length=1, max_length=MAX_LIST,
                                     description="The (prompt, output) pairs to attribute.")
    flag: SetName | None = Field(None, description="Name of a prototype set: items whose target tokens used any "
                                                   "of its prototypes are flagged.")
    flag_prototypes: list[ProtoId] | None = Field(None, max_length=MAX_LIST, description="Prototype ids flagging "
                                                  "items (with `flag`: added to the set).")

    def options(self) -> QueryOptions:
        return QueryOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(QueryOptions)})


class AuditJob(BaseModel):
    id: str
    index: str
    status: Literal["queued", "running", "completed", "cancelled"]
    created_at: float
    updated_at: float
    n_items: int
    n_done: int
    n_failed: int
    progress: float = Field(description="Finished items / all items.")
    params: dict[str, Any]


class AuditItemOut(BaseModel):
    item_no: int
    id: str | None
    status: Literal["pending", "done", "failed"]
    attempts: int
    completions: int
    error: str | None
    target_text: str | None
    flagged: bool
    flagged_prototypes: list[int]
    used_prototypes: list[int]
    documents: list[dict[str, Any]]


class AuditList(BaseModel):
    total: int = Field(description="Audits that match, over every page.")
    audits: list[AuditJob] = Field(description="This page, newest first.")
    next_offset: int | None = Field(description="`offset` of the next page; null on the last page.")


class AuditItems(BaseModel):
    job: AuditJob
    items: list[AuditItemOut]


# ---------------------------------------------------------------------------- sql
class SqlRequest(Strict):
    index: IndexName
    sql: str = Field(min_length=1, max_length=100_000, description="One SELECT statement.")


class SqlColumn(BaseModel):
    name: str
    type: str


class SqlResponse(BaseModel):
    index: str
    columns: list[SqlColumn]
    rows: list[list[Any]]
    row_count: int
    elapsed_ms: float


# ---------------------------------------------------------------------------- documents
class Document(BaseModel):
    doc_id: int
    external_id: str | None
    source: str | None
    title: str | None
    url: str | None
    text: str
    n_tokens: int


class DocumentBatchRequest(Strict):
    index: IndexName
    ids: list[DocId] = Field(min_length=1, max_length=MAX_LIST)


class DocumentBatch(BaseModel):
    index: str
    documents: list[Document]
    missing: list[int] = Field(description="Requested ids with no document.")


# ---------------------------------------------------------------------------- prototypes
class SignatureToken(BaseModel):
    token_id: int
    token: str
    logit: float = Field(description="(W p_i)_v: the prototype's logit signature for this token.")


class Context(BaseModel):
    doc_id: int
    seq_id: int
    pos: int
    act: float
    before: str
    token: str
    after: str


class Prototype(BaseModel):
    index: str
    proto_id: int
    label: str | None
    n_tokens: int
    mass: float
    share: float = Field(description="Share of the corpus's activation mass.")
    mean_act: float
    top_tokens: list[str]
    signature: list[SignatureToken]
    top_contexts: list[Context]


class PrototypeSummary(BaseModel):
    proto_id: int
    n_tokens: int
    mass: float
    mean_act: float
    top_tokens: list[str]
    label: str | None


class PrototypeList(BaseModel):
    index: str
    total: int
    prototypes: list[PrototypeSummary]


class PrototypeSetIn(Strict):
    index: IndexName
    prototypes: list[ProtoId] = Field(min_length=1, max_length=MAX_LIST)
    description: str | None = Field(None, max_length=2000)


class PrototypeSet(BaseModel):
    index: str
    name: str
    prototypes: list[int]
    description: str | None
    updated_at: float
    shared: bool = Field(description="Readable by every key, written by admin keys only (seeded by the operator or "
                                     "written with an admin key); otherwise the set belongs to the key that wrote it.")


class PrototypeSets(BaseModel):
    index: str
    sets: list[PrototypeSet]


class TextSource(Strict):
    """Where a topic's (or a contrast's) tokens come from: exactly one of the three (the others absent or
    null), as the schema says (``oneOf``)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": [k], "properties": {k: {"type": t}}} for k, t in (("texts", "array"), ("doc_ids", "array"),
                                                                       ("sql", "string"))]})

    texts: list[Annotated[str, Field(min_length=1, max_length=20_000)]] | None = Field(
        None, min_length=1, max_length=1000, description="Example texts, run through the model.")
    doc_ids: list[DocId] | None = Field(
        None, min_length=1, max_length=100_000, description="Documents of the index (their stored activations).")
    sql: str | None = Field(None, min_length=1, max_length=20_000,
                            description="One read-only SQL statement over the store whose first column is "
                                        "`doc_id`, e.g. `SELECT doc_id FROM documents WHERE external_id LIKE "
                                        "'zippy/%'` (the limits of `/v1/sql` apply).")

    @model_validator(mode="after")
    def _one(self) -> TextSource:
        if sum(x is not None for x in (self.texts, self.doc_ids, self.sql)) != 1:
            raise ValueError("give exactly one of texts, doc_ids, sql")
        return self


class DiscoverRequest(Strict):
    index: IndexName
    topic: TextSource
    contrast: TextSource | None = Field(None, description="Default: the rest of the corpus (the whole corpus when "
                                                          "the topic is pasted texts).")
    top_n: JInt = Field(20, ge=1, le=1000, description="Prototypes to return.")
    min_support: JInt = Field(5, ge=1, le=10**9, description="Least topic tokens a prototype must be active on.")
    min_docs: JInt = Field(2, ge=1, le=10**9, description="Least topic documents (texts) it must be active in.")
    smoothing: JFloat = Field(0.5, gt=0, le=1000, description="Tokens of mean activation added to both sides of the "
                                                            "ratio, so that rare prototypes do not win on chance.")
    include_untrained: StrictBool = Field(False, description="Also count documents the checkpoint did not train on.")
    contexts: JInt = Field(3, ge=0, le=5, description="Strongest topic contexts shown per prototype.")
    measure: Literal["activation", "logit"] = Field(
        "activation", description="What a token counts for a prototype: its activation, or its positive share of "
                                  "the next token's logit `a_i (W p_i)_y` (the per-token view; the default contrast "
                                  "then takes a pass over the corpus).")
    select: Literal["ratio", "effect"] = Field(
        "ratio", description="`effect`: also choose, from the ranked prototypes, the set whose suppression most "
                             "raises the model's loss on the topic relative to the contrast (greedy, measured with "
                             "the model), within `max_selected` prototypes and `max_ppl_ratio` (see `selection`).")
    max_selected: JInt | None = Field(None, ge=1, le=1000, description="With `select: effect`: the most prototypes "
                                      "chosen (default 2% of the bank).")
    max_ppl_ratio: JFloat = Field(1.02, ge=1.0, le=10.0, description="With `select: effect`: the largest perplexity "
                                  "ratio on the contrast a chosen set may cost.")


class SelectionStep(BaseModel):
    proto_id: int
    effect: float = Field(description="The topic's loss increase minus the contrast's, in nats per token, once "
                                      "this prototype is in the set.")
    topic_loss_increase: float
    contrast_loss_increase: float
    contrast_ppl_ratio: float


class SelectionCost(BaseModel):
    doc_id: int | None = Field(description="The contrast document (contrast given by documents or sampled).")
    text_index: int | None = Field(description="The contrast text (contrast given by texts).")
    tokens: int = Field(description="Its tokens the selection scored.")
    extra_nats: float = Field(description="How much its summed next-token loss rises with the chosen set removed.")
    share: float = Field(description="Its share of the whole contrast's rise.")
    snippet: str = Field(description="Its first tokens, as text.")


class SelectionStrength(BaseModel):
    alpha: float = Field(description="The strength the chosen set is scaled by (0 removes it).")
    effect: float = Field(description="The topic's loss increase minus the contrast's, nats per token.")
    topic_loss_increase: float
    contrast_loss_increase: float
    contrast_ppl_ratio: float


class EffectSelection(BaseModel):
    rule: str
    budget: int
    max_ppl_ratio: float
    contrast: str = Field(description="What the contrast texts were.")
    topic_tokens: int
    contrast_tokens: int
    candidates: int
    seconds: float
    prototypes: list[int] = Field(description="The chosen set, in the order it was chosen.")
    steps: list[SelectionStep]
    cost_by_text: list[SelectionCost] = Field(description="The (at most 3) contrast texts on which the chosen "
                                              "set's perplexity cost falls most, largest first: a set's cost often "
                                              "sits on a few texts, and these say what else it writes.")
    strengths: list[SelectionStrength] = Field(
        description="The chosen set's effect and cost at strengths 0, 0.25, 0.5 and 0.75, measured on the same texts "
                    "as its steps: a lower strength often keeps most of the effect for a fraction of the cost.")


class DiscoveredContext(BaseModel):
    act: float
    doc_id: int | None = Field(description="The document (topic given by documents).")
    text_index: int | None = Field(description="The example text (topic given by texts).")
    before: str
    token: str
    after: str


class DiscoveredPrototype(BaseModel):
    proto_id: int
    label: str | None
    score: float = Field(description="Log-ratio of activation mass per token, topic over contrast (smoothed).")
    ratio: float = Field(description="exp(score): how many times more mass per token on the topic.")
    topic_share: float = Field(description="Share of the topic's activation mass it carries.")
    topic_support: int = Field(description="Topic tokens it is active on.")
    topic_docs: int = Field(description="Topic documents (texts) it is active in.")
    contrast_support: int = Field(description="Contrast tokens it is active on.")
    contexts: list[DiscoveredContext]


class MassSummary(BaseModel):
    source: str
    tokens: int
    documents: int


class DiscoverResponse(BaseModel):
    index: str
    measure: str
    topic: MassSummary
    contrast: MassSummary
    prototypes: list[DiscoveredPrototype]
    selection: EffectSelection | None = Field(None, description="With `select: effect`: the set chosen by its "
                                                                "measured effect.")


class DiscoverTask(BaseModel):
    id: str
    index: str
    status: Literal["queued", "running", "completed", "failed", "cancelled"]
    created_at: float
    updated_at: float
    stage: str | None = Field(description="The stage running or last reported: `ranking`, then with `select: "
                                          "effect` `model` (the selection's texts through the model) and "
                                          "`selection` (candidate sets measured).")
    stage_done: int = Field(description="Units of the stage done (text windows; candidate evaluations).")
    stage_total: int = Field(description="Units of the stage in all (for `selection`: the most it can take; "
                                         "it may stop early).")
    progress: float = Field(description="Share of the whole task done, estimated from the stages (0-1).")
    attempts: int = Field(description="Starts of the task (more than one: a server stopped during it).")
    error: str | None
    result: DiscoverResponse | None = Field(description="When completed: the discovery, as `POST "
                                                        "/v1/prototypes/discover` answers it.")


class DiscoverTaskList(BaseModel):
    total: int = Field(description="Tasks that match, over every page.")
    tasks: list[DiscoverTask] = Field(description="This page, newest first (without `result`: GET the task).")
    next_offset: int | None = Field(description="`offset` of the next page; null on the last page.")


# ---------------------------------------------------------------------------- health
class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    indexes: list[dict[str, Any]]
    default_index: str
    audit_worker: Literal["leader", "standby"]
