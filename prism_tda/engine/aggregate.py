"""Document scores from token scores: the one implementation (DESIGN §2, aggregation).

A document's score aggregates its scored tokens' scores: the best token's cosine (``cosine_max``,
the default), the sum of its cosines (``cosine_sum``), the best or summed raw influence
(``raw_max``, ``raw_sum``), or ``cosine_match``: for each target token the document's best cosine,
averaged over the target tokens. Ties of a score are broken by the other measure (raw influence for
the cosine aggregations, the cosine for the raw ones), then by the lower document id, so parts
ranked apart merge into the same order (``engine/shards.py``).

:class:`DocumentTotals` accumulates those per document over batches of tokens (the exact pass reads
the corpus a batch at a time); every ranking and every per-document score of the engine comes from
it: the fast path's shortlist and re-rank, exact mode, and the evaluation's document scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arrays import unique
from .kernels import best_in_runs
from .types import Aggregation

NEAR_TIE = 1e-3  # scores within 0.1% of each other are reported as tied


def near(a: np.ndarray | float, b: float) -> np.ndarray:
    """Whether ``a`` lies within :data:`NEAR_TIE` (relative to ``b``) of ``b``."""
    return np.abs(np.asarray(a, np.float64) - b) <= NEAR_TIE * abs(b)


@dataclass(frozen=True)
class Settled:
    """:func:`settle_near_ties`'s answer: ``order`` (positions, best first, at most ``n``), ``tied_beyond``
    (documents left out whose score is within :data:`NEAR_TIE` of the ``n``-th best) and, of those,
    ``unsettled`` (their second measure too is within it of the lowest taken from the near-tie)."""

    order: np.ndarray
    tied_beyond: int
    unsettled: int


def settle_near_ties(score: np.ndarray, second: np.ndarray, n: int, sign: float = 1.0) -> Settled:
    """The ``n`` documents an answer returns when the score cannot separate them at the cut: of a list
    ranked best first by ``sign * score``, those scoring more than :data:`NEAR_TIE` above the ``n``-th
    best keep their places, and the rest of the ``n`` come from the documents within it of the
    ``n``-th best (the near-tie), by ``sign * second`` (ties of both: the score's order), kept in the
    score's order. The list must hold every document of that near-tie (``DocumentTotals.tied_beyond``
    counts those after the ``n``-th)."""
    s, v = sign * np.asarray(score, np.float64), sign * np.asarray(second, np.float64)
    if len(s) <= n or n < 1:
        return Settled(np.arange(min(len(s), max(n, 0))), 0, 0)
    last = float(s[n - 1])
    band = np.flatnonzero(near(s, last))
    above = np.flatnonzero(s > last + NEAR_TIE * abs(last))
    room = n - len(above)
    by_second = band[np.argsort(-v[band], kind="stable")]
    taken, left = by_second[:room], by_second[room:]
    floor = float(v[taken[-1]])
    return Settled(np.concatenate([above, np.sort(taken)]), len(left), int(near(v[left], floor).sum()))


def best_of_groups(groups: np.ndarray, value: np.ndarray, tie: np.ndarray | None = None) -> np.ndarray:
    """Positions of each group's element with the highest ``value`` (among equals, the highest
    ``tie``), one per group, groups ascending."""
    if len(groups) == 0:
        return np.zeros(0, dtype=np.int64)
    if bool(np.all(groups[1:] >= groups[:-1])):  # runs (tokens in row order): one compiled pass
        return best_in_runs(groups, np.asarray(value, np.float64),
                            np.zeros(len(groups)) if tie is None else np.asarray(tie, np.float64))
    order = np.lexsort((-value, groups) if tie is None else (-tie, -value, groups))
    g = groups[order]
    return order[np.r_[True, g[1:] != g[:-1]]]


@dataclass
class DocumentTotals:
    """Per document of ``docs`` (ascending ids): the best token by cosine and by raw influence (kept
    signed: the best by ``sign``), the sums, and for ``cosine_match`` the best cosine per target token.
    A token is named by what the caller passes as ``tok`` (a global row, or a position in a list)."""

    docs: np.ndarray  # (D,) the documents, ascending
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
    match_max: np.ndarray | None = None  # (D, n_targets)
    match_best: np.ndarray | None = None  # (D,) that token's mean cosine over the target tokens
    match_best_tok: np.ndarray | None = None
    match_best_raw: np.ndarray | None = None

    @classmethod
    def empty(cls, docs: np.ndarray, n_targets: int | None = None) -> DocumentTotals:
        n = len(docs)
        low = np.full(n, -np.inf)
        none = np.full(n, -1, dtype=np.int64)
        tot = cls(np.asarray(docs, np.int64), low.copy(), none.copy(), np.zeros(n), low.copy(), none.copy(),
                  np.zeros(n), np.zeros(n), np.zeros(n))
        if n_targets is not None:
            tot.match_max = np.full((n, n_targets), -np.inf)
            tot.match_best, tot.match_best_tok, tot.match_best_raw = low.copy(), none.copy(), np.zeros(n)
        return tot

    @classmethod
    def of_tokens(cls, docs: np.ndarray, cos: np.ndarray, raw: np.ndarray, sign: float,
                  match: np.ndarray | None = None) -> DocumentTotals:
        """The totals of one list of scored tokens (``docs``: each token's document); a token is named by
        its position in the list."""
        tot = cls.empty(unique(docs), None if match is None else match.shape[1])
        pos = np.arange(len(docs), dtype=np.int64)
        tot.add(docs, pos, cos, raw, sign)
        if match is not None:
            tot.add_match(docs, pos, match, raw, sign)
        return tot

    def _local(self, docs: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.docs, docs)

    def add(self, docs: np.ndarray, tok: np.ndarray, cos: np.ndarray, raw: np.ndarray, sign: float) -> None:
        """Take in scored tokens (``docs``: each one's document, one of ``self.docs``)."""
        at = self._local(docs)
        n = len(self.docs)
        for kind, v, w, companion in (("cosine", cos, raw, "cosine_best_raw"), ("raw", raw, cos, "raw_best_cosine")):
            best, arg = getattr(self, f"{kind}_max"), getattr(self, f"{kind}_best_tok")
            sv = sign * v
            top = best_of_groups(at, sv, sign * w)  # each document's best, ties by the other measure
            cur = best[at[top]]
            better = (sv[top] > cur) | ((sv[top] == cur) & (sign * w[top] > sign * getattr(self, companion)[at[top]]))
            best[at[top][better]] = sv[top][better]
            arg[at[top][better]] = tok[top][better]
            getattr(self, companion)[at[top][better]] = w[top][better]
            getattr(self, f"{kind}_sum")[:] += np.bincount(at, weights=v, minlength=n)

    def add_match(self, docs: np.ndarray, tok: np.ndarray, match: np.ndarray, raw: np.ndarray, sign: float) -> None:
        """Take in scored tokens' cosines with each target token (``cosine_match``)."""
        assert self.match_max is not None and self.match_best is not None
        assert self.match_best_tok is not None and self.match_best_raw is not None
        at = self._local(docs)
        sm = sign * match
        if len(at):  # each document's best per target token: one sort by document and a reduction per run
            order = np.argsort(at, kind="stable")
            grp = at[order]
            start = np.r_[0, np.nonzero(grp[1:] != grp[:-1])[0] + 1]
            d = grp[start]
            self.match_max[d] = np.maximum(self.match_max[d], np.maximum.reduceat(sm[order], start, axis=0))
        whole = sm.mean(1)
        top = best_of_groups(at, whole)
        better = whole[top] > self.match_best[at[top]]
        d = at[top][better]
        self.match_best[d], self.match_best_tok[d], self.match_best_raw[d] = (
            whole[top][better], tok[top][better], raw[top][better])

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
        """Per document, its score under each aggregation computed (0 where it has no scored token)."""
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

    def rank(self, aggregation: Aggregation, sign: float, n: int,
             keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions in ``docs``, scores, tie-break measures) of the ``n`` best documents with a scored
        token (and ``keep`` true), best first: by ``sign * score``, then ``sign * tie``, then the lower
        document id."""
        ok = self.best_token(aggregation) >= 0
        if keep is not None:
            ok &= keep
        scored = np.nonzero(ok)[0]
        score = self.scores(sign)[aggregation][scored]
        tie = self.tie_break(aggregation)[scored]
        top = np.lexsort((-(sign * tie), -(sign * score)))[:n]
        return scored[top], np.asarray(score[top], np.float64), np.asarray(tie[top], np.float64)

    def tied_beyond(self, aggregation: Aggregation, sign: float, n: int, keep: np.ndarray | None = None) -> int:
        """How many documents ranked after the ``n`` best score within :data:`NEAR_TIE` (relative) of the
        ``n``-th best: a cut inside a near-tie when above 0."""
        _, score, _ = self.rank(aggregation, sign, len(self.docs), keep)
        if len(score) <= n or n < 1:
            return 0
        return int(near(score[n:], score[n - 1]).sum())

    def expand(self, n_docs: int, sign: float) -> dict[Aggregation, np.ndarray]:
        """:meth:`scores` as arrays over every document id of the index (0 for the others)."""
        out = {}
        for k, v in self.scores(sign).items():
            full = np.zeros(n_docs)
            full[self.docs] = v
            out[k] = full
        return out
