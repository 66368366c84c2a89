"""PRISM-TDA: training-data attribution for PRISM prototype language models."""

import os
import sys
from importlib.resources import files

# torch's OpenMP workers (GNU libgomp) spin for 300,000 iterations after each parallel region before
# they sleep: milliseconds in which, on a few cores, they take a core from the compiled scoring and the
# numpy work that run between torch calls in a query or an index build. 30,000 keeps the spinning
# between back-to-back torch calls and gives the core back soon after (bench/query_profile.py:
# p50 80 -> 68 ms on 2 cores, docs/benchmarks.md). Read when torch is first imported, so only if
# this package is imported first; a value set in the environment is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

__version__ = "0.1.0"


def demo_corpus_path() -> str:
    """Path of the bundled demo corpus (Debian's BSD fortune cookies, JSONL.gz)."""
    return str(files("prism_tda") / "data" / "fortunes.jsonl.gz")


def demo_model_path() -> str | None:
    """Path of the bundled demo model (a checkpoint directory trained on the demo corpus), or None in a
    tree without one."""
    path = files("prism_tda") / "data" / "demo_model"
    return str(path) if (path / "config.json").is_file() else None


# A process that already uses transformers gets the "prism" Auto classes with this import (prism_tda.hf
# registers them); otherwise importing prism_tda stays light and `import prism_tda.hf` registers them.
if "transformers" in sys.modules:
    try:
        from . import hf  # noqa: F401
    except ImportError as _e:  # a transformers too old or broken: the rest of the package still works
        import warnings

        warnings.warn(f"prism_tda.hf not registered with transformers: {_e}", stacklevel=2)
