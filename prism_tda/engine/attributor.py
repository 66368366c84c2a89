"""The attribution engine's front door: which training documents drove an output (DESIGN §2).

One forward pass over the query gives its prototype-space gradient (``query.py``). The fast path
(the default):

1. first stages pick candidate sequences, sublinear in the corpus (``candidates.py``);
2. their tokens are scored from the index's compressed values and the best ``exact_rerank``
   documents shortlisted (``scoring.approx_scores``);
3. the shortlisted documents' best sequences are run through the model again and scored exactly,
   and the documents ranked by those exact scores (``scoring.exact_scores``), so every returned
   score is DESIGN's exact influence.

``mode="exact"`` scores every token of the corpus exactly (one forward pass over it: the reference
the fast path is measured against, ``exact.py``). Results are presented by ``present.py``.

    att = Attributor.open("runs/demo/index")
    res = att.attribute(QuerySpec("A computer", " is a machine"), QueryOptions(n_documents=5))
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from prism_tda.errors import PrismError, QueryError, check_stop

from . import layout, scoring
from . import shards as shards_module
from .aggregate import NEAR_TIE, near, settle_near_ties
from .arrays import index_in, unique
from .candidates import FirstStages, posting_plan
from .exact import exhaustive, measure_rate
from .influence import EKFAC, document_influence
from .layout import IndexManifest
from .present import left_out_opposed, scored_document
from .query import Query, QueryEncoder
from .reader import IndexReader
from .reads import Reads, load_index_checkpoint, read_complete_manifest
from .scoring import (
    Preconditioner,
    PreconditionerCache,
    TokenScores,
    approx_scores,
    concat_scores,
    document_scores,
    document_totals,
    exact_scores,
    not_removed,
    prefix_copies,
    rank_documents_with_ties,
    reach,
    token_docs,
    trained_only,
    unit_keys,
)
from .shards import CallContext, LocalShards, ShardSet
from .steering import MEASURES, Discovered, PrototypeMass, rank_prototypes, signature_matrix, text_mass

if TYPE_CHECKING:
    from .cluster import ClusterSpec
from .types import (
    AGGREGATIONS,
    Aggregation,
    Attribution,
    ExactEstimate,
    Mode,
    QueryOptions,
    QuerySpec,
    Timings,
)

# cosine_match's first stages also read each target token's own posting lists: its MATCH_TARGET_TOKENS
# best tokens join the candidates, each target reading a MATCH_TARGET_BUDGET_DIVISOR-th of the rows the
# whole query may read (0: the whole query's stages only; bench/attribution/match_windows.py measures both)
MATCH_TARGET_TOKENS = 128
MATCH_TARGET_BUDGET_DIVISOR = 4
# and its shortlist takes every window of the n best documents by their match over the candidate windows
# only (a first shortlist, merged over the shard holders as any is), not of every candidate's document
# (the per-target candidates make that several times dearer)
MATCH_SHORTLIST_FIRST = True
# a sum aggregation's first stages also take every window of the SUM_DOCUMENTS documents whose rows read
# from the posting lists sum highest under it (the rows the token stage scores anyway; 0: the best tokens'
# windows only; bench/attribution/sum_aggregations.py measures both)
SUM_DOCUMENTS = 256


class Attributor:
    """An index, the checkpoint it was built from, and the queries it answers."""

    def __init__(self, index_dir: str | Path, *, checkpoint: str | Path | None = None,
                 stages: FirstStages | None = None, exact_token_limit: int | None = None,
                 cluster: ClusterSpec | None = None) -> None:
        """``exact_token_limit``: refuse ``mode="exact"`` on indexes with more tokens (it runs the model
        over all of them). ``cluster``: hold the shards in Ray actors of that cluster
        (``engine/cluster.py``) instead of this process."""
        manifest = read_complete_manifest(Path(index_dir))
        self.model, self.tokenizer, ck_config = load_index_checkpoint(Path(index_dir), manifest, checkpoint)
        self.model.eval()
        self.shards: ShardSet
        self.reader: Reads
        if cluster is None:
            local = IndexReader(index_dir, self.model.W)
            self.reader, self.shards = local, LocalShards(local)
        else:
            from .cluster import RayShards, RemoteReader

            ray_shards = RayShards(index_dir, checkpoint or manifest.checkpoint, cluster)
            self.reader, self.shards = RemoteReader(index_dir, self.model.W, ray_shards), ray_shards
        self.stages = stages or FirstStages()
        self.exact_token_limit = exact_token_limit
        self._exact_rate: float | None = None  # tokens/s of the exact pass here: measured, then the last pass's
        self.encoder = QueryEncoder(self.model, self.tokenizer, self.reader.curv.Q, self.reader.curv.u_dim)
        self._pre = PreconditionerCache(self.reader)
        self._corpus_mass: PrototypeMass | None = None
        self._logit_mass: PrototypeMass | None = None  # the corpus under measure="logit": one pass, kept
        self._logit_lock = threading.Lock()
        self._ekfac: EKFAC | None = None

    @classmethod
    def open(cls, index_dir: str | Path, **kw) -> Attributor:
        return cls(index_dir, **kw)

    @property
    def manifest(self) -> IndexManifest:
        return self.reader.manifest

    def local_reader(self, what: str) -> IndexReader:
        """The reader of every shard in this process (for work that reads the shards' own data here);
        an error naming ``what`` when a cluster holds them."""
        if not isinstance(self.shards, LocalShards):
            raise PrismError(f"{what}: reads every shard in this process; open the index without a cluster")
        return self.shards.worker.reader

    def close(self) -> None:
        """Let go of the shard holders (a cluster's actors) and of the shards' open files; the index files
        stay as they are."""
        self.shards.close()
        self.reader.close()

    def preconditioner(self, damping: float | None = None) -> Preconditioner:
        """The curvature at ``damping`` x the index's damping unit (default: the index's)."""
        return self._pre.get(damping)

    def encode(self, spec: QuerySpec, stop: threading.Event | None = None) -> Query:
        return self.encoder.encode(spec, stop)

    def candidate_sequences(self, q: Query, n_candidates: int = 0, pre: Preconditioner | None = None,
                            nprobe: int | None = None, ctx: CallContext | None = None,
                            opponents: bool = False, per_target: bool = False, sums: str | None = None) -> np.ndarray:
        """The sequences the fast path's first stages pick for an encoded query: the ``n_candidates``
        nearest by FAISS (0: none), and those of the best tokens of the query's posting lists (``pre``:
        the curvature, default the index's); ``opponents``: those pointing the most against the query;
        ``per_target`` (``cosine_match``): also those of each target token's own best tokens
        (:data:`MATCH_TARGET_TOKENS`); ``sums`` ("raw" or "cosine", the sum aggregations): also every
        window of the :data:`SUM_DOCUMENTS` documents whose rows read from the posting lists sum highest."""
        pre = pre or self.preconditioner()
        # every first stage is linear in the query's gradient: the most opposed to G are the best for -G
        sign = -1.0 if opponents else 1.0
        G = sign * q.G
        e = self.reader.query_embedding(G * pre.inv.sqrt()) if n_candidates > 0 else None
        st = self.stages
        token_stage = st.proto_candidates > 0 and st.token_candidates > 0
        plan = posting_plan(self.reader, G, pre, st) if token_stage else None
        summing = sums if SUM_DOCUMENTS > 0 else None
        found, posted, summed = self.shards.first_stages(e, n_candidates, nprobe, G, pre, plan,
                                                         st.token_candidates if token_stage else 0, ctx,
                                                         sums=summing, n_summed=SUM_DOCUMENTS if summing else 0)
        parts = [found, posted]
        if len(summed):
            parts.append(self.reader.sequences_of_documents(summed))
        if per_target and token_stage and MATCH_TARGET_TOKENS > 0 and q.n_targets > 1:
            # cosine_match matches each target token on its own: a document that matches every target
            # token well need not hold one token close to the whole query
            each = dataclasses.replace(st, row_budget=max(1, st.row_budget // MATCH_TARGET_BUDGET_DIVISOR))
            for j in range(q.n_targets):
                Gj = sign * q.target_G(j)
                plan_j = posting_plan(self.reader, Gj, pre, each)
                if plan_j is not None:
                    parts.append(self.shards.first_stages(None, 0, nprobe, Gj, pre, plan_j, MATCH_TARGET_TOKENS, ctx)[1])
        return unique(np.concatenate(parts))

    def check_exact(self) -> None:
        if self.exact_token_limit is not None and self.reader.n_tokens > self.exact_token_limit:
            raise QueryError(f"mode: 'exact' runs the model over every training token ({self.reader.n_tokens:,} "
                             f"here, over this server's limit of {self.exact_token_limit:,}); use 'fast'")

    def exact_estimate(self) -> ExactEstimate:
        """What ``mode="exact"`` costs on this index here, before it starts: the tokens it recomputes and
        the seconds at this process's rate (timed on a few batches the first time, then the rate of the
        last exact pass)."""
        if self._exact_rate is None:
            self._exact_rate = measure_rate(self.model, self.reader, self.preconditioner())
        n = self.reader.n_tokens
        return ExactEstimate(n, n / self._exact_rate, self._exact_rate)

    def _fast(self, q: Query, opt: QueryOptions, pre: Preconditioner, ctx: CallContext | None = None,
              seqs: np.ndarray | None = None) -> tuple[TokenScores, int, list, int, int, np.ndarray | None]:
        """(exact token scores, tokens scored approximately, ranked (best token, score), ties beyond the
        last, documents re-ranked, under a sum aggregation the ranked documents' (value, cosine_sum)
        sums, else None); ``seqs``: the candidates when the caller has them already."""
        t0 = time.perf_counter()
        if seqs is None:
            by_sums = {"raw_sum": "raw", "cosine_sum": "cosine"}.get(opt.aggregation) if scoring.WHOLE_DOCUMENT_SUMS \
                else None
            seqs = self.candidate_sequences(q, opt.sketch_candidates, pre, opt.nprobe, ctx, opponents=opt.opponents,
                                            per_target=opt.aggregation == "cosine_match", sums=by_sums)
        if ctx is not None:
            ctx.candidates_ms = 1e3 * (time.perf_counter() - t0)
        # the shortlist ranks the approximate scores under the query's aggregation (cosine_match: each
        # target token's cosines from the decoded token vectors)
        m = opt.exact_tokens if opt.aggregation.endswith("_max") else None
        match = q if opt.aggregation == "cosine_match" else None
        scored_first = 0  # rows scored by a first shortlist
        if match is not None and shards_module.WHOLE_DOCUMENT_MATCH and MATCH_SHORTLIST_FIRST:
            # the best documents by their match over the candidate windows, then every window of those
            first = self.shards.shortlist(q.G, pre, seqs, opt.aggregation, opponents=opt.opponents,
                                          n=max(opt.exact_rerank, opt.n_documents), m=None, match=match.targets,
                                          include_untrained=opt.include_untrained, ctx=ctx, whole=False)
            seqs = seqs[np.isin(self.reader.doc_of_seqs(seqs), first.doc)]
            scored_first = first.n_scored
        short = self.shards.shortlist(q.G, pre, seqs, opt.aggregation, opponents=opt.opponents,
                                      n=max(opt.exact_rerank, opt.n_documents), m=m,
                                      match=None if match is None else match.targets,
                                      include_untrained=opt.include_untrained, ctx=ctx)
        t1 = time.perf_counter()
        if ctx is not None:
            ctx.shortlist_ms = 1e3 * (t1 - t0) - ctx.candidates_ms
        # what re-ranking each shortlisted document takes: the rows of its best sequence to re-score
        # (None: every row), or with cosine_match the windows of its best matches of the target tokens (a
        # target token's best match can sit in any window of the document)
        units = [(short.match_seqs[i] if match is not None else short.best_seq[i : i + 1],
                  None if m is None else short.tokens[i]) for i in range(len(short.doc))]
        # and each document's best rows in its other candidate sequences (its exact best token can sit
        # in any of them), re-scored only where they could still reach the top
        more, more_score = list(short.more), list(short.more_score)
        self.reader.prefetch(unique(np.concatenate([np.zeros(0, np.int64), *(u[0] for u in units)])), ctx)
        if ctx is not None and ctx.missing:  # a partial answer: what the missing shards hold is left out
            seq_base, tok_base = self.reader.seq_base, self.reader.tok_base
            units = [(sq[ctx.answered(sq, seq_base)], None if tk is None else tk[ctx.answered(tk, tok_base)])
                     for sq, tk in units]
            kept = [ctx.answered(r, tok_base) for r in more]
            more, more_score = [r[k] for r, k in zip(more, kept, strict=True)], \
                [v[k] for v, k in zip(more_score, kept, strict=True)]

        def rescore(at: np.ndarray) -> TokenScores:
            seqs = np.concatenate([np.zeros(0, np.int64), *(units[i][0] for i in at)])
            toks = None if m is None else np.concatenate([np.zeros(0, np.int64), *(units[i][1] for i in at)])
            return exact_scores(self.model, self.reader, q.G, pre, seqs, tokens=toks, match=match)

        n_units, sign = len(units), -1.0 if opt.opponents else 1.0
        band = NEAR_TIE if opt.tie_break == "cosine_sum" else 0.0  # a near-tie at the cut is settled: find all of it
        open_rows = [np.ones(len(r), dtype=bool) for r in more]  # rows elsewhere not re-scored yet

        def refine(bar: float) -> TokenScores | None:
            """Re-score the rows elsewhere of the re-scored documents that reach ``bar``."""
            take = []
            for i in done:
                hit = open_rows[i] & (sign * more_score[i] >= bar)
                if hit.any():
                    take.append(more[i][hit])
                    open_rows[i] &= ~hit
            if not take:
                return None
            return exact_scores(self.model, self.reader, q.G, pre, np.zeros(0, np.int64), tokens=np.concatenate(take),
                                match=match)

        # adaptive: the first n_documents distinct windows (a window indexed more than once, the same text
        # in several documents, re-ranks once for all its copies), then only those whose approximate score
        # (of the document, or of its rows elsewhere) could still reach the n-th exact one within the
        # approximation's error as seen on the re-ranked ones
        keys = unit_keys(self.reader, units)

        def with_copies(of: set[bytes]) -> np.ndarray:
            return np.array([i for i, k in enumerate(keys) if k in of], dtype=np.int64)

        done = with_copies(set(list(dict.fromkeys(keys))[: opt.n_documents])) if opt.adaptive_rerank \
            else np.arange(n_units)
        parts = [rescore(done)]
        # a sum aggregation scores the whole document: its re-scored window exact, its other rows from the
        # codes (as its value); per re-scored document, (raw, cosine) sums
        summed = opt.aggregation.endswith("_sum") and scoring.WHOLE_DOCUMENT_SUMS
        whole: dict[int, tuple[float, float]] = {}

        def whole_sums(scores: TokenScores) -> dict[int, float]:
            new = np.array(sorted({int(d) for d in short.doc[done]} - set(whole)), np.int64)
            if len(new):
                sums = self._document_sums(q, pre, scores, new, ctx)
                whole.update(zip(new.tolist(), map(tuple, sums.tolist()), strict=True))
            col = 0 if opt.aggregation == "raw_sum" else 1
            return {d: v[col] for d, v in whole.items()}

        while True:
            so_far = concat_scores(parts, self.reader.k)
            bar = reach(self.reader, so_far, short, done, opt.aggregation, sign, opt.n_documents, band,
                        whole_sums(so_far) if summed else None) if opt.adaptive_rerank else -np.inf
            rest = np.setdiff1d(np.arange(n_units), done)
            rest = rest[sign * short.score[rest] >= bar]
            if len(rest):
                rest = np.setdiff1d(with_copies({keys[i] for i in rest}), done)  # with their copies
                parts.append(rescore(rest))
                done = np.concatenate([done, rest])
                continue
            elsewhere = refine(bar)  # once no other document can reach the top
            if elsewhere is None:
                break
            parts.append(elsewhere)
        exact = concat_scores(parts, self.reader.k, None if match is None else match.n_targets)
        if scoring.PREFIX_COPIES and m is not None:  # exact ties: every candidate window holding the same text
            exact = prefix_copies(self.reader, exact, self._copy_targets(seqs, opt, ctx), opt.aggregation, sign,
                                  opt.n_documents)
        # with the rest of the near-tie at the cut, for it to be settled
        sums = None
        if summed:
            whole_sums(exact)
            ranked, ties, sums = self._rank_whole(exact, whole, opt, sign)
        else:
            ranked, ties = rank_documents_with_ties(self.reader, exact, opt.aggregation, opponents=opt.opponents,
                                                    n=opt.n_documents, with_tied=opt.tie_break == "cosine_sum")
        if ctx is not None:
            ctx.rerank_ms = 1e3 * (time.perf_counter() - t1)
        return exact, short.n_scored + scored_first, ranked, ties, len(done), sums

    def _rank_whole(self, exact: TokenScores, whole: dict[int, tuple[float, float]], opt: QueryOptions,
                    sign: float) -> tuple[list[tuple[int, float]], int, np.ndarray]:
        """The fast path's ranking under a sum aggregation: the re-scored documents by their whole sums
        (``whole``: per document its (raw, cosine) sums), then the other sum, then the lower document id;
        as :func:`rank_documents_with_ties` gives it, each document shown by its best re-scored token,
        and the ranked documents' sums."""
        tot = document_totals(self.reader, exact, sign)
        best = tot.best_token(opt.aggregation)
        # the documents with a re-scored token to show (every one of them, but in a partial answer)
        ok = (best >= 0) & np.isin(tot.docs, np.fromiter(whole, np.int64, len(whole)))
        docs, best = tot.docs[ok], best[ok]
        sums = np.array([whole[int(d)] for d in docs], np.float64).reshape(-1, 2)
        score, tie = (sums[:, 0], sums[:, 1]) if opt.aggregation == "raw_sum" else (sums[:, 1], sums[:, 0])
        order = np.lexsort((docs, -(sign * tie), -(sign * score)))
        n = opt.n_documents
        ties = int(near(score[order[n:]], float(score[order[n - 1]])).sum()) if len(order) > n else 0
        take = order[: n + (ties if opt.tie_break == "cosine_sum" else 0)]
        return [(int(b), float(s)) for b, s in zip(best[take], score[take], strict=True)], ties, sums[take]

    def _copy_targets(self, seqs: np.ndarray, opt: QueryOptions, ctx: CallContext | None) -> np.ndarray:
        """The candidate windows a tied row may be copied to: those the shortlist could rank (trained
        unless asked otherwise, not taken down, in a shard that answered)."""
        seqs = unique(np.asarray(seqs, np.int64))
        if ctx is not None and ctx.missing:
            seqs = seqs[ctx.answered(seqs, self.reader.seq_base)]
        if not opt.include_untrained:
            seqs = trained_only(self.reader, seqs)
        return not_removed(self.reader, seqs)

    def _exhaustive(self, q: Query, opt: QueryOptions, pre: Preconditioner, stop: threading.Event | None = None,
                    progress: bool = False) -> tuple[TokenScores, int, list, tuple[int, int], int, np.ndarray]:
        """(the returned documents' best sequences scored exactly, tokens scored, ranked (best token,
        score), (tied beyond the last, of those unsettled), documents scored, the returned ones' values)."""
        self.check_exact()
        sign = -1.0 if opt.opponents else 1.0
        t0 = time.perf_counter()
        tot = exhaustive(self.model, self.reader, [q], pre, sign=sign, match=opt.aggregation == "cosine_match",
                         progress=progress, on_batch=lambda _: check_stop(stop, "the exact attribution"))[0]
        self._exact_rate = self.reader.n_tokens / max(time.perf_counter() - t0, 1e-9)
        all_docs = np.arange(self.reader.n_docs)
        keep = None if opt.include_untrained else self.reader.trained(all_docs)
        if self.reader.takedown.any():
            keep = ~self.reader.removed(all_docs) & (True if keep is None else keep)
        ties = tot.tied_beyond(opt.aggregation, sign, opt.n_documents, keep)
        settle = opt.tie_break == "cosine_sum" and ties > 0
        top, per_doc, _ = tot.rank(opt.aggregation, sign, opt.n_documents + (ties if settle else 0), keep)
        unsettled = 0
        if settle:  # the near-tie at the cut, settled by the documents' summed cosines (every token exact)
            st = settle_near_ties(per_doc, tot.cosine_sum[top], opt.n_documents, sign)
            top, per_doc, ties, unsettled = top[st.order], per_doc[st.order], st.tied_beyond, st.unsettled
        best_tok = tot.best_token(opt.aggregation)
        # the returned documents' best sequences, scored again for their presentation
        exact = exact_scores(self.model, self.reader, q.G, pre, self.reader.seq_of_tokens(best_tok[top]),
                             match=q if opt.aggregation == "cosine_match" else None)
        where = {int(t): i for i, t in enumerate(exact.tok)}
        return (exact, self.reader.n_tokens,
                [(where[int(best_tok[d])], float(sc)) for d, sc in zip(top, per_doc, strict=True)],
                (ties, unsettled), self.reader.n_docs, np.asarray(tot.raw_sum[top], np.float64))  # every token exact

    def attribute(self, spec: QuerySpec, options: QueryOptions | None = None, *,
                  stop: threading.Event | None = None, progress: bool = False) -> Attribution:
        """Top training documents for one query. ``stop``: when set, the work stops at its next check
        (``Cancelled``): each generated token, each batch of ``mode="exact"``, and between the stages;
        ``progress``: a progress bar for ``mode="exact"``."""
        opt = options or QueryOptions()
        if opt.aggregation not in AGGREGATIONS:
            raise QueryError(f"aggregation: must be one of {list(AGGREGATIONS)}, got {opt.aggregation!r}")
        if opt.mode not in ("fast", "exact"):
            raise QueryError(f"mode: must be 'fast' or 'exact', got {opt.mode!r}")
        pre = self.preconditioner(opt.damping)
        t0 = time.perf_counter()
        q = self.encode(spec, stop)
        check_stop(stop, "the attribution")
        t1 = time.perf_counter()
        ctx = CallContext(partial=opt.allow_partial)
        sign = -1.0 if opt.opponents else 1.0
        if opt.mode == "fast":
            scores, n_scored, ranked, ties, n_exact, sums = self._fast(q, opt, pre, ctx)
            values, unsettled = None if sums is None else sums[:, 0], 0
            if len(ranked) > opt.n_documents:  # a near-tie at the cut: the documents' summed cosines settle it
                if sums is None:
                    best = np.array([b for b, _ in ranked], np.int64)
                    sums = self._document_sums(q, pre, scores, token_docs(self.reader, scores)[best], ctx)
                st = settle_near_ties(np.array([sc for _, sc in ranked]), sums[:, 1], opt.n_documents, sign)
                ranked, values = [ranked[i] for i in st.order], sums[st.order, 0]
                ties, unsettled = st.tied_beyond, st.unsettled
        else:
            scores, n_scored, ranked, (ties, unsettled), n_exact, values = self._exhaustive(q, opt, pre, stop,
                                                                                            progress)
        check_stop(stop, "the attribution")
        t3 = time.perf_counter()
        docs = [scored_document(self.reader, self.tokenizer, scores, best, score, rank, opponents=opt.opponents)
                for rank, (best, score) in enumerate(ranked, 1)]
        if values is None:
            values = self._document_values(q, pre, scores, np.array([d.doc_id for d in docs], np.int64), ctx)
        docs = [dataclasses.replace(d, value=float(v)) for d, v in zip(docs, values, strict=True)]
        t_inf = time.perf_counter()
        if opt.influence:
            check_stop(stop, "the attribution")
            values = self.influence(q, np.array([d.doc_id for d in docs], np.int64))
            for d, v in zip(docs, values, strict=True):
                d.influence = float(v)
        opposed, opposed_value = 0, 0
        if not opt.keep_opposed:
            # the documents that drove the output by both measures: the score's order, less those whose
            # effect pushes the other way, by the full-model influence when asked, else by the value
            # (docs/attribution.md, "A document's value" and "Full-model influence")
            effect = [sign * (d.influence or 0.0) if opt.influence else sign * d.value for d in docs]
            docs, left_out = left_out_opposed(docs, effect)
            opposed, opposed_value = (left_out, 0) if opt.influence else (0, left_out)
        t4 = time.perf_counter()
        cand = ctx.candidates_ms
        ms = Timings(1e3 * (t1 - t0), cand, 1e3 * (t3 - t1) - cand, 1e3 * (t4 - t3), 1e3 * (t4 - t0),
                     ctx.shortlist_ms, ctx.rerank_ms, 1e3 * (t4 - t_inf))
        return Attribution(opt.mode, opt.aggregation, pre.damping, q.info(), docs, q.per_token, ms, int(n_scored),
                           sorted(ctx.missing), ties, n_exact, opposed, opposed_value, unsettled)

    def _document_values(self, q: Query, pre: Preconditioner, exact: TokenScores, docs: np.ndarray,
                         ctx: CallContext) -> np.ndarray:
        """Each returned document's value: its tokens' raw influences ``s_t`` summed over every row of it,
        the re-scored rows' exact, the others' from the index's codes (docs/attribution.md, "A document's
        value")."""
        return self._document_sums(q, pre, exact, docs, ctx)[:, 0]

    def _document_sums(self, q: Query, pre: Preconditioner, exact: TokenScores, docs: np.ndarray,
                       ctx: CallContext | None) -> np.ndarray:
        """(len(docs), 2): per document its value and its tokens' cosines summed over every row of it (its
        ``cosine_sum``), the re-scored rows' exact, the others' from the index's codes."""
        if not len(docs):
            return np.zeros((0, 2))
        tok, first = np.unique(exact.tok, return_index=True)
        of = self.reader.doc_of_seqs(self.reader.seq_of_tokens(tok))
        mine = np.isin(of, docs)
        tok, at = tok[mine], index_in(docs, of[mine])
        held = np.stack([np.bincount(at, weights=np.asarray(v, np.float64)[first][mine], minlength=len(docs))
                         for v in (exact.raw, exact.cos)], axis=1)
        return held + self.shards.document_values(q.G, pre, docs, tok, ctx)

    # ------------------------------------------------------------------------ full-model influence
    def check_influence(self) -> None:
        """QueryError, naming the fix, when the index cannot serve the ``influence`` option: no influence
        curvature, one fitted for another checkpoint, or a file that cannot be read. Reads the file's
        header only (a service checks this when an audit is submitted)."""
        if self._ekfac is not None:
            return
        path, fix = self.reader.dir / layout.EKFAC, self._influence_fix()
        if not path.exists():
            raise QueryError(f"influence: {self.reader.dir} has no influence curvature ({layout.EKFAC}); {fix}")
        try:
            stamp = EKFAC.stamp(path)
        except Exception as e:  # a truncated or foreign file: safetensors' own error type varies
            raise QueryError(f"influence: {path} cannot be read ({e}); {fix}") from None
        if stamp != self.manifest.identity["checkpoint_sha256"]:
            raise QueryError(f"influence: {path} was fitted for another checkpoint than the index's; {fix} again")

    def _influence_fix(self) -> str:
        return f"fit it with `prism index --out {self.reader.dir} --influence`"

    def ekfac(self) -> EKFAC:
        """The index's influence curvature (``engine/influence.py``), read on first use; QueryError when
        the index cannot serve it (:meth:`check_influence`)."""
        if self._ekfac is None:
            self.check_influence()
            path = self.reader.dir / layout.EKFAC
            try:
                self._ekfac = EKFAC.load(path)
            except Exception as e:
                raise QueryError(f"influence: {path} cannot be read ({e}); {self._influence_fix()}") from None
        return self._ekfac

    def influence(self, q: Query, docs: np.ndarray, damping: float | list[float] | None = None) -> np.ndarray:
        """The full-model influence of each of ``docs`` on the encoded query (``engine/influence.py``);
        ``damping``: x each layer's mean eigenvalue (default the module's), or a list (one row each)."""
        from .influence import DEFAULT_DAMPING

        # served from a cluster, the documents' windows come from the actors holding them (the model's
        # passes over them run here, in the coordinator)
        return document_influence(self.model, self.ekfac(), self.reader, q.token_ids, q.target_positions,
                                  q.target_ids, docs, DEFAULT_DAMPING if damping is None else damping)

    # ------------------------------------------------------------------------ steering
    def corpus_mass(self) -> PrototypeMass:
        """Activation mass per prototype over the whole corpus (the prototypes table's totals; read once)."""
        if self._corpus_mass is None:
            self._corpus_mass = self._read_corpus_mass()
        return self._corpus_mass

    def _read_corpus_mass(self) -> PrototypeMass:
        import pyarrow.parquet as pq

        t = pq.read_table(self.reader.dir / layout.PROTOTYPES, columns=["proto_id", "n_tokens", "mass"])
        K = self.model.cfg.n_prototypes
        mass, support = np.zeros(K), np.zeros(K, np.int64)
        ids = t.column("proto_id").to_numpy()
        mass[ids] = t.column("mass").to_numpy()
        support[ids] = t.column("n_tokens").to_numpy()
        return PrototypeMass(mass, support, np.zeros(K, np.int64), self.manifest.tokens, self.manifest.documents)

    def discover(self, *, topic_texts: list[str] | None = None, topic_docs: np.ndarray | None = None,
                 contrast_texts: list[str] | None = None, contrast_docs: np.ndarray | None = None,
                 include_untrained: bool = False, n: int = 20, min_support: int = 5, min_docs: int = 2,
                 smoothing: float = 0.5, measure: str = "activation", max_tokens: int | None = None,
                 stop: threading.Event | None = None,
                 ) -> tuple[list[Discovered], PrototypeMass, PrototypeMass, str]:
        """Prototypes ranked by how specifically they carry a topic given by example texts or documents
        of the index (``engine/steering.py``), against contrast texts or documents, or by default the
        rest of the corpus; returns (ranked, topic mass, contrast mass, what the contrast was).
        ``measure``: what a token counts for a prototype, its activation (the corpus's totals are
        stored) or its positive share of the next token's logit (the default contrast is then read
        from every shard: a pass over the corpus, done once and kept). ``max_tokens``: refuse (QueryError)
        before reading more stored tokens than this; ``stop``: checked as the tokens are read."""
        if measure not in MEASURES:
            raise QueryError(f"measure: must be one of {list(MEASURES)}, got {measure!r}")
        sig = signature_matrix(self.model) if measure == "logit" else None
        if (topic_texts is None) == (topic_docs is None):
            raise QueryError("topic: give example texts or documents (one of them)")
        if contrast_texts is not None and contrast_docs is not None:
            raise QueryError("contrast: give texts or documents, not both")

        def chosen(docs: np.ndarray, field: str) -> np.ndarray:
            docs = unique(np.asarray(docs, np.int64))
            bad = docs[(docs < 0) | (docs >= self.reader.n_docs)]
            if len(bad):
                raise QueryError(f"{field}: document ids {bad[:10].tolist()} out of range [0, {self.reader.n_docs})")
            docs = docs[~self.reader.removed(docs)]  # a document taken down informs nothing
            if not include_untrained:
                docs = docs[self.reader.trained(docs)]
            if not len(docs):
                raise QueryError(f"{field}: no trained document given (include_untrained to use the others)")
            return docs

        sources = {f: chosen(d, f) for f, d in (("topic.doc_ids", topic_docs), ("contrast.doc_ids", contrast_docs))
                   if d is not None}
        corpus_pass = (measure == "logit" and contrast_texts is None and contrast_docs is None
                       and self._logit_mass is None)
        if max_tokens is not None:  # what this request would read, refused before any of it is read
            reads = {f: self._tokens_of(d) for f, d in sources.items()}
            if corpus_pass:
                reads["the corpus (measure logit's default contrast, read once)"] = self.reader.n_tokens
            if sum(reads.values()) > max_tokens:
                raise QueryError("discovery would read " + " + ".join(f"{n:,} tokens of {f}" for f, n in reads.items())
                                 + f", over the limit of {max_tokens:,}; give fewer documents"
                                 + (" or a contrast" if corpus_pass else ""))

        def docs_mass(field: str) -> PrototypeMass:
            return self.shards.prototype_mass(sources[field], measure, sig, stop=stop)

        def corpus() -> PrototypeMass:
            if measure == "activation":
                return self.corpus_mass()
            with self._logit_lock:  # one pass at a time; the others wait for its result
                if self._logit_mass is None:
                    self._logit_mass = self.shards.prototype_mass(np.arange(self.reader.n_docs), measure, sig,
                                                                  stop=stop)
                return self._logit_mass

        with torch.no_grad():
            topic = (text_mass(self.model, self.tokenizer, topic_texts, measure=measure) if topic_texts is not None
                     else docs_mass("topic.doc_ids"))
            if contrast_texts is not None:
                contrast, what = text_mass(self.model, self.tokenizer, contrast_texts, measure=measure), "texts"
            elif contrast_docs is not None:
                contrast, what = docs_mass("contrast.doc_ids"), "documents"
            elif topic_docs is not None:
                contrast, what = corpus() - topic, "the rest of the corpus"
            else:
                contrast, what = corpus(), "the corpus"
        ranked = rank_prototypes(topic, contrast, min_support=min_support, min_docs=min_docs, smoothing=smoothing, n=n)
        return ranked, topic, contrast, what

    def _tokens_of(self, docs: np.ndarray) -> int:
        """Stored tokens of ``docs``: counted from the sequence offsets, or estimated from the mean document
        length where this process does not hold the shards (a cluster)."""
        if isinstance(self.shards, LocalShards):
            return self.local_reader("discovery").tokens_of_documents(docs)
        return int(len(docs) * self.reader.n_tokens / max(1, self.reader.n_docs))

    def exact_document_scores(self, queries: list[Query], *, damping: float | None = None, match: bool = False,
                              progress: bool = False) -> list[dict[Aggregation, np.ndarray]]:
        """Every document's exact score under each aggregation for many encoded queries, all in one pass
        of the model over the corpus (``match``: ``cosine_match`` too)."""
        self.check_exact()
        with torch.no_grad():
            return [t.scores(1.0) for t in exhaustive(self.model, self.reader, queries, self.preconditioner(damping),
                                                      match=match, progress=progress)]

    def candidate_documents(self, q: Query, n_candidates: int | None = None, pre: Preconditioner | None = None) -> np.ndarray:
        """The documents of the fast path's candidate sequences for an encoded query (ascending ids);
        ``n_candidates``: FAISS's part (None: the served default)."""
        n = QueryOptions().sketch_candidates if n_candidates is None else n_candidates
        return unique(self.reader.doc_of_seqs(self.candidate_sequences(q, n, pre)))

    def document_scores(self, q: Query, mode: Mode = "exact", n_candidates: int | None = None,
                        damping: float | None = None, exact_rerank: int | None = None,
                        match: bool = False) -> dict[Aggregation, np.ndarray]:
        """Every document's score for one encoded query under each aggregation (0 where a document has
        no scored token); what the evaluation uses. ``fast``: the shortlisted documents' exact scores,
        the other candidates' approximate ones (``exact_rerank``, ``n_candidates``: None, the served
        default)."""
        pre = self.preconditioner(damping)
        if mode == "exact":
            self.check_exact()
            return exhaustive(self.model, self.reader, [q], pre, match=match)[0].scores(1.0)
        opt = QueryOptions(n_candidates=n_candidates, damping=damping,
                           exact_rerank=QueryOptions().exact_rerank if exact_rerank is None else exact_rerank,
                           aggregation="cosine_match" if match else "cosine_max",
                           include_untrained=True)  # every document: the caller decides which count
        local = self.local_reader("document_scores")
        seqs = self.candidate_sequences(q, opt.sketch_candidates, pre)
        out = document_scores(self.reader, approx_scores(local, q.G, pre, local.rows_of_sequences(seqs),
                                                         match=q.targets if match else None))
        exact = self._fast(q, opt, pre, seqs=seqs)[0]
        ex = document_scores(self.reader, exact)
        hit = np.zeros(self.reader.n_docs, dtype=bool)
        hit[self.reader.doc_of_seqs(self.reader.seq_of_tokens(exact.tok))] = True
        return {k: np.where(hit, ex[k], v) for k, v in out.items()}
