"""The shard side of a query, and how parts answered apart merge into the one-process answer.

A fast-path query (``engine/attributor.py``) has two parts. The **coordinator** holds the model:
it encodes the query (one forward pass), plans the posting-list reads from the index-wide list
sizes, re-ranks the shortlisted documents exactly and presents them. The **shard side** holds the
per-token data: it searches its FAISS parts, reads and scores its posting lists, scores its
candidate sequences from the compressed values and shortlists its documents. A
:class:`ShardWorker` is that side for the shards one process has open: every shard in the
single-process server, some of them in each Ray actor of a cluster (``engine/cluster.py``).

Each step's parts merge by the same total order the one-process code ranks by (best score first,
then the tie-break measure, then the lower id), and every part returns at least as many items as
the merged answer keeps, so the merged answer is the one-process answer: the same documents with
the same scores. (The one exception is FAISS's own order among exactly equal similarities inside
one IVF search, which the merge cannot see.)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from prism_tda.errors import check_stop

from . import scoring
from .arrays import index_in, unique
from .candidates import PostingPlan, best_posting_tokens
from .query import Targets
from .reader import IndexReader
from .scoring import Preconditioner, TokenScores, approx_scores, not_removed, ranked_documents, trained_only
from .steering import PrototypeMass, mass_of_tokens, token_weights
from .types import Aggregation

# a shortlisted document's best rows in its other candidate sequences are re-scored where they could
# still reach the top (bench/attribution/rows_elsewhere.py measures the agreement with exact with and
# without them)
ROWS_ELSEWHERE = True

# cosine_match's fast path matches each target token over every window of a document: the shortlist
# scores every window of the candidates' documents from the codes, and re-ranks each shortlisted document
# in the windows that hold, for some target token, one of its MATCH_ROWS best rows by approximate match
# cosine; False: over the candidate windows only, all of them re-ranked (the earlier rule, kept for
# bench/attribution/match_windows.py)
WHOLE_DOCUMENT_MATCH = True
MATCH_ROWS = 2


@dataclass
class Shortlist:
    """The best documents of some shards by their approximate scores, best first, with what the
    exact re-rank of each needs."""

    doc: np.ndarray  # (n,) global document ids
    score: np.ndarray  # (n,) document score (signed as ranked: see ``sign``)
    tie: np.ndarray  # (n,) the measure that breaks equal scores
    best_seq: np.ndarray  # (n,) the sequence of the document's best token
    tokens: list[np.ndarray]  # per document: its best sequence's rows to re-score (empty: all of them)
    match_seqs: list[np.ndarray]  # per document: the windows to re-rank it in (cosine_match), else empty
    n_scored: int = 0  # tokens scored approximately
    # per document: its best rows in its other candidate sequences (its best token by exact score can sit
    # there), re-scored when their best approximate score could still reach the top; and that score
    more: list[np.ndarray] = field(default_factory=list)
    more_score: list[np.ndarray] = field(default_factory=list)  # per document: each of those rows' score

    def order_key(self, sign: float) -> tuple[np.ndarray, ...]:
        """The keys of ``np.lexsort`` that rank these documents best first."""
        return (self.doc, -(sign * self.tie), -(sign * self.score))


def merge_shortlists(parts: list[Shortlist], n: int, sign: float) -> Shortlist:
    """The ``n`` best documents over parts scored apart, in the order one process ranks them."""
    n_scored = sum(p.n_scored for p in parts)
    parts = [p for p in parts if len(p.doc)]
    if not parts:
        return Shortlist(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0, np.int64), [], [], n_scored)
    cat = Shortlist(np.concatenate([p.doc for p in parts]), np.concatenate([p.score for p in parts]),
                    np.concatenate([p.tie for p in parts]), np.concatenate([p.best_seq for p in parts]),
                    [t for p in parts for t in p.tokens], [s for p in parts for s in p.match_seqs], 0,
                    [r for p in parts for r in p.more], [v for p in parts for v in p.more_score])
    top = np.lexsort(cat.order_key(sign))[:n]
    return Shortlist(cat.doc[top], cat.score[top], cat.tie[top], cat.best_seq[top], [cat.tokens[i] for i in top],
                     [cat.match_seqs[i] for i in top], n_scored, [cat.more[i] for i in top], [cat.more_score[i] for i in top])


def merge_search(parts: list[tuple[np.ndarray, np.ndarray]], n: int) -> np.ndarray:
    """The ``n`` sequences of the highest similarity over FAISS parts searched apart."""
    parts = [p for p in parts if len(p[1])]
    if not parts:
        return np.zeros(0, np.int64)
    sc, seqs = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return seqs[np.lexsort((seqs, -sc))[:n]]


def merge_best_tokens(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], n: int) -> np.ndarray:
    """The sequences of the ``n`` best-scoring posting tokens over parts read apart (each part:
    rows, cosines, sequences)."""
    parts = [p for p in parts if len(p[0])]
    if not parts:
        return np.zeros(0, np.int64)
    tok, cos, seq = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return seq[np.lexsort((tok, -cos))[:n]]


def merge_document_sums(parts: list[tuple[np.ndarray, np.ndarray]], n: int) -> np.ndarray:
    """The ``n`` documents of the highest sums over parts read apart (each part: documents, sums; a
    document's rows lie in one shard, so its sum is in one part), highest first (equal: lower id)."""
    parts = [p for p in parts if len(p[0])]
    if not parts or n <= 0:
        return np.zeros(0, np.int64)
    docs, total = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return docs[np.lexsort((docs, -total))[:n]]


@dataclass
class Sequences:
    """What the coordinator reads of some sequences and their documents: enough to re-score them with
    the model and to present them, without opening their shards."""

    seq: np.ndarray  # (n,) global sequence ids
    first: np.ndarray  # (n,) first global token row
    end: np.ndarray  # (n,) end row
    start: np.ndarray  # (n,) start position in the document
    doc: np.ndarray  # (n,) global document id
    tokens: list[np.ndarray]  # per sequence: input token ids
    targets: list[np.ndarray]  # per sequence: the token each position predicts
    doc_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # documents described below
    external_id: list[str] = field(default_factory=list)
    trained: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))


@dataclass
class CallContext:
    """One query's dealings with the shard holders: whether a partial answer is allowed, and the
    shards that did not answer (then)."""

    partial: bool = False
    missing: set[int] = field(default_factory=set)
    candidates_ms: float = 0.0  # the first stages' time (the answer's timings)
    shortlist_ms: float = 0.0  # scoring the candidates' tokens from the codes, shortlisting documents
    rerank_ms: float = 0.0  # the exact re-rank (the model over the shortlisted sequences) and ranking

    def answered(self, ids: np.ndarray, base: np.ndarray) -> np.ndarray:
        """Which of ``ids`` (global sequence or token ids; ``base``: each shard's first id) lie in a
        shard that answered."""
        gone = np.array(sorted(self.missing), dtype=np.int64)
        return ~np.isin(np.searchsorted(base, ids, side="right") - 1, gone)


@dataclass
class CallStats:
    """One shard-side call: when it started (epoch seconds), how long it ran, and the rows it scored."""

    method: str
    started: float
    seconds: float
    rows: int


def rank_in_runs(grp: np.ndarray) -> np.ndarray:
    """Each element's position within its run of equal values of ``grp`` (0 for a run's first)."""
    start = np.r_[0, np.nonzero(grp[1:] != grp[:-1])[0] + 1] if len(grp) else np.zeros(0, np.int64)
    return np.arange(len(grp)) - np.repeat(start, np.diff(np.r_[start, len(grp)]))


def best_rows_per_sequence(reader: IndexReader, approx: TokenScores, seqs: np.ndarray, m: int, sign: float,
                           tok_seq: np.ndarray | None = None) -> list[np.ndarray]:
    """For each sequence of ``seqs``, the rows (ascending) of its ``m`` best tokens among ``approx``
    by ``sign`` x approximate cosine (equal cosines: the lower row), in one sort of the rows of all of
    them (``tok_seq``: each row's sequence, when the caller has it)."""
    tok_seq = reader.seq_of_tokens(approx.tok) if tok_seq is None else tok_seq
    at = np.nonzero(np.isin(tok_seq, seqs))[0]
    at = at[np.lexsort((approx.tok[at], -(sign * approx.cos[at]), tok_seq[at]))]
    grp = tok_seq[at]
    rank = rank_in_runs(grp)
    at, grp = at[rank < m], grp[rank < m]
    bounds = np.searchsorted(grp, seqs, side="left"), np.searchsorted(grp, seqs, side="right")
    return [np.sort(approx.tok[at[a:b]]) for a, b in zip(*bounds, strict=True)]


def best_match_windows(approx: TokenScores, tok_seq: np.ndarray, tok_doc: np.ndarray, docs: np.ndarray,
                       sign: float, r: int) -> list[np.ndarray]:
    """For each document of ``docs``, the sequences (ascending) that hold, for some target token, one of
    its ``r`` best rows among ``approx`` by ``sign`` x approximate cosine with that target (``approx.match``;
    rows equal to an r-th best count too)."""
    assert approx.match is not None, "cosine_match was not computed"
    if not len(docs):
        return []
    at = np.nonzero(np.isin(tok_doc, docs))[0]
    at = at[np.argsort(tok_doc[at], kind="stable")]
    grp = tok_doc[at]
    if not len(at):
        return [np.zeros(0, np.int64) for _ in docs]
    start = np.r_[0, np.nonzero(grp[1:] != grp[:-1])[0] + 1]
    run = np.repeat(np.arange(len(start)), np.diff(np.r_[start, len(grp)]))
    sm = sign * np.asarray(approx.match[at], np.float64)
    keep = np.zeros(sm.shape, dtype=bool)
    for _ in range(r):  # each pass: every document's best remaining row per target token
        best = np.maximum.reduceat(sm, start, axis=0)
        hit = (sm == best[run]) & np.isfinite(sm)
        keep |= hit
        sm = np.where(hit, -np.inf, sm)
    rows = keep.any(1)
    pair = np.unique(np.stack([grp[rows], tok_seq[at][rows]], 1), axis=0) if rows.any() \
        else np.zeros((0, 2), np.int64)
    bounds = np.searchsorted(pair[:, 0], docs, side="left"), np.searchsorted(pair[:, 0], docs, side="right")
    return [pair[a:b, 1].astype(np.int64) for a, b in zip(*bounds, strict=True)]


def best_rows_elsewhere(reader: IndexReader, approx: TokenScores, docs: np.ndarray, best_seq: np.ndarray,
                        m: int | np.ndarray, sign: float, value: np.ndarray, tok_seq: np.ndarray | None = None,
                        tok_doc: np.ndarray | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """For each document of ``docs`` (distinct), the rows of its ``m`` best tokens (``m``: one number,
    or one per document) among ``approx`` outside its best sequence ``best_seq`` by ``sign`` x ``value``
    (each row's approximate cosine or raw score; equal values: the lower row), best first, and their
    values, in one sort (``tok_seq``, ``tok_doc``: each row's sequence and document, when the caller has
    them)."""
    tok_seq = reader.seq_of_tokens(approx.tok) if tok_seq is None else tok_seq
    tok_doc = reader.doc_of_seqs(tok_seq) if tok_doc is None else tok_doc
    order = np.argsort(docs, kind="stable")
    at = np.minimum(np.searchsorted(docs[order], tok_doc), max(len(docs) - 1, 0))
    keep = np.nonzero((docs[order][at] == tok_doc) & (best_seq[order][at] != tok_seq))[0] if len(docs) \
        else np.zeros(0, np.int64)
    keep = keep[np.lexsort((approx.tok[keep], -(sign * value[keep]), tok_doc[keep]))]
    grp = tok_doc[keep]
    rank = rank_in_runs(grp)
    cap = m if np.isscalar(m) else np.asarray(m)[order][np.searchsorted(docs[order], grp)]
    keep, grp = keep[rank < cap], grp[rank < cap]
    bounds = np.searchsorted(grp, docs, side="left"), np.searchsorted(grp, docs, side="right")
    return ([approx.tok[keep[a:b]] for a, b in zip(*bounds, strict=True)],
            [np.asarray(value[keep[a:b]], np.float64) for a, b in zip(*bounds, strict=True)])


class ShardWorker:
    """The shard side of queries over the shards that one process opens."""

    def __init__(self, reader: IndexReader) -> None:
        self.reader = reader
        self.last: CallStats | None = None
        self.warm()

    def warm(self) -> None:
        """Compile the scoring kernel (``engine/kernels.py``) now, on one stored token, rather than in
        the first query (once per process; numba keeps the machine code on disk after the first time)."""
        r = self.reader
        held = [s for s, sh in r.held_shards() if sh.info.n_tokens]
        if not held:
            return
        G = torch.zeros(r.curv.lam.shape[0], r.curv.u_dim)
        G[0, 0] = 1.0
        approx_scores(r, G, Preconditioner(r.cfg.damping, r.inv(r.cfg.damping), True),
                      np.array([r.tok_base[held[0]]], np.int64))

    @classmethod
    def open(cls, index_dir: str | Path, W: torch.Tensor, shards: list[int] | None = None) -> ShardWorker:
        """A worker over the shards at positions ``shards`` of an index (default: all)."""
        return cls(IndexReader(index_dir, W, shards))

    @property
    def held(self) -> list[int]:
        return list(self.reader.held)

    def _done(self, method: str, t0: float, started: float, rows: int) -> None:
        self.last = CallStats(method, started, time.perf_counter() - t0, rows)

    # ------------------------------------------------------------------------ first stages
    def first_stages(self, e: np.ndarray | None, n: int, nprobe: int | None, G: torch.Tensor, pre: Preconditioner,
                     plan: PostingPlan | None, n_tokens: int, sums: str | None = None) -> tuple[tuple, tuple, tuple]:
        """Both first stages in one call: ((similarities, sequences) of the ``n`` nearest by FAISS,
        (rows, approximate cosines, sequences) of the ``n_tokens`` best tokens of the planned posting
        lists, (documents, sums) of the rows read under ``sums``: "raw" or "cosine", else empty); a stage
        whose input is None answers nothing."""
        t0, started = time.perf_counter(), time.time()
        none: tuple = (np.zeros(0), np.zeros(0, np.int64))
        found = self.reader.search_embedding(e, n, nprobe) if e is not None and n > 0 else none
        post = none + (np.zeros(0, np.int64),)
        summed: tuple = (np.zeros(0, np.int64), np.zeros(0))
        if plan is not None and n_tokens > 0:
            tok, cos, docs, total = best_posting_tokens(self.reader, G, pre, plan, n_tokens, sums)
            post, summed = (tok, cos, self.reader.seq_of_tokens(tok)), (docs, total)
        self._done("first_stages", t0, started, len(post[0]))
        return found, post, summed

    # ------------------------------------------------------------------------ shortlist
    def shortlist(self, G: torch.Tensor, pre: Preconditioner, seqs: np.ndarray, aggregation: Aggregation, *,
                  opponents: bool, n: int, m: int | None, match: Targets | None,
                  include_untrained: bool, whole: bool = True) -> Shortlist:
        """The ``n`` best documents among the candidate sequences ``seqs`` (all in this worker's
        shards) by their approximate scores under ``aggregation``; for each, the rows of its best
        sequence to re-score exactly (the ``m`` best by approximate cosine; None: all) and its ``m`` best
        rows in its other candidate sequences (``Shortlist.more``), or with ``match`` (the query's
        target tokens, for ``cosine_match``) the windows that hold its best matches of the target tokens
        (:data:`WHOLE_DOCUMENT_MATCH`). A sum aggregation and ``cosine_match`` score every window of the
        candidates' documents, not only the candidate windows (``whole`` False: ``cosine_match`` over the
        candidate windows only)."""
        t0, started = time.perf_counter(), time.time()
        reader = self.reader
        seqs = unique(np.asarray(seqs, np.int64))
        whole_match = match is not None and WHOLE_DOCUMENT_MATCH and whole
        # a sum is over the whole document, and a target token's best match can sit in any window of it:
        # every window of a candidate's document
        sign = -1.0 if opponents else 1.0
        if (aggregation.endswith("_sum") and scoring.WHOLE_DOCUMENT_SUMS) or whole_match:
            seqs = reader.sequences_of_documents(reader.doc_of_seqs(seqs))
        if not include_untrained:
            seqs = trained_only(reader, seqs)
        seqs = not_removed(reader, seqs)
        approx = approx_scores(reader, G, pre, reader.rows_of_sequences(seqs), match=match)
        tok_seq = reader.seq_of_tokens(approx.tok)  # each scored row's sequence and document, read once
        tok_doc = reader.doc_of_seqs(tok_seq)
        best, score, tie = ranked_documents(reader, approx, aggregation, sign=sign, n=n, docs=tok_doc)
        best_seq, docs = tok_seq[best], tok_doc[best]
        tokens = best_rows_per_sequence(reader, approx, best_seq, m, sign, tok_seq) if m is not None and len(best_seq) \
            else [np.zeros(0, np.int64) for _ in best_seq]
        match_seqs = [np.zeros(0, np.int64) for _ in best_seq]
        more, more_score = [np.zeros(0, np.int64) for _ in best_seq], [np.zeros(0) for _ in best_seq]
        if match is not None and len(best_seq) and whole_match:
            match_seqs = best_match_windows(approx, tok_seq, tok_doc, docs, sign, MATCH_ROWS)
        elif match is not None and len(best_seq):
            seq_docs = reader.doc_of_seqs(seqs)
            match_seqs = [seqs[seq_docs == d] for d in docs]
        elif len(best_seq) and aggregation.endswith("_max") and ROWS_ELSEWHERE:
            if m is None:  # every row of the best sequence re-scored: as many rows elsewhere, at most
                seen, count = np.unique(tok_seq, return_counts=True)
                cap: int | np.ndarray = count[np.searchsorted(seen, best_seq)]
            else:
                cap = m
            more, more_score = best_rows_elsewhere(reader, approx, docs, best_seq, cap, sign,
                                                   approx.cos if aggregation.startswith("cosine") else approx.raw,
                                                   tok_seq, tok_doc)
        self._done("shortlist", t0, started, len(approx.tok))
        return Shortlist(docs, score, tie, best_seq, tokens, match_seqs, len(approx.tok), more, more_score)

    # ------------------------------------------------------------------------ documents' values
    def document_values(self, G: torch.Tensor, pre: Preconditioner, docs: np.ndarray,
                        skip: np.ndarray) -> np.ndarray:
        """Per document of ``docs`` (all in this worker's shards, in the order given): its tokens'
        approximate raw influences ``s_t`` and their cosines, each summed over every row of it but those
        in ``skip`` (rows the caller holds exact scores of): (len(docs), 2)."""
        t0, started = time.perf_counter(), time.time()
        reader = self.reader
        docs = np.asarray(docs, np.int64)
        rows = reader.rows_of_documents(docs)
        rows = rows[~np.isin(rows, np.asarray(skip, np.int64))]
        out = np.zeros((len(docs), 2))
        if len(rows):
            approx = approx_scores(reader, G, pre, rows)
            at = index_in(docs, reader.doc_of_seqs(reader.seq_of_tokens(approx.tok)))
            for j, v in enumerate((approx.raw, approx.cos)):
                out[:, j] = np.bincount(at, weights=np.asarray(v, np.float64), minlength=len(docs))
        self._done("document_values", t0, started, len(rows))
        return out

    # ------------------------------------------------------------------------ reads
    def sequences(self, seqs: np.ndarray) -> Sequences:
        """The sequences ``seqs`` (all in this worker's shards) and their documents' descriptions."""
        t0, started = time.perf_counter(), time.time()
        r = self.reader
        seqs = np.asarray(seqs, np.int64)
        spans = [r.seq_span(int(s)) for s in seqs]
        toks = [r.sequence_tokens(int(s)) for s in seqs]
        docs = r.doc_of_seqs(seqs)
        uniq = unique(docs)
        out = Sequences(seqs, np.array([a for a, _, _ in spans], np.int64), np.array([b for _, b, _ in spans], np.int64),
                        np.array([c for _, _, c in spans], np.int64), docs,
                        [np.asarray(t, np.int32) for t, _ in toks], [np.asarray(y, np.int32) for _, y in toks],
                        uniq, [r.external_id(int(d)) for d in uniq], r.trained(uniq))
        self._done("sequences", t0, started, 0)
        return out

    def seq_of_tokens(self, tok: np.ndarray) -> np.ndarray:
        return self.reader.seq_of_tokens(np.asarray(tok, np.int64))

    def sequences_of_documents(self, docs: np.ndarray) -> np.ndarray:
        return self.reader.sequences_of_documents(np.asarray(docs, np.int64))

    def trained(self, docs: np.ndarray) -> np.ndarray:
        return self.reader.trained(np.asarray(docs, np.int64))

    def document(self, doc: int) -> dict[str, Any]:
        return self.reader.document(int(doc))

    def top_contexts(self, proto: int, n: int) -> list[tuple[int, float]]:
        return self.reader.top_contexts(int(proto), int(n))

    def prototype_mass(self, docs: np.ndarray, measure: str = "activation", signature: torch.Tensor | None = None,
                       chunk: int = 1 << 18, stop: threading.Event | None = None) -> PrototypeMass:
        """The mass of the documents ``docs`` (all in this worker's shards) under ``measure``
        (``engine/steering.py``: activation, or the positive logit share with the (K, V) ``signature``),
        from the stored activations; ``where`` of a token is its global row. ``stop``: checked between
        chunks (``Cancelled``)."""
        t0, started = time.perf_counter(), time.time()
        r = self.reader
        rows = r.rows_of_documents(np.asarray(docs, np.int64))
        out = PrototypeMass.empty(r.n_prototypes)
        for b in range(0, len(rows), chunk):
            check_stop(stop, "prototype discovery")
            part = rows[b : b + chunk]
            data = r.token_data(part)
            weights = token_weights(data.protos, data.acts, data.targets, measure, signature)
            out = out + mass_of_tokens(data.protos, weights, r.doc_of_seqs(r.seq_of_tokens(part)), r.n_prototypes,
                                       part)
        out.n_docs = len(unique(docs))
        self._done("prototype_mass", t0, started, len(rows))
        return out

    def list_sizes(self) -> np.ndarray:
        return self.reader.open_list_sizes()


def place_shards(sizes: list[int], n_groups: int) -> list[list[int]]:
    """Shard positions for each of ``n_groups`` holders, balanced by size: the largest shard first to
    the holder with the least so far (each holder's list ascending). Empty holders are dropped."""
    load = [0] * n_groups
    out: list[list[int]] = [[] for _ in range(n_groups)]
    for s in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = min(range(n_groups), key=lambda j: (load[j], j))
        out[g].append(s)
        load[g] += sizes[s]
    return [sorted(g) for g in out if g]


class ShardSet(Protocol):
    """Whoever holds the shards, as the coordinator sees them: merged answers of every holder. The
    curvature travels as the coordinator's :class:`Preconditioner` (a holder in another process gets
    its damping and resolves it once there, ``engine/cluster.py``)."""

    def first_stages(self, e: np.ndarray | None, n: int, nprobe: int | None, G: torch.Tensor, pre: Preconditioner,
                     plan: PostingPlan | None, n_tokens: int, ctx: CallContext | None = None,
                     sums: str | None = None, n_summed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def shortlist(self, G: torch.Tensor, pre: Preconditioner, seqs: np.ndarray, aggregation: Aggregation, *,
                  opponents: bool, n: int, m: int | None, match: Targets | None, include_untrained: bool,
                  ctx: CallContext | None = None, whole: bool = True) -> Shortlist: ...

    def document_values(self, G: torch.Tensor, pre: Preconditioner, docs: np.ndarray, skip: np.ndarray,
                        ctx: CallContext | None = None) -> np.ndarray: ...

    def prototype_mass(self, docs: np.ndarray, measure: str = "activation",
                       signature: torch.Tensor | None = None, stop: threading.Event | None = None) -> PrototypeMass: ...

    def close(self) -> None: ...


class LocalShards:
    """Every shard in this process: one worker, answers as they are (the default)."""

    def __init__(self, reader: IndexReader) -> None:
        self.worker = ShardWorker(reader)

    def first_stages(self, e: np.ndarray | None, n: int, nprobe: int | None, G: torch.Tensor, pre: Preconditioner,
                     plan: PostingPlan | None, n_tokens: int, ctx: CallContext | None = None,
                     sums: str | None = None, n_summed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        found, post, summed = self.worker.first_stages(e, n, nprobe, G, pre, plan, n_tokens, sums)
        return merge_search([found], n), merge_best_tokens([post], n_tokens), merge_document_sums([summed], n_summed)

    def shortlist(self, G: torch.Tensor, pre: Preconditioner, seqs: np.ndarray, aggregation: Aggregation, *,
                  opponents: bool, n: int, m: int | None, match: Targets | None, include_untrained: bool,
                  ctx: CallContext | None = None, whole: bool = True) -> Shortlist:
        part = self.worker.shortlist(G, pre, seqs, aggregation, opponents=opponents, n=n, m=m, match=match,
                                     include_untrained=include_untrained, whole=whole)
        return merge_shortlists([part], n, -1.0 if opponents else 1.0)

    def document_values(self, G: torch.Tensor, pre: Preconditioner, docs: np.ndarray, skip: np.ndarray,
                        ctx: CallContext | None = None) -> np.ndarray:
        return self.worker.document_values(G, pre, docs, skip)

    def prototype_mass(self, docs: np.ndarray, measure: str = "activation",
                       signature: torch.Tensor | None = None, stop: threading.Event | None = None) -> PrototypeMass:
        return self.worker.prototype_mass(docs, measure, signature, stop=stop)

    def close(self) -> None:
        pass
