"""Indexer configuration (frozen, validated, serialised into the manifest)."""

from __future__ import annotations

from dataclasses import dataclass

from prism_tda.errors import ConfigError
from prism_tda.model.config import _Config


@dataclass(frozen=True)
class IndexConfig(_Config):
    """How the corpus is cut, run through the model, and summarised.

    Fields that change the stored rows or statistics are part of the index's identity: an index
    built with other values is refused on resume (see ``IDENTITY_FIELDS``).
    """

    stride: int | None = None  # window stride in tokens; None = the model's block_size (no overlap)
    batch_size: int = 32  # sequences per forward batch
    shard_documents: int = 2000  # documents per shard (the unit of atomic writes and of resumption)
    basis_sequences: int = 256  # sequences used to fit the shared curvature eigenbasis Q
    u_rank: int | None = None  # coordinates of Q^T u_t kept per token; None = all d (exact re-rank)
    damping: float = 1.0  # lambda = damping * mean eigenvalue of the per-prototype curvature blocks
    embed_dim: int = 64  # JL projection width r of the per-sequence embeddings
    sketch_buckets: int = 16  # count-sketch buckets B over the prototype axis; embedding width r * B
    faiss_spec: str = "Flat"  # FAISS index_factory string (inner product); e.g. "IVF256,PQ32" when large
    faiss_train_size: int = 20000  # embeddings sampled to train a non-flat index
    seed: int = 0  # JL matrix and count-sketch hashing
    # Activations are stored as float16 rounded to this many mantissa bits (10 = plain float16;
    # 7 = bfloat16 precision, max relative error 2^-8), which lets zstd shrink the column.
    act_mantissa_bits: int = 7
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU

    def __post_init__(self) -> None:
        for name in ("batch_size", "shard_documents", "basis_sequences", "embed_dim", "sketch_buckets",
                     "faiss_train_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"index.{name} must be > 0, got {getattr(self, name)}")
        if self.stride is not None and self.stride <= 0:
            raise ConfigError(f"index.stride must be > 0, got {self.stride}")
        if self.u_rank is not None and self.u_rank <= 0:
            raise ConfigError(f"index.u_rank must be > 0, got {self.u_rank}")
        if self.damping <= 0:
            raise ConfigError(f"index.damping must be > 0, got {self.damping}")
        if not 1 <= self.act_mantissa_bits <= 10:
            raise ConfigError(f"index.act_mantissa_bits must be in [1, 10], got {self.act_mantissa_bits}")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"index.dtype must be auto|fp32|bf16, got {self.dtype!r}")


# Fields whose change alters rows or statistics (batch_size, shard size and dtype on CPU do not
# change any row; shard_documents changes file layout, so it is part of identity as well).
IDENTITY_FIELDS = ("stride", "shard_documents", "basis_sequences", "u_rank", "damping", "embed_dim",
                   "sketch_buckets", "faiss_spec", "seed", "act_mantissa_bits")
