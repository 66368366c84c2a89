"""Which training rows a query scores: every row sharing a prototype with it (exact), or the rows
of candidate sequences from two first stages (fast).

Fast, united: FAISS's ``n_candidates`` nearest sequences by the sketch embedding (a whole window's
gradient), and the sequences of the ``token_candidates`` best single tokens found in the posting
lists of the query's heaviest prototypes (by their part of ``I(q, q)``, at most
``proto_candidates`` of them and ``row_budget`` rows). The second stage finds documents whose one
token matches strongly while the rest of the window does not, which the window-level sketch
ranks poorly. The rows of the candidates are then scored exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .reader import IndexReader
from .scoring import Preconditioner, score_rows


@dataclass(frozen=True)
class FirstStages:
    """Settings of the fast path's token-level first stage; ``proto_candidates=0`` turns it off."""

    proto_candidates: int = 8
    token_candidates: int = 128
    row_budget: int = 1 << 15


def exact_rows(reader: IndexReader, G: torch.Tensor) -> np.ndarray:
    """Activation rows of every training token sharing a prototype with the query."""
    protos = (G.abs().sum(1) > 0).nonzero().flatten().tolist()
    return np.concatenate([reader.posting(p) for p in protos] or [np.zeros(0, np.int64)])


def fast_rows(reader: IndexReader, G: torch.Tensor, pre: Preconditioner, n_candidates: int,
              stages: FirstStages) -> tuple[np.ndarray, np.ndarray]:
    """(candidate sequences, their activation rows) of the fast path."""
    seqs = reader.search(G * pre.inv.sqrt(), n_candidates)
    if stages.proto_candidates > 0 and stages.token_candidates > 0:
        weight = (G * G * pre.inv).sum(1)  # each prototype's part of I(q, q)
        heavy = torch.argsort(weight, descending=True)[: stages.proto_candidates]
        lists: list[np.ndarray] = []
        n = 0
        for p in heavy[weight[heavy] > 0].tolist():
            rows_p = reader.posting(p)
            if lists and n + len(rows_p) > stages.row_budget:
                continue
            lists.append(rows_p)
            n += len(rows_p)
        if lists:
            s = score_rows(reader, G, pre, np.concatenate(lists))
            best = s.tok[np.argsort(-s.cos, kind="stable")[: stages.token_candidates]]
            seqs = np.concatenate([seqs, reader.tok_seq[best]])
    seqs = np.unique(seqs)
    return seqs, reader.rows_of_sequences(seqs)
