"""Scores of training tokens for a query, and of documents from their tokens' scores (DESIGN §2).

A training token t scores its prototype-space influence under the local curvature,

    s_t = sum_{i in K_t} a_{t,i} (G_i(q) / (lambda_i + lam)) . (Q^T u_t),

normalised to a cosine by ``sqrt(I(q, q) I(t, t))``. Two ways to get the token's quantities:

- **approximate**: from the index (activations on an 8-bit log scale, ``Q^T u_t`` decoded from its
  codes, ``I(t, t)`` as stored), cheap, for first stages and to shortlist documents;
- **exact**: recomputed by running the model over the token's sequence (full precision, as DESIGN's
  exact influence), for the shortlisted documents and for ``mode="exact"``.

A document's score aggregates its scored tokens' scores (``engine/aggregate.py``).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from prism_tda.errors import QueryError
from prism_tda.model import PRISM

from .aggregate import DocumentTotals
from .arrays import unique
from .curvature import self_influence
from .kernels import target_products
from .query import Query, Targets
from .reader import IndexReader, TokenData
from .reads import Reads
from .tokens import length_batches, run_batch

if TYPE_CHECKING:
    from .shards import Shortlist
from .types import Aggregation


@dataclass
class Preconditioner:
    """The curvature at one damping: ``inv`` (K, d) = diag (H_i + lam I)^{-1} in the Q basis."""

    damping: float  # x the index's damping unit (engine/curvature.py)
    inv: torch.Tensor
    is_index_default: bool  # the stored I(t, t) are at this damping

    @functools.cached_property
    def inv32(self) -> np.ndarray:
        """``inv`` as a contiguous float32 array (what the compiled scoring reads)."""
        return np.ascontiguousarray(self.inv.numpy(), dtype=np.float32)

    def self_influence(self, G: torch.Tensor) -> float:
        """I(q, q) of a query gradient G (K, d)."""
        return float((G * G * self.inv).sum())


class PreconditionerCache:
    """Preconditioners by damping for one index, the ``size`` most recently used kept (each holds K x d
    floats, so a cache keyed by a client's float must be bounded); thread-safe."""

    def __init__(self, reader: Reads, size: int = 8) -> None:
        self.reader, self.size = reader, size
        self._items: OrderedDict[float, Preconditioner] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, damping: float | None = None) -> Preconditioner:
        """The curvature at ``damping`` x the damping unit (None: the index's)."""
        default = self.reader.cfg.damping
        damping = default if damping is None else float(damping)
        if not damping > 0 or not np.isfinite(damping):
            raise QueryError(f"damping: must be a positive number, got {damping}")
        with self._lock:
            pre = self._items.pop(damping, None)
            if pre is None:
                pre = Preconditioner(damping, self.reader.inv(damping), damping == default)
            self._items[damping] = pre
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return pre


@dataclass
class TokenScores:
    """Scored tokens (global rows, ascending) and what carries their scores."""

    tok: np.ndarray  # (n,)
    raw: np.ndarray  # (n,) s_t
    cos: np.ndarray  # (n,) s_t / sqrt(I(q, q) I(t, t))
    protos: np.ndarray  # (n, k) the token's active prototypes
    slot_val: np.ndarray  # (n, k) each prototype's term a_{t,i} w_i . u_t (0 outside the query's prototypes)
    exact: bool  # recomputed by the model (else from the index's compressed values)
    match: np.ndarray | None = None  # (n, n_targets) each target token's own cosine (cosine_match)


def _query_columns(G: torch.Tensor, pre: Preconditioner) -> tuple[np.ndarray, torch.Tensor]:
    """(column of each prototype in Wq or -1, Wq (P, d) the preconditioned query columns)."""
    active = (G.abs().sum(1) > 0).nonzero().flatten()
    col = np.full(len(G), -1, dtype=np.int64)
    col[active.numpy()] = np.arange(len(active))
    return col, (G[active] * pre.inv[active]).float()


def score_tokens(tok: np.ndarray, protos: np.ndarray, acts: np.ndarray, U: torch.Tensor, t_self: np.ndarray,
                 G: torch.Tensor, pre: Preconditioner, exact: bool) -> TokenScores:
    """Token scores from their quantities: active prototypes (n, k), activations (n, k), token vectors
    ``Q^T u_t`` (n, d) and ``I(t, t)`` (n,), for the query gradient ``G`` (K, d) under ``pre``."""
    col, Wq = _query_columns(G, pre)
    c = col[protos]  # (n, k)
    hit = (c >= 0) & (acts > 0)
    M = (U.float() @ Wq.T).numpy()  # (n, P): one product per token and query prototype
    slot_val = np.zeros(protos.shape, dtype=np.float32)
    r, j = np.nonzero(hit)
    slot_val[r, j] = acts[r, j] * M[r, c[r, j]]
    raw = slot_val.sum(1).astype(np.float64)
    cos = raw / np.sqrt(max(pre.self_influence(G), 1e-30) * np.maximum(t_self, 1e-30))
    return TokenScores(tok, raw, cos, protos, slot_val, exact)


@dataclass
class TargetColumns:
    """Each target token's own preconditioned gradient columns, stacked: target j's column for
    prototype p is row ``col[j, p]`` of ``W`` (-1: p is not active on j); ``self_j`` = I(g_j, g_j)."""

    col: np.ndarray  # (n_targets, K)
    W: torch.Tensor  # (pairs, d)
    self_j: np.ndarray  # (n_targets,)

    @classmethod
    def of(cls, q: Query | Targets, pre: Preconditioner) -> TargetColumns:
        T, K = q.n_targets, pre.inv.shape[0]
        Gs = torch.stack([q.target_G(j) for j in range(T)])  # (T, K, d)
        Ws = Gs * pre.inv[None]
        live = Gs.abs().sum(2) > 0  # (T, K)
        j, p = live.nonzero(as_tuple=True)
        col = np.full((T, K), -1, dtype=np.int64)
        col[j.numpy(), p.numpy()] = np.arange(len(j))
        return cls(col, Ws[j, p].float(), (Ws * Gs).sum((1, 2)).double().numpy())


def target_raw(cols: TargetColumns, protos: np.ndarray, acts: np.ndarray, M: np.ndarray) -> np.ndarray:
    """(n, n_targets) each token's influence with each target token's own gradient, from ``M`` (n, pairs):
    each token's product with every (target, prototype) column of ``cols`` (compiled,
    ``kernels.target_products``)."""
    out = np.zeros((protos.shape[0], cols.col.shape[0]))
    target_products(cols.col, np.ascontiguousarray(protos), np.ascontiguousarray(acts), np.ascontiguousarray(M), out)
    return out


def match_cosines(protos: np.ndarray, acts: np.ndarray, U: torch.Tensor, t_self: np.ndarray, q: Query | Targets,
                  pre: Preconditioner, cols: TargetColumns | None = None) -> np.ndarray:
    """(n, n_targets): each token's cosine with each target token's own gradient (``cosine_match``):
    one product of the token vectors with every (target, prototype) column."""
    cols = cols or TargetColumns.of(q, pre)
    raw = target_raw(cols, protos, acts, (U.float() @ cols.W.T).numpy())
    return raw / np.sqrt(np.maximum(cols.self_j, 1e-30)[None, :] * np.maximum(t_self, 1e-30)[:, None])


def approx_match(reader: IndexReader, scores: TokenScores, data: TokenData, targets: Targets, pre: Preconditioner,
                 t_self: np.ndarray, U: torch.Tensor | None = None) -> np.ndarray:
    """(n, n_targets) approximate cosines of scored tokens with each target token's own gradient
    (``cosine_match``), from their decoded vectors (``U``: all of them, when the caller decoded them
    already); 0 for tokens that share no prototype with the query (their influence on every target
    token is 0). ``data``: the tokens' stored values, as read for ``scores``."""
    cols = TargetColumns.of(targets, pre)
    out = np.zeros((len(scores.tok), targets.n_targets))
    rows = np.nonzero((scores.slot_val != 0).any(1))[0]
    if len(rows):
        part = TokenData(data.protos[rows], data.acts[rows], data.self_influence[rows], data.targets[rows])
        Ur = U[torch.from_numpy(rows)] if U is not None else reader.token_vectors(scores.tok[rows], part)
        out[rows] = match_cosines(part.protos, part.acts, Ur, t_self[rows], targets, pre, cols)
    return out


def approx_scores(reader: IndexReader, G: torch.Tensor, pre: Preconditioner, tok: np.ndarray,
                  match: Targets | None = None) -> TokenScores:
    """Scores of the tokens ``tok`` (global rows, ascending) from the index's stored values.

    At the index's damping the token vectors are never decoded: with ``u_t = m_t - W[y_t]`` and
    ``m_t`` product-quantised, each query column's product with ``m_t`` is a sum of table lookups,
    one per sub-quantiser (asymmetric scoring), and its product with ``W[y_t]`` one lookup; only
    the tokens that share a prototype with the query are touched. A token stored by its direction
    (``engine/codec.py``) looks up the direction codebook's table and is scaled by its length, which
    needs its direction decoded: all of it in one compiled pass over the rows (``engine/kernels.py``).
    Other dampings need ``I(t, t)`` recomputed, so they decode. With
    ``match``, each token's cosine with each target token too (:func:`approx_match`)."""
    if not pre.is_index_default:
        data = reader.token_data(tok)
        U = reader.token_vectors(tok, data)
        t_self = self_influence(U, data.protos, data.acts, pre.inv)
        out = score_tokens(tok, data.protos, data.acts, U, t_self, G, pre, exact=False)
        if match is not None:
            out.match = approx_match(reader, out, data, match, pre, t_self, U)
        return out
    if not len(tok):
        return concat_scores([], reader.k, None if match is None else match.n_targets, exact=False)
    col, Wq = _query_columns(G, pre)
    # (n_sub, P, 2^bits), (P, V), and the direction codebook's (n_sub, P, 2^bits)
    m_tab, y_tab, d_tab = reader.codec.lookup_tables(Wq, directions=reader.codec.has_directions)
    data, slot_val = reader.scored_token_data(tok, col, m_tab.numpy(), y_tab.numpy(),
                                              None if d_tab is None else d_tab.numpy(), pre.inv32)
    raw = slot_val.sum(1).astype(np.float64)
    cos = raw / np.sqrt(max(pre.self_influence(G), 1e-30) * np.maximum(data.self_influence, 1e-30))
    out = TokenScores(tok, raw, cos, data.protos, slot_val, False)
    if match is not None:
        out.match = approx_match(reader, out, data, match, pre, data.self_influence)
    return out


def window_key(tokens: list[int] | np.ndarray, targets: list[int] | np.ndarray, positions: np.ndarray | None = None) -> bytes:
    """What a sequence's exact scores depend on besides the query: its input tokens, its targets and
    the positions scored (None: every one). Two sequences with one key score the same."""
    h = hashlib.blake2b(digest_size=16)
    for part in (tokens, targets, () if positions is None else positions):
        b = np.asarray(part, dtype=np.int64).tobytes()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


def exact_scores(model: PRISM, reader: Reads, G: torch.Tensor, pre: Preconditioner, seqs: np.ndarray, *,
                 tokens: np.ndarray | None = None, batch_size: int = 32, match: Query | None = None) -> TokenScores:
    """Scores of every token of the sequences ``seqs`` (or only of the global rows ``tokens``, which
    then name the sequences), recomputed by the model in full precision; with ``match``, also each
    token's cosine with each of that query's target tokens. Each sequence runs up to its last needed
    token, in batches of similar lengths (``tokens.length_batches``: at most ``batch_size`` full-length
    sequences' worth of padded tokens each). A window that repeats another's tokens, targets and scored
    positions (the same text indexed twice) runs once; its copies take its scores."""
    Q = reader.curv.Q
    if tokens is not None:
        tokens = unique(tokens)
        tok_seq = reader.seq_of_tokens(tokens)
        seqs = tok_seq
    seqs = unique(seqs)
    first, data = reader.sequences_tokens(seqs)
    positions = None
    if tokens is not None:
        positions = [tokens[tok_seq == s] - f for s, f in zip(seqs, first, strict=True)]
        ends = np.array([int(p.max()) + 1 for p in positions], dtype=np.int64)
    else:
        ends = np.array([len(t) for t, _ in data], dtype=np.int64)
    rep_of: dict[bytes, int] = {}
    rep = np.array([rep_of.setdefault(window_key(t, g, None if positions is None else positions[i]), i)
                    for i, (t, g) in enumerate(data)], dtype=np.int64)
    runs = np.flatnonzero(rep == np.arange(len(seqs)))
    parts = []
    for at in length_batches(ends[runs], batch_size * model.cfg.block_size):
        at = runs[np.sort(at)]
        toks, tgts = zip(*(data[i] for i in at), strict=True)
        tb = run_batch(model, list(toks), list(tgts), positions=None if positions is None else [positions[i] for i in at])
        ut = tb.u @ Q  # (n, d), rows ordered by sequence then position
        protos, acts = tb.proto_idx.numpy(), tb.acts.float().numpy()
        rows = first[at][tb.row.numpy()] + tb.pos.numpy()
        t_self = self_influence(ut, protos, acts, pre.inv)
        part = score_tokens(rows, protos, acts, ut, t_self, G, pre, exact=True)
        if match is not None:
            part.match = match_cosines(protos, acts, ut, t_self, match, pre)
        parts.append(part)
    out = concat_scores(parts, reader.k, None if match is None else match.n_targets)
    copies = np.flatnonzero(rep != np.arange(len(seqs)))
    if not len(copies):
        return out
    lo = np.searchsorted(out.tok, first[rep[copies]])
    hi = np.searchsorted(out.tok, first[rep[copies]] + ends[rep[copies]])
    take = [np.arange(a, b) for a, b in zip(lo, hi, strict=True)]
    at = np.concatenate(take)
    shift = np.repeat(first[copies] - first[rep[copies]], [len(t) for t in take])
    dup = TokenScores(out.tok[at] + shift, out.raw[at], out.cos[at], out.protos[at], out.slot_val[at], True,
                      None if out.match is None else out.match[at])
    return concat_scores([out, dup], reader.k, None if match is None else match.n_targets)


def concat_scores(parts: list[TokenScores], k: int, n_targets: int | None = None, exact: bool = True) -> TokenScores:
    """Token scores of disjoint parts as one, rows ascending (``k``, ``n_targets``, ``exact``: the
    shapes and kind of an empty answer)."""
    if not parts:
        return TokenScores(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros((0, k), np.int64),
                           np.zeros((0, k), np.float32), exact,
                           None if n_targets is None else np.zeros((0, n_targets)))
    tok = np.concatenate([p.tok for p in parts])
    order = np.argsort(tok, kind="stable")
    cat = {f: np.concatenate([getattr(p, f) for p in parts])[order] for f in ("raw", "cos", "protos", "slot_val")}
    m = None
    if parts[0].match is not None:
        m = np.concatenate([p.match for p in parts if p.match is not None])[order]
    return TokenScores(tok[order], cat["raw"], cat["cos"], cat["protos"], cat["slot_val"], parts[0].exact, m)


def token_docs(reader: Reads, scores: TokenScores) -> np.ndarray:
    return reader.doc_of_seqs(reader.seq_of_tokens(scores.tok))


def document_totals(reader: Reads, scores: TokenScores, sign: float, docs: np.ndarray | None = None) -> DocumentTotals:
    """The per-document totals of a list of scored tokens (``engine/aggregate.py``); a token is named
    by its position in ``scores`` (``docs``: each token's document, when the caller has them)."""
    return DocumentTotals.of_tokens(token_docs(reader, scores) if docs is None else docs, scores.cos, scores.raw, sign,
                                    scores.match)


def document_scores(reader: Reads, scores: TokenScores) -> dict[Aggregation, np.ndarray]:
    """Every document's score under each aggregation (0 where a document has no scored token)."""
    return document_totals(reader, scores, 1.0).expand(reader.n_docs, 1.0)


def _ranked(reader: Reads, scores: TokenScores, aggregation: Aggregation, sign: float,
            n: int, docs: np.ndarray | None = None) -> tuple[DocumentTotals, np.ndarray, np.ndarray, np.ndarray]:
    if aggregation == "cosine_match" and scores.match is None:
        raise ValueError("cosine_match needs the target tokens' cosines (TokenScores.match)")
    tot = document_totals(reader, scores, sign, docs)
    at, score, tie = tot.rank(aggregation, sign, n)
    return tot, tot.best_token(aggregation)[at], score, tie


def ranked_documents(reader: Reads, scores: TokenScores, aggregation: Aggregation, *, sign: float,
                     n: int, docs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(index into ``scores.tok`` of each document's best token, document score, tie-break measure) of
    the ``n`` best documents, best first (``DocumentTotals.rank``: the order parts ranked apart merge
    by, ``engine/shards.py``); ``docs``: each token's document, when the caller has them."""
    return _ranked(reader, scores, aggregation, sign, n, docs)[1:]


def rank_documents_with_ties(reader: Reads, scores: TokenScores, aggregation: Aggregation, *, opponents: bool,
                             n: int, with_tied: bool = False) -> tuple[list[tuple[int, float]], int]:
    """:func:`rank_documents` and how many documents of ``scores`` ranked after those score within 0.1%
    of the last one (``DocumentTotals.tied_beyond``); ``with_tied``: those documents ranked too, after
    the ``n`` (for ``settle_near_ties``)."""
    sign = -1.0 if opponents else 1.0
    tot, best, score, _ = _ranked(reader, scores, aggregation, sign, n)
    ties = tot.tied_beyond(aggregation, sign, n)
    if with_tied and ties:
        at, score, _ = tot.rank(aggregation, sign, n + ties)
        best = tot.best_token(aggregation)[at]
    return [(int(b), float(s)) for b, s in zip(best, score, strict=True)], ties


def rank_documents(reader: Reads, scores: TokenScores, aggregation: Aggregation, *, opponents: bool,
                   n: int) -> list[tuple[int, float]]:
    """The ``n`` best documents as (index into ``scores.tok`` of the document's best token, document
    score), best first; with ``opponents``, the most negative."""
    return rank_documents_with_ties(reader, scores, aggregation, opponents=opponents, n=n)[0]


def unit_keys(reader: Reads, units: list[tuple[np.ndarray, np.ndarray | None]]) -> list[bytes]:
    """One key per re-rank unit (its sequences, and the global rows to score in them or None for every
    row): units with one key hold the same windows scored at the same positions, so they re-rank to
    the same scores (``window_key``)."""
    seqs = np.concatenate([np.zeros(0, np.int64), *(np.asarray(u[0], np.int64) for u in units)])
    first, data = reader.sequences_tokens(seqs)
    out, at = [], 0
    for useqs, toks in units:
        h = hashlib.blake2b(digest_size=16)
        for _ in range(len(useqs)):
            tokens, targets = data[at]
            pos = None
            if toks is not None:
                lo = first[at]
                pos = toks[(toks >= lo) & (toks < lo + len(tokens))] - lo
            h.update(window_key(tokens, targets, pos))
            at += 1
        out.append(h.digest())
    return out


# x the largest approximation error seen among the re-ranked documents: 1 re-scores a quarter fewer
# documents than 2 where rankings tie, with the same agreement (bench/attribution/rerank_depth.py)
RERANK_MARGIN = 1.0


def reach(reader: Reads, exact: TokenScores, short: Shortlist, done: np.ndarray, aggregation: Aggregation,
          sign: float, n: int, band: float = 0.0, whole: dict[int, float] | None = None) -> float:
    """The ``sign`` x approximate score a document of ``short`` (the shortlist, best first by approximate
    score) must reach to possibly enter the top ``n``: the ``n``-th best exact score among ``done`` (the
    positions re-scored into ``exact``) less ``band`` x its size (a near-tie to settle reaches that far
    below it) and ``RERANK_MARGIN`` x the largest |exact - approximate| document score seen among them;
    -inf while fewer than ``n`` of them have an exact score. ``whole``: each re-scored document's score
    as the caller has it (a sum aggregation's, over the whole document) instead of from ``exact``."""
    if whole is not None:
        exact_of = {d: sign * v for d, v in whole.items()}
    else:
        tot = document_totals(reader, exact, sign)
        has = tot.best_token(aggregation) >= 0
        exact_of = dict(zip(tot.docs[has].tolist(), (sign * tot.scores(sign)[aggregation][has]).tolist(), strict=True))
    ex = np.array([exact_of.get(int(d), np.nan) for d in short.doc[done]])
    ok = ~np.isnan(ex)
    if ok.sum() < n:
        return -np.inf
    nth = np.sort(ex[ok])[::-1][n - 1]
    return float(nth - band * abs(nth) - RERANK_MARGIN * float(np.abs(ex[ok] - sign * short.score[done][ok]).max()))


# a sum aggregation's fast path scores each document over all of its windows: the shortlist from every
# window of the candidates' documents, the re-ranked ones by their whole sums (re-scored rows exact, the
# others from the codes); False: over the candidate windows and the re-ranked window only (the earlier
# rule, kept for bench/attribution/sum_aggregations.py)
WHOLE_DOCUMENT_SUMS = True

# the n best documents' best rows are copied to the candidate windows that hold the same text up to
# them, when those documents tie exactly (bench/attribution/prefix_copies.py measures the agreement with
# exact with and without)
PREFIX_COPIES = True
TIE_RTOL = 1e-6  # exact scores this close are one value computed in two batch shapes


def prefix_copies(reader: Reads, scores: TokenScores, seqs: np.ndarray, aggregation: Aggregation, sign: float,
                  n: int) -> TokenScores:
    """``scores`` and, where two of its ``n`` best documents tie exactly (the same score and tie-break
    up to float32 rounding, :data:`TIE_RTOL`: text they share, a licence header or a repeated
    document), the best row of each of the ``n`` best copied to every window of ``seqs`` that holds
    the same input tokens from its start through that row's position and the same target there (a
    window scored already takes the copy's values too, so shared text ties bitwise). The model is
    causal and reads each window from its own start, so it computes that position of such a window
    exactly as it did the row's: the copy's exact score is the row's own. Exact mode scores every
    copy and keeps the lowest document ids among equal scores; without the copies the fast path keeps
    whichever copies its shortlist happened to hold (their compressed scores differ in the last
    digits). Max aggregations only (a copied row is one token of its document, which a sum would
    undercount)."""
    if not aggregation.endswith("_max") or not len(scores.tok) or not len(seqs):
        return scores
    tot = document_totals(reader, scores, sign)
    at, score, tie = tot.rank(aggregation, sign, len(tot.docs))
    # equal up to float32 rounding: the re-rank runs windows in batches of different shapes
    same = np.isclose(score[:n, None], score[None, :], rtol=TIE_RTOL, atol=0) & \
        np.isclose(tie[:n, None], tie[None, :], rtol=TIE_RTOL, atol=0)
    if same.sum(1).max(initial=0) < 2:  # no other document ties with one of the n best
        return scores
    src = tot.best_token(aggregation)[at[:n]]  # positions in ``scores``
    rows = scores.tok[src]
    s_first, s_data = reader.sequences_tokens(reader.seq_of_tokens(rows))
    pos = rows - s_first
    c_first, c_data = reader.sequences_tokens(seqs)
    lens = np.array([len(t) for t, _ in c_data], dtype=np.int64)
    off = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    flat_t = np.concatenate([np.zeros(0, np.int64), *(t for t, _ in c_data)])
    flat_y = np.concatenate([np.zeros(0, np.int64), *(y for _, y in c_data)])
    take, dst = [], []
    for i, p in enumerate(pos):
        tk, tg = s_data[i]
        ok = np.flatnonzero(lens > p)
        ok = ok[(flat_t[off[ok] + p] == tk[p]) & (flat_y[off[ok] + p] == tg[p])]
        for c in ok:
            if np.array_equal(c_data[c][0][: p + 1], tk[: p + 1]):
                take.append(src[i])
                dst.append(c_first[c] + p)
    if not dst:
        return scores
    # each copy takes the best-ranked source's values (the first); a copy the re-rank scored already
    # takes them too, so that equal text ties exactly whatever batch it ran in
    dst_a, first = np.unique(np.array(dst, np.int64), return_index=True)
    take_a = np.array(take, np.int64)[first]
    at_s = np.searchsorted(scores.tok, dst_a)
    had = (at_s < len(scores.tok)) & (scores.tok[np.minimum(at_s, len(scores.tok) - 1)] == dst_a)
    out = TokenScores(scores.tok, scores.raw.copy(), scores.cos.copy(), scores.protos.copy(), scores.slot_val.copy(),
                      scores.exact, None if scores.match is None else scores.match.copy())
    for f in ("raw", "cos", "protos", "slot_val"):
        getattr(out, f)[at_s[had]] = getattr(scores, f)[take_a[had]]
    if out.match is not None and scores.match is not None:  # (both or neither: for the type checker)
        out.match[at_s[had]] = scores.match[take_a[had]]
    new, t = dst_a[~had], take_a[~had]
    if not len(new):
        return out
    copies = TokenScores(new, scores.raw[t], scores.cos[t], scores.protos[t], scores.slot_val[t], scores.exact,
                         None if scores.match is None else scores.match[t])
    return concat_scores([out, copies], reader.k, None if scores.match is None else scores.match.shape[1],
                         scores.exact)


def not_removed(reader: Reads, seqs: np.ndarray) -> np.ndarray:
    """The sequences of ``seqs`` whose documents were not taken down."""
    if not len(seqs) or not reader.takedown.any():
        return seqs
    return seqs[~reader.removed(reader.doc_of_seqs(seqs))]


def trained_only(reader: Reads, seqs: np.ndarray) -> np.ndarray:
    """The sequences of ``seqs`` whose documents the checkpoint trained on."""
    return seqs[reader.trained(reader.doc_of_seqs(seqs))] if len(seqs) else seqs
