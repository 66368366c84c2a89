"""Reading training corpora: JSONL(.gz), Parquet, Arrow (a Hugging Face ``datasets`` folder written by
``save_to_disk``, or any Arrow IPC file), folders of text files.

The text and the id are read from the fields ``Fields`` names (``text`` and ``id``/``doc_id`` by
default; a dotted path reaches into nested records: ``meta.id``). Arrow files are read through a
memory map one record batch at a time, so a corpus larger than memory is never copied into it.

Bad records (no text, text of the wrong type, undecodable bytes, unparsable lines, a columnar file
without the text column, a record without the id field asked for, an empty file) are counted by
reason and reported with their file and row; they never crash a run and are never dropped silently.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CorpusError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
# a `datasets` folder's own metadata, not documents
DATASETS_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")
MAX_EXAMPLES = 50  # bad-record examples kept per run


@dataclass(frozen=True)
class Fields:
    """Where a record keeps its text and its id: a key, or a dotted path into nested records
    (``meta.id``); a key that itself holds a dot is taken whole first."""

    text: str = "text"
    id: str | None = None  # None: ``id``, else ``doc_id``, else the file and row

    def __post_init__(self) -> None:
        for name, v in (("text", self.text), ("id", self.id)):
            if v is not None and (not v or any(not part for part in v.split("."))):
                raise CorpusError(f"--{name}-field {v!r}: want a field name or a dotted path such as meta.{name}")

    @property
    def is_default(self) -> bool:
        return self == Fields()

    def to_dict(self) -> dict[str, str | None]:
        return {"text_field": self.text, "id_field": self.id}

    def columns(self) -> list[str]:
        """The top-level columns a columnar file must provide for these fields."""
        cols = [self.text.split(".")[0]]
        cols += [self.id.split(".")[0]] if self.id is not None else ["id", "doc_id"]
        return cols + ["source", "title", "url"]


_MISSING = object()


def field_value(rec: dict, path: str):
    """The value at ``path`` of a record (``_MISSING`` when a part of the path is absent)."""
    if path in rec:
        return rec[path]
    cur = rec
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


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
    if name.endswith(ARROW_SUFFIXES):
        return "arrow"
    if name in DATASETS_METADATA and path.parent.joinpath("state.json").is_file():
        return "unknown"
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
            if (p / "dataset_dict.json").is_file():
                splits = sorted(c.name for c in p.iterdir() if c.is_dir())
                raise CorpusError(f"{p} is a datasets DatasetDict with splits {splits}: pass one split's folder, "
                                  f"e.g. {p / (splits[0] if splits else 'train')}")
            found = sorted(f for f in p.rglob("*") if f.is_file() and _kind(f) != "unknown")
            if not found:
                raise CorpusError(f"corpus folder has no .jsonl/.jsonl.gz/.parquet/.arrow/.txt files: {p}")
            out.extend(found)
        else:
            if _kind(p) == "unknown":
                raise CorpusError(f"unsupported corpus file type (want .jsonl[.gz], .parquet, .arrow, .txt): {p}")
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
    whole compressed JSONL file, a range of a Parquet file's row groups or of an Arrow file's record
    batches, or a batch of text files.
    Planned from file sizes and Parquet footers alone, so planning never reads the corpus."""

    unit: int
    kind: str  # jsonl | parquet | arrow | text
    file: str  # the file; for text units, the folder their names are relative to
    start: int = 0  # jsonl: byte offset; parquet: first row group; arrow: first record batch
    stop: int = -1  # exclusive; -1: to the end
    files: list[str] | None = None  # text units: the files, relative to ``file``
    bytes: int = 0  # corpus bytes in the unit
    text_field: str = "text"  # the record's fields (``Fields``)
    id_field: str | None = None

    @property
    def fields(self) -> Fields:
        return Fields(self.text_field, self.id_field)

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


def plan_units(paths: Iterable[str | Path], unit_bytes: int, first: int = 0, fields: Fields | None = None
               ) -> list[WorkUnit]:
    """Cut the corpus into work units of about ``unit_bytes`` each, numbered from ``first``."""
    units: list[WorkUnit] = []
    fields = fields or Fields()

    def add(**kw) -> None:
        units.append(WorkUnit(unit=first + len(units), **kw, text_field=fields.text, id_field=fields.id))

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
            elif kind == "arrow":
                try:
                    sizes = [b.nbytes for b in _arrow_batches(f)]
                except Exception:  # noqa: BLE001 - unreadable: one unit, whose reader reports it
                    add(kind="arrow", file=str(f), bytes=size)
                    continue
                lo, acc = 0, 0
                for g, nb in enumerate(sizes):
                    acc += nb
                    if acc >= unit_bytes or g == len(sizes) - 1:
                        add(kind="arrow", file=str(f), start=lo, stop=g + 1, bytes=acc)
                        lo, acc = g + 1, 0
                if not sizes:
                    add(kind="arrow", file=str(f), bytes=size)
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
        it = _read_jsonl(f, stats, unit.start, unit.stop, unit.fields)
    elif unit.kind == "parquet":
        it = _read_parquet(f, stats, unit.start, unit.stop, unit.fields)
    elif unit.kind == "arrow":
        it = _read_arrow(f, stats, unit.start, unit.stop, unit.fields)
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


def _read_jsonl(path: Path, stats: CorpusStats, start: int = 0, stop: int = -1, fields: Fields | None = None
                ) -> Iterator[Document]:
    src, fields = str(path), fields or Fields()
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
        fallback = f"{path.name}:{row}" if row is not None else f"{path.name}@{offset}"
        doc = _document(rec, fields, src, where, fallback, path.name, len(raw), stats)
        if doc is not None:
            n += 1
            yield doc
    if n == 0 and start == 0 and not any(e["file"] == src for e in stats.examples):
        stats.add_bad(src, None, "empty_file")


def _document(rec: dict, fields: Fields, src: str, where: dict, fallback_id: str, default_source: str,
              nbytes: int | None, stats: CorpusStats) -> Document | None:
    """The document of one record, or None (counted in ``stats``) when it has no usable text or lacks
    the id field asked for. ``nbytes`` None: the text's UTF-8 length."""
    text = field_value(rec, fields.text)
    if not _text_ok(None if text is _MISSING else text, src, stats, **where):
        return None
    assert isinstance(text, str)  # checked by _text_ok
    if fields.id is not None:
        doc_id = field_value(rec, fields.id)
        if doc_id is _MISSING or doc_id is None:
            stats.add_bad(src, reason="missing_id", detail=f"no field {fields.id!r}", **where)
            return None
    else:
        doc_id = rec.get("id", rec.get("doc_id"))
        doc_id = fallback_id if doc_id is None else doc_id
    return Document(str(doc_id), text, str(rec.get("source") or default_source), _opt(rec.get("title")),
                    _opt(rec.get("url")), len(text.encode()) if nbytes is None else nbytes)


def _opt(v) -> str | None:
    return None if v is None else str(v)


def _read_parquet(path: Path, stats: CorpusStats, first_group: int = 0, stop_group: int = -1,
                  fields: Fields | None = None) -> Iterator[Document]:
    import pyarrow.parquet as pq

    src, fields = str(path), fields or Fields()
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file is a reported bad record
        stats.add_bad(src, None, "unreadable_file", str(e))
        return
    names = pf.schema_arrow.names
    if not _has_text_column(names, fields, src, stats, first_group == 0):
        return
    md = pf.metadata
    stop_group = md.num_row_groups if stop_group < 0 else stop_group
    groups = list(range(first_group, stop_group))
    row = sum(md.row_group(g).num_rows for g in range(first_group))
    if not groups:
        if first_group == 0:
            stats.add_bad(src, None, "empty_file")
        return
    cols = _columns(names, fields)
    n0 = row
    for batch in pf.iter_batches(columns=cols, batch_size=4096, row_groups=groups):
        yield from _batch_documents(batch, fields, src, path.name, row, stats)
        row += batch.num_rows
    if row == n0 == 0:
        stats.add_bad(src, None, "empty_file")


def _columns(names: list[str], fields: Fields) -> list[str]:
    want = [fields.text] if fields.text in names else []
    want += [fields.id] if fields.id is not None and fields.id in names else []
    return list(dict.fromkeys(c for c in want + fields.columns() if c in names))


def _has_text_column(names: list[str], fields: Fields, src: str, stats: CorpusStats, report: bool) -> bool:
    if fields.text in names or fields.text.split(".")[0] in names:
        return True
    if report:
        stats.add_bad(src, None, "missing_text_column", f"no column {fields.text!r}; columns: {names}")
    return False


def _batch_documents(batch, fields: Fields, src: str, name: str, row: int, stats: CorpusStats
                     ) -> Iterator[Document]:
    """The documents of one Arrow record batch whose first row is ``row`` of its file."""
    for j, rec in enumerate(batch.to_pylist()):
        r = row + j
        doc = _document(rec, fields, src, {"row": r}, f"{name}:{r}", name, None, stats)
        if doc is not None:
            yield doc


def _arrow_batches(path: Path) -> Generator:
    """The record batches of an Arrow IPC file (the random-access format or the stream format that
    ``datasets`` writes), read through a memory map: each batch's buffers stay in the page cache."""
    import pyarrow as pa

    source = pa.memory_map(str(path), "r")
    try:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            source.seek(0)
            yield from pa.ipc.open_stream(source)
            return
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    finally:
        source.close()


def _read_arrow(path: Path, stats: CorpusStats, first: int = 0, stop: int = -1, fields: Fields | None = None
                ) -> Iterator[Document]:
    """The documents of record batches ``[first, stop)`` of an Arrow file (rows numbered from the file's
    start)."""
    import pyarrow as pa

    src, fields = str(path), fields or Fields()
    row = 0
    try:
        with contextlib.closing(_arrow_batches(path)) as batches:
            for g, batch in enumerate(batches):
                if stop >= 0 and g >= stop:
                    break
                if g == 0 and not _has_text_column(batch.schema.names, fields, src, stats, first == 0):
                    return
                if g >= first:
                    cols = batch.select(_columns(batch.schema.names, fields))
                    yield from _batch_documents(cols, fields, src, path.name, row, stats)
                row += batch.num_rows
    except (OSError, pa.ArrowInvalid) as e:
        stats.add_bad(src, row, "unreadable_file", str(e))
        return
    if row == 0 and first == 0:
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


def read_corpus(paths: Iterable[str | Path], stats: CorpusStats | None = None, fields: Fields | None = None
                ) -> Iterator[Document]:
    """Yield the documents of all corpus paths in a stable order, counting bad records in ``stats``."""
    stats = stats if stats is not None else CorpusStats()
    for unit in plan_units(paths, unit_bytes=1 << 62, fields=fields):  # one unit per file (or text folder)
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


__all__ = ["CorpusStats", "Document", "Fields", "WorkUnit", "corpus_files", "fingerprint", "is_validation", "plan_units",
           "read_corpus", "read_unit"]
