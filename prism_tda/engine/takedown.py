"""Takedown: documents taken out of an index (copyright, privacy, poisoning).

A removal is recorded in ``INDEX/takedown.json`` (written whole under a temporary name and renamed,
under a lock file, so concurrent removals never lose one): which document (its shard's work unit and
its id inside the shard, its global id and external id when removed), when, by whom (the API key's
name, or ``cli``) and why. Every read of the index filters the removed documents out as soon as the
file changes (a ``stat`` per check): attribution answers (fast and exact), prototype contexts and the
labels drawn from them, documents, SQL and discovery; audits that cited one keep the citation,
marked ``removed``. The stored rows stay on disk until a compaction rewrites their shards.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from prism_tda.errors import PrismError
from prism_tda.fsutil import atomic_write_bytes
from prism_tda.model.record import document_key

TAKEDOWN = "takedown.json"
LOCK = ".takedown.lock"
FORMAT = "prism-tda-takedown"
GRAM = 8  # tokens per n-gram of the absence check
N_GRAMS = 4  # n-grams kept per removed document


@dataclass(frozen=True)
class Removal:
    unit: int  # the work unit of the document's shard
    local: int  # the document's id inside that shard
    doc: int  # its global id when it was removed
    external_id: str
    removed_at: str  # ISO 8601, UTC
    by: str  # the API key's name, or "cli"
    reason: str = ""
    generation: int = 0  # of the shard that held it: a rewrite without it (a compaction) ends the entry's mask
    key: int = 0  # model/record.py's document_key of its id and text: what the absence check looks for
    grams: list[int] = field(default_factory=list)  # hashes of a few of its token n-grams, ditto (no text kept)
    gram_length: int = GRAM


@dataclass(frozen=True)
class TakedownResult:
    removed: list[Removal]  # removed by this call
    already: list[str]  # external ids whose documents were all removed before
    not_found: list[str]  # external ids no document of the index has


def read_removals(index_dir: str | Path) -> list[Removal]:
    """Every removal recorded for an index (none when it has no takedown file)."""
    path = Path(index_dir) / TAKEDOWN
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, json.JSONDecodeError) as e:
        raise PrismError(f"{path}: cannot read the takedown record ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("removals"), list):
        raise PrismError(f"{path}: not a takedown record (field 'format' must be {FORMAT!r}, 'removals' a list)")
    try:
        return [Removal(**r) for r in data["removals"]]
    except TypeError as e:
        raise PrismError(f"{path}: a removal has unexpected fields ({e})") from None


@contextlib.contextmanager
def _locked(index_dir: Path) -> Iterator[None]:
    with open(index_dir / LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def remove_documents(index_dir: str | Path, external_ids: Iterable[str], *, by: str, reason: str = "",
                     now: datetime | None = None) -> TakedownResult:
    """Mark every document whose external id is in ``external_ids`` removed (all documents that share
    an id). Ids no document has are reported, not an error."""
    from . import layout
    from .reads import read_complete_manifest

    index_dir = Path(index_dir)
    want = list(dict.fromkeys(str(x) for x in external_ids))
    if not want:
        raise PrismError("takedown: no document id given")
    m = read_complete_manifest(index_dir)
    stamp = (now or datetime.now(timezone.utc)).isoformat(timespec="seconds")
    with _locked(index_dir):
        removals = read_removals(index_dir)
        done = {(r.unit, r.generation, r.local) for r in removals}
        import pyarrow.parquet as pq

        found: dict[str, list[tuple[int, int, int, int]]] = {x: [] for x in want}
        base = 0
        for sh in m.shards:
            ids = pq.read_table(sh.dir(index_dir) / layout.DOCUMENTS,
                                columns=["external_id"]).column("external_id").to_pylist()
            for local, x in enumerate(ids):
                if x in found:
                    found[x].append((sh.unit, sh.generation, local, base + local))
            base += sh.n_docs
        new: list[Removal] = []
        already, missing = [], []
        reader = None
        for x in want:
            hits = [h for h in found[x] if (h[0], h[1], h[2]) not in done]
            if not found[x]:
                missing.append(x)
            elif not hits:
                already.append(x)
            for u, g, loc, d in hits:
                if reader is None:
                    from .reader import IndexReader

                    reader = IndexReader(index_dir)
                rec = reader.document(d)
                toks = document_tokens(reader, d)
                n = min(GRAM, len(toks))
                new.append(Removal(u, loc, d, x, stamp, by, reason, g, document_key(x, rec["text"]),
                                   gram_hashes(toks, n), n))
        if reader is not None:
            reader.close()
        if new:
            body = {"format": FORMAT, "removals": [asdict(r) for r in removals + new]}
            atomic_write_bytes(index_dir / TAKEDOWN, json.dumps(body, indent=1).encode())
    return TakedownResult(new, already, missing)


def read_ids(source: str) -> list[str]:
    """Document ids from ``source``: a file with one id per line (blank lines skipped), else the
    comma-separated ids themselves."""
    path = Path(source)
    if path.is_file():
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return [x.strip() for x in source.split(",") if x.strip()]


class RemovedSet:
    """The removed documents of an index as a mask over its global document ids, read again whenever
    the takedown file changes."""

    def __init__(self, index_dir: Path, shard_of_unit: np.ndarray, doc_base: np.ndarray,
                 generations: dict[int, int]) -> None:
        """``generations``: each held unit's shard generation (a removal applies to that one only)."""
        self.path = Path(index_dir) / TAKEDOWN
        self._shard_of_unit, self._doc_base = shard_of_unit, doc_base
        self._gens = dict(generations)
        self._sig: tuple[int, int, int] | None = None
        self._mask: np.ndarray | None = None  # None: nothing removed
        self._removals: list[Removal] = []
        self._lock = threading.Lock()

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def refresh(self) -> np.ndarray | None:
        """The mask (n_docs,) of removed documents, None when none is; re-read if the file changed."""
        sig = self._signature()
        if sig == self._sig:
            return self._mask
        with self._lock:
            if sig != self._sig:
                removals = read_removals(self.path.parent) if sig is not None else []
                mask = np.zeros(int(self._doc_base[-1]), dtype=bool)
                for r in removals:
                    if self._gens.get(r.unit) == r.generation:
                        mask[self._doc_base[self._shard_of_unit[r.unit]] + r.local] = True
                self._mask = mask if mask.any() else None
                self._removals, self._sig = removals, sig
        return self._mask

    @classmethod
    def of(cls, index_dir: Path, manifest: Any) -> RemovedSet:
        """The set over every shard of ``manifest`` (an ``engine.layout.IndexManifest``)."""
        shards = manifest.shards
        shard_of_unit = np.zeros(max((s.unit for s in shards), default=0) + 1, dtype=np.int64)
        shard_of_unit[[s.unit for s in shards]] = np.arange(len(shards))
        return cls(index_dir, shard_of_unit, manifest.bases()[2], {s.unit: s.generation for s in shards})

    def ids(self) -> np.ndarray:
        """The global ids of the removed documents, ascending."""
        mask = self.refresh()
        return np.zeros(0, np.int64) if mask is None else np.nonzero(mask)[0].astype(np.int64)

    def signature(self) -> tuple[int, int, int] | None:
        """Changes whenever the removals do (for caches of what removed documents could be in)."""
        self.refresh()
        return self._sig

    def removed(self, docs: np.ndarray) -> np.ndarray:
        """(len(docs),) bool: whether each global document id is removed."""
        mask = self.refresh()
        docs = np.asarray(docs, np.int64)
        return np.zeros(len(docs), dtype=bool) if mask is None else mask[docs]

    def any(self) -> bool:
        return self.refresh() is not None

    def removals(self) -> list[Removal]:
        self.refresh()
        return list(self._removals)


def document_tokens(reader: Any, doc: int) -> np.ndarray:
    """The input token ids of a document's first stored window."""
    seq = int(reader.seq_of_tokens(reader.rows_of_documents(np.array([doc]))[:1])[0])
    tokens, _ = reader.sequence_tokens(seq)
    return np.asarray(tokens, np.int64)


def rolling_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """(len - n + 1,) uint64 hash of every n-gram of ``tokens`` (a polynomial hash mod 2^64)."""
    t = np.asarray(tokens).astype(np.uint64)
    if len(t) < n:
        return np.zeros(0, np.uint64)
    h = np.zeros(len(t) - n + 1, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * np.uint64(1_000_003) + t[j : len(t) - n + 1 + j] + np.uint64(1)
    return h


def gram_hashes(tokens: np.ndarray, n: int = GRAM, k: int = N_GRAMS) -> list[int]:
    """Hashes of ``k`` evenly spaced n-grams of ``tokens`` (none when it is shorter than ``n``)."""
    h = rolling_hashes(tokens, n) if n > 0 else np.zeros(0, np.uint64)
    if not len(h):
        return []
    at = np.unique(np.linspace(0, len(h) - 1, min(k, len(h))).astype(np.int64))
    return [int(x) for x in h[at]]


def absence(index_dir: str | Path) -> list[dict[str, Any]]:
    """For every removal: whether the store still holds its document (its id and text), whether any
    stored sequence holds one of its token n-grams, and so its status: ``absent`` (neither),
    ``filtered`` (still stored, until a compaction rewrites its shard; never served), ``present``
    (its text is in the store in another document, or a rewrite missed it)."""
    from . import layout
    from .reads import read_complete_manifest

    index_dir = Path(index_dir)
    removals = read_removals(index_dir)
    if not removals:
        return []
    m = read_complete_manifest(index_dir)
    gens = {sh.unit: sh.generation for sh in m.shards}
    import pyarrow.parquet as pq

    keys: set[int] = set()
    found: dict[int, int] = {}  # gram hash -> sequences holding it
    want: dict[int, set[int]] = {}  # gram length -> hashes
    for r in removals:
        want.setdefault(r.gram_length, set()).update(r.grams)
    for sh in m.shards:
        d = sh.dir(index_dir)
        t = pq.read_table(d / layout.DOCUMENTS, columns=["external_id", "text"])
        keys.update(document_key(x, y) for x, y in zip(t.column("external_id").to_pylist(),
                                                       t.column("text").to_pylist(), strict=True))
        tokens = np.load(layout.array_file(d, "tokens"), mmap_mode="r")
        tok0 = np.load(layout.array_file(d, "seq_tok0"), mmap_mode="r")
        for n, hashes in want.items():
            if not hashes:
                continue
            h = rolling_hashes(np.asarray(tokens), n)
            # only n-grams inside one sequence: the window starting at row i ends before its sequence's end
            ends = np.repeat(np.asarray(tok0[1:]), np.diff(np.asarray(tok0)))[: len(h)]
            ok = np.arange(len(h)) + n <= ends
            hit = np.isin(h, np.fromiter(hashes, np.uint64, len(hashes))) & ok
            for v in h[hit].tolist():
                found[int(v)] = found.get(int(v), 0) + 1
    out = []
    for r in removals:
        stored = gens.get(r.unit) == r.generation
        in_text = r.key in keys
        grams = sum(found.get(g, 0) for g in r.grams)
        status = "filtered" if stored else ("present" if in_text or grams else "absent")
        out.append({"external_id": r.external_id, "unit": r.unit, "removed_at": r.removed_at, "status": status,
                    "document_in_store": in_text, "sequences_with_its_ngrams": grams})
    return out
