"""The same text indexed more than once: its windows run through the model once in a re-rank, every
copy takes their scores, and the fast path's first re-rank pass counts distinct windows, not copies."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prism_tda.engine import Attributor, QueryOptions, QuerySpec, scoring
from prism_tda.engine.scoring import exact_scores, unit_keys
from prism_tda.indexer.run import build_index
from tests.conftest import index_cfg

COPIES = 4


@pytest.fixture(scope="module")
def dup(tiny_ckpt, tiny_corpus, tmp_path_factory) -> tuple[Attributor, dict]:
    """120 documents of the tiny corpus plus ``COPIES`` copies of a long one and of a short one, under
    new ids."""
    docs = [json.loads(line) for line in open(tiny_corpus)][:120]
    long_doc = max(docs[:60], key=lambda d: len(d["text"]))
    short_doc = next(d for d in docs[60:] if 40 < len(d["text"]) < 80)
    extra = [{**d, "id": f"copy/{name}/{i}"} for name, d in (("long", long_doc), ("short", short_doc))
             for i in range(COPIES)]
    path = tmp_path_factory.mktemp("dup") / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs + extra))
    out = tmp_path_factory.mktemp("dupix") / "ix"
    build_index(tiny_ckpt, [path], out, index_cfg(), progress=False)
    att = Attributor.open(out)
    ids = {att.reader.document(d)["external_id"]: d for d in range(att.reader.n_docs)}
    return att, {"long": long_doc, "short": short_doc, "ids": ids}


def _seqs_of(att: Attributor, doc: int) -> np.ndarray:
    return np.flatnonzero(att.reader.doc_of_seqs(np.arange(att.reader.n_seqs)) == doc)


def test_copies_run_once_and_score_as_computed_alone(dup, monkeypatch):
    att, info = dup
    ids = info["ids"]
    copies = [ids[f"copy/long/{i}"] for i in range(COPIES)]
    seqs = np.concatenate([_seqs_of(att, d) for d in copies] + [_seqs_of(att, 5), _seqs_of(att, 9)])
    assert len(_seqs_of(att, copies[0])) > 1  # a document of several windows
    q = att.encode(QuerySpec("The only way", " to be"))
    pre = att.preconditioner()
    runs = []
    real = scoring.run_batch

    def counting(model, toks, tgts, positions=None):
        runs.append(len(toks))
        return real(model, toks, tgts, positions=positions)

    monkeypatch.setattr(scoring, "run_batch", counting)
    both = exact_scores(att.model, att.reader, q.G, pre, seqs)
    windows = len(_seqs_of(att, copies[0])) + len(_seqs_of(att, 5)) + len(_seqs_of(att, 9))
    assert sum(runs) == windows  # each distinct window once
    monkeypatch.setattr(scoring, "run_batch", real)
    # every copy's rows are its first copy's, shifted to its own rows
    spans = [att.reader.seq_span(int(s)) for s in seqs]
    n_win = len(_seqs_of(att, copies[0]))
    for c in range(1, COPIES):
        for w in range(n_win):
            (a0, a1, _), (b0, b1, _) = spans[w], spans[c * n_win + w]
            ra, rb = (both.tok >= a0) & (both.tok < a1), (both.tok >= b0) & (both.tok < b1)
            assert np.array_equal(both.tok[rb] - b0, both.tok[ra] - a0)
            for f in ("raw", "cos", "protos", "slot_val"):
                assert np.array_equal(getattr(both, f)[rb], getattr(both, f)[ra])
    # and what each sequence computed alone gives (a batch of another shape rounds the last bits, which
    # can swap a prototype of nearly equal similarity in or out of a token's active set: those rows aside)
    alone = [exact_scores(att.model, att.reader, q.G, pre, np.array([s])) for s in seqs]
    tok = np.concatenate([a.tok for a in alone])
    assert np.array_equal(np.sort(tok), both.tok)
    order = np.argsort(tok)
    protos = np.concatenate([a.protos for a in alone])[order]
    same = (np.sort(protos, 1) == np.sort(both.protos, 1)).all(1)
    assert same.mean() > 0.99
    for f in ("raw", "cos"):
        want = np.concatenate([getattr(a, f) for a in alone])[order][same]
        np.testing.assert_allclose(getattr(both, f)[same], want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
    # only some rows asked: the copies' same positions
    rows = np.concatenate([att.reader.seq_span(int(s))[0] + np.array([0, 2]) for s in seqs[:2]])
    part = exact_scores(att.model, att.reader, q.G, pre, seqs[:2], tokens=rows)
    assert np.array_equal(part.tok, np.sort(rows))


def test_unit_keys_tell_copies_from_other_windows(dup):
    att, info = dup
    ids = info["ids"]
    a, b = (_seqs_of(att, ids[f"copy/short/{i}"]) for i in (0, 1))
    other = _seqs_of(att, 7)[:1]
    lo_a, lo_b = att.reader.seq_span(int(a[0]))[0], att.reader.seq_span(int(b[0]))[0]
    keys = unit_keys(att.reader, [(a, None), (b, None), (other, None), (a, np.array([lo_a + 1])),
                                  (b, np.array([lo_b + 1])), (b, np.array([lo_b + 2]))])
    assert keys[0] == keys[1] != keys[2]
    assert keys[3] == keys[4] != keys[5] and keys[3] != keys[0]  # the positions scored are part of it


def test_first_rerank_pass_counts_distinct_windows(dup, monkeypatch):
    """The first pass re-ranks the first ``n_documents`` distinct windows of the shortlist with every copy
    of them (free: they run once), and the answer is what re-ranking every shortlisted document gives."""
    from prism_tda.engine import attributor

    att, info = dup
    ids = info["ids"]
    ids_ = att.tokenizer.encode(info["short"]["text"]).ids[:24]
    spec = QuerySpec(att.tokenizer.decode(ids_[:12]), att.tokenizer.decode(ids_[12:]))
    n = 8
    opts = dict(n_documents=n, include_untrained=True, n_candidates=100_000, exact_rerank=64)
    calls = []
    real = attributor.exact_scores

    def recording(model, reader, G, pre, seqs, **kw):
        calls.append(np.asarray(seqs if kw.get("tokens") is None else reader.seq_of_tokens(kw["tokens"])))
        return real(model, reader, G, pre, seqs, **kw)

    monkeypatch.setattr(attributor, "exact_scores", recording)
    res = att.attribute(spec, QueryOptions(**opts))
    monkeypatch.setattr(attributor, "exact_scores", real)
    first = np.unique(calls[0])
    copy_docs = [ids[f"copy/short/{i}"] for i in range(COPIES)] + [ids[info["short"]["id"]]]
    in_first = np.isin(copy_docs, att.reader.doc_of_seqs(first))
    assert in_first.any()  # the copied text is in the first pass (the setting's premise)
    assert in_first.all()  # ... with every copy of it
    keys = {att.reader.sequence_tokens(int(s))[0].__repr__() for s in first}
    assert len(keys) == n and len(first) >= n + COPIES  # n distinct windows, more documents
    full = att.attribute(spec, QueryOptions(**opts, adaptive_rerank=False))
    assert [d.score for d in res.documents] == pytest.approx([d.score for d in full.documents], rel=1e-4)
