"""Per-sequence attribution embeddings ``e(x)`` (``engine.sketch``) from a shard's stored rows, and
the FAISS index over them (DESIGN §2, "Cached / fast")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from prism_tda.engine.curvature import Curvature
from prism_tda.engine.layout import atomic_write_bytes, part_name
from prism_tda.engine.sketch import ROW_CHUNK, Sketch, normalise


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
    pair, pair_of_row = np.unique((a_seq - seq_start) * K + proto, return_inverse=True)
    owner = torch.from_numpy(pair_of_row.reshape(-1))
    G = torch.zeros(len(pair), u.shape[1])
    for c in range(0, len(row), ROW_CHUNK):
        sl = slice(c, c + ROW_CHUNK)
        G.index_add_(0, owner[sl], a[sl, None] * u[row[sl]])
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
