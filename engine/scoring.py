"""Scores of training tokens for a query, and of documents from their tokens' scores (DESIGN §2).

A training token t scores its prototype-space influence under the local curvature,

    s_t = sum_{i in K_t} a_{t,i} (G_i(q) / (lambda_i + lam)) . (Q^T u_t),

normalised to a cosine by ``sqrt(I(q, q) I(t, t))``. A document's score aggregates its scored
tokens: the best token's cosine (``cosine_max``, the default), the sum of its cosines, or the best
or summed raw influence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .reader import IndexReader
from .types import Aggregation


@dataclass
class Preconditioner:
    """The curvature at one damping: ``inv`` (K, u_dim) = diag (H_i + lam I)^{-1} in the Q basis."""

    damping: float  # x the mean curvature eigenvalue
    inv: torch.Tensor
    is_index_default: bool  # I(t, t) of every token is precomputed at this damping

    def self_influence(self, G: torch.Tensor) -> float:
        """I(q, q) of a query gradient G (K, u_dim)."""
        return float((G * G * self.inv).sum())


@dataclass
class TokenScores:
    """The tokens behind a set of activation rows, and their scores."""

    rows: np.ndarray  # the activation rows scored
    tok: np.ndarray  # the distinct token rows among them, ascending
    raw: np.ndarray  # s_t per token
    cos: np.ndarray  # s_t / sqrt(I(q, q) I(t, t))
    row_val: np.ndarray  # each activation row's term a_{t,i} w_i . u_t
    row_owner: np.ndarray  # activation row -> index into ``tok``


def score_rows(reader: IndexReader, G: torch.Tensor, pre: Preconditioner, rows: np.ndarray) -> TokenScores:
    """Influence and cosine of the tokens behind activation ``rows`` for query gradient G."""
    active = (G.abs().sum(1) > 0).nonzero().flatten()
    Wq = (G[active] * pre.inv[active]).float()  # (P, u_dim) preconditioned query columns
    col = np.full(len(G), -1, dtype=np.int64)
    col[active.numpy()] = np.arange(len(active))
    row_tok = reader.row_tok[rows]
    tok, owner = np.unique(row_tok, return_inverse=True)
    c = col[reader.row_proto[rows]]
    hit = c >= 0
    val = np.zeros(len(rows), dtype=np.float32)
    if len(tok) * len(active) <= 8 * len(rows):
        # many rows per token (a candidate's whole sequences): one product per token and prototype
        M = (torch.from_numpy(reader.u[tok]).float() @ Wq.T).numpy()  # (n_tok, P)
        val[hit] = reader.row_act[rows[hit]] * M[owner[hit], c[hit]]
    else:  # about one row per token (posting lists): one dot per row, in chunks to bound memory
        idx = np.nonzero(hit)[0]
        for k in range(0, len(idx), 1 << 16):
            sl = idx[k : k + (1 << 16)]
            u = torch.from_numpy(reader.u[row_tok[sl]]).float()
            val[sl] = reader.row_act[rows[sl]] * (u * Wq[torch.from_numpy(c[sl])]).sum(1).numpy()
    raw = np.bincount(owner, weights=val, minlength=len(tok))
    t_self = reader.tok_self[tok] if pre.is_index_default else reader.token_self_influence(tok, pre.inv)
    cos = raw / np.sqrt(max(pre.self_influence(G), 1e-30) * np.maximum(t_self, 1e-30))
    return TokenScores(rows, tok, raw, cos, val, owner)


def document_scores(reader: IndexReader, scores: TokenScores) -> dict[Aggregation, np.ndarray]:
    """Every document's score under each aggregation (0 where a document has no scored token)."""
    docs = reader.seq_doc[reader.tok_seq[scores.tok]].astype(np.int64)
    def best(v: np.ndarray) -> np.ndarray:
        out = np.full(reader.n_docs, -np.inf)
        np.maximum.at(out, docs, v)
        out[~np.isfinite(out)] = 0.0
        return out

    def total(v: np.ndarray) -> np.ndarray:
        return np.bincount(docs, weights=v, minlength=reader.n_docs)

    return {"cosine_max": best(scores.cos), "cosine_sum": total(scores.cos),
            "raw_max": best(scores.raw), "raw_sum": total(scores.raw)}


def rank_documents(reader: IndexReader, scores: TokenScores, aggregation: Aggregation, *, opponents: bool,
                   n: int) -> list[tuple[int, float]]:
    """The ``n`` best documents as (index into ``scores.tok`` of the document's best token, document
    score), best first; with ``opponents``, the most negative."""
    sign = -1.0 if opponents else 1.0
    per_token = scores.cos if aggregation.startswith("cosine") else scores.raw
    docs = reader.seq_doc[reader.tok_seq[scores.tok]]
    order = np.lexsort((-(sign * per_token), docs))  # by document, best token first
    first = np.ones(len(order), dtype=bool)
    first[1:] = docs[order][1:] != docs[order][:-1]
    best = order[first]  # each document's best token
    if aggregation.endswith("_max"):
        doc_score = per_token[best]
    else:
        _, doc_index = np.unique(docs, return_inverse=True)
        doc_score = np.bincount(doc_index, weights=per_token)[doc_index[best]]
    top = np.argsort(-(sign * doc_score), kind="stable")[:n]
    return [(int(best[i]), float(doc_score[i])) for i in top]
