"""PRISM-TDA: training-data attribution for PRISM prototype language models."""

import sys
from importlib.resources import files

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
