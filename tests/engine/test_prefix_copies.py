"""Text that documents share (a licence header): every window holding the same tokens up to a re-scored
row takes that row's exact score, so the fast path breaks the tie as exact mode does (by the documents'
summed cosines, or with ``tie_break: score`` the lowest ids)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prism_tda.engine import Attributor, QueryOptions, QuerySpec, scoring
from prism_tda.indexer.run import build_index
from tests.conftest import index_cfg

SHARING = 12


@pytest.fixture(scope="module")
def shared(tiny_ckpt, tiny_corpus, tmp_path_factory) -> tuple[Attributor, str, list[int]]:
    """100 documents of the tiny corpus, then ``SHARING`` documents that open with the same header
    and go on with different text; the header, and their ids."""
    docs = [json.loads(line) for line in open(tiny_corpus)]
    head = "Permission is hereby granted, free of charge, to any person obtaining a copy of this"
    extra = [{"id": f"shared/{i}", "text": head + " " + d["text"]} for i, d in enumerate(docs[200 : 200 + SHARING])]
    path = tmp_path_factory.mktemp("shared") / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs[:100] + extra))
    out = tmp_path_factory.mktemp("sharedix") / "ix"
    build_index(tiny_ckpt, [path], out, index_cfg(), progress=False)
    att = Attributor.open(out)
    ids = {att.reader.document(d)["external_id"]: d for d in range(att.reader.n_docs)}
    return att, head, sorted(ids[f"shared/{i}"] for i in range(SHARING))


def test_documents_sharing_text_tie_as_in_exact_mode(shared, monkeypatch):
    import prism_tda.engine.shards as shards

    att, head, sharing = shared
    words = head.split()
    spec = QuerySpec(" ".join(words[:6]), " " + " ".join(words[6:9]))
    n = 4
    # by default the tied documents that go on most like the query are returned, in both modes
    settled = att.attribute(spec, QueryOptions(mode="exact", n_documents=n, include_untrained=True))
    assert settled.tied_beyond_last == SHARING - n and {d.doc_id for d in settled.documents} <= set(sharing)
    fast_settled = att.attribute(spec, QueryOptions(n_documents=n, include_untrained=True, n_candidates=100_000))
    assert {d.doc_id for d in fast_settled.documents} == {d.doc_id for d in settled.documents}
    # with the score's own tie-break (then the lower id)
    base = dict(n_documents=n, include_untrained=True, tie_break="score")
    ex = att.attribute(spec, QueryOptions(mode="exact", **base)).documents
    # the header's documents tie exactly at the top; exact mode keeps the lowest ids
    assert [d.doc_id for d in ex] == sharing[:n]
    assert len({d.score for d in ex}) == 1
    # the shortlist sees the lowest ids a little lower than their copies (compressed scores differ in
    # the last digits) and holds fewer documents than share the header
    real = shards.approx_scores
    low = set(sharing[: SHARING // 2])

    def noisy(reader, G, pre, tok, match=None):
        out = real(reader, G, pre, tok, match)
        hit = np.isin(reader.doc_of_seqs(reader.seq_of_tokens(out.tok)), list(low))
        out.cos = np.where(hit, out.cos - 1e-3, out.cos)
        return out

    monkeypatch.setattr(shards, "approx_scores", noisy)
    fast = dict(n_candidates=100_000, exact_rerank=n, **base)
    got = att.attribute(spec, QueryOptions(**fast)).documents
    assert [d.doc_id for d in got] == sharing[:n]
    for g, e in zip(got, ex, strict=True):
        assert g.score == pytest.approx(e.score, rel=1e-5)
        assert g.token_row - att.reader.seq_span(g.seq_id)[0] == e.token_row - att.reader.seq_span(e.seq_id)[0]
    monkeypatch.setattr(scoring, "PREFIX_COPIES", False)  # without the copies: the shortlist's documents
    without = [d.doc_id for d in att.attribute(spec, QueryOptions(**fast)).documents]
    assert not set(without) & low


def test_copies_reach_exactly_the_windows_that_share_the_text_and_score_as_recomputed(shared):
    att, head, sharing = shared
    r = att.reader
    q = att.encode(QuerySpec(head[:40], head[40:60]))
    pre = att.preconditioner()
    doc_of = r.doc_of_seqs(np.arange(r.n_seqs))
    firsts = np.array([np.flatnonzero(doc_of == d)[0] for d in sharing])  # each one's opening window
    two = scoring.exact_scores(att.model, r, q.G, pre, firsts[:2])
    out = scoring.prefix_copies(r, two, np.arange(r.n_seqs), "cosine_max", 1.0, 2)
    new = np.setdiff1d(out.tok, two.tok)
    # the two tie, so their best row is copied to the other documents' opening windows, and nowhere else
    assert sorted(r.doc_of_seqs(r.seq_of_tokens(new)).tolist()) == sharing[2:]
    assert np.array_equal(np.sort(r.seq_of_tokens(new)), np.sort(firsts[2:]))
    again = scoring.exact_scores(att.model, r, q.G, pre, firsts[2:], tokens=new)
    np.testing.assert_allclose(out.cos[np.isin(out.tok, new)], again.cos, rtol=1e-5)
    np.testing.assert_allclose(out.raw[np.isin(out.tok, new)], again.raw, rtol=1e-5)
    # a window the re-rank scored already, in a batch of another shape: it takes the source's values, so
    # the text ties exactly whatever the batch's rounding
    third = scoring.exact_scores(att.model, r, q.G, pre, firsts[2:3])
    both = scoring.concat_scores([two, third], r.k)
    out2 = scoring.prefix_copies(r, both, np.arange(r.n_seqs), "cosine_max", 1.0, 2)
    best2 = two.tok[np.argmax(two.cos)]
    row3 = out.tok[np.isin(r.seq_of_tokens(out.tok), firsts[2:3]) & np.isin(out.tok, new)]
    assert len(row3) == 1 and out2.cos[np.searchsorted(out2.tok, row3[0])] == two.cos[two.tok == best2][0]
    # no exact tie among the best: nothing is added; a sum aggregation: nothing either
    lone = scoring.exact_scores(att.model, r, q.G, pre, np.array([0, 1, 2]))
    assert scoring.prefix_copies(r, lone, np.arange(r.n_seqs), "cosine_max", 1.0, 2) is lone
    assert scoring.prefix_copies(r, two, np.arange(r.n_seqs), "cosine_sum", 1.0, 2) is two
