"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``), trained on the training corpus."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from prism_tda.errors import CheckpointError

EOS = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` tokens (``<|endoftext|>`` is id 0)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: tokenizer file is missing")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
        raise CheckpointError(f"{path}: not a valid tokenizers JSON file ({e})") from e


def eos_id(tok: Tokenizer) -> int:
    i = tok.token_to_id(EOS)
    if i is None:
        raise CheckpointError(f"tokenizer has no {EOS} token")
    return i
