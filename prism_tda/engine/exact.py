"""Exact attribution: every training token's score, recomputed by the model in full precision.

This is DESIGN §2's exact prototype-space influence over the whole corpus, token by token; it costs
a forward pass over the corpus (the index stores only compressed token vectors), so it is the
reference the fast path is measured against, not a served default. Many queries share one pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from prism_tda.model import PRISM

from .aggregate import DocumentTotals
from .curvature import self_influence
from .query import Query
from .reads import Reads
from .scoring import Preconditioner, match_cosines, score_tokens
from .tokens import run_batch
from .types import Aggregation


@dataclass
class ExactBatch:
    """One batch of the exact pass: the tokens' global rows, documents, active prototypes and
    activations (n, k), ``Q^T u_t`` (n, d) and ``I(t, t)`` under the pass's curvature."""

    rows: np.ndarray
    docs: np.ndarray
    protos: np.ndarray
    acts: np.ndarray
    ut: torch.Tensor
    t_self: np.ndarray


def exhaustive(model: PRISM, reader: Reads, queries: list[Query], pre: Preconditioner, *, sign: float = 1.0,
               batch_size: int = 32, progress: bool = False, match: bool = False,
               on_batch: Callable[[int], object] | None = None,
               inspect: Callable[[ExactBatch], object] | None = None,
               n_seqs: int | None = None) -> list[DocumentTotals]:
    """One pass of the model over every sequence of the index (the first ``n_seqs`` only, when given),
    scoring every token for each query; with ``match``, each target token apart as well
    (``cosine_match``: one more product per target). ``inspect``: called with every batch's exact
    quantities (for measurements beyond the totals)."""
    Q = reader.curv.Q
    end = reader.n_seqs if n_seqs is None else min(n_seqs, reader.n_seqs)
    totals = [DocumentTotals.empty(np.arange(reader.n_docs), q.n_targets if match else None) for q in queries]
    with tqdm(total=reader.n_tokens, desc="exact", unit="tok", unit_scale=True, disable=not progress) as bar:
        for b in range(0, end, batch_size):
            seqs = np.arange(b, min(b + batch_size, end))
            toks, tgts = zip(*(reader.sequence_tokens(int(s)) for s in seqs), strict=True)
            tb = run_batch(model, list(toks), list(tgts))
            ut = tb.u @ Q
            protos, acts = tb.proto_idx.numpy(), tb.acts.float().numpy()
            t_self = self_influence(ut, protos, acts, pre.inv)
            lo = reader.seq_span(int(seqs[0]))[0]
            rows = np.arange(lo, lo + len(t_self))
            docs = reader.doc_of_seqs(reader.seq_of_tokens(rows))
            if inspect is not None:
                inspect(ExactBatch(rows, docs, protos, acts, ut, t_self))
            for q, tot in zip(queries, totals, strict=True):
                s = score_tokens(rows, protos, acts, ut, t_self, q.G, pre, exact=True)
                tot.add(docs, rows, s.cos, s.raw, sign)
                if match:
                    tot.add_match(docs, rows, match_cosines(protos, acts, ut, t_self, q, pre), s.raw, sign)
            bar.update(len(rows))
            if on_batch is not None:
                on_batch(len(rows))
    return totals


def measure_rate(model: PRISM, reader: Reads, pre: Preconditioner, *, n_seqs: int = 64) -> float:
    """Tokens per second of the exact pass on this machine: ``exhaustive`` over the index's first
    ``n_seqs`` sequences, the first batch's warm-up included, so the rate errs low (an estimate from it
    errs long)."""
    n_tok = 0

    def count(n: int) -> None:
        nonlocal n_tok
        n_tok += n

    t0 = time.perf_counter()
    with torch.no_grad():
        exhaustive(model, reader, [], pre, on_batch=count, n_seqs=n_seqs)
    return n_tok / max(time.perf_counter() - t0, 1e-9)


def exact_document_scores(model: PRISM, reader: Reads, queries: list[Query], pre: Preconditioner,
                          **kw) -> list[dict[Aggregation, np.ndarray]]:
    """Every document's exact score under each aggregation, for each query, in one pass."""
    with torch.no_grad():
        return [t.scores(1.0) for t in exhaustive(model, reader, queries, pre, **kw)]
