"""What an index is on disk: its build configuration, the manifest, explicit Parquet schemas and
atomic part files. The indexer writes this layout; the engine and the service read it.

    INDEX_DIR/
      manifest.json                 format, hashes, config, corpus fingerprint, shards, counts, timings
      documents/part-00000.parquet  one row per training document
      sequences/part-00000.parquet  one row per model-length window (with its token ids)
      activations/part-00000.parquet  one row per token x active prototype
      token_grads/part-00000.parquet  one row per token: Q^T u_t (float16)
      stats/part-00000.safetensors  additive curvature statistics of the shard
      prototypes.parquet, vocab.parquet, curvature.safetensors
      embeddings/part-00000.npy, faiss.index

Every file is written under a temporary name, fsynced, and renamed into place; the manifest is
rewritten the same way and lists only shards whose every part is in place.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from prism_tda.config import Config
from prism_tda.errors import ConfigError, PrismError
from prism_tda.fsutil import atomic_write_bytes, fsync_dir

FORMAT = "prism-tda-index"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class IndexConfig(Config):
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


@dataclass
class ShardForward:
    """What the forward stage wrote for one shard."""

    activation_rows: int
    tokens: int
    bytes: dict[str, int]


@dataclass
class ShardEntry:
    """One shard: a contiguous range of documents, sequences and tokens, written atomically."""

    shard: int
    doc_start: int
    n_docs: int
    seq_start: int
    n_seqs: int
    n_tokens: int
    forward: ShardForward | None = None  # set once every part of the forward stage is in place
    embedded: bool = False


@dataclass
class Plan:
    corpus: dict[str, Any]  # the corpus reader's counts (records, bad records by reason)
    documents: int
    sequences: int
    tokens: int


@dataclass
class IndexManifest:
    """``manifest.json``: what the index was built from, how, and which of its parts are complete."""

    identity: dict[str, Any]  # what must match for a run to resume this index (see indexer.run.identity)
    checkpoint: str
    corpus: list[str]
    config: IndexConfig
    model: dict[str, Any]  # the checkpoint's model config
    versions: dict[str, str]
    plan: Plan | None = None
    shards: list[ShardEntry] = field(default_factory=list)
    complete: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    summary: dict[str, Any] | None = None  # counts, bytes, grounding and timings of the finished index
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def documents(self) -> int:
        return self.plan.documents if self.plan else 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = MANIFEST) -> IndexManifest:
        try:
            if d.get("format") != FORMAT or d.get("format_version") != FORMAT_VERSION:
                raise PrismError(f"{where}: format {d.get('format')!r} version {d.get('format_version')!r} is not "
                                 f"{FORMAT!r} version {FORMAT_VERSION}; rebuild the index with this version")
            shards = [ShardEntry(**{**s, "forward": ShardForward(**s["forward"]) if s.get("forward") else None})
                      for s in d["shards"]]
            return cls(identity=d["identity"], checkpoint=d["checkpoint"], corpus=d["corpus"],
                       config=IndexConfig.from_dict(d["config"], where=f"{where}: config"), model=d["model"],
                       versions=d["versions"], plan=Plan(**d["plan"]) if d.get("plan") else None, shards=shards,
                       complete=bool(d.get("complete")), timings=d.get("timings", {}), summary=d.get("summary"))
        except (KeyError, TypeError) as e:
            raise PrismError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None


def id_type(max_value: int) -> pa.DataType:
    """Narrowest integer type that holds ids in [0, max_value)."""
    if max_value <= 2**15:
        return pa.int16()
    if max_value <= 2**31:
        return pa.int32()
    return pa.int64()


def schemas(vocab_size: int, n_prototypes: int, u_dim: int) -> dict[str, pa.Schema]:
    tok, proto = id_type(vocab_size), id_type(n_prototypes)
    return {
        "documents": pa.schema([
            ("doc_id", pa.int32()), ("external_id", pa.string()), ("source", pa.string()),
            ("title", pa.string()), ("url", pa.string()), ("text", pa.string()), ("n_tokens", pa.int32()),
        ]),
        "sequences": pa.schema([
            ("seq_id", pa.int32()), ("doc_id", pa.int32()), ("start_token", pa.int32()),
            ("n_tokens", pa.int16()), ("token_ids", pa.list_(tok)), ("target_ids", pa.list_(tok)),
        ]),
        "activations": pa.schema([
            ("seq_id", pa.int32()), ("pos", pa.int16()), ("token_id", tok), ("proto_id", proto),
            ("act", pa.float16()), ("doc_id", pa.int32()),
        ]),
        "token_grads": pa.schema([
            ("seq_id", pa.int32()), ("pos", pa.int16()), ("u", pa.list_(pa.float16(), u_dim)),
        ]),
        "prototypes": pa.schema([
            ("proto_id", proto), ("n_tokens", pa.int64()), ("mass", pa.float64()), ("mean_act", pa.float32()),
            ("top_tokens", pa.list_(pa.string())), ("label", pa.string()),
        ]),
        "vocab": pa.schema([("token_id", tok), ("token", pa.string())]),
    }


def part_name(shard: int, suffix: str = "parquet") -> str:
    return f"part-{shard:05d}.{suffix}"


def write_table(path: Path, table: pa.Table, **kwargs: Any) -> int:
    """Write a zstd Parquet file atomically; return its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd", compression_level=6, **kwargs)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path.stat().st_size


def read_manifest(index_dir: Path) -> IndexManifest | None:
    """The index's manifest, or None when there is none yet; errors name the file."""
    f = Path(index_dir) / MANIFEST
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise PrismError(f"{f}: cannot be read ({e})") from None
    return IndexManifest.from_dict(data, where=str(f))


def write_manifest(index_dir: Path, manifest: IndexManifest) -> None:
    atomic_write_bytes(Path(index_dir) / MANIFEST, json.dumps(manifest.to_dict(), indent=2, sort_keys=True).encode())


def clean_temporaries(index_dir: Path) -> int:
    """Remove temporary files left by a killed run; return how many."""
    n = 0
    for p in Path(index_dir).rglob(".*.tmp-*"):
        p.unlink(missing_ok=True)
        n += 1
    return n


def dir_bytes(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0
