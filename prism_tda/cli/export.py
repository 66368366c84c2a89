"""`prism export`: a checkpoint in another library's format (``--format hf``: Hugging Face transformers)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from prism_tda.errors import PrismError

FORMATS = ("hf",)


def cmd_export(args: argparse.Namespace) -> int:
    try:
        from transformers.utils import logging as hf_logging

        from prism_tda.hf import export_hf
    except ImportError as e:
        raise PrismError(f"--format hf needs transformers ({e}); install it with: pip install 'prism-tda[hf]'") from e
    hf_logging.disable_progress_bar()
    out = export_hf(args.checkpoint, args.out)
    print(json.dumps({"format": args.format, "out": str(out), "files": sorted(p.name for p in out.iterdir())}))
    return 0


def register(sub: Any) -> None:
    e = sub.add_parser("export", help="export a checkpoint as a Hugging Face transformers model",
                       description="Write a checkpoint as a Hugging Face model directory: config.json, "
                                   "model.safetensors, generation_config.json, the tokenizer, standalone code "
                                   "for trust_remote_code=True, and the training record. The directory must be "
                                   "new (or empty); `prism index/generate --checkpoint` read it back.")
    e.add_argument("--checkpoint", required=True, help="checkpoint or run directory")
    e.add_argument("--out", required=True, help="the model directory to write (new or empty)")
    e.add_argument("--format", choices=FORMATS, default="hf", help="hf: Hugging Face transformers (default)")
    e.set_defaults(fn=cmd_export)
