"""Rewriting shards (``indexer/merge.py``): an index merged into one shard answers as the original,
copies of a shard under other work units are found under their own ids; the index's sequences and
documents as the product reads them."""

from __future__ import annotations

import numpy as np

from prism_tda.engine import Attributor, QueryOptions, QuerySpec, layout
from prism_tda.engine.reader import IndexReader
from prism_tda.engine.reads import document_table
from prism_tda.engine.scoring import approx_scores
from prism_tda.indexer.merge import merge_index
from prism_tda.indexer.run import build_index
from tests.conftest import index_cfg

SPECS = [QuerySpec("A computer", " is a"), QuerySpec("Love is", " a")]


def test_an_index_merged_into_one_shard_answers_as_the_original(index, tmp_path):
    merged = merge_index(index, tmp_path / "merged")
    assert len(layout.read_manifest(merged).shards) == 1 and len(layout.read_manifest(index).shards) > 1
    a, b = Attributor.open(index), Attributor.open(merged)
    assert (a.reader.n_tokens, a.reader.n_seqs, a.reader.n_docs) == (b.reader.n_tokens, b.reader.n_seqs, b.reader.n_docs)
    for spec in SPECS:
        for agg in ("cosine_max", "raw_sum"):
            ra = a.attribute(spec, QueryOptions(n_documents=8, mode="exact", aggregation=agg))
            rb = b.attribute(spec, QueryOptions(n_documents=8, mode="exact", aggregation=agg))
            assert [(d.doc_id, d.external_id, d.token_row) for d in ra.documents] == \
                   [(d.doc_id, d.external_id, d.token_row) for d in rb.documents]
            np.testing.assert_allclose([d.score for d in ra.documents], [d.score for d in rb.documents], rtol=1e-6)
        fa = {d.doc_id for d in a.attribute(spec, QueryOptions(n_documents=8)).documents}
        fb = {d.doc_id for d in b.attribute(spec, QueryOptions(n_documents=8)).documents}
        assert len(fa & fb) >= 6  # the first stages see the same rows (their ties may fall apart)
    # the stored codes read the same, direction-coded tokens included (their bits merged in row order)
    rows = np.arange(a.reader.n_tokens)
    dirs = a.reader.token_code_dirs(rows)
    assert dirs.any() and np.array_equal(dirs, b.reader.token_code_dirs(rows))
    q, pre_a, pre_b = a.encode(SPECS[0]), a.preconditioner(), b.preconditioner()
    np.testing.assert_allclose(approx_scores(a.reader, q.G, pre_a, rows).raw, approx_scores(b.reader, q.G, pre_b, rows).raw,
                               rtol=1e-3, atol=1e-6)
    # done already: the same directory is kept
    assert merge_index(index, tmp_path / "merged") == merged


def test_copies_of_a_shard_are_found_under_their_own_ids(index, tmp_path):
    two = merge_index(index, tmp_path / "two", copies=2)
    one = Attributor.open(index)
    att = Attributor.open(two)
    assert att.reader.n_seqs == 2 * one.reader.n_seqs
    reader = att.local_reader("test")
    q = att.encode(SPECS[0])
    e = reader.query_embedding(q.G * att.preconditioner().inv.sqrt())
    _, seqs = reader.search_embedding(e, 40)
    n = one.reader.n_seqs
    assert (seqs < n).any() and (seqs >= n).any()  # both copies answer, each under its own ids
    first = sorted(s for s in seqs.tolist() if s < n)
    assert sorted(s - n for s in seqs.tolist() if s >= n) == first  # the copies' rows match


def test_sequences_and_documents_as_the_product_reads_them(index):
    r = IndexReader(index)  # no model needed for these reads
    docs = document_table(index, ["doc_id", "external_id", "n_tokens"])
    assert docs.column("doc_id").to_pylist() == list(range(r.n_docs))
    n_tok = 0
    for s in range(r.n_seqs):
        toks, tgts = r.sequence_tokens(s)
        assert toks[1:] == tgts[:-1]  # every target but the last is the next input token
        n_tok += len(toks)
    assert n_tok == r.n_tokens


def test_merged_and_copied_shards_under_an_ivf_template(tiny_ckpt, tiny_corpus, tmp_path):
    """Under an IVF template a shard stores its inverted lists alone, and so do the merged shard and
    its copies: each copy's entries carry its own work unit, and every list probed finds both."""
    src = tmp_path / "ivf"
    build_index(tiny_ckpt, [tiny_corpus], src, index_cfg(faiss_spec="IVF4,Flat"), progress=False)
    two = merge_index(src, tmp_path / "two", copies=2)
    for sh in layout.read_manifest(two).shards:
        assert (sh.dir(two) / layout.SHARD_IVF).is_file() and not (sh.dir(two) / layout.SHARD_FAISS).exists()
        whole = layout.shard_index(two / layout.FAISS_TEMPLATE, sh.dir(two))
        units = {int(u) for u in layout.split_faiss_ids(_ids(whole))[0]}
        assert units == {sh.unit}
    one, att = Attributor.open(src), Attributor.open(two)
    reader = att.local_reader("test")
    e = reader.query_embedding(att.encode(SPECS[0]).G * att.preconditioner().inv.sqrt())
    _, seqs = reader.search_embedding(e, 40, nprobe=4)
    n = one.reader.n_seqs
    assert reader.stacked.ntotal == 2 * n
    assert sorted(s - n for s in seqs.tolist() if s >= n) == sorted(s for s in seqs.tolist() if s < n) != []


def _ids(index) -> np.ndarray:
    """Every id in an IVF index's lists."""
    import faiss

    ivf = faiss.extract_index_ivf(index)
    il = ivf.invlists
    return np.concatenate([faiss.rev_swig_ptr(il.get_ids(i), il.list_size(i)).copy() for i in range(ivf.nlist)])
