"""A query, from text to its prototype-space gradient (DESIGN §2, "What a query is").

The prompt (and completion) are tokenised once; the query is checked against the model's context
before any work (so a generation that cannot fit is refused before it runs); then one forward
pass gives the target tokens' error signals and activations, hence

    G_i(q) = sum_{t in targets} a_{t,i} Q^T u_t        (K, u_dim), in the curvature basis Q

and the per-token view: each target token's logit split into its active prototypes' parts and
the residual's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from prism_tda.errors import PromptTooLongError, QueryError
from prism_tda.model import PRISM
from prism_tda.model.generate import generate
from prism_tda.model.tokenizer import eos_id

from .tokens import run_batch
from .types import QueryInfo, QuerySpec, TokenPrototype, TokenView


@dataclass
class Tokens:
    """A query's text as token ids, tokenised once."""

    prompt: list[int]
    completion: list[int] | None


@dataclass
class Targets:
    """Each target token's active prototypes, activations and ``Q^T u``: its own part of ``G``."""

    protos: torch.Tensor  # (n_targets, k)
    acts: torch.Tensor  # (n_targets, k)
    u: torch.Tensor  # (n_targets, u_dim)
    n_prototypes: int

    @property
    def n_targets(self) -> int:
        return len(self.protos)

    def target_G(self, j: int) -> torch.Tensor:
        """Target token ``j``'s part of ``G`` (K, u_dim): the gradient of its loss alone."""
        G = torch.zeros(self.n_prototypes, self.u.shape[1], dtype=self.u.dtype)
        G.index_add_(0, self.protos[j], self.acts[j, :, None] * self.u[j][None, :])
        return G


@dataclass
class Query:
    spec: QuerySpec
    token_ids: list[int]  # prompt + target, as run through the model
    n_prompt: int
    target_positions: list[int]  # positions whose next token is a target token
    target_ids: list[int]
    G: torch.Tensor  # (K, u_dim) prototype-space gradient in the Q basis
    per_token: list[TokenView]
    target_text: str
    # each target token's own part of G: its active prototypes, activations and Q^T u_t
    target_protos: torch.Tensor  # (n_targets, k)
    target_acts: torch.Tensor  # (n_targets, k)
    target_u: torch.Tensor  # (n_targets, u_dim)

    @property
    def n_targets(self) -> int:
        return len(self.target_ids)

    def target_G(self, j: int) -> torch.Tensor:
        """Target token ``j``'s part of ``G`` (K, u_dim): the gradient of its loss alone."""
        return self.targets.target_G(j)

    @property
    def targets(self) -> Targets:
        """The target tokens' own parts of ``G`` (what ``cosine_match`` needs where the shards are)."""
        return Targets(self.target_protos, self.target_acts, self.target_u, self.G.shape[0])

    @property
    def prototypes(self) -> torch.Tensor:
        """Ids of the prototypes active on some target token (the nonzero columns of G)."""
        return (self.G.abs().sum(1) > 0).nonzero().flatten()

    def info(self) -> QueryInfo:
        return QueryInfo(self.token_ids, self.n_prompt, self.target_ids, self.target_text)


class QueryEncoder:
    """Turns a :class:`QuerySpec` into a :class:`Query` with the model, its tokenizer and the index's
    curvature basis ``Q`` (the first ``u_dim`` coordinates are kept)."""

    def __init__(self, model: PRISM, tokenizer: Tokenizer, Q: torch.Tensor, u_dim: int) -> None:
        self.model, self.tokenizer, self.Q, self.u_dim = model, tokenizer, Q, u_dim

    @property
    def context(self) -> int:
        return self.model.cfg.block_size

    def tokenize(self, spec: QuerySpec) -> Tokens:
        return Tokens(self.tokenizer.encode(spec.prompt).ids if spec.prompt else [],
                      self.tokenizer.encode(spec.completion).ids if spec.completion is not None else None)

    def check(self, spec: QuerySpec, tokens: Tokens | None = None) -> Tokens:
        """Refuse, before any work, a query that cannot succeed: an empty prompt or completion, both a
        completion and a generation, or a prompt whose completion (or the most tokens generation may
        add) does not fit the context (prompt + target at most context + 1 tokens)."""
        tokens = tokens or self.tokenize(spec)
        n, ctx = len(tokens.prompt), self.context
        if n == 0:
            raise QueryError("prompt: is empty (no tokens)")
        if n > ctx:
            raise PromptTooLongError(f"prompt: {n} tokens; the model's context is {ctx}")
        if spec.completion is not None:  # (never with max_new_tokens: QuerySpec refuses both)
            if not tokens.completion:
                raise QueryError("completion: is empty (no tokens)")
            if n + len(tokens.completion) > ctx + 1:
                raise PromptTooLongError(f"prompt + completion: {n + len(tokens.completion)} tokens; the model's "
                                         f"context is {ctx}")
        if spec.max_new_tokens is not None and n + spec.max_new_tokens > ctx + 1:
            raise PromptTooLongError(f"prompt + max_new_tokens: {n} + {spec.max_new_tokens} tokens; the model's "
                                     f"context is {ctx} (at most {ctx + 1 - n} new tokens for this prompt)")
        return tokens

    def encode(self, spec: QuerySpec, stop: threading.Event | None = None) -> Query:
        """The query's tokens, target and prototype-space gradient; ``stop``: checked as a generated
        target is written (``Cancelled``)."""
        tok = self.check(spec)
        p_ids = tok.prompt
        if tok.completion is not None:
            c_ids = tok.completion
        elif spec.max_new_tokens:
            c_ids = generate(self.model, self.tokenizer, p_ids, spec.max_new_tokens, stop=stop).token_ids
        else:
            c_ids = []
        ids = p_ids + c_ids
        if c_ids:
            positions = list(range(len(p_ids) - 1, len(ids) - 1))
        else:  # no target: the prompt's own next-token predictions
            positions = list(range(len(ids) - 1)) or [0]
            if len(ids) == 1:
                ids = ids + [eos_id(self.tokenizer)]
        if spec.target_index is not None:
            if not 0 <= spec.target_index < len(positions):
                raise QueryError(f"target_index: {spec.target_index} is out of range [0, {len(positions)})")
            positions = [positions[spec.target_index]]
        inp, tgt = ids[:-1], ids[1:]
        targets = [tgt[p] for p in positions]
        # the target positions only (ascending): the rows of the batch are theirs, in order
        tb = run_batch(self.model, [inp], [tgt], positions=[np.asarray(positions, np.int64)])
        ut = (tb.u @ self.Q)[:, : self.u_dim]  # (n, u_dim) Q^T u_t of the target tokens
        a, idx = tb.acts.float(), tb.proto_idx  # (n, k)
        G = torch.zeros(self.model.cfg.n_prototypes, self.u_dim)
        for j in range(idx.shape[1]):  # k small: one scatter per active slot
            G.index_add_(0, idx[:, j], a[:, j : j + 1] * ut)
        return Query(spec, ids, len(p_ids), positions, targets, G, self._per_token(ids, positions, targets, tb.z),
                     self.tokenizer.decode(targets), idx, a, ut.float())

    def _per_token(self, ids: list[int], positions: list[int], targets: list[int],
                   hidden: torch.Tensor) -> list[TokenView]:
        d = self.model.decompose(torch.tensor(ids[:-1]), positions=torch.tensor(positions),
                                 tokens=torch.tensor(targets), hidden=hidden)
        out = []
        for n, (pos, y) in enumerate(zip(positions, targets, strict=True)):
            protos = [TokenPrototype(int(p), float(a), float(c))
                      for p, a, c in zip(d.proto_idx[n], d.acts[n], d.contrib[n], strict=True) if a > 0]
            out.append(TokenView(pos, y, self.tokenizer.decode([y]), float(d.logit[n]), float(d.residual[n]), protos))
        return out
