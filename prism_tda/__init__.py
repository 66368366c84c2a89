"""PRISM-TDA: training-data attribution for PRISM prototype language models."""

from importlib.resources import files

__version__ = "0.1.0"


def demo_corpus_path() -> str:
    """Path of the bundled demo corpus (Debian's BSD fortune cookies, JSONL.gz)."""
    return str(files("prism_tda") / "data" / "fortunes.jsonl.gz")
