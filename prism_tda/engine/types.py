"""The values that cross from the engine to its callers (CLI, service, benchmarks): what a query
asks, how it is scored, and what comes back. Plain dataclasses; the service's HTTP schemas are
built from them (their attribute docstrings become the API's field descriptions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import Field

from prism_tda.errors import QueryError

Mode = Literal["fast", "exact"]
# cosine_match: each target token matched to its best token of the document, the cosines averaged
# over the target tokens (a multi-token target is matched as a whole, not by its best piece)
Aggregation = Literal["cosine_max", "cosine_sum", "raw_max", "raw_sum", "cosine_match"]
AGGREGATIONS: tuple[Aggregation, ...] = ("cosine_max", "cosine_sum", "raw_max", "raw_sum", "cosine_match")
# the FAISS sketch stage's sequences under opponents by default (QueryOptions.n_candidates None); the
# other queries leave it out (bench/attribution/opponents.py, bench/attribution/near_ties.py --variants)
OPPONENT_SKETCH_CANDIDATES = 256

# pydantic reads each attribute's docstring as its description
_DOCS = {"use_attribute_docstrings": True}


@dataclass(frozen=True)
class QuerySpec:
    """What to attribute: a prompt plus a target (a given completion, a greedy generation of
    ``max_new_tokens``, or with neither the prompt's own next-token predictions)."""

    prompt: Annotated[str, Field(min_length=1, max_length=20_000)]
    """The prompt text."""
    completion: Annotated[str | None, Field(min_length=1, max_length=20_000)] = None
    """The output to attribute. Omit it (and `max_new_tokens`) to attribute the prompt's own next-token
    predictions."""
    max_new_tokens: Annotated[int | None, Field(ge=1, le=4096)] = None
    """Generate this many tokens greedily and attribute them (no `completion`)."""
    target_index: Annotated[int | None, Field(ge=0, le=100_000)] = None
    """Attribute only this target token."""

    def __post_init__(self) -> None:
        if self.completion is not None and self.max_new_tokens is not None:
            raise QueryError("give either completion or max_new_tokens, not both")


@dataclass(frozen=True)
class QueryOptions:
    """How to score and what to return (defaults: DESIGN §2's). Every field reaches the engine from
    HTTP (``/v1/attribute``, audits) and the command line (``prism attribute``) by its own name."""

    n_documents: Annotated[int, Field(ge=1, le=1000)] = 10
    """Documents to return (at most the server's max_top_k)."""
    mode: Mode = "fast"
    """fast: posting-list candidates (and FAISS's: n_candidates), shortlisted from the stored codes,
    re-ranked exactly; exact: every training token recomputed by the model (refused past the server's
    exact_max_tokens)."""
    n_candidates: Annotated[int | None, Field(ge=0, le=16_384)] = None
    """Candidate sequences the fast path also asks FAISS for, nearest the query by the sketch of a whole
    window (at most the server's max_candidates); 0: the posting lists' candidates only. None (the
    default): 0, or 256 with ``opponents`` (where the sketch stage was measured to add agreement with
    exact mode; elsewhere it changed 2 documents of 3,680: docs/benchmarks.md)."""
    opponents: bool = False
    """Return the documents that most oppose the output."""
    damping: Annotated[float | None, Field(gt=0, le=1e6)] = None
    """Curvature damping, x the index's damping unit: each prototype's own (shrunk) mean curvature
    eigenvalue, or the mean over prototypes for an index built with ``damping_scope=global`` (default:
    the index's)."""
    aggregation: Aggregation = "cosine_max"
    """How a document's token scores make its score: the best token's cosine (default), the sum of
    cosines, the best or summed raw influence (a sum over every window of the document), or
    cosine_match: each target token matched to its best token of the document, averaged (a multi-token
    target matched as a whole)."""
    exact_rerank: Annotated[int, Field(ge=1, le=1024)] = 128
    """Fast path: the shortlist, documents by approximate score that may be re-scored exactly by the model
    before ranking (at least n_documents are; with adaptive_rerank only those that could still reach the
    top). At millions of tokens the exact top 10 lies within the first hundred or so of the approximate
    order; 32 is faster there and agrees less with exact mode."""
    adaptive_rerank: bool = True
    """Fast path: re-rank the first n_documents of the shortlist, then only the shortlisted documents whose
    approximate score could still reach the n-th exact score (within the largest approximation error
    seen on the re-ranked ones); false: re-rank all exact_rerank."""
    exact_tokens: Annotated[int | None, Field(ge=1, le=4096)] = 4
    """Fast path, best-token aggregations: tokens of each re-ranked sequence re-scored exactly, the best
    by their approximate scores first; null: every token (sum aggregations always take every token).
    As many of the document's best tokens in its other candidate sequences are re-scored too where their
    approximate scores could still reach the top (null: all of them)."""
    nprobe: Annotated[int | None, Field(ge=1, le=65_536)] = None
    """FAISS lists searched (IVF indexes; default: the index's, in its manifest)."""
    include_untrained: bool = False
    """Also return documents the checkpoint did not train on (by its training record: held out, never
    reached, or not in its corpus); each document says `trained`."""
    influence: bool = False
    """Also give each returned document its full-model influence (``influence``): EK-FAC through every
    linear layer, summed over the document's windows, one backward pass per window (needs the index's
    influence curvature: `prism index --out IDX --influence`). Of the first
    n_documents by score, those whose influence pushes the other way are left out (counted in
    ``opposed_by_influence``) unless ``keep_opposed``."""
    tie_break: Literal["cosine_sum", "score"] = "cosine_sum"
    """When more documents score within 0.1% of the n_documents-th best (a near-tie the score cannot
    decide) than there are places left, those whose tokens' cosines sum highest (their ``cosine_sum``:
    how much of the document points where the query does) take them, shown in the score's order;
    ``tied_beyond_last`` counts the others. ``score``: the score's own order decides, down to its last
    digits (then the best token's raw influence, then the lower document id)."""
    keep_opposed: bool = False
    """Keep the documents whose effect pushes the other way. By default, of the first n_documents by
    score, a document whose ``value`` (summed prototype-space influence) is <= 0 (>= 0 with
    ``opponents``) is left out (counted in ``opposed_by_value``): its best token matches the output, but
    training on the whole document raised the output's loss. With ``influence`` the full-model
    influence decides instead (``opposed_by_influence``)."""
    allow_partial: bool = False
    """Served from a cluster: when some shards do not answer, return the best documents of the others
    (`partial: true`, naming the missing shards) instead of failing with `shard-unavailable`."""

    @property
    def sketch_candidates(self) -> int:
        """``n_candidates`` as the fast path takes it (None: the default for the query's kind)."""
        if self.n_candidates is not None:
            return self.n_candidates
        return OPPONENT_SKETCH_CANDIDATES if self.opponents else 0


@dataclass
class Highlight:
    __pydantic_config__ = _DOCS

    start: int
    """Start offset (characters) into the snippet."""
    end: int
    """End offset (characters, exclusive)."""
    text: str
    """The highlighted training token's text."""
    weight: float
    """Its influence relative to the document's best token (1 for the best token)."""
    token_row: int
    """The training token's row in the index."""


@dataclass
class ProtoShare:
    __pydantic_config__ = _DOCS

    proto_id: int
    share: float
    """The prototype's share of the document's score."""


@dataclass
class ScoredDocument:
    """One attributed training document."""

    __pydantic_config__ = _DOCS

    rank: int
    """1 for the best document."""
    doc_id: int
    """The document's id in the index."""
    external_id: str
    """The document's id in the training corpus."""
    score: float
    """The document's score under the query's aggregation (by default the cosine of preconditioned
    prototype-space gradients of its best token)."""
    raw_influence: float
    """Unnormalised prototype-space influence of the best token (breaks ties of ``score``)."""
    trained: bool
    """Whether the checkpoint trained on this document, from its training record (False: no training
    window covered it, or the record does not hold it; such documents are returned only with
    ``include_untrained``)."""
    seq_id: int
    """The sequence (model-length window) holding the best token."""
    token_row: int
    """The best token's row in the index."""
    position: int
    """The best token's position in the document's token stream."""
    snippet: str
    """The document's text around its best token (the tokens it predicts)."""
    highlights: list[Highlight] = field(default_factory=list)
    """Training tokens of the snippet that share prototypes with the query and push the same way."""
    prototypes: list[ProtoShare] = field(default_factory=list)
    """The prototypes that carry the best token's score."""
    value: float = 0.0
    """The document's predicted effect on the query's loss in prototype space: its tokens' unnormalised
    influences summed over every token of it (exact for the re-ranked rows, from the index's codes for the
    others in fast mode; every token exact in exact mode). Positive: training on it lowered the loss. The
    ranking stays the score's; this is the value to compare documents' effects by (it predicts
    leave-some-out retraining better than the score: docs/benchmarks.md, "A document's value")."""
    influence: float | None = None
    """With ``influence``: how much training on this document lowered the query's loss, predicted through
    the whole model (EK-FAC over every linear layer, summed over its windows; negative: raised it). The
    ranking stays the score's; this is the value to compare documents' effects by."""


@dataclass
class TokenPrototype:
    __pydantic_config__ = _DOCS

    proto_id: int
    act: float
    """The prototype's activation a_{t,i}."""
    contribution: float
    """a_{t,i} (W p_i)_y: the prototype's part of the token's logit."""


@dataclass
class TokenView:
    """One target token's logit, split into its active prototypes' parts and the residual's."""

    __pydantic_config__ = _DOCS

    position: int
    """The position whose next token this is."""
    token_id: int
    token: str
    logit: float
    residual: float
    """(W r_t)_y: the residual's part of the logit."""
    prototypes: list[TokenPrototype]


@dataclass
class QueryInfo:
    __pydantic_config__ = _DOCS

    token_ids: list[int]
    """Prompt and target tokens, as run through the model."""
    n_prompt: int
    """How many of ``token_ids`` are the prompt."""
    target_ids: list[int]
    target_text: str


@dataclass
class ExactEstimate:
    """What ``mode: exact`` costs on an index, before it starts."""

    __pydantic_config__ = _DOCS

    tokens: int
    """Training tokens it recomputes with the model (all of the index's)."""
    seconds: float
    """Expected wall time at ``tokens_per_s``."""
    tokens_per_s: float
    """This process's measured rate: a few timed batches at first, then the last exact pass's."""


@dataclass
class Timings:
    """Milliseconds spent per stage."""

    __pydantic_config__ = _DOCS

    query_forward: float
    """Tokenising, generating (if asked) and the query's forward pass."""
    candidates: float
    """First stages: which training rows to score."""
    score: float
    """Scoring the rows and ranking documents."""
    details: float
    """Snippets, highlights and prototypes of the returned documents."""
    total: float
    shortlist: float = 0.0
    """Of ``score``, fast mode: the candidates' tokens scored from the stored codes, documents shortlisted."""
    rerank: float = 0.0
    """Of ``score``, fast mode: the shortlisted sequences run through the model again, documents ranked."""
    influence: float = 0.0
    """Of ``details``, with ``influence``: the returned documents' full-model influence."""


@dataclass
class Attribution:
    """The answer to one query."""

    __pydantic_config__ = _DOCS

    mode: Mode
    aggregation: Aggregation
    damping: float
    """The damping used, x the index's damping unit."""
    query: QueryInfo
    documents: list[ScoredDocument]
    per_token: list[TokenView]
    timings_ms: Timings
    tokens_scored: int
    """Training tokens scored (fast: the candidates' tokens, approximately; exact: every token)."""
    missing_shards: list[int] = field(default_factory=list)
    """Shards that did not answer (only when the query allowed a partial answer; then the documents
    are the best of the other shards)."""
    tied_beyond_last: int = 0
    """Documents not returned whose score is within 0.1% of the n_documents-th best: the cut falls
    inside a near-tie when above 0, and which of the tied documents are returned is decided by
    ``tie_break`` (by default their summed cosines), not by the score. Counted among the documents
    scored exactly: every document in exact mode, the re-ranked ones (``documents_reranked``) in fast
    mode, so there it is a lower bound."""
    documents_reranked: int = 0
    """Documents scored exactly: fast, the shortlisted documents the model re-scored (at least
    n_documents, at most exact_rerank; fewer with adaptive_rerank); exact, every document."""
    opposed_by_influence: int = 0
    """With ``influence`` (without ``keep_opposed``): documents the score ranked among the first ``n_documents`` but left out
    because their full-model influence pushes the other way (negative for the documents that drove the
    output, positive with ``opponents``); the others keep their ranks' order."""
    opposed_by_value: int = 0
    """Without ``influence`` or ``keep_opposed``: documents the score ranked among the first
    ``n_documents`` but left out because their ``value`` pushes the other way (the same rule as
    ``opposed_by_influence``, by the prototype-space value)."""
    unsettled_beyond_last: int = 0
    """Of ``tied_beyond_last``, the documents whose summed cosines too are within 0.1% of the lowest
    returned from the near-tie: neither measure separates them from what was returned (typically the
    same text in several documents). 0 with ``tie_break: score``."""

    @property
    def partial(self) -> bool:
        """Whether some shards did not answer."""
        return bool(self.missing_shards)
