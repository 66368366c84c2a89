"""The training record: which documents a run trained on, up to a checkpoint (DESIGN §1).

A document's identity is a 64-bit key of its corpus id and its text (``document_key``): the same id
with another text is another document. The record is a document dictionary (the keys of the
training split, in the order of the training stream) with, for each, the number of training
windows that covered any of its tokens up to the checkpoint's step: 10 bytes per document (1 GB at
100M documents), written as ``training_record.safetensors`` in every checkpoint, listed and hashed in
its ``config.json``. Whether a document was trained on is read from it everywhere (index, answers,
audits, SQL): a document the record does not hold, or holds with no window, was not trained on,
whatever its id.

The windows of a step depend only on ``(seed, step)`` (``model/data.py``), so the counts are exact,
and a resumed run continues the record of its checkpoint.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from prism_tda.errors import CheckpointError

RECORD = "training_record.safetensors"


def document_key(doc_id: str, text: str) -> int:
    """A document's 64-bit identity (as a signed int64): its corpus id and its text."""
    h = hashlib.blake2b(doc_id.encode("utf-8", "surrogatepass"), digest_size=8, key=b"prism-doc")
    h.update(b"\x00")
    h.update(text.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass
class TrainingRecord:
    """Per training document (``keys``, in the order of the training stream), the training windows
    that covered it; ``corpus``: the corpus files and fingerprint the run read."""

    keys: np.ndarray  # (n_docs,) int64 document keys
    windows: np.ndarray  # (n_docs,) int64 windows that covered the document
    step: int = 0
    corpus: dict[str, Any] = field(default_factory=dict)
    _sorted: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def empty(cls, keys: np.ndarray, corpus: dict[str, Any] | None = None) -> TrainingRecord:
        return cls(np.asarray(keys, np.int64), np.zeros(len(keys), np.int64), 0, corpus or {})

    def add_windows(self, doc_start: np.ndarray, starts: np.ndarray, length: int) -> None:
        """Count the windows ``[s, s + length)`` of the training stream whose documents begin at the
        token offsets ``doc_start`` (ascending, one per document of ``keys``)."""
        starts = np.asarray(starts, np.int64)
        first = np.searchsorted(doc_start, starts, side="right") - 1
        last = np.searchsorted(doc_start, starts + length - 1, side="right") - 1
        span = last - first + 1
        docs = np.repeat(first, span) + (np.arange(span.sum()) - np.repeat(np.cumsum(span) - span, span))
        np.add.at(self.windows, docs, 1)
        self._sorted = None

    @property
    def n_trained(self) -> int:
        return int((self.windows > 0).sum())

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(windows, held) of each document key: the windows that covered it (0 when none did, or the
        record does not hold it) and whether the record holds it at all."""
        if self._sorted is None:
            order = np.argsort(self.keys, kind="stable")
            self._sorted = (self.keys[order], self.windows[order])
        k, w = self._sorted
        keys = np.asarray(keys, np.int64)
        if not len(k):
            return np.zeros(len(keys), np.int64), np.zeros(len(keys), bool)
        at = np.clip(np.searchsorted(k, keys), 0, len(k) - 1)
        held = k[at] == keys
        return np.where(held, w[at], 0), held

    def summary(self) -> dict[str, Any]:
        return {"documents": len(self.keys), "trained_documents": self.n_trained,
                "windows": int(self.windows.sum()), "step": self.step, **self.corpus}

    def save(self, directory: Path) -> Path:
        path = Path(directory) / RECORD
        save_file({"keys": self.keys, "windows": self.windows},
                  str(path), metadata={"step": str(self.step)})
        return path

    @classmethod
    def load(cls, directory: Path, corpus: dict[str, Any] | None = None) -> TrainingRecord | None:
        """The record of a checkpoint directory (None when it has none: checkpoints from before it)."""
        path = Path(directory) / RECORD
        if not path.is_file():
            return None
        try:
            t = load_file(str(path))
            from safetensors import safe_open

            with safe_open(str(path), framework="numpy") as f:
                step = int((f.metadata() or {}).get("step", 0))
        except Exception as e:  # noqa: BLE001  (any unreadable file is the same error for the user)
            raise CheckpointError(f"{path}: cannot read the training record ({e})") from None
        if "keys" not in t or "windows" not in t or len(t["keys"]) != len(t["windows"]):
            raise CheckpointError(f"{path}: a training record needs 'keys' and 'windows' of one length")
        return cls(t["keys"].astype(np.int64), t["windows"].astype(np.int64), step, corpus or {})


def window_starts(n_stream: int, *, step: int, seed: int, block: int, total: int) -> np.ndarray:
    """The start offsets of the ``total`` windows of one training step's global batch (every rank's)."""
    from .data import step_generator

    n_windows = n_stream - block - 1
    return torch.randint(0, n_windows, (total,), generator=step_generator(seed, step)).numpy()
