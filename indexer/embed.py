"""Fixed-size attribution embeddings ``e(x)`` and the FAISS index over them (DESIGN §2, "Cached / fast").

For each prototype i active in x, the preconditioned column ``v_i = (H_i + lam I)^{-1/2} g_i(x)``
(in the Q basis) is projected to ``r`` dimensions by a Gaussian JL matrix and added into one of
``B`` buckets with a random sign (a count-sketch over the prototype axis). Then
``<e(q), e(x)>`` is an unbiased estimate of ``sum_i v_i(q) . v_i(x) = I(q, x)``. Embeddings are
L2-normalised, so FAISS inner-product search ranks by the cosine of preconditioned gradients.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from .curvature import Curvature
from .store import atomic_write_bytes, part_name

ROW_CHUNK = 65536


class Sketch:
    def __init__(self, n_prototypes: int, u_dim: int, r: int, buckets: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.R = torch.randn(u_dim, r, generator=g) / r**0.5  # (u_dim, r), JL
        self.bucket = torch.randint(0, buckets, (n_prototypes,), generator=g)
        self.sign = torch.randint(0, 2, (n_prototypes,), generator=g).float() * 2 - 1
        self.r, self.buckets = r, buckets

    @property
    def dim(self) -> int:
        return self.r * self.buckets

    def embed_rows(self, group: torch.Tensor, proto: torch.Tensor, w: torch.Tensor, n_groups: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Add the preconditioned per-row gradients ``w`` (rows, u_dim) of prototype ``proto`` into
        ``n_groups`` sketches (n_groups, B * r), in ``out`` when given."""
        if out is None:
            out = torch.zeros(n_groups, self.dim)
        flat = out.view(n_groups * self.buckets, self.r)
        for c in range(0, len(group), ROW_CHUNK):
            sl = slice(c, c + ROW_CHUNK)
            proj = (w[sl] @ self.R) * self.sign[proto[sl]].unsqueeze(1)  # (rows, r)
            flat.index_add_(0, group[sl] * self.buckets + self.bucket[proto[sl]], proj)
        return out


def normalise(e: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(e, axis=1, keepdims=True)
    return (e / np.maximum(n, 1e-12)).astype(np.float32)


def shard_embeddings(index_dir: Path, shard: int, seq_start: int, n_seqs: int, curv: Curvature,
                     sketch: Sketch) -> np.ndarray:
    """e(x) (n_seqs, D), unnormalised, for one shard from its stored activations and token grads."""
    acts = pq.read_table(index_dir / "activations" / part_name(shard), columns=["seq_id", "pos", "proto_id", "act"])
    grads = pq.read_table(index_dir / "token_grads" / part_name(shard))
    T = 1 << 16
    tok_key = grads["seq_id"].to_numpy().astype(np.int64) * T + grads["pos"].to_numpy()
    u = torch.from_numpy(np.asarray(grads["u"].combine_chunks().flatten().to_numpy(zero_copy_only=False),
                                    dtype=np.float32).reshape(len(tok_key), -1))
    a_seq = acts["seq_id"].to_numpy().astype(np.int64)
    row = torch.from_numpy(np.searchsorted(tok_key, a_seq * T + acts["pos"].to_numpy()))
    proto = acts["proto_id"].to_numpy().astype(np.int64)
    a = torch.from_numpy(acts["act"].to_numpy().astype(np.float32))
    K = curv.lam.shape[0]
    # G_i(x) = sum_t a_{t,i} Q^T u_t: aggregate the rows of each (sequence, prototype) pair first,
    # so the preconditioning and projection run once per pair instead of once per row.
    pair, inv = np.unique((a_seq - seq_start) * K + proto, return_inverse=True)
    inv = torch.from_numpy(inv.reshape(-1))
    G = torch.zeros(len(pair), u.shape[1])
    for c in range(0, len(row), ROW_CHUNK):
        sl = slice(c, c + ROW_CHUNK)
        G.index_add_(0, inv[sl], a[sl, None] * u[row[sl]])
    pair_proto = torch.from_numpy(pair % K)
    G *= curv.inv_sqrt()[pair_proto]  # (pairs, u_dim) preconditioned columns v_i(x)
    out = torch.zeros(n_seqs, sketch.dim)
    sketch.embed_rows(torch.from_numpy(pair // K), pair_proto, G, n_seqs, out)
    return out.numpy()


def save_embeddings(index_dir: Path, shard: int, e: np.ndarray) -> None:
    import io

    buf = io.BytesIO()
    np.save(buf, e.astype(np.float32), allow_pickle=False)
    atomic_write_bytes(index_dir / "embeddings" / part_name(shard, "npy"), buf.getvalue())


def build_faiss(index_dir: Path, shards: list[int], dim: int, spec: str, train_size: int, seed: int) -> int:
    """Train (if the spec needs it) on a sample, add every shard's normalised embeddings, write."""
    import faiss

    index = faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
    parts = [index_dir / "embeddings" / part_name(s, "npy") for s in shards]
    if not index.is_trained:
        sample = np.concatenate([normalise(np.load(p, mmap_mode="r")) for p in parts])
        rng = np.random.default_rng(seed)
        if len(sample) > train_size:
            sample = sample[rng.choice(len(sample), train_size, replace=False)]
        index.train(sample)
    for p in parts:
        index.add(normalise(np.load(p)))
    tmp = index_dir / ".faiss.index.tmp"
    faiss.write_index(index, str(tmp))
    tmp.replace(index_dir / "faiss.index")
    return index.ntotal


def open_faiss(index_dir: Path):
    """Open the index memory-mapped where FAISS supports it for the spec."""
    import faiss

    path = str(Path(index_dir) / "faiss.index")
    try:
        return faiss.read_index(path, faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError:
        return faiss.read_index(path)
