"""On-disk layout of an index: explicit Parquet schemas, atomic part files, the manifest.

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

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from prism_tda.fsutil import atomic_write_bytes, fsync_dir

FORMAT = "prism-tda-index"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


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


def read_manifest(index_dir: Path) -> dict[str, Any] | None:
    f = Path(index_dir) / MANIFEST
    if not f.is_file():
        return None
    return json.loads(f.read_text())


def write_manifest(index_dir: Path, manifest: dict[str, Any]) -> None:
    atomic_write_bytes(Path(index_dir) / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())


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
