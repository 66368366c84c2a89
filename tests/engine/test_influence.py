"""Full-model influence (EK-FAC over every linear layer) of the returned documents, against
independent computations: per-sequence gradients from autograd one sequence at a time, and the
preconditioner as an explicit matrix."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from prism_tda.engine import Attributor, QueryOptions, QuerySpec, layout
from prism_tda.engine import influence as inf
from prism_tda.engine.reader import IndexReader
from prism_tda.errors import PrismError, QueryError

COMPUTER = QuerySpec("A computer", " is a")


@pytest.fixture(scope="module")
def ix(index, tmp_path_factory):
    """A copy of the shared index (this module writes its influence curvature)."""
    out = tmp_path_factory.mktemp("influence") / "ix"
    shutil.copytree(index, out)
    return out


@pytest.fixture(scope="module")
def att(ix) -> Attributor:
    return Attributor.open(ix)


def weight_grads(model, x: list[int], y: list[int], positions: list[int]) -> dict[str, torch.Tensor]:
    """d(summed cross-entropy at ``positions``)/dW of every linear layer, by autograd on the weights."""
    layers = inf.tracked(model)
    logits = model(torch.tensor([x])).logits[0].float()
    loss = F.cross_entropy(logits[positions], torch.tensor(y), reduction="sum")
    gs = torch.autograd.grad(loss, [m.weight for m in layers.values()])
    return dict(zip(layers, gs, strict=True))


def test_preconditioner_is_the_inverse_of_the_ekfac_matrix():
    torch.manual_seed(0)
    d_in, d_out = 3, 4
    qa = torch.linalg.qr(torch.randn(d_in, d_in, dtype=torch.float64))[0]
    qs = torch.linalg.qr(torch.randn(d_out, d_out, dtype=torch.float64))[0]
    lam = torch.rand(d_out, d_in, dtype=torch.float64) + 0.1
    ek = inf.EKFAC({"l": qa}, {"l": qs}, {"l": lam}, 1)
    G = torch.randn(d_out, d_in)
    # F = (Q_S kron Q_A) diag(vec(lam) + damping mean) (Q_S kron Q_A)^T acting on row-major vec(G)
    Q = torch.kron(qs, qa)
    damping = 0.3
    Fm = Q @ torch.diag(lam.flatten() + damping * lam.mean()) @ Q.T
    want = torch.linalg.solve(Fm, G.double().flatten()).reshape(d_out, d_in)
    got = ek.precondition({"l": G}, damping)["l"]
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)


def test_sequence_and_query_gradients_match_autograd(att, ix):
    model, reader = att.model, IndexReader(ix)
    q = att.encode(COMPUTER)
    G = inf.query_gradient(model, q.token_ids, q.target_positions, q.target_ids)
    want = weight_grads(model, q.token_ids[: max(q.target_positions) + 1], q.target_ids, q.target_positions)
    for n in want:
        assert torch.allclose(G[n], want[n], rtol=1e-4, atol=1e-6), n
    torch.manual_seed(1)
    P = {n: torch.randn_like(g) for n, g in G.items()}
    # sequences of different lengths batched together (padding must not leak)
    lengths = np.array([reader.seq_span(s)[1] - reader.seq_span(s)[0] for s in range(reader.n_seqs)])
    seqs = np.concatenate([np.nonzero(lengths == lengths.max())[0][:3], np.nonzero(lengths < lengths.max())[0][:3]])
    assert len(np.unique(lengths[seqs])) > 1
    got = inf.sequence_influence(model, P, reader, seqs)
    for s, v in zip(seqs, got, strict=True):
        x, y = reader.sequence_tokens(int(s))
        g = weight_grads(model, x, y, list(range(len(x))))
        assert v == pytest.approx(sum(float((P[n] * g[n]).sum()) for n in g), rel=1e-3, abs=1e-5)
    reader.close()


def test_fitted_factors_are_orthonormal_and_eigenvalues_carry_the_gradient_norm(att, ix):
    """With the empirical Fisher, the corrected eigenvalues sum to the mean squared norm of the
    per-sequence gradients (a rotation keeps the norm): checked against autograd per sequence."""
    model, reader = att.model, IndexReader(ix)
    ek = inf.fit(model, reader, max_sequences=12, sample=False, seed=3)
    assert ek.n_sequences == 12
    seqs = np.sort(np.random.default_rng(3).choice(np.arange(reader.n_seqs)[reader.trained(
        reader.doc_of_seqs(np.arange(reader.n_seqs)))], 12, replace=False))
    norms: dict[str, float] = {}
    for s in seqs:
        x, y = reader.sequence_tokens(int(s))
        for n, g in weight_grads(model, x, y, list(range(len(x)))).items():
            norms[n] = norms.get(n, 0.0) + float((g.double() ** 2).sum()) / len(seqs)
    for n in ek.qa:
        eye_a, eye_s = torch.eye(len(ek.qa[n]), dtype=ek.qa[n].dtype), torch.eye(len(ek.qs[n]), dtype=ek.qs[n].dtype)
        assert torch.allclose(ek.qa[n].T @ ek.qa[n], eye_a, atol=1e-5)
        assert torch.allclose(ek.qs[n].T @ ek.qs[n], eye_s, atol=1e-5)
        assert float(ek.lam[n].min()) >= 0
        assert float(ek.lam[n].sum()) == pytest.approx(norms[n], rel=1e-3)
    reader.close()


def test_attribute_returns_each_documents_influence(att, ix):
    with pytest.raises(QueryError, match="--influence"):
        att.attribute(COMPUTER, QueryOptions(n_documents=4, influence=True))
    info = inf.fit_index(ix, max_sequences=64)
    assert (ix / layout.EKFAC).exists() and info["sequences"] == 64
    res = att.attribute(COMPUTER, QueryOptions(n_documents=8, influence=True))
    plain = att.attribute(COMPUTER, QueryOptions(n_documents=8, keep_opposed=True))  # the first 8 by score
    assert all(d.influence is None for d in plain.documents) and plain.opposed_by_influence == 0
    q = att.encode(COMPUTER)
    # the score's order, less the documents whose full-model influence pushes the other way
    every = dict(zip([d.doc_id for d in plain.documents],
                     att.influence(q, np.array([d.doc_id for d in plain.documents])), strict=True))
    assert [d.doc_id for d in res.documents] == [d.doc_id for d in plain.documents if every[d.doc_id] > 0]
    assert res.opposed_by_influence == sum(v <= 0 for v in every.values())
    every_kept = att.attribute(COMPUTER, QueryOptions(n_documents=8, influence=True, keep_opposed=True))
    assert [d.doc_id for d in every_kept.documents] == [d.doc_id for d in plain.documents]
    assert every_kept.opposed_by_influence == 0 and every_kept.opposed_by_value == 0
    assert [d.rank for d in res.documents] == list(range(1, len(res.documents) + 1))
    assert 0 < len(res.documents) and all(d.influence > 0 for d in res.documents)
    opp = att.attribute(COMPUTER, QueryOptions(n_documents=8, influence=True, opponents=True))
    assert all(d.influence < 0 for d in opp.documents)
    docs = np.array([d.doc_id for d in res.documents])
    reader = IndexReader(ix)
    seqs, of = inf.document_sequences(reader, docs)
    P = att.ekfac().precondition(inf.query_gradient(att.model, q.token_ids, q.target_positions, q.target_ids),
                                 inf.DEFAULT_DAMPING)
    per_seq = inf.sequence_influence(att.model, P, reader, seqs)
    for d in res.documents:
        assert d.influence == pytest.approx(float(per_seq[of == d.doc_id].sum()), rel=1e-4, abs=1e-6)
    assert len({round(d.influence, 6) for d in res.documents}) == len(res.documents)
    assert res.timings_ms.influence > 0
    # several dampings in one pass: the default's row is the value above
    rows = att.influence(q, docs, [inf.DEFAULT_DAMPING, 1.0])
    assert rows.shape == (2, len(docs))
    assert np.allclose(rows[0], [d.influence for d in res.documents], rtol=1e-4, atol=1e-6)
    reader.close()


def test_curvature_of_another_checkpoint_is_refused(ix, tmp_path):
    if not (ix / layout.EKFAC).exists():
        inf.fit_index(ix, max_sequences=16)
    other = tmp_path / "ix"
    shutil.copytree(ix, other)
    ek = inf.EKFAC.load(ix / layout.EKFAC)
    ek.save(other / layout.EKFAC, "0" * 64)
    with pytest.raises(PrismError, match="another checkpoint"):
        Attributor.open(other).attribute(COMPUTER, QueryOptions(n_documents=2, influence=True))


def test_concurrent_queries_get_their_own_values(att, ix):
    """Server threads share the model: influence in two threads at once, while a third runs plain
    queries through the same layers, gives each query the value it gets alone."""
    import threading

    if not (ix / layout.EKFAC).exists():
        inf.fit_index(ix, max_sequences=16)
    specs = [COMPUTER, QuerySpec("The only way", " to be")]
    alone = [[d.influence for d in att.attribute(s, QueryOptions(n_documents=4, influence=True)).documents]
             for s in specs]
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(3):
                got[i] = [d.influence for d in att.attribute(specs[i], QueryOptions(n_documents=4, influence=True)).documents]
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    def plain() -> None:
        for _ in range(6):
            att.attribute(QuerySpec("A man", " said"), QueryOptions(n_documents=3))

    threads = [threading.Thread(target=run, args=(0,)), threading.Thread(target=run, args=(1,)),
               threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert np.allclose(got[i], alone[i], rtol=1e-4, atol=1e-6), (i, got[i], alone[i])
