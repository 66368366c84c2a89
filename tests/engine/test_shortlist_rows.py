"""The shortlist's choice of the rows to re-score in each shortlisted sequence (the m best by
approximate cosine), and of each document's best rows in its other sequences, in one sort: the same
rows as choosing sequence by sequence, document by document."""

import numpy as np
import pytest

from prism_tda.engine.scoring import TokenScores
from prism_tda.engine.shards import best_rows_elsewhere, best_rows_per_sequence


class Windows:
    """Rows cut into sequences of 7 rows each, documents of 3 sequences each."""

    def seq_of_tokens(self, tok: np.ndarray) -> np.ndarray:
        return np.asarray(tok, np.int64) // 7

    def doc_of_seqs(self, seqs: np.ndarray) -> np.ndarray:
        return np.asarray(seqs, np.int64) // 3


def one_by_one(tok: np.ndarray, cos: np.ndarray, seqs: np.ndarray, m: int, sign: float) -> list[np.ndarray]:
    out = []
    for s in seqs:
        at = np.nonzero(tok // 7 == s)[0]
        at = at[np.lexsort((tok[at], -(sign * cos[at])))[:m]]
        out.append(np.sort(tok[at]))
    return out


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_same_rows_as_one_sequence_at_a_time(sign: float, m: int) -> None:
    rng = np.random.default_rng(m + (10 if sign > 0 else 20))
    tok = np.sort(rng.choice(700, size=300, replace=False)).astype(np.int64)
    cos = rng.choice([-0.5, -0.1, 0.0, 0.2, 0.4, 0.9], size=len(tok))  # many equal cosines: the row decides
    approx = TokenScores(tok, cos.copy(), cos, np.zeros((len(tok), 2), np.int64), np.zeros((len(tok), 2), np.float32), False)
    seqs = rng.permutation(np.unique(tok // 7))[:40]
    seqs = np.r_[seqs, 999]  # a sequence with no scored row gets none
    got = best_rows_per_sequence(Windows(), approx, seqs, m, sign)
    want = one_by_one(tok, cos, seqs, m, sign)
    assert len(got) == len(seqs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert len(got[-1]) == 0
    assert [len(g) for g in got] == [min(m, int(np.sum(tok // 7 == s))) for s in seqs]


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_rows_elsewhere_are_each_documents_best_outside_its_best_sequence(sign: float, m: int) -> None:
    rng = np.random.default_rng(m + (30 if sign > 0 else 40))
    tok = np.sort(rng.choice(2100, size=900, replace=False)).astype(np.int64)
    cos = rng.choice([-0.5, -0.1, 0.0, 0.2, 0.4, 0.9], size=len(tok))
    approx = TokenScores(tok, cos.copy(), cos, np.zeros((len(tok), 2), np.int64), np.zeros((len(tok), 2), np.float32), False)
    docs = rng.permutation(np.unique(tok // 21))[:30]
    best_seq = docs * 3 + rng.integers(0, 3, size=len(docs))
    docs, best_seq = np.r_[docs, 999], np.r_[best_seq, 2997]  # a document with no scored row gets none
    rows, vals = best_rows_elsewhere(Windows(), approx, docs, best_seq, m, sign, cos)
    assert len(rows) == len(vals) == len(docs)
    for d, b, got, v in zip(docs, best_seq, rows, vals, strict=True):
        at = np.nonzero((tok // 21 == d) & (tok // 7 != b))[0]
        at = at[np.lexsort((tok[at], -(sign * cos[at])))[:m]]
        np.testing.assert_array_equal(got, tok[at])
        np.testing.assert_array_equal(v, cos[at])
    assert len(rows[-1]) == 0
    caps = rng.integers(0, 5, size=len(docs))  # one number per document
    rows, _ = best_rows_elsewhere(Windows(), approx, docs, best_seq, caps, sign, cos)
    for d, b, c, got in zip(docs, best_seq, caps, rows, strict=True):
        at = np.nonzero((tok // 21 == d) & (tok // 7 != b))[0]
        np.testing.assert_array_equal(got, tok[at[np.lexsort((tok[at], -(sign * cos[at])))[:c]]])
