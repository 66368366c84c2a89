"""The attribution engine: per-token view, exact scores against an independent computation,
fast path against the exact path, and query errors."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from prism_tda.attribution import Attributor, QueryError
from prism_tda.indexer.forward import run_batch


@pytest.fixture(scope="module")
def att(index) -> Attributor:
    return Attributor.open(index)


def test_per_token_view_adds_up_to_the_logit(att):
    res = att.attribute("The only way", " to be", top_k=3)
    assert len(res["per_token"]) == len(res["query"]["target_ids"]) >= 1
    for t in res["per_token"]:
        total = sum(p["contribution"] for p in t["prototypes"]) + t["residual"]
        assert abs(total - t["logit"]) < 1e-3
        assert 1 <= len(t["prototypes"]) <= att.model.cfg.top_k


def test_exact_scores_match_an_independent_computation(att, index):
    res = att.attribute("A computer", " is a", mode="exact", top_k=5)
    q = att.encode_query("A computer", " is a")
    seqs = pq.read_table(sorted((index / "sequences").glob("*.parquet"))).to_pydict()
    for d in res["documents"]:
        s, row = d["seq_id"], d["token_row"]
        pos = row - int(att.seq_tok0[s])
        tb = run_batch(att.model, [seqs["token_ids"][s]], [seqs["target_ids"][s]])  # the training sequence, anew
        ut = (tb.u[pos].double() @ att.curv.Q.double())  # full precision, full rank
        raw = sum(float(a) * float((q.G[i].double() * att.inv[i].double() * ut).sum())
                  for i, a in zip(tb.proto_idx[pos].tolist(), tb.acts[pos]) if a > 0)
        assert raw == pytest.approx(d["raw_influence"], rel=2e-2, abs=1e-3 * abs(raw) + 1e-6)
        assert -1.0 - 1e-6 <= d["score"] <= 1.0 + 1e-6


def test_fast_path_reranks_exactly_and_finds_the_exact_top(att):
    for prompt, completion in [("A computer", " is a"), ("Love is", " a"), ("The", None)]:
        exact = att.attribute(prompt, completion, mode="exact", top_k=10)
        fast = att.attribute(prompt, completion, mode="fast", top_k=10, n_candidates=10_000)
        # with every sequence a candidate, the fast path is the exact path
        assert [d["doc_id"] for d in fast["documents"]] == [d["doc_id"] for d in exact["documents"]]
        narrow = att.attribute(prompt, completion, mode="fast", top_k=10, n_candidates=32)
        ex = {d["doc_id"]: d["score"] for d in exact["documents"]}
        for d in narrow["documents"]:  # exact re-rank: a document found scores as in the exact path
            if d["doc_id"] in ex:
                assert d["score"] == pytest.approx(ex[d["doc_id"]], rel=1e-6)
        assert narrow["rows_scored"] < exact["rows_scored"]


def test_opponents_are_negative_and_ordered(att):
    res = att.attribute("A computer", " is a", mode="exact", top_k=5, opponents=True)
    scores = [d["score"] for d in res["documents"]]
    assert scores == sorted(scores) and scores[0] < 0


def test_single_target_token_and_generation(att):
    full = att.encode_query("A computer", " is a")
    one = att.encode_query("A computer", " is a", target_index=1)
    assert one.target_ids == full.target_ids[1:2]
    gen = att.encode_query("A computer", max_new_tokens=3)
    assert 1 <= len(gen.target_ids) <= 3
    own = att.encode_query("A computer is")
    assert own.target_positions == list(range(len(own.token_ids) - 1))
    assert torch.isfinite(own.G).all() and own.self_influence > 0


def test_bad_queries(att):
    with pytest.raises(QueryError, match="empty"):
        att.attribute("", " x")
    with pytest.raises(QueryError, match="context"):
        att.attribute("word " * 200, " x")
    with pytest.raises(QueryError, match="target_index"):
        att.encode_query("A computer", " is", target_index=5)
    with pytest.raises(QueryError, match="mode"):
        att.attribute("A", " b", mode="nope")
    assert np.all(att.tok_self >= 0)


def test_documents_carry_snippet_highlights_and_prototypes(att, index):
    res = att.attribute("A computer", " is a", mode="exact", top_k=5)
    docs = pq.read_table(sorted((index / "documents").glob("*.parquet")), columns=["doc_id", "external_id"]).to_pydict()
    external = dict(zip(docs["doc_id"], docs["external_id"], strict=True))
    q = att.encode_query("A computer", " is a")
    query_protos = set((q.G.abs().sum(1) > 0).nonzero().flatten().tolist())
    for d in res["documents"]:
        assert d["external_id"] == external[d["doc_id"]]
        assert d["snippet"] and d["highlights"]
        for h in d["highlights"]:
            assert d["snippet"][h["start"]:h["end"]] == h["text"] and 0 < h["weight"] <= 1 + 1e-9
        # the best token is highlighted with weight 1
        assert any(h["token_row"] == d["token_row"] and h["weight"] == pytest.approx(1.0) for h in d["highlights"])
        shares = [p["share"] for p in d["prototypes"]]
        assert sum(abs(s) for s in shares) == pytest.approx(1.0) and shares == sorted(shares, reverse=True)
        assert {p["proto_id"] for p in d["prototypes"]} <= query_protos


def test_document_scores_cover_every_document_and_agree_with_the_ranking(att):
    q = att.encode_query("A computer", " is a")
    s = att.document_scores(q, mode="exact")
    assert s["cosine_max"].shape == s["raw_sum"].shape == (att.n_docs,)
    res = att.attribute("A computer", " is a", mode="exact", top_k=5)
    top = np.argsort(-s["cosine_max"], kind="stable")[:5]
    assert [d["score"] for d in res["documents"]] == pytest.approx(s["cosine_max"][top].tolist())


def test_token_stage_adds_the_best_tokens_sequences_to_the_faiss_candidates(index):
    with_stage = Attributor.open(index, proto_candidates=1, token_candidates=16)
    faiss_only = Attributor.open(index, proto_candidates=0)
    q = with_stage.encode_query("A computer", " is a machine")
    seqs, rows = with_stage.candidate_rows(q, 8)
    base, _ = faiss_only.candidate_rows(q, 8)
    assert set(base) <= set(seqs) and len(seqs) > len(base)
    # the best token of the heaviest prototype's posting list sits in a candidate sequence
    weight = (q.G * q.G * with_stage.inv).sum(1)
    p = int(weight.argmax())
    post = with_stage.post_rows[with_stage.post_start[p] : with_stage.post_start[p + 1]]
    tok, raw, _, _ = with_stage._score_rows(q, post)
    best = tok[np.argmax(with_stage._token_cosines(q, raw, tok))]
    assert with_stage.tok_seq[best] in set(seqs)
    assert np.array_equal(rows, np.concatenate([np.arange(with_stage.seq_row0[s], with_stage.seq_row0[s + 1])
                                                 for s in seqs]))
