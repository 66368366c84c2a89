"""``prism export --format hf``: a checkpoint as a Hugging Face model directory.

The directory holds ``config.json`` (``model_type`` "prism", the architecture, an ``auto_map`` naming
the standalone code), ``model.safetensors`` (the checkpoint's tensors under their own names),
``generation_config.json``, the tokenizer (``tokenizer.json`` and ``tokenizer_config.json``, a
``PreTrainedTokenizerFast``), ``configuration_prism.py`` and ``modeling_prism.py``, and the training
record when the checkpoint has one. It is written beside its destination under a temporary name
and renamed into place, so a crash never leaves a half-written directory behind the name.

``prism_tda.model.checkpoint.load_checkpoint`` reads such a directory back (``model/hfdir.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from prism_tda import __version__
from prism_tda.errors import CheckpointError, ConfigError
from prism_tda.fsutil import fsync_dir
from prism_tda.model import checkpoint as ckpt
from prism_tda.model.hfdir import RECORD_SUMMARY, TRAINING
from prism_tda.model.record import RECORD

from .convert import hf_tokenizer, wrap
from .standalone import write_remote_code

TOKENIZER_CONFIG = "tokenizer_config.json"


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Export ``checkpoint`` (a checkpoint or run directory) to the new directory ``out``; return ``out``.

    Refuses an ``out`` that exists and is not empty."""
    out = Path(out)
    _check_empty(out)
    source = ckpt.resolve(checkpoint)
    model, tokenizer, config = ckpt.load_checkpoint(source)
    extra = {TRAINING: config.get("training", {})}
    has_record = (source / RECORD).is_file()
    if has_record and "training_record" in config:
        extra[RECORD_SUMMARY] = {k: v for k, v in config["training_record"].items() if k != "file"}
    hf = wrap(model, tokenizer, **extra)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        hf.config.auto_map = write_remote_code(tmp, __version__)
        hf.config.architectures = ["PrismForCausalLM"]
        hf.save_pretrained(tmp)
        if not (tmp / ckpt.WEIGHTS).is_file():
            raise CheckpointError(f"{tmp / ckpt.WEIGHTS}: save_pretrained wrote no single safetensors file")
        shutil.copymode(tmp / "config.json", tmp / ckpt.WEIGHTS)  # readable as the other files are
        hf_tokenizer(tokenizer, model.cfg.block_size).save_pretrained(tmp)
        _portable_tokenizer_class(tmp / TOKENIZER_CONFIG)
        if has_record:
            shutil.copyfile(source / RECORD, tmp / RECORD)
        fsync_dir(tmp)
        _check_empty(out)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return out


def _portable_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class every transformers version knows (5.x writes its own "TokenizersBackend",
    which 4.x cannot load; 5.x reads "PreTrainedTokenizerFast" as that)."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _check_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory; export into a new one")
