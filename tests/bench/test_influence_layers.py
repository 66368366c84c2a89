"""The layer ablation of the `influence` option (``bench/attribution/influence_layers.py``) rests on two
facts checked here on a copy of the tiny index: a document's full-model value is the sum of its
per-layer terms, and tracking only some layers (the cheaper backward pass it times) gives the sum of
those layers' terms."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import prism_tda.engine.influence as inf
from bench.attribution.influence_layers import subsets_of, tracking_only
from prism_tda.engine import Attributor, QuerySpec
from prism_tda.engine.arrays import index_in

pytestmark = pytest.mark.slow  # a bench script's run: the slow tier


def test_per_layer_terms_add_up_and_tracking_fewer_layers_gives_their_sum(index, tmp_path):
    ix = tmp_path / "ix"
    shutil.copytree(index, ix)
    inf.fit_index(ix, max_sequences=16)
    att = Attributor.open(ix)
    ek, reader = att.ekfac(), att.local_reader("test")
    q = att.encode(QuerySpec("the computer", " is a machine"))
    docs = np.arange(min(4, reader.n_docs), dtype=np.int64)
    layers = sorted(ek.qa)
    subsets = subsets_of(layers)
    assert subsets["all"] == layers and len(subsets["last_block_output_projections"]) == 2
    assert sorted(subsets["attention"] + subsets["mlp"]) == layers

    P = ek.precondition(inf.query_gradient(att.model, q.token_ids, q.target_positions, q.target_ids))
    seqs, of = inf.document_sequences(reader, docs)
    rows = inf.sequence_influence(att.model, [{n: P[n]} for n in layers], reader, seqs)
    whole = inf.document_influence(att.model, ek, reader, q.token_ids, q.target_positions, q.target_ids, docs)
    per_doc = {n: np.bincount(index_in(docs, of), weights=r, minlength=len(docs)) for n, r in zip(layers, rows, strict=True)}
    np.testing.assert_allclose(sum(per_doc.values()), whole, rtol=1e-4, atol=1e-6 * np.abs(whole).max())

    names = subsets[f"block_{max(int(n.split('.')[1]) for n in layers)}"]
    was = inf.tracked
    with tracking_only(names):
        part = inf.document_influence(att.model, ek, reader, q.token_ids, q.target_positions, q.target_ids, docs)
    assert inf.tracked is was
    want = sum(per_doc[n] for n in names)
    np.testing.assert_allclose(part, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
    assert not np.allclose(part, whole)  # the other layers' terms are really left out
