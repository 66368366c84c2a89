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
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from prism_tda.errors import PrismError
from prism_tda.fsutil import atomic_write_bytes

TAKEDOWN = "takedown.json"
LOCK = ".takedown.lock"
FORMAT = "prism-tda-takedown"


@dataclass(frozen=True)
class Removal:
    unit: int  # the work unit of the document's shard
    local: int  # the document's id inside that shard
    doc: int  # its global id when it was removed
    external_id: str
    removed_at: str  # ISO 8601, UTC
    by: str  # the API key's name, or "cli"
    reason: str = ""


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
        done = {(r.unit, r.local) for r in removals}
        import pyarrow.parquet as pq

        found: dict[str, list[tuple[int, int, int]]] = {x: [] for x in want}
        base = 0
        for sh in m.shards:
            ids = pq.read_table(layout.shard_dir(index_dir, sh.unit) / layout.DOCUMENTS,
                                columns=["external_id"]).column("external_id").to_pylist()
            for local, x in enumerate(ids):
                if x in found:
                    found[x].append((sh.unit, local, base + local))
            base += sh.n_docs
        new: list[Removal] = []
        already, missing = [], []
        for x in want:
            hits = [h for h in found[x] if (h[0], h[1]) not in done]
            if not found[x]:
                missing.append(x)
            elif not hits:
                already.append(x)
            new += [Removal(u, loc, d, x, stamp, by, reason) for u, loc, d in hits]
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
                 units: Iterable[int]) -> None:
        self.path = Path(index_dir) / TAKEDOWN
        self._shard_of_unit, self._doc_base = shard_of_unit, doc_base
        self._units = set(units)
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
                    if r.unit in self._units:
                        mask[self._doc_base[self._shard_of_unit[r.unit]] + r.local] = True
                self._mask = mask if mask.any() else None
                self._removals, self._sig = removals, sig
        return self._mask

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

    def report(self) -> dict[str, Any]:
        rs = self.removals()
        return {"removed_documents": len(rs), "removals": [asdict(r) for r in rs]}
