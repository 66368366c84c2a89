"""Reading an index for queries: its manifest, curvature, FAISS index and training-token rows.

Rows are addressed by two integer spaces:

- token rows: one per training token, in (``seq_id``, ``pos``) order; ``u[t]`` is ``Q^T u_t``;
- activation rows: one per (token, active prototype), in the same order, with ``row_tok``,
  ``row_proto`` and ``row_act``; posting lists group them by prototype.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from prism_tda.errors import PrismError

from . import layout
from .curvature import Curvature
from .layout import IndexManifest
from .sketch import Sketch, normalise

KEY = 1 << 16  # positions within a sequence are below this (int16 column): seq_id * KEY + pos is unique


def open_faiss(index_dir: Path):
    """The FAISS index, memory-mapped where FAISS supports it for the spec."""
    import faiss

    path = str(Path(index_dir) / "faiss.index")
    try:
        return faiss.read_index(path, faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError:
        return faiss.read_index(path)


def read_complete_manifest(index_dir: Path) -> IndexManifest:
    """The manifest of a complete index; a clear error for anything else."""
    m = layout.read_manifest(index_dir)
    if m is None or not m.complete:
        raise PrismError(f"{index_dir}: not a complete index (manifest.json missing or incomplete)")
    return m


class IndexReader:
    def __init__(self, index_dir: str | Path) -> None:
        t0 = time.perf_counter()
        self.dir = Path(index_dir)
        self.manifest = read_complete_manifest(self.dir)
        self.cfg = self.manifest.config
        self.curv = Curvature.load(self.dir / "curvature.safetensors")
        self.mean_eig = float(self.curv.damping) / self.cfg.damping  # the damping unit
        K = self.curv.lam.shape[0]
        self.sketch = Sketch(K, self.curv.u_dim, self.cfg.embed_dim, self.cfg.sketch_buckets, self.cfg.seed)
        self.faiss = open_faiss(self.dir)
        self._load_rows()
        self.tok_self = self.token_self_influence(np.arange(self.n_tokens), self.inv(self.cfg.damping))
        self.load_seconds = time.perf_counter() - t0

    @property
    def n_prototypes(self) -> int:
        return self.curv.lam.shape[0]

    def inv(self, damping: float) -> torch.Tensor:
        """(K, u_dim) diagonal of (H_i + damping * mean_eig * I)^{-1} in the Q basis."""
        return 1.0 / (self.curv.lam + damping * self.mean_eig)

    def _load_rows(self) -> None:
        parts = sorted((self.dir / "token_grads").glob("part-*.parquet"))
        self.n_tokens = sum(pq.read_metadata(f).num_rows for f in parts)
        # Q^T u_t of every training token, read batch by batch into one array (reading the whole
        # table at once held several copies of it in the Arrow memory pool)
        self.u = np.empty((self.n_tokens, self.curv.u_dim), dtype=np.float16)
        tok_seq = np.empty(self.n_tokens, dtype=np.int64)
        tok_pos = np.empty(self.n_tokens, dtype=np.int64)
        k = 0
        for f in parts:
            for b in pq.ParquetFile(f).iter_batches(batch_size=1 << 14, columns=["seq_id", "pos", "u"],
                                                    use_threads=False):
                n = b.num_rows
                self.u[k : k + n] = b.column(2).flatten().to_numpy(zero_copy_only=False).reshape(n, -1)
                tok_seq[k : k + n] = b.column(0).to_numpy()
                tok_pos[k : k + n] = b.column(1).to_numpy()
                k += n
        tok_key = tok_seq * KEY + tok_pos
        seqs = pq.read_table(sorted((self.dir / "sequences").glob("part-*.parquet")),
                             columns=["seq_id", "doc_id", "start_token", "n_tokens", "target_ids"])
        self.seq_doc = seqs["doc_id"].to_numpy()
        self.seq_start = seqs["start_token"].to_numpy()
        # flat per token row: the token it predicts (what the row's gradient learns)
        self.tok_target = seqs["target_ids"].combine_chunks().flatten().to_numpy()
        docs = pq.read_table(sorted((self.dir / "documents").glob("part-*.parquet")), columns=["doc_id", "external_id"])
        n_docs = int(pc.max(docs["doc_id"]).as_py()) + 1 if docs.num_rows else 0
        self.doc_external = np.empty(n_docs, dtype=object)
        self.doc_external[docs["doc_id"].to_numpy()] = docs["external_id"].to_numpy(zero_copy_only=False)
        self.n_docs = n_docs
        n_seq = len(self.seq_doc)
        self.seq_tok0 = np.zeros(n_seq + 1, dtype=np.int64)  # token rows of sequence s: [tok0[s], tok0[s+1])
        np.cumsum(seqs["n_tokens"].to_numpy(), out=self.seq_tok0[1:])
        self.tok_seq = tok_seq
        acts = pq.read_table(sorted((self.dir / "activations").glob("part-*.parquet")),
                             columns=["seq_id", "pos", "proto_id", "act"])
        a_key = acts["seq_id"].to_numpy().astype(np.int64) * KEY + acts["pos"].to_numpy()
        self.row_tok = np.searchsorted(tok_key, a_key)  # activation row -> token row
        self.row_proto = acts["proto_id"].to_numpy().astype(np.int64)
        self.row_act = acts["act"].to_numpy().astype(np.float32)
        self.seq_row0 = np.searchsorted(self.row_tok, self.seq_tok0)  # activation rows of each sequence
        self.tok_row0 = np.searchsorted(self.row_tok, np.arange(self.n_tokens + 1))  # ... and of each token
        # posting lists: activation rows grouped by prototype
        order = np.argsort(self.row_proto, kind="stable")
        self.post_rows = order
        self.post_start = np.searchsorted(self.row_proto[order], np.arange(self.n_prototypes + 1))

    # --------------------------------------------------------------------------- rows
    def token_self_influence(self, tok: np.ndarray, inv: torch.Tensor) -> np.ndarray:
        """I(t, t) = sum_i a_{t,i}^2 sum_j u_j^2 / (lam_ij + lam) for the token rows ``tok``, in chunks
        of 32k activation rows (a few MB of temporaries)."""
        starts, ends = self.tok_row0[tok], self.tok_row0[tok + 1]
        rows = _ranges(starts, ends)
        owner = np.repeat(np.arange(len(tok)), ends - starts)  # activation row -> index into tok
        out = np.zeros(len(tok), dtype=np.float64)
        for c in range(0, len(rows), 1 << 15):
            r = rows[c : c + (1 << 15)]
            u = torch.from_numpy(self.u[self.row_tok[r]]).float()
            val = self.row_act[r] ** 2 * (u * u * inv[torch.from_numpy(self.row_proto[r])]).sum(1).numpy()
            out += np.bincount(owner[c : c + (1 << 15)], weights=val, minlength=len(tok))
        return out

    def rows_of_sequences(self, seqs: np.ndarray) -> np.ndarray:
        """Activation rows of the given sequences."""
        return _ranges(self.seq_row0[seqs], self.seq_row0[seqs + 1])

    def posting(self, proto: int) -> np.ndarray:
        """Activation rows of one prototype."""
        return self.post_rows[self.post_start[proto] : self.post_start[proto + 1]]

    def search(self, G_pre: torch.Tensor, n: int) -> np.ndarray:
        """The ``n`` sequences nearest to the preconditioned query columns ``G_pre`` (K, u_dim) by the
        cosine of their sketch embeddings."""
        K = G_pre.shape[0]
        e = self.sketch.embed_rows(torch.zeros(K, dtype=torch.long), torch.arange(K), G_pre, 1).numpy()
        _, ids = self.faiss.search(normalise(e), min(n, self.faiss.ntotal))
        return ids[0][ids[0] >= 0]

    def external_id(self, doc: int) -> str:
        return str(self.doc_external[doc])


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, e)`` for each pair."""
    lens = ends - starts
    if len(lens) == 0 or lens.sum() == 0:
        return np.zeros(0, np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return np.arange(lens.sum(), dtype=np.int64) + offsets
