"""Exact attribution: every training token's score, recomputed by the model in full precision.

This is DESIGN §2's exact prototype-space influence over the whole corpus, token by token; it costs
a forward pass over the corpus (the index stores only compressed token vectors), so it is the
reference the fast path is measured against, not a served default. Many queries share one pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from prism_tda.model import PRISM

from .query import Query
from .reader import IndexReader
from .scoring import Preconditioner, _scores, best_of_groups, match_cosines, self_influence
from .tokens import run_batch
from .types import Aggregation


@dataclass
class DocumentTotals:
    """Per document: the best token by cosine and by raw influence, and the sums."""

    cosine_max: np.ndarray
    cosine_best_tok: np.ndarray
    cosine_sum: np.ndarray
    raw_max: np.ndarray
    raw_best_tok: np.ndarray
    raw_sum: np.ndarray
    cosine_best_raw: np.ndarray  # the raw influence of each document's best token by cosine (a tie-break)
    raw_best_cosine: np.ndarray  # the cosine of each document's best token by raw influence
    # cosine_match (when asked): per document and target token the best cosine (signed), and the
    # document's token closest to the whole target
    match_max: np.ndarray | None = None  # (n_docs, n_targets)
    match_best: np.ndarray | None = None  # (n_docs,) that token's mean cosine over the target tokens
    match_best_tok: np.ndarray | None = None
    match_best_raw: np.ndarray | None = None

    @classmethod
    def empty(cls, n_docs: int, sign: float, n_targets: int | None = None) -> DocumentTotals:
        low = np.full(n_docs, -np.inf)
        none = np.full(n_docs, -1, dtype=np.int64)
        tot = cls(low.copy(), none.copy(), np.zeros(n_docs), low.copy(), none.copy(), np.zeros(n_docs),
                  np.zeros(n_docs), np.zeros(n_docs))
        if n_targets is not None:
            tot.match_max = np.full((n_docs, n_targets), -np.inf)
            tot.match_best, tot.match_best_tok, tot.match_best_raw = low.copy(), none.copy(), np.zeros(n_docs)
        return tot

    def add_match(self, docs: np.ndarray, tok: np.ndarray, match: np.ndarray, raw: np.ndarray, sign: float) -> None:
        assert self.match_max is not None and self.match_best is not None
        assert self.match_best_tok is not None and self.match_best_raw is not None
        sm = sign * match
        np.maximum.at(self.match_max, (docs[:, None], np.arange(match.shape[1])[None, :]), sm)
        whole = sm.mean(1)
        top = best_of_groups(docs, whole)
        better = whole[top] > self.match_best[docs[top]]
        d = docs[top][better]
        self.match_best[d], self.match_best_tok[d], self.match_best_raw[d] = (
            whole[top][better], tok[top][better], raw[top][better])

    def add(self, docs: np.ndarray, tok: np.ndarray, cos: np.ndarray, raw: np.ndarray, sign: float) -> None:
        for kind, v, w, companion in (("cosine", cos, raw, "cosine_best_raw"), ("raw", raw, cos, "raw_best_cosine")):
            best, arg = getattr(self, f"{kind}_max"), getattr(self, f"{kind}_best_tok")
            sv = sign * v
            top = best_of_groups(docs, sv, sign * w)  # each document's best, ties by the other measure
            cur = best[docs[top]]
            better = (sv[top] > cur) | ((sv[top] == cur) & (sign * w[top] > sign * getattr(self, companion)[docs[top]]))
            best[docs[top][better]] = sv[top][better]
            arg[docs[top][better]] = tok[top][better]
            getattr(self, companion)[docs[top][better]] = w[top][better]
            getattr(self, f"{kind}_sum")[:] += np.bincount(docs, weights=v, minlength=len(best))

    def tie_break(self, aggregation: Aggregation) -> np.ndarray:
        """Per document, the measure that breaks ties of ``aggregation``'s score: raw influence for the
        cosine aggregations, the cosine for the raw ones."""
        if aggregation == "cosine_match":
            assert self.match_best_raw is not None, "cosine_match was not computed"
            return self.match_best_raw
        return {"cosine_max": self.cosine_best_raw, "cosine_sum": self.raw_sum,
                "raw_max": self.raw_best_cosine, "raw_sum": self.cosine_sum}[aggregation]

    def best_token(self, aggregation: Aggregation) -> np.ndarray:
        """Per document, the token shown for ``aggregation`` (-1: no scored token)."""
        if aggregation == "cosine_match":
            assert self.match_best_tok is not None, "cosine_match was not computed"
            return self.match_best_tok
        return self.cosine_best_tok if aggregation.startswith("cosine") else self.raw_best_tok

    def scores(self, sign: float) -> dict[Aggregation, np.ndarray]:
        def signed_max(v: np.ndarray) -> np.ndarray:
            out = sign * v
            out[~np.isfinite(out)] = 0.0
            return out

        out: dict[Aggregation, np.ndarray] = {"cosine_max": signed_max(self.cosine_max), "cosine_sum": self.cosine_sum,
                                              "raw_max": signed_max(self.raw_max), "raw_sum": self.raw_sum}
        if self.match_max is not None:
            m = self.match_max.copy()
            m[~np.isfinite(m)] = 0.0
            out["cosine_match"] = sign * m.mean(1)
        return out


def exhaustive(model: PRISM, reader: IndexReader, queries: list[Query], pre: Preconditioner, *, sign: float = 1.0,
               batch_size: int = 32, progress: bool = False, match: bool = False,
               on_batch: Callable[[int], object] | None = None) -> list[DocumentTotals]:
    """One pass of the model over every sequence of the index, scoring every token for each query;
    with ``match``, each target token apart as well (``cosine_match``: one more product per target)."""
    Q = reader.curv.Q
    totals = [DocumentTotals.empty(reader.n_docs, sign, q.n_targets if match else None) for q in queries]
    with tqdm(total=reader.n_tokens, desc="exact", unit="tok", unit_scale=True, disable=not progress) as bar:
        for b in range(0, reader.n_seqs, batch_size):
            seqs = np.arange(b, min(b + batch_size, reader.n_seqs))
            toks, tgts = zip(*(reader.sequence_tokens(int(s)) for s in seqs), strict=True)
            tb = run_batch(model, list(toks), list(tgts))
            ut = tb.u @ Q
            protos, acts = tb.proto_idx.numpy(), tb.acts.float().numpy()
            t_self = self_influence(ut, protos, acts, pre.inv)
            lo = reader.seq_span(int(seqs[0]))[0]
            rows = np.arange(lo, lo + len(t_self))
            docs = reader.doc_of_seqs(reader.seq_of_tokens(rows))
            for q, tot in zip(queries, totals, strict=True):
                s = _scores(rows, protos, acts, ut, t_self, q.G, pre, exact=True)
                tot.add(docs, rows, s.cos, s.raw, sign)
                if match:
                    tot.add_match(docs, rows, match_cosines(protos, acts, ut, t_self, q, pre), s.raw, sign)
            bar.update(len(rows))
            if on_batch is not None:
                on_batch(len(rows))
    return totals


def exact_document_scores(model: PRISM, reader: IndexReader, queries: list[Query], pre: Preconditioner,
                          **kw) -> list[dict[Aggregation, np.ndarray]]:
    """Every document's exact score under each aggregation, for each query, in one pass."""
    with torch.no_grad():
        return [t.scores(1.0) for t in exhaustive(model, reader, queries, pre, **kw)]
