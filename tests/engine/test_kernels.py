"""The compiled scoring of stored codes and the re-rank's batching: against the numpy and decoded
computations they replace."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch

from prism_tda.engine import Attributor, QueryOptions, QuerySpec, kernels
from prism_tda.engine.aggregate import best_of_groups
from prism_tda.engine.codec import TABLES_BYTES, pack, unpack
from prism_tda.engine.kernels import _unpack_row, over_parts
from prism_tda.engine.scoring import approx_scores, score_tokens
from prism_tda.engine.tokens import WIDTH_STEP, length_batches, width_batches
from prism_tda.indexer.run import build_index
from tests.conftest import index_cfg


@pytest.mark.parametrize("bits", [8, 12, 16])
def test_unpacking_a_row_matches_the_codec(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(50, 16))
    packed = pack(codes, bits)
    out = np.empty(16, np.int64)
    for r in range(len(codes)):
        _unpack_row(packed, r, bits, 16, out)
        assert np.array_equal(out, codes[r])
    assert np.array_equal(unpack(packed, bits, 16), codes)


def test_length_batches_are_the_cheapest_partition():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(1, 129, size=int(rng.integers(1, 8)))
        per_call, cap = 100, 400
        groups = length_batches(lengths, cap, per_call)
        assert np.array_equal(np.sort(np.concatenate(groups)), np.arange(len(lengths)))

        def cost(gs, lengths=lengths, per_call=per_call) -> float:
            return sum(len(g) * lengths[g].max() + per_call for g in gs)

        for g in groups:
            assert len(g) == 1 or len(g) * lengths[g].max() <= cap
        # every partition into runs of the sorted lengths, within the cap: none is cheaper
        order = np.argsort(lengths, kind="stable")
        n = len(lengths)
        best = np.inf
        for cuts in itertools.product([False, True], repeat=n - 1):
            bounds = [0, *[i + 1 for i, c in enumerate(cuts) if c], n]
            gs = [order[a:b] for a, b in itertools.pairwise(bounds)]
            if all(len(g) == 1 or len(g) * lengths[g].max() <= cap for g in gs):
                best = min(best, cost(gs))
        assert cost(groups) == pytest.approx(best)


@pytest.fixture(scope="module")
def att12(tiny_ckpt, tiny_corpus, tmp_path_factory) -> Attributor:
    """An index with 12-bit codes (two per three bytes) and direction codes, in several shards."""
    out = tmp_path_factory.mktemp("index12") / "ix"
    build_index(tiny_ckpt, [tiny_corpus], out, index_cfg(code_bits=12, code_subquantizers=8), progress=False)
    return Attributor.open(out)


def test_compiled_scores_are_the_decoded_vectors_scores(att12):
    r = att12.reader
    assert len(r.shards) > 1 and r.codec.bits == 12
    pre = att12.preconditioner()
    tok = np.arange(0, r.n_tokens, 3)
    dirs = r.token_code_dirs(tok)
    assert dirs.any() and not dirs.all()  # both kinds of codes are scored
    for spec in [QuerySpec("A computer", " is a"), QuerySpec("Love is", " a")]:
        q = att12.encode(spec)
        ap = approx_scores(r, q.G, pre, tok)
        data = r.token_data(tok)
        dec = score_tokens(tok, data.protos, data.acts, r.token_vectors(tok, data), data.self_influence, q.G, pre,
                           exact=False)
        assert np.array_equal(ap.protos, data.protos)
        np.testing.assert_allclose(ap.slot_val, dec.slot_val, rtol=1e-3, atol=1e-5 * np.abs(dec.slot_val).max())
        np.testing.assert_allclose(ap.cos, dec.cos, rtol=1e-3, atol=1e-5)
        assert (ap.slot_val != 0).any(1).sum() > 10


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_parts_are_each_covered_once_on_threads(monkeypatch, threads):
    monkeypatch.setattr(kernels, "MIN_ROWS_PER_THREAD", 4)
    sizes = [0, 3, 40, 1, 17, 0, 64]
    seen = [np.zeros(n, np.int64) for n in sizes]
    who: set[str] = set()

    def visit(i: int, sl: slice) -> None:
        who.add(threading.current_thread().name)
        seen[i][sl] += 1

    over_parts(sizes, visit, threads)
    assert all((v == 1).all() for v in seen)
    # one thread: the caller's own; more: the pool's (as many at once as asked, at most)
    assert all(w.startswith("prism-kernels") for w in who) == (threads > 1)


def test_scores_over_many_shards_on_threads_equal_one_thread(att12, monkeypatch):
    """Every shard's rows on the threads at once (as at many shards, each with a few hundred of a
    query's rows) gives the one-thread answer bitwise, rows in their own order."""
    r, pre = att12.reader, att12.preconditioner()
    tok = np.arange(1, r.n_tokens, 2)
    assert len(np.unique(np.searchsorted(r.tok_base, tok, side="right"))) > 2
    q = att12.encode(QuerySpec("A computer", " is a"))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = approx_scores(r, q.G, pre, tok)
        monkeypatch.setattr(kernels, "MIN_ROWS_PER_THREAD", 16)
        torch.set_num_threads(3)
        many = approx_scores(r, q.G, pre, tok)
    finally:
        torch.set_num_threads(old)
    for f in ("tok", "protos", "slot_val", "raw", "cos"):
        assert np.array_equal(getattr(one, f), getattr(many, f)), f


def test_rows_copied_out_first_score_as_rows_read_in_place(att12, monkeypatch):
    """The large-shard path (each chunk's stored bytes copied out, then computed) gives the in-place
    path's answer bitwise, over chunk boundaries and both kinds of codes."""
    r, pre = att12.reader, att12.preconditioner()
    tok = np.arange(r.n_tokens)
    dirs = r.token_code_dirs(tok)
    q = att12.encode(QuerySpec("The", " cat sat on the mat."))
    assert all(len(sh.protos) < kernels.GATHER_MIN_ROWS for sh in r.shards)
    in_place = approx_scores(r, q.G, pre, tok)
    hits = (in_place.slot_val != 0).any(1)
    assert hits.sum() > 3 * kernels.GATHER_ROWS and (hits & dirs).sum() >= 5  # both kinds of codes scored
    monkeypatch.setattr(kernels, "GATHER_MIN_ROWS", 0)
    copied = approx_scores(r, q.G, pre, tok)
    for f in ("protos", "slot_val", "raw", "cos"):
        assert np.array_equal(getattr(in_place, f), getattr(copied, f)), f


def test_adaptive_rerank_recomputes_fewer_documents_for_the_same_top(att12):
    agree, fewer = [], []
    for spec in [QuerySpec("A computer", " is a"), QuerySpec("Love is", " a"), QuerySpec("The only way", " to"),
                 QuerySpec("Never", " give")]:
        full = att12.attribute(spec, QueryOptions(n_documents=5, exact_rerank=24, adaptive_rerank=False))
        ada = att12.attribute(spec, QueryOptions(n_documents=5, exact_rerank=24))
        assert full.documents_reranked == 24
        assert 5 <= ada.documents_reranked <= 24
        fewer.append(ada.documents_reranked < full.documents_reranked)
        # a document both return has its one exact score
        both = {d.doc_id: d.score for d in full.documents}
        for d in ada.documents:
            if d.doc_id in both:
                assert d.score == pytest.approx(both[d.doc_id], rel=1e-5)
        agree.append(len(both.keys() & {d.doc_id for d in ada.documents}))
    assert sum(agree) >= 0.9 * 5 * len(agree) and any(fewer)


def test_best_of_sorted_groups_is_the_stable_sorts_first():
    """The compiled pass over runs picks what a stable sort by (group, -value, -tie) puts first, NaN
    included."""
    rng = np.random.default_rng(0)
    for t in range(500):
        n = int(rng.integers(1, 60))
        g = np.sort(rng.integers(0, 8, n))
        v, w = rng.integers(0, 4, n).astype(float), rng.integers(0, 3, n).astype(float)
        if t % 3 == 0:
            v[rng.random(n) < 0.2], w[rng.random(n) < 0.2] = np.nan, np.nan
        for keys, tie in (((-w, -v, g), w), ((-v, g), None)):
            order = np.lexsort(keys)
            first = order[np.r_[True, g[order][1:] != g[order][:-1]]]
            assert np.array_equal(best_of_groups(g, v, tie), first)
    # groups out of order take the sort
    g = np.array([2, 1, 2, 1])
    assert np.array_equal(best_of_groups(g, np.array([1.0, 2.0, 3.0, 0.0])), [1, 2])


def test_lookup_tables_are_kept_within_their_byte_budget(att12):
    codec = att12.reader.codec
    d = codec.centroids.shape[0] * codec.centroids.shape[2]
    rng = np.random.default_rng(0)
    small = torch.from_numpy(rng.standard_normal((4, d)).astype(np.float32))
    first = codec.lookup_tables(small)
    assert codec.lookup_tables(small.clone())[0] is first[0]  # the same columns: the tables kept
    per_column = sum(t.numel() * t.element_size() for t in first if t is not None) / 4
    for _ in range(3 * TABLES_BYTES // int(4 * per_column) + 2):  # more than the budget holds
        codec.lookup_tables(torch.from_numpy(rng.standard_normal((4, d)).astype(np.float32)))
        assert sum(size for _, size in codec._tables.values()) <= TABLES_BYTES
    big = torch.from_numpy(rng.standard_normal((int(TABLES_BYTES / per_column) + 1, d)).astype(np.float32))
    codec.lookup_tables(big)
    assert codec.lookup_tables(big)[0] is not codec.lookup_tables(big)[0]  # too big to keep


def test_width_batches_group_sequences_by_their_rounded_length():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 129, size=300)
    batches = width_batches(lengths, 16, 128)
    assert np.array_equal(np.sort(np.concatenate([b for b, _ in batches])), np.arange(300))
    for at, w in batches:
        assert 1 <= len(at) <= 16 and w % WIDTH_STEP == 0 and w <= 128
        assert (lengths[at] <= w).all() and (lengths[at] > w - WIDTH_STEP).all()  # pads under one step
