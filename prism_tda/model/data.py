"""Token streams for training: documents joined by ``<|endoftext|>``, sampled as random windows.

The batch of step ``s`` depends only on ``(seed, s)``, so a resumed run sees exactly the batches
an uninterrupted run would. The global batch of a step is laid out ``[micro][rank][row]``: one
process with ``grad_accum = 2`` and two processes with ``grad_accum = 1`` see the same rows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from prism_tda.corpus import CorpusStats, Document, Fields, is_validation, read_corpus

from .record import document_key, window_starts
from .tokenizer import eos_id

log = logging.getLogger(__name__)


@dataclass
class TokenData:
    train: np.ndarray  # (n_train_tokens,) int32
    val: np.ndarray  # (n_val_tokens,) int32
    stats: dict
    doc_keys: np.ndarray  # (n_train_docs,) int64: each training document's key (model/record.py), stream order
    doc_start: np.ndarray  # (n_train_docs,) int64: where each one begins in ``train``

    @property
    def n_train_tokens(self) -> int:
        return int(self.train.shape[0])


def split_documents(corpus: list[str], val_fraction: float, fields: Fields | None = None
                    ) -> tuple[Iterator[tuple[bool, Document]], CorpusStats]:
    """The corpus's documents in order, each with whether it is in the validation split (read lazily,
    one at a time), and the reader's counts (complete once the iterator is exhausted)."""
    stats = CorpusStats()
    docs = ((is_validation(d.doc_id, val_fraction), d) for d in read_corpus(corpus, stats, fields))
    return docs, stats


class _Stream:
    """Token ids of documents appended in chunks, each document followed by ``<|endoftext|>``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok, self.eos = tokenizer, eos_id(tokenizer)
        self.parts: list[np.ndarray] = []
        self.pending: list[str] = []
        self.keys: list[int] = []
        self.lengths: list[int] = []

    def add(self, doc: Document) -> None:
        self.pending.append(doc.text)
        self.keys.append(document_key(doc.doc_id, doc.text))
        if len(self.pending) >= 2048:
            self.flush()

    def flush(self) -> None:
        for enc in self.tok.encode_batch(self.pending):
            self.parts.append(np.asarray(enc.ids + [self.eos], dtype=np.int32))
            self.lengths.append(len(enc.ids) + 1)
        self.pending = []

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(stream, document keys, where each document begins)."""
        self.flush()
        stream = np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=np.int32)
        starts = np.cumsum([0] + self.lengths[:-1]).astype(np.int64) if self.lengths else np.zeros(0, np.int64)
        return stream, np.array(self.keys, dtype=np.int64), starts


def load_or_build(
    corpus: list[str], tokenizer: Tokenizer, val_fraction: float, cache_dir: Path, key: str, *, progress: bool = True,
    fields: Fields | None = None,
) -> TokenData:
    """Token streams for ``corpus``, cached under ``cache_dir`` by ``key`` (tokenizer + corpus hash). The
    corpus is read one document at a time and tokenised in chunks: its text is never all in memory."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    meta_f = cache_dir / "tokens.json"
    names = ("train", "val", "doc_keys", "doc_start")
    if meta_f.is_file():
        meta = json.loads(meta_f.read_text())
        if meta.get("key") == key and all((cache_dir / f"{n}.npy").is_file() for n in names):
            arrays = [np.load(cache_dir / f"{n}.npy", allow_pickle=False) for n in names]
            return TokenData(arrays[0], arrays[1], meta["stats"], arrays[2], arrays[3])
    docs, stats = split_documents(corpus, val_fraction, fields)
    streams = {False: _Stream(tokenizer), True: _Stream(tokenizer)}
    for is_val, doc in tqdm(docs, desc="tokenize", unit="doc", disable=not progress, leave=False):
        streams[is_val].add(doc)
    train, doc_keys, doc_start = streams[False].arrays()
    val, _, _ = streams[True].arrays()
    n_train, n_val = len(doc_keys), len(streams[True].keys)
    if not n_train or not n_val:
        raise ValueError(f"corpus {corpus} gave {n_train} training and {n_val} validation documents")
    s = stats.to_dict() | {"train_documents": n_train, "val_documents": n_val,
                           "train_tokens": int(train.size), "val_tokens": int(val.size)}
    for name, arr in (("train", train), ("val", val), ("doc_keys", doc_keys), ("doc_start", doc_start)):
        tmp = cache_dir / f"{name}.tmp.npy"
        np.save(tmp, arr, allow_pickle=False)
        tmp.replace(cache_dir / f"{name}.npy")
    meta_f.write_text(json.dumps({"key": key, "stats": s}, indent=2))
    if stats.n_bad:
        log.warning("bad corpus records", extra={"bad_by_reason": dict(stats.bad)})
    return TokenData(train, val, s, doc_keys, doc_start)


def step_generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step) % (2**63 - 1))
    return g


def get_batch(
    stream: np.ndarray, *, step: int, seed: int, block: int, batch_size: int,
    micro: int = 0, grad_accum: int = 1, rank: int = 0, world: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 (batch_size, block): this rank's slice of step ``step``'s global batch."""
    if len(stream) - block - 1 <= 0:
        raise ValueError(f"training stream has {len(stream)} tokens, fewer than block_size + 1 = {block + 1}")
    starts = window_starts(len(stream), step=step, seed=seed, block=block, total=batch_size * grad_accum * world)
    lo = (micro * world + rank) * batch_size
    rows = np.stack([stream[s : s + block + 1] for s in starts[lo : lo + batch_size]]).astype(np.int64)
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


def eval_batches(stream: np.ndarray, *, block: int, batch_size: int, max_tokens: int):
    """Consecutive non-overlapping windows of the validation stream, up to ``max_tokens``."""
    n = min((len(stream) - 1) // block, max(1, max_tokens // block))
    for i in range(0, n, batch_size):
        rows = np.stack([stream[j * block : j * block + block + 1] for j in range(i, min(i + batch_size, n))])
        t = torch.from_numpy(rows.astype(np.int64))
        yield t[:, :-1], t[:, 1:]
