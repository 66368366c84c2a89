"""The attribution engine: per-token view, exact scores against an independent computation, the fast
path against the exact path, options, and query errors."""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

from prism_tda.engine import Attributor, FirstStages, QueryOptions, QuerySpec, layout
from prism_tda.engine.aggregate import settle_near_ties
from prism_tda.engine.candidates import posting_plan, read_postings
from prism_tda.engine.curvature import self_influence
from prism_tda.engine.scoring import approx_scores, exact_scores, score_tokens
from prism_tda.engine.shards import CallContext
from prism_tda.engine.tokens import run_batch
from prism_tda.errors import PromptTooLongError, QueryError
from prism_tda.indexer.run import build_index
from tests.conftest import index_cfg

COMPUTER = QuerySpec("A computer", " is a")


@pytest.fixture(scope="module")
def att(index) -> Attributor:
    return Attributor.open(index)


def exact(n: int = 10, **kw) -> QueryOptions:
    return QueryOptions(n_documents=n, mode="exact", **kw)


def test_per_token_view_adds_up_to_the_logit(att):
    res = att.attribute(QuerySpec("The only way", " to be"), QueryOptions(n_documents=3))
    assert len(res.per_token) == len(res.query.target_ids) >= 1
    for t in res.per_token:
        total = sum(p.contribution for p in t.prototypes) + t.residual
        assert abs(total - t.logit) < 1e-3
        assert 1 <= len(t.prototypes) <= att.model.cfg.n_active


def test_exact_scores_match_an_independent_computation(att):
    res = att.attribute(COMPUTER, exact(5))
    q = att.encode(COMPUTER)
    pre = att.preconditioner()
    inv = pre.inv.double()
    Iq = float((q.G.double() ** 2 * inv).sum())
    for d in res.documents:
        toks, tgts = att.reader.sequence_tokens(d.seq_id)
        lo, _, _ = att.reader.seq_span(d.seq_id)
        pos = d.token_row - lo
        tb = run_batch(att.model, [toks], [tgts])  # the training sequence, anew
        ut = tb.u[pos].double() @ att.reader.curv.Q.double()
        a, p = tb.acts[pos].double(), tb.proto_idx[pos]
        raw = sum(float(a[j]) * float((q.G[p[j]].double() * inv[p[j]] * ut).sum()) for j in range(len(p)) if a[j] > 0)
        It = float((a ** 2 * (ut ** 2 * inv[p]).sum(1)).sum())
        assert raw == pytest.approx(d.raw_influence, rel=1e-4, abs=1e-9)
        assert d.score == pytest.approx(raw / (Iq * It) ** 0.5, rel=1e-4)
        assert -1.0 - 1e-6 <= d.score <= 1.0 + 1e-6


def test_fast_path_reranks_exactly_and_finds_the_exact_top(att):
    for spec in [COMPUTER, QuerySpec("Love is", " a"), QuerySpec("The")]:
        ex = att.attribute(spec, exact())
        # every sequence a candidate and every document re-ranked: the fast path is the exact path
        full = att.attribute(spec, QueryOptions(n_documents=10, n_candidates=100_000, exact_rerank=100_000,
                                                exact_tokens=None))
        assert [d.score for d in full.documents] == pytest.approx([d.score for d in ex.documents], rel=1e-4)
        # the same documents, up to the order of ties (batches of other shapes round the last bits)
        all_exact = att.document_scores(att.encode(spec), mode="exact")["cosine_max"]
        tenth = ex.documents[-1].score
        assert all(all_exact[d.doc_id] >= tenth - 1e-4 * abs(tenth) for d in full.documents)
        # only the approximately best tokens of each sequence re-scored: each score is a real token's exact
        # score (at most the document's best), and nearly the same top
        part = att.attribute(spec, QueryOptions(n_documents=10, n_candidates=100_000, exact_rerank=100_000))
        assert all(d.score <= all_exact[d.doc_id] + 1e-4 * abs(all_exact[d.doc_id]) + 1e-6 for d in part.documents)
        # (the exact top 10 is often a plateau of documents tied to 1e-7, so "in the top" means scoring at
        # least the exact 10th best, within rounding, not being one of the ids the exact path kept)
        def in_top(docs: list, scores: np.ndarray = all_exact, tenth: float = tenth) -> int:
            return sum(scores[d.doc_id] >= tenth - 1e-4 * abs(tenth) for d in docs)

        assert in_top(part.documents) >= 8
        narrow = att.attribute(spec, QueryOptions(n_documents=10, n_candidates=32))
        scores = {d.doc_id: d.score for d in ex.documents}
        for d in narrow.documents:  # exact re-rank: a document found scores as in the exact path
            if d.doc_id in scores:
                assert d.score == pytest.approx(scores[d.doc_id], rel=1e-4)
        assert in_top(narrow.documents) >= 6
        assert narrow.tokens_scored < ex.tokens_scored == att.reader.n_tokens


def test_a_documents_best_token_in_another_sequence_is_re_scored(att, monkeypatch):
    """A document's best token by exact score can sit outside the sequence of its best approximate one:
    the re-rank scores its best rows in its other candidate sequences too (``Shortlist.more``)."""
    import prism_tda.engine.shards as shards

    spec, r = COMPUTER, att.reader
    q, pre = att.encode(spec), att.preconditioner()
    every = exact_scores(att.model, r, q.G, pre, np.arange(r.n_seqs))
    seq = r.seq_of_tokens(every.tok)
    doc = r.doc_of_seqs(seq)
    n_seqs = {int(d): len(np.unique(seq[doc == d])) for d in np.unique(doc)}
    order = np.argsort(-every.cos, kind="stable")
    # the best-scoring document that spans several sequences, and the sequence of its best token
    best = next(int(t) for t in order if n_seqs[int(doc[t])] > 1)
    D, S = int(doc[best]), int(seq[best])
    real = shards.approx_scores

    def demoted(reader, G, pre_, tok, match=None):  # every row of S ranks last by approximate score
        out = real(reader, G, pre_, tok, match)
        out.cos = np.where(reader.seq_of_tokens(out.tok) == S, out.cos - 10.0, out.cos)
        return out

    monkeypatch.setattr(shards, "approx_scores", demoted)
    opts = dict(n_documents=10, n_candidates=100_000, exact_rerank=100_000, exact_tokens=64, adaptive_rerank=False)
    res = att.attribute(spec, QueryOptions(**opts))
    got = {d.doc_id: d.score for d in res.documents}
    assert D in got and got[D] == pytest.approx(float(every.cos[best]), rel=1e-4)
    monkeypatch.setattr(shards, "best_rows_elsewhere",  # without the rows elsewhere
                        lambda reader, approx, docs, *a: ([np.zeros(0, np.int64)] * len(docs), [np.zeros(0)] * len(docs)))
    assert att.attribute(spec, QueryOptions(**opts)).documents != res.documents


def test_many_sequences_read_at_once_as_one_at_a_time(att):
    r = att.reader
    seqs = np.random.default_rng(0).choice(r.n_seqs, size=min(40, r.n_seqs), replace=False)  # unsorted
    assert len(np.unique(np.searchsorted(r.seq_base, seqs, side="right"))) > 1  # across shards
    first, data = r.sequences_tokens(seqs)
    assert len(first) == len(data) == len(seqs)
    for s, f, (tk, tg) in zip(seqs, first, data, strict=True):
        assert f == r.seq_span(int(s))[0]
        assert (tk.tolist(), tg.tolist()) == r.sequence_tokens(int(s))
    empty_first, empty = r.sequences_tokens(np.zeros(0, np.int64))
    assert len(empty_first) == len(empty) == 0


def test_approximate_scores_track_the_exact_ones(att):
    q = att.encode(COMPUTER)
    pre = att.preconditioner()
    seqs = np.arange(0, att.reader.n_seqs, 5)
    ex = exact_scores(att.model, att.reader, q.G, pre, seqs)
    ap = approx_scores(att.reader, q.G, pre, ex.tok)
    # the same active prototypes (two of nearly equal similarity can swap slots: a forward pass in
    # another batch rounds differently)
    assert np.array_equal(ap.tok, ex.tok) and np.array_equal(np.sort(ap.protos, 1), np.sort(ex.protos, 1))
    assert np.corrcoef(ap.cos, ex.cos)[0, 1] > 0.9
    # the lookup-table scores are the scores of the decoded token vectors
    data = att.reader.token_data(ex.tok)
    dec = score_tokens(ex.tok, data.protos, data.acts, att.reader.token_vectors(ex.tok, data),
                  data.self_influence, q.G, pre, exact=False)
    np.testing.assert_allclose(ap.raw, dec.raw, rtol=1e-4, atol=1e-6 * np.abs(dec.raw).max())
    np.testing.assert_allclose(ap.slot_val, dec.slot_val, rtol=1e-3, atol=1e-6 * np.abs(dec.slot_val).max())
    # and the approximate cosine is the stored token's cosine: its score over its own length (the one
    # its decoded vector has), not over the exact token's
    own = self_influence(att.reader.token_vectors(ex.tok, data), data.protos, data.acts, pre.inv)
    live = ap.raw != 0  # (a token no prototype fired for scores 0 over a length of 0)
    assert (own[live] > 0).all()
    cos_of_stored = ap.raw[live] / np.sqrt(pre.self_influence(q.G) * own[live])
    np.testing.assert_allclose(ap.cos[live], cos_of_stored, rtol=2e-3)


def test_opponents_are_negative_and_ordered(att):
    # the ranking itself: every one of the first 5 (the rule on values is tested apart)
    res = att.attribute(COMPUTER, exact(5, opponents=True, keep_opposed=True))
    scores = [d.score for d in res.documents]
    assert scores == sorted(scores) and scores[0] < 0
    assert [d.rank for d in res.documents] == [1, 2, 3, 4, 5]
    fast = att.attribute(COMPUTER, QueryOptions(n_documents=5, opponents=True, n_candidates=100_000,
                                                exact_rerank=100_000, keep_opposed=True))
    assert [d.score for d in fast.documents] == pytest.approx(scores, rel=1e-4)


def test_opponents_first_stages_search_against_the_query(att, monkeypatch):
    """An opponents query's first stages look for what points against the query (FAISS and the posting
    lists searched with -G): with few candidates they hold the exact most opposed documents, which a
    search along the query misses, and the served answer finds them."""
    from prism_tda.engine.exact import exhaustive

    monkeypatch.setattr(att, "stages", FirstStages(token_candidates=16))
    trained = att.reader.trained(np.arange(att.reader.n_docs))
    found = {"against": 0, "along": 0, "served": 0}
    for spec in (COMPUTER, QuerySpec("Love is", " a"), QuerySpec("The best way to", " get")):
        q = att.encode(spec)
        worst = exhaustive(att.model, att.reader, [q], att.preconditioner(), sign=-1.0)[0].scores(-1.0)["cosine_max"]
        worst[~trained] = np.inf
        most = set(np.argsort(worst, kind="stable")[:5].tolist())
        for name, opp in (("against", True), ("along", False)):
            found[name] += len(most & set(att.reader.doc_of_seqs(att.candidate_sequences(q, 16, opponents=opp)).tolist()))
        res = att.attribute(spec, QueryOptions(n_documents=5, opponents=True, n_candidates=16, keep_opposed=True,
                                               tie_break="score"))
        found["served"] += len(most & {d.doc_id for d in res.documents})
    # of the 3 x 5 most opposed documents
    assert found["against"] >= 14 and found["served"] >= 13
    assert found["along"] <= 5  # what the first stages held before they searched with -G


def test_single_target_token_and_generation(att):
    full = att.encode(COMPUTER)
    one = att.encode(QuerySpec("A computer", " is a", target_index=1))
    assert one.target_ids == full.target_ids[1:2]
    gen = att.encode(QuerySpec("A computer", max_new_tokens=3))
    assert 1 <= len(gen.target_ids) <= 3
    own = att.encode(QuerySpec("A computer is"))
    assert own.target_positions == list(range(len(own.token_ids) - 1))
    assert torch.isfinite(own.G).all() and att.preconditioner().self_influence(own.G) > 0


def test_bad_queries(att, index):
    with pytest.raises(QueryError, match="empty"):
        att.attribute(QuerySpec("", " x"))
    with pytest.raises(PromptTooLongError, match="context"):
        att.attribute(QuerySpec("word " * 200, " x"))
    with pytest.raises(PromptTooLongError, match="max_new_tokens"):
        att.encoder.check(QuerySpec("word " * 10, max_new_tokens=40))
    with pytest.raises(QueryError, match="target_index"):
        att.encode(QuerySpec("A computer", " is", target_index=5))
    with pytest.raises(QueryError, match="mode"):
        att.attribute(QuerySpec("A", " b"), QueryOptions(mode="nope"))  # type: ignore[arg-type]
    with pytest.raises(QueryError, match="damping"):
        att.attribute(QuerySpec("A", " b"), QueryOptions(damping=0.0))
    limited = Attributor.open(index, exact_token_limit=1000)
    with pytest.raises(QueryError, match="exact"):
        limited.attribute(COMPUTER, exact())


def test_documents_carry_snippet_highlights_and_prototypes(att):
    res = att.attribute(COMPUTER, exact(5))
    query_protos = set(att.encode(COMPUTER).prototypes.tolist())
    for d in res.documents:
        assert d.external_id == att.reader.external_id(d.doc_id)
        assert d.snippet and d.highlights
        for h in d.highlights:
            assert d.snippet[h.start:h.end] == h.text and 0 < h.weight <= 1 + 1e-9
        # the best token is highlighted with weight 1
        assert any(h.token_row == d.token_row and h.weight == pytest.approx(1.0) for h in d.highlights)
        shares = [p.share for p in d.prototypes]
        assert sum(abs(s) for s in shares) == pytest.approx(1.0) and shares == sorted(shares, reverse=True)
        assert {p.proto_id for p in d.prototypes} <= query_protos


def test_document_scores_cover_every_document_and_agree_with_the_ranking(att):
    q = att.encode(COMPUTER)
    s = att.document_scores(q, mode="exact")
    assert set(s) == {"cosine_max", "cosine_sum", "raw_max", "raw_sum"}
    assert all(v.shape == (att.reader.n_docs,) for v in s.values())
    trained = att.reader.trained(np.arange(att.reader.n_docs))
    for aggregation in s:  # every aggregation ranks the (trained) documents as document_scores says
        res = att.attribute(COMPUTER, exact(5, aggregation=aggregation, tie_break="score", keep_opposed=True))
        order = np.nonzero(trained)[0][np.argsort(-s[aggregation][trained], kind="stable")]
        assert [d.score for d in res.documents] == pytest.approx(s[aggregation][order[:5]].tolist(), rel=1e-6)
        assert res.aggregation == aggregation and res.unsettled_beyond_last == 0
        # by default a near-tie at the cut is settled by the documents' summed cosines
        settled = att.attribute(COMPUTER, exact(5, aggregation=aggregation, keep_opposed=True))
        st = settle_near_ties(s[aggregation][order], s["cosine_sum"][order], 5)
        assert {d.doc_id for d in settled.documents} == set(order[st.order].tolist())
        assert (settled.tied_beyond_last, settled.unsettled_beyond_last) == (st.tied_beyond, st.unsettled)
        assert settled.tied_beyond_last == res.tied_beyond_last  # the same near-tie, another pick from it
    fast = att.document_scores(q, mode="fast")
    best = int(np.argmax(fast["cosine_max"]))
    assert fast["cosine_max"][best] == pytest.approx(s["cosine_max"][best], rel=1e-4)  # re-ranked exactly


def test_a_documents_value_sums_every_token_of_it(att):
    """A returned document's value is its tokens' raw influences summed over all of its rows: every row
    recomputed in exact mode; in fast mode the re-ranked rows exact and the others from the codes."""
    pre = att.preconditioner()
    r = att.reader
    for spec in (COMPUTER, QuerySpec("Love is", " a")):
        q = att.encode(spec)
        ex = att.attribute(spec, exact(6))
        fast = att.attribute(spec, QueryOptions(n_documents=6))
        for d in ex.documents:  # each document's windows recomputed, apart from the exact pass
            seqs = np.unique(r.seq_of_tokens(r.rows_of_documents(np.array([d.doc_id]))))
            want = float(np.sum(exact_scores(att.model, r, q.G, pre, seqs).raw))
            assert d.value == pytest.approx(want, rel=1e-4, abs=1e-6)
        want = {d.doc_id: d.value for d in ex.documents}
        both = [d for d in fast.documents if d.doc_id in want]
        assert len(both) >= 3
        for d in both:  # from the codes where not re-ranked: near the exact sum
            assert d.value == pytest.approx(want[d.doc_id], rel=0.01, abs=1e-6)
        # the parts: every row of the documents given exactly, or none (all from the codes)
        docs = np.array([d.doc_id for d in ex.documents], np.int64)
        seqs = np.unique(r.seq_of_tokens(r.rows_of_documents(docs)))
        every = exact_scores(att.model, r, q.G, pre, seqs)
        assert att._document_values(q, pre, every, docs, CallContext()) == pytest.approx(
            [want[int(d)] for d in docs], rel=1e-4, abs=1e-6)
        none = exact_scores(att.model, r, q.G, pre, np.zeros(0, np.int64))
        coded = [float(approx_scores(r, q.G, pre, r.rows_of_documents(np.array([d]))).raw.sum()) for d in docs]
        assert att._document_values(q, pre, none, docs, CallContext()) == pytest.approx(coded, rel=1e-6, abs=1e-9)


def test_sum_aggregations_score_every_window_of_a_document(att, monkeypatch):
    """Under raw_sum and cosine_sum a document scores the sum over every window of it in fast mode as in
    exact mode: the re-ranked window exact, the others from the codes (raw_sum: its value). The earlier
    rule (the candidate windows, then the re-ranked window alone) scored part of a long document."""
    from prism_tda.engine import scoring

    r = att.reader
    windows = np.bincount(r.doc_of_seqs(np.arange(r.n_seqs)), minlength=r.n_docs)
    specs = [COMPUTER, QuerySpec("Love is", " a"), QuerySpec("The best way to", " get")]
    off: list[float] = []
    for spec in specs:
        ex = att.document_scores(att.encode(spec), mode="exact")
        for agg in ("raw_sum", "cosine_sum"):
            res = att.attribute(spec, QueryOptions(n_documents=10, aggregation=agg, keep_opposed=True))
            long = [d for d in res.documents if windows[d.doc_id] > 1]
            assert long, "the check needs documents of several windows"
            for d in res.documents:
                assert d.score == pytest.approx(ex[agg][d.doc_id], rel=0.02, abs=1e-6)
                if agg == "raw_sum":
                    assert d.score == pytest.approx(d.value, rel=1e-9, abs=1e-9)
            monkeypatch.setattr(scoring, "WHOLE_DOCUMENT_SUMS", False)
            before = att.attribute(spec, QueryOptions(n_documents=10, aggregation=agg, keep_opposed=True))
            monkeypatch.setattr(scoring, "WHOLE_DOCUMENT_SUMS", True)
            off += [abs(d.score / ex[agg][d.doc_id] - 1) for d in before.documents if windows[d.doc_id] > 1]
    assert max(off) > 0.1  # the earlier rule's error on a document of several windows, for contrast


def test_cosine_match_matches_each_target_over_every_window_of_a_document(att, monkeypatch):
    """Under cosine_match a document's fast score takes each target token's best match over all of its
    windows, as exact mode does: a returned document's score never exceeds its exact one, and the
    documents of several windows score it (2%) unless a target's best match lay outside the windows the
    codes pointed to. The earlier rule (the candidate windows only) scored such documents lower."""
    from prism_tda.engine import shards

    r = att.reader
    windows = np.bincount(r.doc_of_seqs(np.arange(r.n_seqs)), minlength=r.n_docs)
    specs = [QuerySpec("A computer", " is a machine that"), QuerySpec("Love is", " a many splendored thing"),
             QuerySpec("The best way to", " get what you want")]
    opt = QueryOptions(n_documents=10, aggregation="cosine_match", keep_opposed=True)
    now: list[float] = []
    before: list[float] = []
    for spec in specs:
        ex = att.document_scores(att.encode(spec), mode="exact", match=True)["cosine_match"]
        res = att.attribute(spec, opt)
        assert res.documents
        for d in res.documents:
            assert d.score <= ex[d.doc_id] + 1e-4 * abs(ex[d.doc_id])  # a match over fewer rows is never better
            if windows[d.doc_id] > 1:
                now.append(abs(d.score / ex[d.doc_id] - 1))
        monkeypatch.setattr(shards, "WHOLE_DOCUMENT_MATCH", False)
        earlier = att.attribute(spec, opt)
        monkeypatch.setattr(shards, "WHOLE_DOCUMENT_MATCH", True)
        before += [abs(d.score / ex[d.doc_id] - 1) for d in earlier.documents if windows[d.doc_id] > 1]
    assert now and before, "the check needs documents of several windows"
    assert np.mean(np.array(now) < 0.02) >= 0.9
    assert np.mean(np.array(before) < 0.02) < np.mean(np.array(now) < 0.02)


def test_cosine_match_first_stages_read_each_target_tokens_lists(att, monkeypatch):
    """Under cosine_match the first stages add each target token's own best tokens to the whole query's
    candidates (a superset, larger for some query); 0 turns it off."""
    from prism_tda.engine import attributor

    grew = 0
    for spec in (QuerySpec("A computer", " is a machine that"), QuerySpec("Love is", " a many splendored thing")):
        q = att.encode(spec)
        base = att.candidate_sequences(q)
        both = att.candidate_sequences(q, per_target=True)
        assert np.isin(base, both).all()
        grew += len(both) > len(base)
        monkeypatch.setattr(attributor, "MATCH_TARGET_TOKENS", 0)
        assert np.array_equal(att.candidate_sequences(q, per_target=True), base)
        monkeypatch.setattr(attributor, "MATCH_TARGET_TOKENS", 128)
    assert grew


def test_sum_first_stages_take_the_documents_whose_posting_rows_sum_highest(att, monkeypatch):
    """Under a sum aggregation the first stages add every window of the documents whose rows read from
    the posting lists sum highest (a superset of the whole query's candidates, larger for some query);
    those documents are the highest sums of the rows read, and 0 turns it off."""
    from prism_tda.engine import attributor
    from prism_tda.engine.candidates import posting_plan, read_postings
    from prism_tda.engine.scoring import approx_scores

    r, pre = att.reader, att.preconditioner()
    grew = 0
    monkeypatch.setattr(attributor, "SUM_DOCUMENTS", 3)
    for spec in (QuerySpec("A computer", " is a machine that"), QuerySpec("Love is", " a many splendored thing")):
        q = att.encode(spec)
        base = att.candidate_sequences(q)
        for sums, col in (("raw", "raw"), ("cosine", "cos")):
            more = att.candidate_sequences(q, sums=sums)
            assert np.isin(base, more).all()
            grew += len(more) > len(base)
            s = approx_scores(r, q.G, pre, read_postings(r, posting_plan(r, q.G, pre, att.stages)))
            docs, at = np.unique(r.doc_of_seqs(r.seq_of_tokens(s.tok)), return_inverse=True)
            total = np.bincount(at, weights=getattr(s, col))
            best = docs[np.lexsort((docs, -total))[:3]]
            assert np.isin(r.sequences_of_documents(best), more).all()
        monkeypatch.setattr(attributor, "SUM_DOCUMENTS", 0)
        assert np.array_equal(att.candidate_sequences(q, sums="raw"), base)
        monkeypatch.setattr(attributor, "SUM_DOCUMENTS", 3)
    assert grew


def test_documents_whose_value_opposes_the_output_are_left_out(att):
    """By default, of the first n by score, a document whose value (its whole influence) pushes the other
    way is left out and counted; keep_opposed returns them all; with opponents the sign flips."""
    seen_left_out = 0
    for spec in (COMPUTER, QuerySpec("Love is", " a"), QuerySpec("The", " man"), QuerySpec("You will", " be")):
        for mode in ("fast", "exact"):
            every = att.attribute(spec, QueryOptions(n_documents=12, mode=mode, keep_opposed=True))
            served = att.attribute(spec, QueryOptions(n_documents=12, mode=mode))
            assert every.opposed_by_value == 0
            assert [d.doc_id for d in served.documents] == [d.doc_id for d in every.documents if d.value > 0]
            assert served.opposed_by_value == sum(d.value <= 0 for d in every.documents)
            assert [d.rank for d in served.documents] == list(range(1, len(served.documents) + 1))
            seen_left_out += served.opposed_by_value
            opp_every = att.attribute(spec, QueryOptions(n_documents=12, mode=mode, opponents=True, keep_opposed=True))
            opp = att.attribute(spec, QueryOptions(n_documents=12, mode=mode, opponents=True))
            assert [d.doc_id for d in opp.documents] == [d.doc_id for d in opp_every.documents if d.value < 0]
            assert opp.opposed_by_value == sum(d.value >= 0 for d in opp_every.documents)
    assert seen_left_out > 0  # the rule was exercised


def test_damping_is_a_query_option(att):
    base = att.attribute(COMPUTER, exact(5))
    assert base.damping == att.reader.cfg.damping
    low = att.attribute(COMPUTER, exact(5, damping=0.01))
    assert low.damping == 0.01 and [d.score for d in low.documents] != [d.score for d in base.documents]
    same = att.attribute(COMPUTER, exact(5, damping=att.reader.cfg.damping))
    assert [d.score for d in same.documents] == [d.score for d in base.documents]
    fast_low = att.attribute(COMPUTER, QueryOptions(n_documents=5, damping=0.01, n_candidates=100_000,
                                                    exact_rerank=100_000))
    assert [d.score for d in fast_low.documents] == pytest.approx([d.score for d in low.documents], rel=1e-4)


def test_token_stage_reads_under_its_budget_and_adds_candidates(att):
    q = att.encode(QuerySpec("A computer", " is a machine"))
    pre = att.preconditioner()
    for budget in (50, 400, 3000):
        tok = read_postings(att.reader, posting_plan(att.reader, q.G, pre, FirstStages(row_budget=budget)))
        assert 0 < len(tok) <= budget
    base = att.candidate_sequences(q, 8)
    att_faiss = Attributor.open(att.reader.dir, stages=FirstStages(proto_candidates=0))
    only_faiss = att_faiss.candidate_sequences(q, 8)
    assert set(only_faiss) <= set(base) and len(base) > len(only_faiss)


def test_best_cells_reads_the_heaviest_prototypes_best_lists_first(att):
    """``FirstStages.best_cells``: the best cell of each of the n heaviest query prototypes leads the plan,
    heaviest first, whatever its priority among the other lists; the rest keep their order and the budget
    still holds."""
    import torch

    q = att.encode(QuerySpec("A computer", " is a machine"))
    pre = att.preconditioner()
    base = posting_plan(att.reader, q.G, pre, FirstStages(row_budget=1 << 30, best_cells=0))  # priority order only
    n = 3
    plan = posting_plan(att.reader, q.G, pre, FirstStages(row_budget=1 << 30, best_cells=n))
    weight = (q.G * q.G * pre.inv).sum(1)
    heavy = torch.argsort(weight, descending=True)[:n].numpy()
    C = att.reader.n_cells
    assert [int(g) // C for g in plan.lists[:n]] == heavy.tolist()
    for g in plan.lists[:n]:  # each one's best cell: its first list in the priority order
        assert g == next(b for b in base.lists if b // C == g // C)
    rest = [b for b in base.lists if b not in set(plan.lists[:n].tolist())]
    assert plan.lists[n:].tolist() == rest
    for budget in (50, 400):
        tok = read_postings(att.reader, posting_plan(att.reader, q.G, pre, FirstStages(row_budget=budget, best_cells=n)))
        assert 0 < len(tok) <= budget


def test_ivf_parts_are_searched_as_one_index(att, tiny_ckpt, tiny_corpus, tmp_path):
    """Shards' IVF parts share their template, so the reader stacks their lists and searches once; with
    every list probed, IVF-Flat finds what the Flat index of the same corpus finds, as global ids."""
    out = tmp_path / "ivf"
    build_index(tiny_ckpt, [tiny_corpus], out, index_cfg(faiss_spec="IVF4,Flat"), progress=False)
    ivf = Attributor.open(out)
    reader = ivf.local_reader("test")
    assert reader.stacked is not None and len(reader.shards) > 1
    assert reader.stacked.ntotal == reader.n_seqs == att.reader.n_seqs
    assert ivf.manifest.calibration.faiss_nprobe == 1
    q = ivf.encode(COMPUTER)
    G = q.G * ivf.preconditioner().inv.sqrt()

    def search(r, n, nprobe=None):
        return r.search_embedding(r.query_embedding(G), n, nprobe)[1]

    stacked = search(reader, 20, nprobe=4)
    flat = search(att.local_reader("test"), 20)
    assert len(stacked) == 20 and stacked[0] == flat[0] and set(stacked) == set(flat)
    reader.stacked = None  # shard by shard: the same sequences
    assert search(reader, 20, nprobe=4).tolist() == stacked.tolist()
    one = search(reader, 20)  # the index's nprobe: one list of four
    assert 0 < len(one) <= 20
    # each shard stores its inverted lists alone: the quantiser is the template's, stored once
    template = (out / layout.FAISS_TEMPLATE).stat().st_size
    for sh in ivf.manifest.shards:
        d = sh.dir(out)
        assert (d / layout.SHARD_IVF).is_file() and not (d / layout.SHARD_FAISS).exists()
        assert sh.bytes["faiss"] == (d / layout.SHARD_IVF).stat().st_size
    # shards written whole (the form of older indexes; an index appended to by this version holds
    # both forms): they read and answer the same
    older = tmp_path / "older"
    shutil.copytree(out, older)
    for sh in ivf.manifest.shards[:-1]:
        d = sh.dir(older)
        whole = layout.shard_index(older / layout.FAISS_TEMPLATE, d)
        assert whole.ntotal == sh.n_seqs
        faiss.write_index(whole, str(d / layout.SHARD_FAISS))
        # the whole form repeats the template (quantiser and the rest) beside the same lists
        assert (d / layout.SHARD_FAISS).stat().st_size >= template + (d / layout.SHARD_IVF).stat().st_size - 64
        (d / layout.SHARD_IVF).unlink()
    last = ivf.manifest.shards[-1].dir(older)
    assert (last / layout.SHARD_IVF).is_file() and not (last / layout.SHARD_FAISS).exists()
    old_reader = Attributor.open(older).local_reader("test")
    assert old_reader.stacked is not None and old_reader.stacked.ntotal == reader.n_seqs
    assert search(old_reader, 20, nprobe=4).tolist() == stacked.tolist()
    # the lists are memory-mapped, and closing the reader lets go of the maps
    def mapped():
        return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if line.endswith(layout.SHARD_IVF)}

    files = {str(sh.dir(out) / layout.SHARD_IVF) for sh in ivf.manifest.shards}
    assert files <= mapped()
    shards = list(reader.shards)
    assert all(sh.faiss_lists is not None for sh in shards)
    reader.close()
    gc.collect()
    assert all(sh.faiss_lists is None for sh in shards) and not files & mapped()
    # and the process is whole afterwards: lists freed from Python (not by an index that owns them)
    # corrupted the heap, so that FAISS's next calls crashed; in a fresh process, as a server would
    code = ("import gc, sys, faiss, numpy as np\n"
            "from prism_tda.engine.reader import IndexReader\n"
            "for _ in range(2):\n"
            "    r = IndexReader(sys.argv[1]); r.close(); del r; gc.collect()\n"
            "km = faiss.Kmeans(4, 8, niter=2, seed=0)\n"
            "km.train(np.random.default_rng(0).standard_normal((400, 4)).astype(np.float32))\n"
            "print('ok', km.centroids.shape)\n")
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok (8, 4)", run.stderr[-2000:]
    assert "no destructor found" not in run.stderr


def test_documents_know_whether_the_checkpoint_trained_on_them(att, tiny_ckpt):
    from prism_tda.corpus import is_validation
    from prism_tda.model import checkpoint as ckpt
    from prism_tda.model.record import document_key

    val_fraction = ckpt.load_checkpoint(tiny_ckpt)[2]["training"]["train_config"]["val_fraction"]
    record = ckpt.load_record(tiny_ckpt)
    docs = np.arange(att.reader.n_docs)
    trained = att.reader.trained(docs)
    recs = [att.reader.document(int(d)) for d in docs]
    seen, held = record.lookup(np.array([document_key(r["external_id"], r["text"]) for r in recs]))
    assert np.array_equal(trained, seen > 0)  # from the record, document by document
    val = np.array([is_validation(r["external_id"], val_fraction) for r in recs])
    assert val.any() and not trained[val].any() and not held[val].any()  # held out: never in the record
    assert trained.any() and (~trained & ~val).any()  # 40 steps do not cover every training document
    # a held-out document's own text as the query: found only when asked for, and marked
    held = int(np.nonzero(~trained)[0][0])
    ids = att.tokenizer.encode(att.reader.document(held)["text"]).ids
    spec = QuerySpec(att.tokenizer.decode(ids[:16]), att.tokenizer.decode(ids[16:24]))
    n = att.reader.n_docs
    for mode in ("exact", "fast"):
        opts = dict(n_documents=n, mode=mode, n_candidates=100_000, exact_rerank=n)
        default = att.attribute(spec, QueryOptions(**opts))
        both = att.attribute(spec, QueryOptions(**opts, include_untrained=True))
        assert default.documents and all(d.trained for d in default.documents)
        assert all(d.trained == bool(trained[d.doc_id]) for d in both.documents)
        assert held in {d.doc_id for d in both.documents if not d.trained}
        # leaving the held-out documents out changes nothing about the trained ones' scores
        kept = {d.doc_id: d.score for d in both.documents if d.trained}
        got = {d.doc_id: d.score for d in default.documents}
        assert set(got) <= set(kept)
        assert all(got[k] == pytest.approx(kept[k], rel=1e-4) for k in got)


def test_ties_are_broken_by_raw_influence(att):
    from prism_tda.engine.scoring import TokenScores, rank_documents

    # one token of each of six documents, with equal cosines and different raw influences
    seq_first = np.array([att.reader.seq_span(s)[0] for s in range(att.reader.n_seqs)])
    docs = att.reader.doc_of_seqs(np.arange(att.reader.n_seqs))
    _, first_seq = np.unique(docs, return_index=True)
    tok = np.sort(seq_first[first_seq[:6]])
    raw = np.array([0.5, 3.0, 1.0, 2.0, 0.1, 2.5])
    cos = np.array([0.9, 0.999, 0.999, 0.999, 0.3, 0.999])
    k = att.reader.k
    scores = TokenScores(tok, raw, cos, np.zeros((6, k), np.int64), np.zeros((6, k), np.float32), True)
    ranked = rank_documents(att.reader, scores, "cosine_max", opponents=False, n=6)
    assert [raw[b] for b, _ in ranked] == [3.0, 2.5, 2.0, 1.0, 0.5, 0.1]
    ranked = rank_documents(att.reader, scores, "raw_max", opponents=False, n=6)
    assert [raw[b] for b, _ in ranked] == [3.0, 2.5, 2.0, 1.0, 0.5, 0.1]
    ranked = rank_documents(att.reader, scores, "cosine_max", opponents=True, n=6)
    assert [raw[b] for b, _ in ranked] == [0.1, 0.5, 1.0, 2.0, 2.5, 3.0]


def test_answers_say_when_the_cut_falls_inside_a_near_tie():
    """``tied_beyond_last``: documents after the n returned whose score is within 0.1% of the n-th's,
    for either sign; 0 when the cut separates the scores or fewer documents exist."""
    from prism_tda.engine.aggregate import DocumentTotals

    docs = np.arange(6)
    cos = np.array([0.9, 0.8, 0.8, 0.7995, 0.7993, 0.5])  # 0.7995 and 0.7993 within 0.1% of 0.8
    tot = DocumentTotals.of_tokens(docs, cos, cos, 1.0)
    assert tot.tied_beyond("cosine_max", 1.0, 2) == 3  # the 2nd best is 0.8: 0.8, 0.7995, 0.7993 follow
    assert tot.tied_beyond("cosine_max", 1.0, 3) == 2
    assert tot.tied_beyond("cosine_max", 1.0, 1) == 0 and tot.tied_beyond("cosine_max", 1.0, 6) == 0
    assert tot.tied_beyond("cosine_max", 1.0, 5) == 0  # 0.5 is not within 0.1% of 0.7993
    neg = DocumentTotals.of_tokens(docs, -cos, -cos, -1.0)  # opponents: the most negative first
    assert neg.tied_beyond("cosine_max", -1.0, 2) == 3


def test_a_near_tie_at_the_cut_is_settled_by_the_second_measure():
    """Documents more than 0.1% above the n-th best keep their places; the rest of the n come from the
    near-tie by the second measure (then the score's order) and are shown in the score's order; the
    left-out tied ones are counted, and those the second measure cannot separate either; the same with
    the signs flipped (opponents); nothing moves without a near-tie at the cut."""
    score = np.array([0.9, 0.8004, 0.8, 0.7995, 0.7993, 0.5])  # 0.8004 .. 0.7993 within 0.1% of 0.8
    second = np.array([0.0, 1.0, 2.0, 5.0, 2.0, 9.0])
    st = settle_near_ties(score, second, 3)
    assert st.order.tolist() == [0, 2, 3] and (st.tied_beyond, st.unsettled) == (2, 1)  # 4 ties 2's 2.0
    assert settle_near_ties(-score, -second, 3, sign=-1.0).order.tolist() == [0, 2, 3]
    st = settle_near_ties(score, second, 1)  # 0.9 stands alone: no near-tie at the cut
    assert st.order.tolist() == [0] and (st.tied_beyond, st.unsettled) == (0, 0)
    st = settle_near_ties(score, second, 5)  # the cut after the whole near-tie
    assert st.order.tolist() == [0, 1, 2, 3, 4] and st.tied_beyond == 0
    assert settle_near_ties(score[:2], second[:2], 3).order.tolist() == [0, 1]


def test_cosine_match_matches_each_target_token_and_averages(att):
    """A multi-token target is matched as a whole: each target token's best token of a document,
    averaged; checked against queries of one target token each, scored independently."""
    spec = QuerySpec("A computer", " is a machine")
    q = att.encode(spec)
    assert q.n_targets >= 2
    whole = att.document_scores(q, mode="exact", match=True)["cosine_match"]
    pieces = [att.document_scores(att.encode(QuerySpec(spec.prompt, spec.completion, target_index=j)),
                                  mode="exact")["cosine_max"] for j in range(q.n_targets)]
    np.testing.assert_allclose(whole, np.mean(pieces, axis=0), rtol=1e-5, atol=1e-7)
    # the pieces add up to the query: G is the sum of the target tokens' own parts
    assert torch.allclose(sum(q.target_G(j) for j in range(q.n_targets)), q.G, atol=1e-5)
    # the exact path ranks by it (trained documents), and the fast path with every candidate re-ranked agrees
    trained = att.reader.trained(np.arange(att.reader.n_docs))
    ex = att.attribute(spec, exact(5, aggregation="cosine_match"))
    top = np.nonzero(trained)[0][np.argsort(-whole[trained], kind="stable")[:5]]
    assert [d.score for d in ex.documents] == pytest.approx(whole[top].tolist(), rel=1e-5)
    full = att.attribute(spec, QueryOptions(n_documents=5, n_candidates=100_000, exact_rerank=100_000,
                                            aggregation="cosine_match"))
    assert [d.score for d in full.documents] == pytest.approx([d.score for d in ex.documents], rel=1e-4)
    # and it differs from the best single piece: a document matching one target token only scores lower
    best_piece = np.max(pieces, axis=0)
    assert np.all(whole <= best_piece + 1e-6)


def test_cosine_match_shortlist_uses_approximate_target_cosines(att):
    """The fast path shortlists ``cosine_match`` by each target token's approximate cosines (decoded token
    vectors): they agree with the exact ones to the codes' precision, tokens that share no prototype
    with the query score 0 for every target, and re-ranking only as many documents as are returned
    gives the exact top documents when every sequence is a candidate."""
    spec = QuerySpec("A computer", " is a machine")
    q = att.encode(spec)
    pre = att.preconditioner()
    seqs = np.arange(att.reader.n_seqs)
    approx = approx_scores(att.reader, q.G, pre, att.reader.rows_of_sequences(seqs), match=q.targets)
    ex = exact_scores(att.model, att.reader, q.G, pre, seqs, match=q)
    assert approx.match is not None and ex.match is not None
    assert np.array_equal(approx.tok, ex.tok) and approx.match.shape == ex.match.shape == (len(ex.tok), q.n_targets)
    assert np.corrcoef(approx.match.ravel(), ex.match.ravel())[0, 1] > 0.99
    # to the codes' precision: all but a rare badly quantised token within 0.1 (the codebooks, trained by
    # FAISS, differ with the CPU's SIMD kernels), and none far off
    err = np.abs(approx.match - ex.match)
    assert np.quantile(err, 0.9999) < 0.1 and err.max() < 0.3 and err.mean() < 0.01
    idle = ~(approx.slot_val != 0).any(1)
    assert idle.any() and np.all(approx.match[idle] == 0)
    fast = att.attribute(spec, QueryOptions(n_documents=5, n_candidates=100_000, exact_rerank=5,
                                            aggregation="cosine_match"))
    full = att.attribute(spec, exact(5, aggregation="cosine_match"))
    # the exact answer's tie count is the one of every trained document's score
    whole = att.document_scores(q, mode="exact", match=True)["cosine_match"]
    trained = np.sort(whole[att.reader.trained(np.arange(att.reader.n_docs)) & (whole != 0)])[::-1]
    last = full.documents[-1].score
    assert full.tied_beyond_last == int((np.abs(trained[5:] - last) <= 1e-3 * abs(last)).sum())
    assert {d.doc_id for d in fast.documents} == {d.doc_id for d in full.documents}
    assert [d.score for d in fast.documents] == pytest.approx([d.score for d in full.documents], rel=1e-4)


def test_long_work_stops_when_asked(att):
    """Exact mode and discovery check their ``stop`` event as they go and stop with ``Cancelled``;
    the service sets it when the client disconnects."""
    import threading
    import time

    from prism_tda.errors import Cancelled

    stop = threading.Event()
    stop.set()
    with pytest.raises(Cancelled, match="attribution was stopped"):
        att.attribute(COMPUTER, exact(), stop=stop)
    with pytest.raises(Cancelled, match="generation was stopped"):  # a generated target: token by token
        att.attribute(QuerySpec(COMPUTER.prompt, max_new_tokens=8), stop=stop)
    with pytest.raises(Cancelled, match="discovery"):
        att.discover(topic_docs=np.arange(50), measure="logit", stop=stop)
    # set mid-way: the exact pass stops well before its end
    t0 = time.perf_counter()
    att.attribute(COMPUTER, exact())
    full = time.perf_counter() - t0
    stop = threading.Event()
    threading.Timer(full / 4, stop.set).start()
    t0 = time.perf_counter()
    with pytest.raises(Cancelled):
        att.attribute(COMPUTER, exact(), stop=stop)
    assert time.perf_counter() - t0 < full * 0.75, (full, time.perf_counter() - t0)


def test_discovery_refuses_a_scan_over_its_limit_before_reading(att):
    with pytest.raises(QueryError, match="over the limit of 100"):
        att.discover(topic_docs=np.arange(20), max_tokens=100)
    n = att.reader.tokens_of_documents(np.arange(20))
    assert n == len(att.reader.rows_of_documents(np.arange(20)))
    ranked, *_ = att.discover(topic_docs=np.arange(20), max_tokens=n, min_support=1, min_docs=1)
    assert ranked


def test_the_damping_cache_is_bounded(att):
    for i in range(30):
        att.preconditioner(0.5 + 0.1 * i)
    assert len(att._pre) <= 8
    with pytest.raises(QueryError, match="damping"):
        att.preconditioner(float("nan"))


def test_exact_mode_is_estimated_before_it_starts(index, monkeypatch):
    """The estimate comes from a few timed batches (64 sequences, a small share of the pass) and covers
    every token; after an exact pass it is that pass's own rate. Checked by what the estimate is made of,
    not by wall-clock ratios, which a loaded machine changes (how close it comes is a benchmark's matter)."""
    import time

    import prism_tda.engine.exact as exact_module

    timed: list[int | None] = []
    real = exact_module.exhaustive

    def counting(*args, **kw):
        timed.append(kw.get("n_seqs"))
        return real(*args, **kw)

    monkeypatch.setattr(exact_module, "exhaustive", counting)
    att = Attributor.open(index)
    est = att.exact_estimate()
    assert timed == [64] and 64 < att.reader.n_seqs  # a few batches, not the pass
    assert est.tokens == att.reader.n_tokens and est.tokens_per_s > 0
    assert est.seconds == pytest.approx(est.tokens / est.tokens_per_s)
    assert att.exact_estimate() == est  # measured once
    t0 = time.perf_counter()
    att.attribute(COMPUTER, exact(3))
    pass_s = time.perf_counter() - t0
    after = att.exact_estimate()
    assert after.tokens == est.tokens and after.tokens_per_s != est.tokens_per_s
    assert 0 < after.seconds <= pass_s  # the pass's own recomputation, a part of the whole answer


def test_external_ids_read_alone_are_the_documents_ids(att):
    """A document's external id comes from its row group's id column alone (cached apart from the
    decoded row groups): the same id as the whole record's, for every document, and a bad id raises."""
    r = att.reader
    r._id_group.cache_clear()
    for d in range(r.n_docs):
        assert r.external_id(d) == str(r.document(d)["external_id"])
    assert r._id_group.cache_info().currsize >= 1
    for bad in (-1, r.n_docs):
        with pytest.raises(KeyError):
            r.external_id(bad)


def test_the_default_fast_path_leaves_faiss_out_and_n_candidates_brings_it_back(att, monkeypatch):
    """``n_candidates`` None (the served default) is 0 but under ``opponents``: the first stages are the
    posting lists alone, FAISS is never searched; above 0 its nearest sequences join the candidates."""
    calls = []
    search = att.reader.search_embedding

    def counted(e, n, nprobe=None):
        calls.append(n)
        return search(e, n, nprobe)

    monkeypatch.setattr(att.reader, "search_embedding", counted)
    assert QueryOptions().sketch_candidates == 0 and QueryOptions(opponents=True).sketch_candidates == 256
    assert QueryOptions(n_candidates=0, opponents=True).sketch_candidates == 0
    q = att.encode(COMPUTER)
    plain = att.attribute(COMPUTER, QueryOptions(n_documents=5))
    assert calls == [] and plain.documents
    att.attribute(COMPUTER, QueryOptions(n_documents=5, opponents=True))
    assert calls == [256]
    calls.clear()
    posting = set(att.candidate_sequences(q, 0))
    assert calls == []
    with_faiss = set(att.candidate_sequences(q, 64))
    assert calls == [64]
    found = set(search(att.reader.query_embedding(q.G * att.preconditioner().inv.sqrt()), 64)[1].tolist())
    assert with_faiss == posting | found and found - posting  # FAISS adds sequences the lists did not give
