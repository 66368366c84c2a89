"""Checkpoint directories: ``config.json``, ``model.safetensors``, ``tokenizer.json``.

A training run also writes ``optimizer.safetensors`` and ``trainer_state.json`` beside them so
that it can resume exactly. Nothing here ever unpickles: tensors go through safetensors, the
rest through JSON. A directory is written under a temporary name and renamed into place, so a
crash never leaves a half-written checkpoint behind a valid name.

A *run directory* holds ``step_XXXXXXX/`` checkpoints and a ``latest`` file naming the newest
complete one; every loader accepts either a checkpoint or a run directory, or a Hugging Face model
directory of a PRISM model (``config.json`` with ``model_type`` "prism", see ``model/hfdir.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from prism_tda.errors import CheckpointError, ConfigError
from prism_tda.fsutil import atomic_write_bytes, fsync_dir

from . import hfdir
from .config import ModelConfig
from .model import PRISM
from .record import RECORD, TrainingRecord
from .tokenizer import load_tokenizer

FORMAT = "prism-tda-checkpoint"
FORMAT_VERSION = 1
CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
OPTIMIZER, TRAINER_STATE = "optimizer.safetensors", "trainer_state.json"


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=True).encode())


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or the newest complete checkpoint of a run directory."""
    path = Path(path)
    if (path / CONFIG).is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        target = path / latest.read_text().strip()
        if (target / CONFIG).is_file():
            return target
        raise CheckpointError(f"{latest}: names {target.name}, which has no {CONFIG}")
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    raise CheckpointError(f"{path}: neither a checkpoint ({CONFIG} missing) nor a run directory ('latest' missing)")


def save_checkpoint(
    path: str | Path,
    model: PRISM,
    tokenizer: Tokenizer,
    *,
    training: dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    trainer_state: dict[str, Any] | None = None,
    trainer_tensors: dict[str, torch.Tensor] | None = None,
    record: TrainingRecord | None = None,
) -> Path:
    """Write a checkpoint directory atomically and return its path. ``record``: the documents the run
    trained on up to this checkpoint (``model/record.py``), listed and hashed with the weights."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / WEIGHTS), metadata={"format": FORMAT})
    tokenizer.save(str(tmp / TOKENIZER))
    if optimizer is not None:
        tensors, meta = _flatten_optimizer(optimizer)
        tensors.update({f"trainer.{k}": v.contiguous().cpu() for k, v in (trainer_tensors or {}).items()})
        save_file(tensors, str(tmp / OPTIMIZER))
        _write_json(tmp / TRAINER_STATE, {**(trainer_state or {}), "optimizer": meta})
    files = [WEIGHTS, TOKENIZER]
    if record is not None:
        files.append(record.save(tmp).name)
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": model.cfg.to_dict(),
        "n_params": model.num_params(),
        "tokenizer": {"file": TOKENIZER, "vocab_size": tokenizer.get_vocab_size()},
        "training": training or {},
        "files": {name: sha256_file(tmp / name) for name in files},
    }
    if record is not None:
        config["training_record"] = {"file": RECORD, **record.summary()}
    _write_json(tmp / CONFIG, config)
    fsync_dir(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def read_config(path: str | Path) -> dict[str, Any]:
    """Parse and validate ``config.json`` of a checkpoint directory (that of a Hugging Face directory of
    a PRISM model is translated into ours)."""
    f = Path(path) / CONFIG
    try:
        config = json.loads(f.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{f}: missing") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from e
    if hfdir.is_hf_config(config):
        return hfdir.checkpoint_config(Path(path), config, fmt=FORMAT, version=FORMAT_VERSION)
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise CheckpointError(f"{f}: field 'format' must be {FORMAT!r}")
    if config.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{f}: field 'format_version' is {config.get('format_version')!r}, expected {FORMAT_VERSION}")
    for key in ("model", "tokenizer", "files"):
        if not isinstance(config.get(key), dict):
            raise CheckpointError(f"{f}: field '{key}' is missing or not an object")
    return config


def load_checkpoint(
    path: str | Path, *, device: str | torch.device = "cpu", verify: bool = True
) -> tuple[PRISM, Tokenizer, dict[str, Any]]:
    """Load (model in eval mode, tokenizer, config dict) from a checkpoint or run directory."""
    path = resolve(path)
    config = read_config(path)
    try:
        cfg = ModelConfig.from_dict(config["model"], where=f"{path / CONFIG}: field 'model'")
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    if verify:
        for name, digest in config["files"].items():
            f = path / name
            if not f.is_file():
                raise CheckpointError(f"{f}: missing (listed in {CONFIG} 'files')")
            if sha256_file(f) != digest:
                raise CheckpointError(f"{f}: sha256 does not match {CONFIG} 'files.{name}' (corrupt or modified)")
    tokenizer = load_tokenizer(path / TOKENIZER)
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise CheckpointError(
            f"{path / TOKENIZER}: tokenizer has {tokenizer.get_vocab_size()} tokens but "
            f"{path / CONFIG} field 'model.vocab_size' is {cfg.vocab_size}"
        )
    try:
        state = load_file(str(path / WEIGHTS), device=str(device))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path / WEIGHTS}: cannot read safetensors ({e})") from e
    model = PRISM(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{path / WEIGHTS}: tensors missing {missing[:5]}, unexpected {extra[:5]}")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"{path / WEIGHTS}: tensor '{k}' has shape {tuple(state[k].shape)}, config expects {tuple(v.shape)}"
            )
    model.load_state_dict(state)
    model.to(device).eval()
    return model, tokenizer, config


def load_training_state(
    path: str | Path, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Restore the optimizer in place; return (trainer_state JSON, trainer tensors)."""
    path = Path(path)
    meta_file, tensor_file = path / TRAINER_STATE, path / OPTIMIZER
    try:
        meta = json.loads(meta_file.read_text())
        tensors = load_file(str(tensor_file))
    except FileNotFoundError as e:
        raise CheckpointError(f"{e.filename}: missing, cannot resume from {path}") from e
    except (json.JSONDecodeError, SafetensorError) as e:
        raise CheckpointError(f"{path}: trainer state unreadable ({e})") from e
    state: dict[int, dict[str, torch.Tensor]] = {}
    trainer_tensors = {}
    for key, t in tensors.items():
        if key.startswith("trainer."):
            trainer_tensors[key[len("trainer.") :]] = t
            continue
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = t
    optimizer.load_state_dict({"state": state, "param_groups": meta.pop("optimizer")["param_groups"]})
    return meta, trainer_tensors


def _flatten_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"state.{idx}.{name}"] = t.detach().contiguous().cpu()
    return tensors, {"param_groups": sd["param_groups"]}


def load_record(path: str | Path) -> TrainingRecord | None:
    """The training record of a checkpoint (or a run's newest), None for a checkpoint without one."""
    path = resolve(path)
    config = read_config(path)
    return TrainingRecord.load(path, {k: v for k, v in config.get("training_record", {}).items()
                                      if k in ("corpus_fingerprint", "corpus_files", "corpus_fields")})
