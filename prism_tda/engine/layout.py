"""What an index is on disk: its build configuration, the manifest, and the files of each shard.
The indexer writes this layout; the engine and the service read it.

An index is a set of self-contained shards plus a manifest. A shard holds the documents of one
work unit of the corpus (a byte range of a JSONL file, row groups of a Parquet file, a batch of
text files); it is built independently (by a Ray worker, or later, to append new documents) and
published by writing its ``shard.json`` last. Ids inside a shard are local (0-based); global ids
are the shard's offset (the counts of the shards before it, in unit order) plus the local id.

    INDEX/
      manifest.json             format, identity, config, work units, calibration, shards, summary
      calibration.safetensors   curvature basis Q and corrections lam (the index curvature), the
                                token-vector codebooks, posting cells, activation ranges
      faiss_template.index      the trained, empty FAISS index every shard's part starts from
      prototypes.parquet, vocab.parquet, stats.safetensors (the shards' statistics, summed)
      takedown.json             documents taken down (engine/takedown.py), if any
      shards/u000000/           (u000000.g1/, ...: the shard rewritten without documents taken down)
        documents.parquet       doc, external_id, source, title, url, text, n_tokens, trained
        sequences.parquet       seq, doc, start_token, n_tokens, tok0
        seq_tok0.npy seq_doc.npy seq_start.npy seq_last_target.npy     per sequence
        tokens.npy protos.npy acts.npy codes.npy self.npy               per token (memory-mapped)
        post_offsets.npy post_tokens.npy                                posting lists
        faiss.ivf               the shard's FAISS part: under an IVF template, its inverted lists
                                only (FAISS's own serialisation, memory-mapped when read; the
                                quantisers are the template's, stored once); under a Flat
                                template, and in shards written before, a whole index (faiss.index)
        shard.json (written last)
        stats.safetensors       the shard's additive statistics, until the reduce folds them into the
                                index's stats.safetensors (which records the units it holds)

Per token: the input token id (uint16 when the vocabulary allows), the k active prototypes
(uint16 up to 65,536 prototypes) and their activations (uint8 on a per-prototype log scale; 0 =
inactive), the packed codes of the token vector (``engine/codec.py``), one bit saying whether
those codes are of the vector's direction (``code_dir.npy``, ``np.packbits`` order; absent in
indexes built before direction codes: none are), and ``I(t, t)`` (float16, scaled by the shard's
``self_scale``) of the token as stored: of the vector its codes decode to, with its stored
activations (``self_of: "codes"``; shards written before hold the exact value, ``"exact"``). Posting lists hold, for each prototype and cell of the
token-vector direction, the tokens for which that prototype carries most of ``I(t, t)``,
strongest first. Every file is written under a temporary name, fsynced and renamed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from prism_tda.config import Config
from prism_tda.config import check as _check
from prism_tda.corpus import WorkUnit
from prism_tda.errors import PrismError
from prism_tda.fsutil import atomic_write_bytes, fsync_dir

FORMAT = "prism-tda-index"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
SHARD_INFO = "shard.json"
SHARDS = "shards"
CALIBRATION = "calibration.safetensors"
FAISS_TEMPLATE = "faiss_template.index"
POST_SIZES = "post_sizes.npy"  # each posting list's entries over every shard (written by the reduce)
EKFAC = "ekfac.safetensors"  # the full-model influence curvature (engine/influence.py; optional)
PROTOTYPES, VOCAB, STATS, ESTIMATE = "prototypes.parquet", "vocab.parquet", "stats.safetensors", "estimate.json"
# a shard's files: its tables, its FAISS part and one .npy per array (array_file)
DOCUMENTS, SEQUENCES, SHARD_FAISS = "documents.parquet", "sequences.parquet", "faiss.index"
SHARD_IVF = "faiss.ivf"  # an IVF template's shard part: its inverted lists alone
# the index-wide files (besides the shards and POST_SIZES), the manifest first
INDEX_FILES = (MANIFEST, CALIBRATION, FAISS_TEMPLATE, PROTOTYPES, VOCAB, STATS)
ARRAYS = ("tokens", "protos", "acts", "codes", "self", "post_offsets", "post_tokens", "proto_top", "seq_tok0",
          "seq_doc", "seq_start", "seq_last_target")
# arrays a shard may lack (written by later versions of the indexer; readers default them)
OPTIONAL_ARRAYS = ("code_dir",)
DOC_ROW_GROUP = 128  # documents per Parquet row group written: a document is read by its row group


@dataclass(frozen=True)
class IndexConfig(Config):
    """How the corpus is cut, run through the model, summarised and stored.

    Fields that change the stored rows are part of the index's identity: an index built with
    other values is refused on resume or append (see ``IDENTITY_FIELDS``).
    """

    stride: int | None = None  # window stride in tokens; None = the model's block_size (no overlap)
    batch_size: int = 32  # sequences per forward batch
    shard_bytes: int = 64 << 20  # corpus bytes per work unit (one unit = one shard)
    calibration_tokens: int = 262_144  # tokens of the sample that fixes curvature, codebooks and cells
    # lambda_i = damping x a unit (engine/curvature.py): "prototype", each block's own mean eigenvalue shrunk
    # toward the global mean; "global", the mean over blocks (set damping with it: 1.0 was its default)
    damping: float = 0.03
    damping_scope: str = "prototype"
    embed_dim: int = 64  # JL projection width r of the per-sequence embeddings
    sketch_buckets: int = 16  # count-sketch buckets B over the prototype axis; embedding width r * B
    faiss_spec: str = "auto"  # FAISS factory string; "auto": Flat when small, IVF-PQ when large
    code_subquantizers: int = 16  # product-quantiser sub-vectors of a token vector
    code_bits: int = 12  # bits per sub-vector code (8, 12 or 16)
    posting_entries: int = 2  # posting-list entries per token (the prototypes it is filed under)
    # which prototypes file a token: "both", the first half of the entries those carrying most of its
    # I(t, t), the rest its most active others; "share", all by I(t, t); "activation", all by activation
    posting_by: str = "both"
    posting_cells: int = 256  # cells of the token-vector direction inside each prototype's list
    seed: int = 0  # JL matrix, count-sketch hashing, k-means
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU

    def __post_init__(self) -> None:
        for name in ("batch_size", "shard_bytes", "calibration_tokens", "embed_dim", "sketch_buckets",
                     "code_subquantizers", "posting_entries", "posting_cells"):
            _check(getattr(self, name) > 0, f"index.{name} must be > 0, got {getattr(self, name)}")
        _check(self.stride is None or self.stride > 0, f"index.stride must be > 0, got {self.stride}")
        _check(self.damping_scope in ("prototype", "global"),
               f"index.damping_scope must be prototype|global, got {self.damping_scope!r}")
        _check(self.damping > 0, f"index.damping must be > 0, got {self.damping}")
        _check(self.code_bits in (8, 12, 16), f"index.code_bits must be 8, 12 or 16, got {self.code_bits}")
        _check(self.code_bits != 12 or self.code_subquantizers % 2 == 0,
               "index.code_subquantizers must be even with 12-bit codes (they pack in pairs)")
        _check(self.posting_by in ("share", "activation", "both"),
               f"index.posting_by must be share|activation|both, got {self.posting_by!r}")
        _check(self.dtype in ("auto", "fp32", "bf16"), f"index.dtype must be auto|fp32|bf16, got {self.dtype!r}")


# What an index built before a config field existed was built with (its manifest lacks the field)
OLDER_CONFIG = {"damping_scope": "global", "posting_by": "share"}

# Fields whose change alters rows (batch size does not; dtype does only on a GPU, and is recorded).
IDENTITY_FIELDS = ("stride", "shard_bytes", "calibration_tokens", "damping", "damping_scope", "embed_dim",
                   "sketch_buckets", "faiss_spec", "code_subquantizers", "code_bits", "posting_entries", "posting_by", "posting_cells", "seed")


@dataclass
class ShardInfo:
    """One complete shard (``shard.json``)."""

    unit: int
    n_docs: int
    n_seqs: int
    n_tokens: int
    self_scale: float  # I(t, t) is stored as float16 of I / self_scale
    bytes: dict[str, int]
    corpus: dict[str, Any]  # the unit's reader counts (records, bad records by reason)
    seconds: float
    stats: dict[str, float] = field(default_factory=dict)  # loss, grounding sums of the shard
    generation: int = 0  # rewrites of the shard without documents taken down (indexer/compact.py)
    # what the stored I(t, t) is of: "codes", the stored token (what its codes decode to, with its stored
    # activations; exact for direction-coded tokens); "exact", the token itself (shards written before,
    # until `prism index --upgrade`)
    self_of: str = "exact"

    @property
    def name(self) -> str:
        return f"u{self.unit:06d}"

    def dir(self, index_dir: Path) -> Path:
        """This shard's folder in ``index_dir`` (each generation has its own)."""
        return shard_dir(index_dir, self.unit, self.generation)


@dataclass
class Calibration:
    """What the calibration sample fixed for every shard."""

    tokens: int
    sequences: int
    estimated_tokens: int  # the corpus, estimated from its bytes
    faiss_spec: str
    faiss_nprobe: int
    seconds: float


@dataclass
class IndexManifest:
    """``manifest.json``: what the index was built from, how, and which of its shards are complete."""

    identity: dict[str, Any]  # what must match to resume or append (see indexer.run.identity)
    checkpoint: str
    corpus: list[str]
    config: IndexConfig
    model: dict[str, Any]  # the checkpoint's model config
    versions: dict[str, str]
    units: list[WorkUnit] = field(default_factory=list)
    calibration: Calibration | None = None
    shards: list[ShardInfo] = field(default_factory=list)  # complete shards, in unit order
    complete: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def documents(self) -> int:
        return sum(s.n_docs for s in self.shards)

    @property
    def sequences(self) -> int:
        return sum(s.n_seqs for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.n_tokens for s in self.shards)

    def bases(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, sequences, documents): each shard's first global id, and the total last; ids are
        global, shards in manifest order."""
        counts = np.array([[s.n_tokens, s.n_seqs, s.n_docs] for s in self.shards], dtype=np.int64).reshape(-1, 3)
        bases = np.zeros((len(self.shards) + 1, 3), dtype=np.int64)
        np.cumsum(counts, axis=0, out=bases[1:])
        return bases[:, 0], bases[:, 1], bases[:, 2]

    def add_shard(self, info: ShardInfo) -> None:
        self.shards = sorted([s for s in self.shards if s.unit != info.unit] + [info], key=lambda s: s.unit)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = MANIFEST) -> IndexManifest:
        if d.get("format") != FORMAT or d.get("format_version") != FORMAT_VERSION:
            raise PrismError(f"{where}: format {d.get('format')!r} version {d.get('format_version')!r} is not "
                             f"{FORMAT!r} version {FORMAT_VERSION}; rebuild the index with this version "
                             "(delete it and run the same `prism index` command)")
        try:
            return cls(identity=d["identity"], checkpoint=d["checkpoint"], corpus=d["corpus"],
                       config=IndexConfig.from_dict({**OLDER_CONFIG, **d["config"]}, where=f"{where}: config"),
                       model=d["model"],
                       versions=d["versions"], units=[WorkUnit(**u) for u in d.get("units", [])],
                       calibration=Calibration(**d["calibration"]) if d.get("calibration") else None,
                       shards=[ShardInfo(**s) for s in d.get("shards", [])], complete=bool(d.get("complete")),
                       timings=d.get("timings", {}), summary=d.get("summary"))
        except (KeyError, TypeError) as e:
            raise PrismError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None


def posting_list_sizes(offsets: list[np.ndarray], n_lists: int) -> np.ndarray:
    """Entries of each posting list summed over shards, from the shards' list offsets."""
    out = np.zeros(n_lists, dtype=np.int64)
    for off in offsets:
        sizes: np.ndarray = np.diff(np.asarray(off, dtype=np.int64))
        out += sizes
    return out


# ------------------------------------------------------------------------------ FAISS ids
FAISS_UNIT_SHIFT = 32  # a shard's FAISS ids: (work unit << 32) | local sequence id


def faiss_ids(unit: int, local_seqs: np.ndarray) -> np.ndarray:
    """FAISS ids of a shard's sequences: they name the shard (by its work unit, known before the
    shard is built, unlike its global offset), so every shard's lists can be searched as one."""
    return (np.int64(unit) << FAISS_UNIT_SHIFT) | local_seqs.astype(np.int64)


def split_faiss_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(work unit, local sequence id) of FAISS ids."""
    ids = np.asarray(ids, dtype=np.int64)
    return ids >> FAISS_UNIT_SHIFT, ids & ((1 << FAISS_UNIT_SHIFT) - 1)


def write_shard_faiss(index: Any, out: Path) -> int:
    """Write a shard's FAISS part into the shard directory ``out``; its bytes. An IVF index (the
    template with the shard's entries added) is written as its inverted lists alone (``SHARD_IVF``):
    the quantisers are the template's, which the index stores once, and repeating them per shard
    cost ~1.5 MB a shard. Any other index is written whole (``SHARD_FAISS``). Atomic and fsynced."""
    import faiss

    try:
        ivf: Any = faiss.extract_index_ivf(index)
    except RuntimeError:
        ivf = None
    w = faiss.VectorIOWriter()
    if ivf is not None:
        faiss.write_InvertedLists(ivf.invlists, w)
    else:
        faiss.write_index(index, w)
    data = faiss.vector_to_array(w.data).tobytes()
    name, other = (SHARD_IVF, SHARD_FAISS) if ivf is not None else (SHARD_FAISS, SHARD_IVF)
    atomic_write_bytes(out / name, data)
    (out / other).unlink(missing_ok=True)  # a shard holds one form (a rewrite may change it)
    return len(data)


def read_shard_lists(path: Path) -> Any:
    """A shard's inverted lists from its ``SHARD_IVF`` file, memory-mapped read-only (FAISS maps an
    array-lists file as on-disk lists), inside an empty IVF index that owns them: its ``invlists``
    are the lists, and they (and their map) go when it does. FAISS hands the lists over unowned, and
    deleting them from Python corrupts SWIG's type table; an index deleting its own lists is FAISS's
    path. The owner is of the lists' shape only (a scalar quantiser of ``code_size`` dimensions, never
    trained or searched): a few hundred bytes, where a copy of the template was a megabyte or more."""
    import faiss

    try:
        reader = faiss.FileIOReader(str(path))
        lists: Any = faiss.read_InvertedLists(reader, faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError as e:
        raise PrismError(f"{path}: not a FAISS inverted-lists file ({e}); rebuild the shard: delete "
                         f"{path.parent} and run `prism index` again") from None
    quantizer: Any = faiss.IndexFlatIP(lists.code_size)
    owner = faiss.IndexIVFScalarQuantizer(quantizer, lists.code_size, lists.nlist, faiss.ScalarQuantizer.QT_8bit,
                                          faiss.METRIC_INNER_PRODUCT)
    quantizer.thisown, owner.own_fields = False, True
    owner.replace_invlists(lists, True)
    return owner


def list_entries(lists: Any) -> int:
    """Entries in FAISS inverted lists."""
    return sum(lists.list_size(i) for i in range(lists.nlist))


def over_template(template_path: Path, lists: Any, *, own: bool) -> Any:
    """The index's FAISS template (at ``template_path``) over a shard's inverted ``lists``, as one index;
    ``own``: the index frees the lists (else they must outlive it)."""
    import faiss

    index = faiss.read_index(str(template_path))
    ivf = faiss.extract_index_ivf(index)
    if own:
        lists.thisown = False
    ivf.replace_invlists(lists, own)
    index.ntotal = ivf.ntotal = list_entries(lists)
    return index


def shard_index(template_path: Path, shard: Path) -> Any:
    """A shard's FAISS part as a whole index: its ``SHARD_FAISS`` file, or the template at
    ``template_path`` over the shard's ``SHARD_IVF`` lists (read in memory: for rewriting a shard's
    part, not for serving it)."""
    import faiss

    if (shard / SHARD_IVF).is_file():
        return over_template(template_path, faiss.read_InvertedLists(faiss.FileIOReader(str(shard / SHARD_IVF))),
                             own=True)
    return faiss.read_index(str(shard / SHARD_FAISS))


# ------------------------------------------------------------------------------ tables
def id_type(max_value: int) -> pa.DataType:
    """Narrowest signed integer type that holds ids in [0, max_value)."""
    if max_value <= 2**15:
        return pa.int16()
    if max_value <= 2**31:
        return pa.int32()
    return pa.int64()


def np_id_type(max_value: int) -> np.dtype:
    """Narrowest unsigned numpy type for ids in [0, max_value) (token and prototype arrays)."""
    return np.dtype(np.uint16) if max_value <= 2**16 else np.dtype(np.uint32)


def schemas(vocab_size: int, n_prototypes: int) -> dict[str, pa.Schema]:
    tok, proto = id_type(vocab_size), id_type(n_prototypes)
    return {
        "documents": pa.schema([
            ("doc", pa.int32()), ("external_id", pa.string()), ("source", pa.string()), ("title", pa.string()),
            ("url", pa.string()), ("text", pa.string()), ("n_tokens", pa.int32()), ("trained", pa.bool_()),
        ]),
        "sequences": pa.schema([
            ("seq", pa.int32()), ("doc", pa.int32()), ("start_token", pa.int32()), ("n_tokens", pa.int16()),
            ("tok0", pa.int64()),
        ]),
        "prototypes": pa.schema([
            ("proto_id", proto), ("n_tokens", pa.int64()), ("mass", pa.float64()), ("mean_act", pa.float32()),
            ("top_tokens", pa.list_(pa.string())), ("label", pa.string()),
            ("act_lo", pa.float32()), ("act_hi", pa.float32()),  # the log scale of the stored activations
        ]),
        "vocab": pa.schema([("token_id", tok), ("token", pa.string())]),
    }


def array_file(shard: Path, name: str) -> Path:
    """The file of one of a shard's arrays (``ARRAYS``)."""
    return shard / f"{name}.npy"


def shard_dir(index_dir: Path, unit: int, generation: int = 0) -> Path:
    """The folder of a work unit's shard: ``u000123``, and ``u000123.g2`` for its second rewrite."""
    return Path(index_dir) / SHARDS / (f"u{unit:06d}" + (f".g{generation}" if generation else ""))


def write_table(path: Path, table: pa.Table, **kwargs: Any) -> int:
    """Write a zstd Parquet file atomically; return its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd", compression_level=6, **kwargs)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path.stat().st_size


def write_array(path: Path, array: np.ndarray) -> int:
    """Write a ``.npy`` file atomically (readers memory-map it); return its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        np.save(fh, np.ascontiguousarray(array), allow_pickle=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path.stat().st_size


def read_manifest(index_dir: Path) -> IndexManifest | None:
    """The index's manifest, or None when there is none yet; errors name the file."""
    f = Path(index_dir) / MANIFEST
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise PrismError(f"{f}: cannot be read ({e})") from None
    return IndexManifest.from_dict(data, where=str(f))


def write_manifest(index_dir: Path, manifest: IndexManifest) -> None:
    atomic_write_bytes(Path(index_dir) / MANIFEST, json.dumps(manifest.to_dict(), indent=2, sort_keys=True).encode())


def read_shard_info(path: Path) -> ShardInfo | None:
    f = Path(path) / SHARD_INFO
    return ShardInfo(**json.loads(f.read_text())) if f.is_file() else None


def write_shard_info(path: Path, info: ShardInfo) -> None:
    atomic_write_bytes(Path(path) / SHARD_INFO, json.dumps(dataclasses.asdict(info), indent=2).encode())


def clean_temporaries(index_dir: Path) -> int:
    """Remove temporary files left by a killed run; return how many."""
    n = 0
    for p in Path(index_dir).rglob(".*.tmp-*"):
        p.unlink(missing_ok=True)
        n += 1
    return n


def dir_bytes(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def disk_bytes(index_dir: Path) -> dict[str, int]:
    """Bytes of every file of an index, by kind (a shard's file by its name in ``ShardInfo.bytes``, an
    index-wide file by its stem), shards summed."""
    m = read_manifest(index_dir)
    out: dict[str, int] = {}
    if m is None:
        return out
    for sh in m.shards:
        d = sh.dir(index_dir)
        for name, b in sh.bytes.items():
            if name == "stats" and not (d / STATS).exists():
                continue  # folded into the index's statistics and deleted by the reduce
            out[name] = out.get(name, 0) + int(b)
        out["shard"] = out.get("shard", 0) + (d / SHARD_INFO).stat().st_size
    for name in (*INDEX_FILES, POST_SIZES):
        if (index_dir / name).exists():
            stem = name.split(".")[0]
            out[stem] = out.get(stem, 0) + (index_dir / name).stat().st_size
    return out
