"""Request and response bodies, one family per resource."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StringConstraints,
    model_validator,
)

from prism_tda.engine.types import (
    Aggregation,
    Mode,
    QueryInfo,
    QueryOptions,
    QuerySpec,
    ScoredDocument,
    Timings,
    TokenView,
)

IndexName = Annotated[str | None, Field(None, max_length=200, description="Index to use (default: the server's "
                                                                          "default index).")]
Prompt = Annotated[str, Field(min_length=1, max_length=20_000, description="The prompt text.")]


def _json_int(v: Any) -> Any:
    """An integer as JSON Schema has it: a number without a fraction (5 or 5.0), never a boolean or a string."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError("must be an integer")
    return int(v)


def _json_number(v: Any) -> Any:
    """A number as JSON Schema has it: never a boolean or a string."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number")
    return v


# Request fields take JSON's own types only (pydantic's lax mode would turn true into 1 and "5" into 5,
# which the schema refuses): the server accepts exactly what openapi.yaml describes.
JInt = Annotated[int, BeforeValidator(_json_int)]
JFloat = Annotated[float, BeforeValidator(_json_number)]
ProtoId = Annotated[JInt, Field(ge=0, le=2**31 - 1)]
DocId = Annotated[JInt, Field(ge=0, le=2**31 - 1)]
SetName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_LIST = 10_000  # the longest list any request may carry (the server's own limits are lower)


class OneTarget(Strict):
    """A query's target: ``completion`` or ``max_new_tokens``, never both (not even one of them null), as
    the schema says (``not: required [completion, max_new_tokens]``)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"not": {"required": ["completion", "max_new_tokens"]}})

    @model_validator(mode="before")
    @classmethod
    def _one_target(cls, data: Any) -> Any:
        if isinstance(data, dict) and "completion" in data and "max_new_tokens" in data:
            raise ValueError("give either completion or max_new_tokens, not both")
        return data


# ---------------------------------------------------------------------------- attribute
class AttributeRequest(OneTarget):
    index: IndexName
    prompt: Prompt
    completion: str | None = Field(None, min_length=1, max_length=20_000,
                                   description="The output to attribute. Omit it (and `max_new_tokens`) to "
                                               "attribute the prompt's own next-token predictions.")
    max_new_tokens: JInt | None = Field(None, ge=1, le=4096, description="Generate this many tokens greedily "
                                                                        "and attribute them (no `completion`).")
    target_index: JInt | None = Field(None, ge=0, le=100_000, description="Attribute only this target token.")
    top_k: JInt = Field(10, ge=1, le=1000, description="Documents to return (at most the server's max_top_k).")
    mode: Mode = Field("fast", description="fast: FAISS and posting-list candidates, shortlisted from the stored "
                                           "codes, re-ranked exactly; exact: every training token recomputed by "
                                           "the model (refused past the server's exact_max_tokens).")
    n_candidates: JInt = Field(256, ge=1, le=16_384, description="Candidate sequences the fast path asks FAISS for.")
    exact_rerank: JInt = Field(32, ge=1, le=1024, description="Fast path: documents re-scored exactly by the model "
                                                             "before ranking (at least top_k are).")
    exact_tokens: JInt | None = Field(16, ge=1, le=4096, description="Fast path, best-token aggregations: tokens "
                                     "of each re-ranked sequence re-scored exactly, the best by their "
                                     "approximate scores first; null: every token.")
    nprobe: JInt | None = Field(None, ge=1, le=65_536, description="FAISS lists searched (IVF indexes; default: "
                                                                  "the index's, in its manifest).")
    opponents: StrictBool = Field(False, description="Return the documents that most oppose the output.")
    damping: JFloat | None = Field(None, gt=0, le=1e6, description="Curvature damping, x the mean curvature "
                                                                  "eigenvalue (default: the index's).")
    aggregation: Aggregation = Field("cosine_max", description="How a document's token scores make its score: "
                                                               "the best token's cosine (default), the sum of "
                                                               "cosines, the best or summed raw influence, or "
                                                               "cosine_match: each target token matched to its "
                                                               "best token of the document, averaged (a "
                                                               "multi-token target matched as a whole).")
    include_untrained: StrictBool = Field(False, description="Also return documents the checkpoint did not train on "
                                                       "(its validation split); each document says `trained`.")
    allow_partial: StrictBool = Field(False, description="Served from a cluster: when some shards do not answer, return "
                                                   "the best documents of the others (`partial: true`, naming the "
                                                   "missing shards) instead of 503 `shard-unavailable`.")

    def spec(self) -> QuerySpec:
        return QuerySpec(self.prompt, self.completion, self.max_new_tokens, self.target_index)

    def options(self) -> QueryOptions:
        return QueryOptions(n_documents=self.top_k, mode=self.mode, n_candidates=self.n_candidates,
                            opponents=self.opponents, damping=self.damping, aggregation=self.aggregation,
                            exact_rerank=self.exact_rerank, exact_tokens=self.exact_tokens, nprobe=self.nprobe,
                            include_untrained=self.include_untrained, allow_partial=self.allow_partial)



class AttributeResponse(BaseModel):
    """The engine's answer (``prism_tda.engine.Attribution``) and the index that gave it."""

    index: str
    mode: Mode
    aggregation: Aggregation
    damping: float = Field(description="The damping used, x the mean curvature eigenvalue.")
    query: QueryInfo
    documents: list[ScoredDocument]
    per_token: list[TokenView]
    timings_ms: Timings
    tokens_scored: int = Field(description="Training tokens scored (fast: the candidates' tokens, approximately; "
                                           "exact: every token).")
    partial: bool = Field(False, description="Some shards did not answer (only with `allow_partial`): the "
                                             "documents are the best of the other shards.")
    missing_shards: list[int] = Field(default_factory=list, description="The shards that did not answer.")


# ---------------------------------------------------------------------------- generate
class GenerateRequest(Strict):
    index: IndexName
    prompt: Prompt
    max_new_tokens: JInt | None = Field(None, ge=1, le=4096, description="Tokens to generate (at most the "
                                       "server's max_new_tokens; default 32 or that limit when lower).")
    temperature: JFloat = Field(0.0, ge=0.0, le=10.0, description="0: greedy; below 0.001 counts as greedy "
                                                                  "(dividing by it would overflow).")
    top_k: JInt | None = Field(None, ge=1, le=100_000, description="Sample from the top-k tokens only (a sampling "
                                                                  "cut-off, not the documents' top_k).")
    seed: JInt = Field(0, ge=0, le=2**63 - 1)
    suppress: Annotated[list[ProtoId], Field(max_length=MAX_LIST)] | SetName | None = Field(
        None, description="Prototypes that contribute nothing to the logits: a list of ids, or the name of "
                          "a stored prototype set.")


class GenerateResponse(BaseModel):
    index: str
    completion: str
    token_ids: list[int]
    n_prompt_tokens: int
    stopped: bool = Field(description="Generation ended at the end-of-text token.")
    suppressed: list[int]
    suppress_set: str | None


# ---------------------------------------------------------------------------- audits
class AuditItemIn(OneTarget):
    id: str | None = Field(None, max_length=200, description="Your id for the item (kept in the results).")
    prompt: Prompt
    completion: str | None = Field(None, min_length=1, max_length=20_000)
    max_new_tokens: JInt | None = Field(None, ge=1, le=4096)
    flag: SetName | None = Field(None, description="Prototype set flagging this item (overrides the audit's).")

    def spec(self) -> QuerySpec:
        return QuerySpec(self.prompt, self.completion, self.max_new_tokens)


class AuditRequest(Strict):
    index: IndexName
    items: list[AuditItemIn] = Field(min_length=1, max_length=MAX_LIST,
                                     description="The (prompt, output) pairs to attribute.")
    top_k: JInt = Field(10, ge=1, le=1000)
    mode: Mode = "fast"
    n_candidates: JInt = Field(256, ge=1, le=16_384)
    include_untrained: StrictBool = Field(False, description="Also attribute to documents the checkpoint did not train "
                                                       "on; each result document says `trained`.")
    flag: SetName | None = Field(None, description="Name of a prototype set: items whose target tokens used any "
                                                   "of its prototypes are flagged.")
    flag_prototypes: list[ProtoId] | None = Field(None, max_length=MAX_LIST, description="Prototype ids flagging "
                                                  "items (with `flag`: added to the set).")


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


# ---------------------------------------------------------------------------- health
class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    indexes: list[dict[str, Any]]
    default_index: str
    audit_worker: Literal["leader", "standby"]
