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
import os
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
    nbytes: int = 0  # bytes of the record in its file (for sizing a corpus from its file sizes)


@dataclass
class CorpusStats:
    """What was read: documents, bad records by reason, and the first few bad records."""

    n_documents: int = 0
    n_files: int = 0
    bad: Counter = field(default_factory=Counter)
    examples: list[dict] = field(default_factory=list)

    def add_bad(self, path: str, row: int | None, reason: str, detail: str = "", offset: int | None = None) -> None:
        """Count a bad record of ``path`` at ``row`` (or, inside a split file, at byte ``offset``)."""
        self.bad[reason] += 1
        where = {"row": row} if offset is None else {"row": row, "offset": offset}
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"file": path, **where, "reason": reason, "detail": detail[:200]})
        log.warning("bad record", extra={"file": path, **where, "reason": reason, "detail": detail[:200]})

    def merge(self, other: CorpusStats) -> None:
        self.n_documents += other.n_documents
        self.n_files += other.n_files
        self.bad.update(other.bad)
        self.examples = (self.examples + other.examples)[:MAX_EXAMPLES]

    @classmethod
    def from_dict(cls, d: dict) -> CorpusStats:
        return cls(d["documents"], d["files"], Counter(d["bad_by_reason"]), list(d["bad_examples"]))

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


def _text_ok(text, path: str, stats: CorpusStats, *, row: int | None, offset: int | None = None) -> bool:
    if text is None:
        stats.add_bad(path, row, "missing_text", offset=offset)
        return False
    if not isinstance(text, str):
        stats.add_bad(path, row, "text_not_string", type(text).__name__, offset=offset)
        return False
    if not text.strip():
        stats.add_bad(path, row, "empty_text", offset=offset)
        return False
    return True


@dataclass
class WorkUnit:
    """A part of the corpus that one worker reads on its own: a byte range of a plain JSONL file, a
    whole compressed JSONL file, a range of a Parquet file's row groups, or a batch of text files.
    Planned from file sizes and Parquet footers alone, so planning never reads the corpus."""

    unit: int
    kind: str  # jsonl | parquet | text
    file: str  # the file; for text units, the folder their names are relative to
    start: int = 0  # jsonl: byte offset; parquet: first row group
    stop: int = -1  # exclusive; -1: to the end
    files: list[str] | None = None  # text units: the files, relative to ``file``
    bytes: int = 0  # corpus bytes in the unit

    @property
    def name(self) -> str:
        return f"u{self.unit:06d}"

    @property
    def whole_file(self) -> bool:
        return self.start == 0 and self.stop == -1


def gzip_size(path: Path, compressed: int) -> int:
    """The uncompressed size of a gzip file, from its trailer (the size modulo 2^32, so files of
    4 GiB and more are taken at the smallest size not below their compressed size); the compressed
    size when the trailer cannot be read."""
    try:
        with open(path, "rb") as fh:
            fh.seek(-4, os.SEEK_END)
            size = int.from_bytes(fh.read(4), "little")
    except OSError:
        return compressed
    while size < compressed:
        size += 1 << 32
    return size


def plan_units(paths: Iterable[str | Path], unit_bytes: int, first: int = 0) -> list[WorkUnit]:
    """Cut the corpus into work units of about ``unit_bytes`` each, numbered from ``first``."""
    units: list[WorkUnit] = []

    def add(**kw) -> None:
        units.append(WorkUnit(unit=first + len(units), **kw))

    for p in paths:
        p = Path(p).absolute()
        root = p if p.is_dir() else p.parent
        batch: list[str] = []
        batch_bytes = 0
        for f in corpus_files([p]):
            kind, size = _kind(f), f.stat().st_size
            if kind == "text":
                batch.append(str(f.relative_to(root)))
                batch_bytes += size
                if batch_bytes >= unit_bytes:
                    add(kind="text", file=str(root), files=batch, bytes=batch_bytes)
                    batch, batch_bytes = [], 0
            elif kind == "jsonl" and not f.name.lower().endswith(".gz") and size > unit_bytes:
                n = -(-size // unit_bytes)
                for j in range(n):
                    lo, hi = j * size // n, (j + 1) * size // n
                    add(kind="jsonl", file=str(f), start=lo, stop=hi if j < n - 1 else -1, bytes=hi - lo)
            elif kind == "parquet":
                import pyarrow.parquet as pq

                try:
                    md = pq.read_metadata(f)
                except Exception:  # noqa: BLE001 - unreadable: one unit, whose reader reports it
                    add(kind="parquet", file=str(f), bytes=size)
                    continue
                lo, acc = 0, 0
                for g in range(md.num_row_groups):
                    acc += md.row_group(g).total_byte_size
                    if acc >= unit_bytes or g == md.num_row_groups - 1:
                        add(kind="parquet", file=str(f), start=lo, stop=g + 1, bytes=acc)
                        lo, acc = g + 1, 0
                if md.num_row_groups == 0:
                    add(kind="parquet", file=str(f), bytes=size)
            elif f.name.lower().endswith(".gz"):
                add(kind=kind, file=str(f), bytes=gzip_size(f, size))
            else:
                add(kind=kind, file=str(f), bytes=size)
        if batch:
            add(kind="text", file=str(root), files=batch, bytes=batch_bytes)
    return units


def read_unit(unit: WorkUnit, stats: CorpusStats) -> Iterator[Document]:
    """The documents of one work unit, counting bad records in ``stats``."""
    f = Path(unit.file)
    if unit.kind == "jsonl":
        it = _read_jsonl(f, stats, unit.start, unit.stop)
    elif unit.kind == "parquet":
        it = _read_parquet(f, stats, unit.start, unit.stop)
    else:
        it = (d for name in unit.files or [] for d in _read_text(f / name, f, stats))
    stats.n_files += 1 if unit.kind != "text" else len(unit.files or [])
    for doc in it:
        stats.n_documents += 1
        yield doc


def _lines(path: Path, start: int, stop: int) -> Iterator[tuple[int, int, bytes]]:
    """(line number or -1, byte offset, line) of the lines that begin in [start, stop) of a file; line
    numbers are known only when reading from the start."""
    if path.name.lower().endswith(".gz"):
        with gzip.open(path, "rb") as fh:
            offset = 0
            for row, raw in enumerate(fh):
                yield row, offset, raw
                offset += len(raw)
        return
    with open(path, "rb") as fh:
        if start > 0:
            fh.seek(start - 1)
            if fh.read(1) != b"\n":
                fh.readline()  # the line that began before ``start`` belongs to the previous unit
        row = 0 if start == 0 else -1
        while True:
            offset = fh.tell()
            if stop >= 0 and offset >= stop:
                return
            raw = fh.readline()
            if not raw:
                return
            yield row, offset, raw
            if row >= 0:
                row += 1


def _read_jsonl(path: Path, stats: CorpusStats, start: int = 0, stop: int = -1) -> Iterator[Document]:
    src = str(path)
    n = 0
    for line_no, offset, raw in _lines(path, start, stop):
        row = line_no if line_no >= 0 else None
        where = dict(row=row) if row is not None else dict(row=None, offset=offset)
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            stats.add_bad(src, reason="undecodable_bytes", detail=str(e), **where)
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            stats.add_bad(src, reason="invalid_json", detail=str(e), **where)
            continue
        if not isinstance(rec, dict):
            stats.add_bad(src, reason="record_not_object", detail=type(rec).__name__, **where)
            continue
        text = rec.get("text")
        if not _text_ok(text, src, stats, **where):
            continue
        doc_id = rec.get("id", rec.get("doc_id"))
        if doc_id is None:
            doc_id = f"{path.name}:{row}" if row is not None else f"{path.name}@{offset}"
        n += 1
        assert isinstance(text, str)  # checked by _text_ok
        yield Document(str(doc_id), text, str(rec.get("source") or path.name), _opt(rec.get("title")),
                       _opt(rec.get("url")), len(raw))
    if n == 0 and start == 0 and not any(e["file"] == src for e in stats.examples):
        stats.add_bad(src, None, "empty_file")


def _opt(v) -> str | None:
    return None if v is None else str(v)


def _read_parquet(path: Path, stats: CorpusStats, first_group: int = 0, stop_group: int = -1) -> Iterator[Document]:
    import pyarrow.parquet as pq

    src = str(path)
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a reported bad record
        stats.add_bad(src, None, "unreadable_file", str(e))
        return
    names = pf.schema_arrow.names
    if "text" not in names:
        if first_group == 0:
            stats.add_bad(src, None, "missing_text_column", f"columns: {names}")
        return
    md = pf.metadata
    stop_group = md.num_row_groups if stop_group < 0 else stop_group
    groups = list(range(first_group, stop_group))
    row = sum(md.row_group(g).num_rows for g in range(first_group))
    if not groups:
        if first_group == 0:
            stats.add_bad(src, None, "empty_file")
        return
    cols = [c for c in ("text", "id", "doc_id", "url", "title", "source") if c in names]
    n0 = row
    for batch in pf.iter_batches(columns=cols, batch_size=4096, row_groups=groups):
        data = batch.to_pydict()
        for j in range(batch.num_rows):
            text = data["text"][j]
            r = row + j
            if _text_ok(text, src, stats, row=r):
                doc_id = data.get("id", data.get("doc_id", [None] * batch.num_rows))[j]
                yield Document(
                    str(doc_id) if doc_id is not None else f"{path.name}:{r}",
                    text,
                    str(data["source"][j]) if "source" in data and data["source"][j] else path.name,
                    _opt(data["title"][j]) if "title" in data else None,
                    _opt(data["url"][j]) if "url" in data else None,
                    len(text.encode()),
                )
        row += batch.num_rows
    if row == n0 == 0:
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
    yield Document(doc_id, text, source=path.parent.name or "text", title=path.stem, nbytes=len(raw))


def read_corpus(paths: Iterable[str | Path], stats: CorpusStats | None = None) -> Iterator[Document]:
    """Yield the documents of all corpus paths in a stable order, counting bad records in ``stats``."""
    stats = stats if stats is not None else CorpusStats()
    for unit in plan_units(paths, unit_bytes=1 << 62):  # one unit per file (or text folder)
        yield from read_unit(unit, stats)


def fingerprint(paths: Iterable[str | Path], sample: int = 1 << 16) -> str:
    """sha256 over every corpus file's name and size and its first and last ``sample`` bytes: cheap at
    any corpus size (shards record the units they read; a file rewritten in place with the same size
    and the same head and tail would go unnoticed)."""
    h = hashlib.sha256()
    for f in corpus_files(paths):
        size = f.stat().st_size
        h.update(f.name.encode())
        h.update(str(size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(sample))
            if size > sample:
                fh.seek(max(sample, size - sample))
                h.update(fh.read(sample))
    return h.hexdigest()


def is_validation(doc_id: str, fraction: float) -> bool:
    """Deterministic document-level train/validation split by a hash of the id."""
    digest = hashlib.blake2b(doc_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


__all__ = ["CorpusStats", "Document", "WorkUnit", "corpus_files", "fingerprint", "is_validation", "plan_units",
           "read_corpus", "read_unit"]
