"""A Hugging Face model directory of a PRISM model, read as a checkpoint (without transformers).

Such a directory is what ``prism export --format hf`` writes, or what ``save_pretrained`` of a
``PrismForCausalLM`` writes after fine-tuning: ``config.json`` with ``model_type`` "prism" and the
``ModelConfig`` fields at its top level, ``model.safetensors`` with the tensors under PRISM's own
names, ``tokenizer.json``, and ``training_record.safetensors`` when it has one. :func:`checkpoint_config`
turns its ``config.json`` into the one of our checkpoints (DESIGN §1) so every loader reads it: the
file digests are computed (the directory lists none), ``training`` is the summary the export kept.
"""

from __future__ import annotations

import dataclasses
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from prism_tda.errors import CheckpointError

from .config import ModelConfig
from .record import RECORD

MODEL_TYPE = "prism"
TRAINING, RECORD_SUMMARY = "prism_training", "prism_training_record"  # keys an export adds to config.json
WEIGHTS, TOKENIZER, SHARDED = "model.safetensors", "tokenizer.json", "model.safetensors.index.json"


def is_hf_config(config: object) -> bool:
    return isinstance(config, dict) and config.get("model_type") == MODEL_TYPE


def checkpoint_config(path: Path, hf: dict[str, Any], *, fmt: str, version: int) -> dict[str, Any]:
    """Our checkpoint config of the HF directory ``path`` whose ``config.json`` is ``hf``."""
    if not (path / WEIGHTS).is_file():
        if (path / SHARDED).is_file():
            raise CheckpointError(f"{path / SHARDED}: sharded weights; save with save_pretrained(..., "
                                  f"max_shard_size=...) above the model's size to get one {WEIGHTS}")
        raise CheckpointError(f"{path / WEIGHTS}: missing")
    if not (path / TOKENIZER).is_file():
        raise CheckpointError(f"{path / TOKENIZER}: missing (save the tokenizer with the model)")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    files = [WEIGHTS, TOKENIZER] + ([RECORD] if (path / RECORD).is_file() else [])
    config: dict[str, Any] = {
        "format": fmt,
        "format_version": version,
        "model": {k: v for k, v in hf.items() if k in fields},
        "tokenizer": {"file": TOKENIZER},
        "training": hf.get(TRAINING) or {},
        "files": {name: _sha256(path / name) for name in files},
    }
    if RECORD in files:
        config["training_record"] = {"file": RECORD, **(hf.get(RECORD_SUMMARY) or {})}
    return config


def _sha256(path: Path) -> str:
    st = os.stat(path)
    return _sha256_of(str(path.resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=64)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """A file's digest, once per (path, size, mtime): loaders read the config more than once."""
    from .checkpoint import sha256_file

    return sha256_file(path)
