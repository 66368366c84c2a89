"""Token streams for training: documents joined by ``<|endoftext|>``, sampled as random windows.

The batch of step ``s`` depends only on ``(seed, s)``, so a resumed run sees exactly the batches
an uninterrupted run would. The global batch of a step is laid out ``[micro][rank][row]``: one
process with ``grad_accum = 2`` and two processes with ``grad_accum = 1`` see the same rows.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from prism_tda.corpus import CorpusStats, Document, is_validation, read_corpus

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


def split_documents(corpus: list[str], val_fraction: float) -> tuple[list[Document], list[Document], CorpusStats]:
    stats = CorpusStats()
    train: list[Document] = []
    val: list[Document] = []
    for doc in read_corpus(corpus, stats):
        (val if is_validation(doc.doc_id, val_fraction) else train).append(doc)
    return train, val, stats


def encode_stream(docs: list[Document], tokenizer: Tokenizer, *, desc: str = "tokenize",
                  progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents, each followed by ``<|endoftext|>``, into one int32 stream; (stream, where
    each document begins)."""
    eos = eos_id(tokenizer)
    parts: list[np.ndarray] = []
    chunk = 2048
    with tqdm(total=len(docs), desc=desc, unit="doc", disable=not progress, leave=False) as bar:
        for i in range(0, len(docs), chunk):
            for enc in tokenizer.encode_batch([d.text for d in docs[i : i + chunk]]):
                parts.append(np.asarray(enc.ids + [eos], dtype=np.int32))
            bar.update(min(chunk, len(docs) - i))
    starts = np.cumsum([0] + [len(x) for x in parts[:-1]]).astype(np.int64) if parts else np.zeros(0, np.int64)
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)), starts


def load_or_build(
    corpus: list[str], tokenizer: Tokenizer, val_fraction: float, cache_dir: Path, key: str, *, progress: bool = True
) -> TokenData:
    """Token streams for ``corpus``, cached under ``cache_dir`` by ``key`` (tokenizer + corpus hash)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    meta_f = cache_dir / "tokens.json"
    names = ("train", "val", "doc_keys", "doc_start")
    if meta_f.is_file():
        meta = json.loads(meta_f.read_text())
        if meta.get("key") == key and all((cache_dir / f"{n}.npy").is_file() for n in names):
            arrays = [np.load(cache_dir / f"{n}.npy", allow_pickle=False) for n in names]
            return TokenData(arrays[0], arrays[1], meta["stats"], arrays[2], arrays[3])
    train_docs, val_docs, stats = split_documents(corpus, val_fraction)
    if not train_docs or not val_docs:
        raise ValueError(f"corpus {corpus} gave {len(train_docs)} training and {len(val_docs)} validation documents")
    train, doc_start = encode_stream(train_docs, tokenizer, desc="tokenize train", progress=progress)
    val, _ = encode_stream(val_docs, tokenizer, desc="tokenize val", progress=progress)
    doc_keys = np.array([document_key(d.doc_id, d.text) for d in train_docs], dtype=np.int64)
    s = stats.to_dict() | {"train_documents": len(train_docs), "val_documents": len(val_docs),
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
