"""The ``prism`` command line: one entry point, one sub-command per job.

Each module holds its commands and their parsers: ``train`` (train, generate, index), ``query``
(attribute, discover, sql), ``serve`` (demo, serve, openapi, settings-doc), ``export`` (export),
``control`` (control fit, control eval). The commands are thin: they parse, call the library, and print.
"""

from __future__ import annotations

import argparse
import sys

from prism_tda.errors import PrismError
from prism_tda.logs import setup_logging

from . import control, export, query, serve, train
from .common import default_state_dir, index_args
from .train import PRESETS, build_configs

__all__ = ["PRESETS", "build_configs", "build_parser", "default_state_dir", "index_args", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prism", description="PRISM-TDA: training-data attribution for PRISM models.")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["text", "json"],
                   help="json: one object per line (default for `serve`); text: for terminals (default otherwise)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (train, query, serve, export, control):
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.log_format is None:
        args.log_format = "json" if args.command == "serve" else "text"
    setup_logging(args.log_level, args.log_format)
    try:
        return args.fn(args)
    except PrismError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
