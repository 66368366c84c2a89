"""The attribution engine's front door: which training documents drove an output (DESIGN §2).

One forward pass over the query gives its prototype-space gradient (``query.py``); first stages
pick the training rows to score (``candidates.py``); the rows are scored exactly (``scoring.py``)
and the best documents presented (``present.py``). Nothing here runs the model over training data.

    att = Attributor.open("runs/demo/index")
    res = att.attribute(QuerySpec("A computer", " is a machine"), QueryOptions(n_documents=5))
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from prism_tda.errors import PrismError, QueryError
from prism_tda.model import checkpoint as ckpt

from .candidates import FirstStages, exact_rows, fast_rows
from .present import scored_document
from .query import Query, QueryEncoder
from .reader import IndexReader
from .scoring import Preconditioner, document_scores, rank_documents, score_rows
from .types import AGGREGATIONS, Aggregation, Attribution, Mode, QueryOptions, QuerySpec, Timings


class Attributor:
    """An index, the checkpoint it was built from, and the queries it answers."""

    def __init__(self, index_dir: str | Path, *, checkpoint: str | Path | None = None,
                 stages: FirstStages | None = None) -> None:
        self.reader = IndexReader(index_dir)
        m = self.reader.manifest
        self.model, self.tokenizer, ck_config = ckpt.load_checkpoint(checkpoint or m.checkpoint)
        self.model.eval()
        if ck_config["files"]["model.safetensors"] != m.identity["checkpoint_sha256"]:
            raise PrismError(f"{index_dir}: index was built from another checkpoint than {checkpoint or m.checkpoint}")
        self.stages = stages or FirstStages()
        self.encoder = QueryEncoder(self.model, self.tokenizer, self.reader.curv.Q, self.reader.curv.u_dim)
        self._pre: dict[float, Preconditioner] = {}

    @classmethod
    def open(cls, index_dir: str | Path, **kw) -> Attributor:
        return cls(index_dir, **kw)

    @property
    def manifest(self):
        return self.reader.manifest

    def preconditioner(self, damping: float | None = None) -> Preconditioner:
        """The curvature at ``damping`` x the mean eigenvalue (default: the index's)."""
        damping = self.reader.cfg.damping if damping is None else float(damping)
        if not damping > 0:
            raise QueryError(f"damping: must be > 0, got {damping}")
        if damping not in self._pre:
            self._pre[damping] = Preconditioner(damping, self.reader.inv(damping),
                                                damping == self.reader.cfg.damping)
        return self._pre[damping]

    def encode(self, spec: QuerySpec) -> Query:
        return self.encoder.encode(spec)

    def candidate_sequences(self, q: Query, n_candidates: int = 256, damping: float | None = None) -> np.ndarray:
        """The sequences the fast path's first stages pick for an encoded query."""
        return fast_rows(self.reader, q.G, self.preconditioner(damping), n_candidates, self.stages)[0]

    def rows(self, q: Query, mode: Mode, pre: Preconditioner, n_candidates: int) -> np.ndarray:
        if mode == "exact":
            return exact_rows(self.reader, q.G)
        if mode == "fast":
            return fast_rows(self.reader, q.G, pre, n_candidates, self.stages)[1]
        raise QueryError(f"mode: must be 'fast' or 'exact', got {mode!r}")

    def attribute(self, spec: QuerySpec, options: QueryOptions | None = None) -> Attribution:
        """Top training documents for one query."""
        opt = options or QueryOptions()
        if opt.aggregation not in AGGREGATIONS:
            raise QueryError(f"aggregation: must be one of {list(AGGREGATIONS)}, got {opt.aggregation!r}")
        pre = self.preconditioner(opt.damping)
        t0 = time.perf_counter()
        q = self.encode(spec)
        t1 = time.perf_counter()
        rows = self.rows(q, opt.mode, pre, opt.n_candidates)
        t2 = time.perf_counter()
        scores = score_rows(self.reader, q.G, pre, rows)
        ranked = rank_documents(self.reader, scores, opt.aggregation, opponents=opt.opponents, n=opt.n_documents)
        t3 = time.perf_counter()
        docs = [scored_document(self.reader, self.tokenizer, scores, best, score, rank, opponents=opt.opponents)
                for rank, (best, score) in enumerate(ranked, 1)]
        t4 = time.perf_counter()
        ms = Timings(1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2), 1e3 * (t4 - t3), 1e3 * (t4 - t0))
        return Attribution(opt.mode, opt.aggregation, pre.damping, q.info(), docs, q.per_token, ms, int(len(rows)))

    def document_scores(self, q: Query, mode: Mode = "exact", n_candidates: int = 256,
                        damping: float | None = None) -> dict[Aggregation, np.ndarray]:
        """Every document's score for one encoded query under each aggregation (0 where a document has
        no scored token); what the evaluation uses."""
        pre = self.preconditioner(damping)
        return document_scores(self.reader, score_rows(self.reader, q.G, pre, self.rows(q, mode, pre, n_candidates)))
