"""The attribution engine: per-token view, exact scores against an independent computation,
fast path against the exact path, options, and query errors."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from prism_tda.engine import Attributor, FirstStages, QueryOptions, QuerySpec
from prism_tda.engine.candidates import fast_rows
from prism_tda.engine.scoring import score_rows
from prism_tda.engine.tokens import run_batch
from prism_tda.errors import PromptTooLongError, QueryError

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


def test_exact_scores_match_an_independent_computation(att, index):
    res = att.attribute(COMPUTER, exact(5))
    q = att.encode(COMPUTER)
    inv = att.preconditioner().inv
    seqs = pq.read_table(sorted((index / "sequences").glob("*.parquet"))).to_pydict()
    for d in res.documents:
        s, row = d.seq_id, d.token_row
        pos = row - int(att.reader.seq_tok0[s])
        tb = run_batch(att.model, [seqs["token_ids"][s]], [seqs["target_ids"][s]])  # the training sequence, anew
        ut = (tb.u[pos].double() @ att.reader.curv.Q.double())  # full precision, full rank
        raw = sum(float(a) * float((q.G[i].double() * inv[i].double() * ut).sum())
                  for i, a in zip(tb.proto_idx[pos].tolist(), tb.acts[pos], strict=True) if a > 0)
        assert raw == pytest.approx(d.raw_influence, rel=2e-2, abs=1e-3 * abs(raw) + 1e-6)
        assert -1.0 - 1e-6 <= d.score <= 1.0 + 1e-6


def test_fast_path_reranks_exactly_and_finds_the_exact_top(att):
    for spec in [COMPUTER, QuerySpec("Love is", " a"), QuerySpec("The")]:
        ex = att.attribute(spec, exact())
        fast = att.attribute(spec, QueryOptions(n_documents=10, n_candidates=10_000))
        # with every sequence a candidate, the fast path is the exact path
        assert [d.doc_id for d in fast.documents] == [d.doc_id for d in ex.documents]
        narrow = att.attribute(spec, QueryOptions(n_documents=10, n_candidates=32))
        scores = {d.doc_id: d.score for d in ex.documents}
        for d in narrow.documents:  # exact re-rank: a document found scores as in the exact path
            if d.doc_id in scores:
                assert d.score == pytest.approx(scores[d.doc_id], rel=1e-6)
        assert narrow.rows_scored < ex.rows_scored


def test_opponents_are_negative_and_ordered(att):
    res = att.attribute(COMPUTER, exact(5, opponents=True))
    scores = [d.score for d in res.documents]
    assert scores == sorted(scores) and scores[0] < 0
    assert [d.rank for d in res.documents] == [1, 2, 3, 4, 5]


def test_single_target_token_and_generation(att):
    full = att.encode(COMPUTER)
    one = att.encode(QuerySpec("A computer", " is a", target_index=1))
    assert one.target_ids == full.target_ids[1:2]
    gen = att.encode(QuerySpec("A computer", max_new_tokens=3))
    assert 1 <= len(gen.target_ids) <= 3
    own = att.encode(QuerySpec("A computer is"))
    assert own.target_positions == list(range(len(own.token_ids) - 1))
    assert torch.isfinite(own.G).all() and att.preconditioner().self_influence(own.G) > 0


def test_bad_queries(att):
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
    assert np.all(att.reader.tok_self >= 0)


def test_documents_carry_snippet_highlights_and_prototypes(att, index):
    res = att.attribute(COMPUTER, exact(5))
    docs = pq.read_table(sorted((index / "documents").glob("*.parquet")), columns=["doc_id", "external_id"]).to_pydict()
    external = dict(zip(docs["doc_id"], docs["external_id"], strict=True))
    query_protos = set(att.encode(COMPUTER).prototypes.tolist())
    for d in res.documents:
        assert d.external_id == external[d.doc_id]
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
    for aggregation in s:  # every aggregation ranks the documents as document_scores says
        res = att.attribute(COMPUTER, exact(5, aggregation=aggregation))
        top = np.argsort(-s[aggregation], kind="stable")[:5]
        assert [d.score for d in res.documents] == pytest.approx(s[aggregation][top].tolist())
        assert res.aggregation == aggregation


def test_damping_is_a_query_option(att):
    base = att.attribute(COMPUTER, exact(5))
    assert base.damping == att.reader.cfg.damping
    low = att.attribute(COMPUTER, exact(5, damping=0.01))
    assert low.damping == 0.01 and [d.score for d in low.documents] != [d.score for d in base.documents]
    # the same damping given explicitly is the index's default, to the bit
    same = att.attribute(COMPUTER, exact(5, damping=att.reader.cfg.damping))
    assert [d.score for d in same.documents] == [d.score for d in base.documents]
    # I(t, t) computed on demand agrees with the precomputed one at the index's damping
    tok = np.arange(0, att.reader.n_tokens, 97)
    on_demand = att.reader.token_self_influence(tok, att.reader.inv(att.reader.cfg.damping))
    assert on_demand == pytest.approx(att.reader.tok_self[tok], rel=1e-9)


def test_token_stage_adds_the_best_tokens_sequences_to_the_faiss_candidates(index):
    att = Attributor.open(index)
    pre = att.preconditioner()
    q = att.encode(QuerySpec("A computer", " is a machine"))
    seqs, rows = fast_rows(att.reader, q.G, pre, 8, FirstStages(proto_candidates=1, token_candidates=16))
    base, _ = fast_rows(att.reader, q.G, pre, 8, FirstStages(proto_candidates=0))
    assert set(base) <= set(seqs) and len(seqs) > len(base)
    # the best token of the heaviest prototype's posting list sits in a candidate sequence
    p = int((q.G * q.G * pre.inv).sum(1).argmax())
    s = score_rows(att.reader, q.G, pre, att.reader.posting(p))
    assert att.reader.tok_seq[s.tok[np.argmax(s.cos)]] in set(seqs)
    assert np.array_equal(rows, np.concatenate([np.arange(att.reader.seq_row0[s], att.reader.seq_row0[s + 1])
                                                 for s in seqs]))
