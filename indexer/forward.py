"""One shard's worth of the per-token quantities (``engine.tokens``): its activations and token
gradients written as Parquet parts, and its additive curvature statistics."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save as st_save

from prism_tda.engine.layout import ShardForward, atomic_write_bytes, part_name, write_table
from prism_tda.engine.tokens import TokenBatch, run_batch
from prism_tda.model import PRISM


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x as float16 rounded to nearest with ``bits`` mantissa bits (of 10), back in float32."""
    h = x.detach().cpu().to(torch.float16).numpy().view(np.uint16).astype(np.int32)
    drop = 10 - bits
    if drop > 0:
        h = ((h + (1 << (drop - 1))) >> drop) << drop
    return torch.from_numpy(h.astype(np.uint16).view(np.float16).astype(np.float32)).to(x.device)


class ShardStats:
    """Additive (and one max-merged) statistics of a set of tokens, in the eigenbasis Q."""

    def __init__(self, K: int, d: int, u_dim: int) -> None:
        self.S = torch.zeros(d, d, dtype=torch.float64)  # sum_t u_t u_t^T
        self.lam = torch.zeros(K, u_dim, dtype=torch.float64)  # sum_t a_{t,i}^2 (Q^T u_t)^2
        self.count = torch.zeros(K, dtype=torch.float64)  # tokens where i is active (a > 0)
        self.mass = torch.zeros(K, dtype=torch.float64)  # sum_t a_{t,i}
        self.max_cos = torch.full((K,), -1.0, dtype=torch.float64)  # max-merged
        self.scalars = torch.zeros(3, dtype=torch.float64)  # n_tokens, sum loss, sum top cos

    def add(self, tb: TokenBatch, ut: torch.Tensor) -> None:
        u = tb.u.double()
        self.S += u.T @ u
        a = tb.acts.double()
        idx = tb.proto_idx.reshape(-1)
        k = tb.acts.shape[1]
        sq = ut.double().pow(2)  # (N, u_dim)
        for j in range(k):  # k small: avoids an (N k, u_dim) temporary
            self.lam.index_add_(0, tb.proto_idx[:, j], a[:, j : j + 1].pow(2) * sq)
        self.count.index_add_(0, idx, (a.reshape(-1) > 0).double())
        self.mass.index_add_(0, idx, a.reshape(-1))
        self.max_cos = torch.maximum(self.max_cos, tb.proto_max_cos.double().cpu())
        self.scalars += torch.tensor([len(tb.u), float(tb.loss.sum()), float(tb.top_cos.sum())], dtype=torch.float64)

    def merge(self, other: ShardStats) -> None:
        for name in ("S", "lam", "count", "mass", "scalars"):
            getattr(self, name).add_(getattr(other, name))
        self.max_cos = torch.maximum(self.max_cos, other.max_cos)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ("S", "lam", "count", "mass", "max_cos", "scalars")}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> ShardStats:
        self = cls.__new__(cls)
        for k, v in t.items():
            setattr(self, k, v.double())
        return self


class ShardProcessor:
    """Runs the model over one shard's sequences and writes its parts (activations, token_grads, stats)."""

    def __init__(self, model: PRISM, Q: torch.Tensor, u_dim: int, schemas: dict[str, pa.Schema], *,
                 batch_size: int, device: torch.device | str = "cpu",
                 autocast: contextlib.AbstractContextManager | None = None, act_mantissa_bits: int = 10) -> None:
        self.model, self.Q, self.u_dim = model, Q.float(), u_dim
        self.act_bits = act_mantissa_bits
        self.schemas, self.batch_size, self.device, self.autocast = schemas, batch_size, device, autocast

    def process(self, out: Path, shard: int, on_tokens: Callable[[int], object] | None = None) -> ShardForward:
        seqs = pq.read_table(out / "sequences" / part_name(shard)).to_pydict()
        K, d = self.model.cfg.n_prototypes, self.model.cfg.d_model
        stats = ShardStats(K, d, self.u_dim)
        act_cols: dict[str, list[np.ndarray]] = {k: [] for k in self.schemas["activations"].names}
        grad_seq, grad_pos, grad_u = [], [], []
        n = len(seqs["seq_id"])
        for b0 in range(0, n, self.batch_size):
            sl = slice(b0, min(b0 + self.batch_size, n))
            tb = run_batch(self.model, seqs["token_ids"][sl], seqs["target_ids"][sl], device=self.device,
                           autocast=self.autocast)
            ut = (tb.u @ self.Q.to(tb.u.device))[:, : self.u_dim]  # (N, u_dim) Q^T u_t
            tb.acts = round_mantissa(tb.acts, self.act_bits)  # stored precision, used for the stats too
            stats.add(tb, ut.cpu())
            seq_ids = torch.as_tensor(seqs["seq_id"][sl])[tb.row.cpu()]
            doc_ids = torch.as_tensor(seqs["doc_id"][sl])[tb.row.cpu()]
            keep = tb.acts.cpu() > 0  # (N, k): only active prototypes get a row
            k = keep.shape[1]
            act_cols["seq_id"].append(seq_ids[:, None].expand(-1, k)[keep].numpy().astype(np.int32))
            act_cols["pos"].append(tb.pos.cpu()[:, None].expand(-1, k)[keep].numpy().astype(np.int16))
            act_cols["token_id"].append(tb.token_ids.cpu()[:, None].expand(-1, k)[keep].numpy())
            # within a token, rows ordered by prototype id (compresses better than by similarity)
            pid, order = tb.proto_idx.cpu().sort(dim=1)
            act_cols["proto_id"].append(pid[keep.gather(1, order)].numpy())
            act_cols["act"].append(tb.acts.cpu().gather(1, order)[keep.gather(1, order)].numpy().astype(np.float16))
            act_cols["doc_id"].append(doc_ids[:, None].expand(-1, k)[keep].numpy().astype(np.int32))
            grad_seq.append(seq_ids.numpy().astype(np.int32))
            grad_pos.append(tb.pos.cpu().numpy().astype(np.int16))
            grad_u.append(ut.cpu().numpy().astype(np.float16))
            if on_tokens is not None:
                on_tokens(len(tb.u))
        sch = self.schemas["activations"]
        acts = pa.Table.from_arrays(
            [pa.array(np.concatenate(act_cols[f.name]) if act_cols[f.name] else [], type=f.type) for f in sch],
            schema=sch,
        )
        u = np.concatenate(grad_u) if grad_u else np.zeros((0, self.u_dim), np.float16)
        grads = pa.Table.from_arrays([
            pa.array(np.concatenate(grad_seq) if grad_seq else [], pa.int32()),
            pa.array(np.concatenate(grad_pos) if grad_pos else [], pa.int16()),
            pa.FixedSizeListArray.from_arrays(pa.array(u.reshape(-1), pa.float16()), self.u_dim),
        ], schema=self.schemas["token_grads"])
        sizes = {
            "activations": write_table(out / "activations" / part_name(shard), acts,
                                       # bfloat16-precision acts take few distinct values: a dictionary
                                       # suits them (and DuckDB reads no byte-stream-split float16)
                                       use_dictionary=["seq_id", "pos", "token_id", "proto_id", "act", "doc_id"]),
            "token_grads": write_table(out / "token_grads" / part_name(shard), grads, use_dictionary=False),
        }
        blob = st_save({k: v.contiguous() for k, v in stats.tensors().items()})
        atomic_write_bytes(out / "stats" / part_name(shard, "safetensors"), blob)
        return ShardForward(activation_rows=acts.num_rows, tokens=int(stats.scalars[0]), bytes=sizes)

