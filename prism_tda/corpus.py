"""Reading training corpora: JSONL(.gz), Parquet with a ``text`` column, folders of text files.

Bad records (no text, text of the wrong type, undecodable bytes, unparsable lines, a Parquet
file without a ``text`` column, an empty file) are counted by reason and reported with their
file and row; they never crash a run and are never dropped silently.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CorpusError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
MAX_EXAMPLES = 50  # bad-record examples kept per run


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str
    source: str = ""
    title: str | None = None
    url: str | None = None


@dataclass
class CorpusStats:
    """What was read: documents, bad records by reason, and the first few bad records."""

    n_documents: int = 0
    n_files: int = 0
    bad: Counter = field(default_factory=Counter)
    examples: list[dict] = field(default_factory=list)

    def add_bad(self, path: str, row: int | None, reason: str, detail: str = "") -> None:
        self.bad[reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"file": path, "row": row, "reason": reason, "detail": detail[:200]})
        log.warning("bad record", extra={"file": path, "row": row, "reason": reason, "detail": detail[:200]})

    @property
    def n_bad(self) -> int:
        return sum(self.bad.values())

    def to_dict(self) -> dict:
        return {
            "documents": self.n_documents,
            "files": self.n_files,
            "bad_records": self.n_bad,
            "bad_by_reason": dict(self.bad),
            "bad_examples": self.examples,
        }


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return "unknown"


def corpus_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand corpus paths (files or folders, searched recursively) into a sorted file list."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise CorpusError(f"corpus path does not exist: {p}")
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and _kind(f) != "unknown")
            if not found:
                raise CorpusError(f"corpus folder has no .jsonl/.jsonl.gz/.parquet/.txt files: {p}")
            out.extend(found)
        else:
            if _kind(p) == "unknown":
                raise CorpusError(f"unsupported corpus file type (want .jsonl[.gz], .parquet, .txt): {p}")
            out.append(p)
    return out


def _text_ok(text, path: str, row: int | None, stats: CorpusStats) -> bool:
    if text is None:
        stats.add_bad(path, row, "missing_text")
        return False
    if not isinstance(text, str):
        stats.add_bad(path, row, "text_not_string", type(text).__name__)
        return False
    if not text.strip():
        stats.add_bad(path, row, "empty_text")
        return False
    return True


def _read_jsonl(path: Path, stats: CorpusStats) -> Iterator[Document]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    src = str(path)
    n = 0
    with opener(path, "rb") as fh:
        for row, raw in enumerate(fh):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                stats.add_bad(src, row, "undecodable_bytes", str(e))
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                stats.add_bad(src, row, "invalid_json", str(e))
                continue
            if not isinstance(rec, dict):
                stats.add_bad(src, row, "record_not_object", type(rec).__name__)
                continue
            text = rec.get("text")
            if not _text_ok(text, src, row, stats):
                continue
            doc_id = rec.get("id", rec.get("doc_id"))
            doc_id = str(doc_id) if doc_id is not None else f"{path.name}:{row}"
            n += 1
            assert isinstance(text, str)  # checked by _text_ok
            yield Document(doc_id, text, str(rec.get("source") or path.name), _opt(rec.get("title")), _opt(rec.get("url")))
    if n == 0 and not any(e["file"] == src for e in stats.examples):
        stats.add_bad(src, None, "empty_file")


def _opt(v) -> str | None:
    return None if v is None else str(v)


def _read_parquet(path: Path, stats: CorpusStats) -> Iterator[Document]:
    import pyarrow.parquet as pq

    src = str(path)
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a reported bad record
        stats.add_bad(src, None, "unreadable_file", str(e))
        return
    names = pf.schema_arrow.names
    if "text" not in names:
        stats.add_bad(src, None, "missing_text_column", f"columns: {names}")
        return
    cols = [c for c in ("text", "id", "doc_id", "url", "title", "source") if c in names]
    row = 0
    for batch in pf.iter_batches(columns=cols, batch_size=4096):
        data = batch.to_pydict()
        for j in range(batch.num_rows):
            text = data["text"][j]
            r = row + j
            if _text_ok(text, src, r, stats):
                doc_id = data.get("id", data.get("doc_id", [None] * batch.num_rows))[j]
                yield Document(
                    str(doc_id) if doc_id is not None else f"{path.name}:{r}",
                    text,
                    str(data["source"][j]) if "source" in data and data["source"][j] else path.name,
                    _opt(data["title"][j]) if "title" in data else None,
                    _opt(data["url"][j]) if "url" in data else None,
                )
        row += batch.num_rows
    if row == 0:
        stats.add_bad(src, None, "empty_file")


def _read_text(path: Path, root: Path | None, stats: CorpusStats) -> Iterator[Document]:
    src = str(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        stats.add_bad(src, None, "undecodable_bytes", str(e))
        return
    if not text.strip():
        stats.add_bad(src, None, "empty_file")
        return
    doc_id = str(path.relative_to(root)) if root is not None else path.name
    yield Document(doc_id, text, source=path.parent.name or "text", title=path.stem)


def read_corpus(paths: Iterable[str | Path], stats: CorpusStats | None = None) -> Iterator[Document]:
    """Yield the documents of all corpus paths in a stable order, counting bad records in ``stats``."""
    stats = stats if stats is not None else CorpusStats()
    for p in paths:
        p = Path(p)
        root = p if p.is_dir() else None
        for f in corpus_files([p]):
            stats.n_files += 1
            kind = _kind(f)
            if kind == "jsonl":
                it = _read_jsonl(f, stats)
            elif kind == "parquet":
                it = _read_parquet(f, stats)
            else:
                it = _read_text(f, root, stats)
            for doc in it:
                stats.n_documents += 1
                yield doc


def fingerprint(paths: Iterable[str | Path]) -> str:
    """sha256 over file names, sizes and contents of every corpus file."""
    h = hashlib.sha256()
    for f in corpus_files(paths):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def is_validation(doc_id: str, fraction: float) -> bool:
    """Deterministic document-level train/validation split by a hash of the id."""
    digest = hashlib.blake2b(doc_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


__all__ = ["CorpusStats", "Document", "corpus_files", "fingerprint", "is_validation", "read_corpus"]
