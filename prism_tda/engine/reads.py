"""What the coordinator of a query reads of an index, wherever its shards are held.

:class:`IndexWide` is what every process that serves an index reads itself, in O(1) of the tokens:
the manifest, the calibration (curvature, codec, posting cells, activation scale), the sketch, the
global id bases and counts. :class:`Reads` adds the reads of sequences, documents and prototype
contexts; two classes implement it, held to it by the type checker:

- ``engine.reader.IndexReader``: the shards' files, memory-mapped in this process;
- ``engine.cluster.RemoteReader``: the shards held by Ray actors, asked and cached.

Everything else a query needs of the shards themselves (token codes, posting lists, FAISS) is the
shard side's (``engine/shards.py``), which always reads a local ``IndexReader``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from prism_tda.errors import PrismError
from prism_tda.model import checkpoint as ckpt

from . import layout
from .calibration import IndexCalibration
from .layout import IndexConfig, IndexManifest
from .sketch import Sketch, normalise
from .takedown import RemovedSet

log = logging.getLogger(__name__)


def read_complete_manifest(index_dir: Path) -> IndexManifest:
    """The manifest of a complete index; a clear error for anything else."""
    if not Path(index_dir).is_dir():
        raise PrismError(f"{index_dir}: does not exist; build an index there with `prism index --checkpoint RUN "
                         f"--out {index_dir}` (or `prism demo` for runs/demo/index)")
    m = layout.read_manifest(index_dir)
    if m is None or not m.complete:
        raise PrismError(f"{index_dir}: not a complete index (manifest.json missing or incomplete); run the "
                         "`prism index` command that writes it (again, to finish it)")
    return m


def load_index_checkpoint(index_dir: Path, m: IndexManifest, checkpoint: str | Path | None = None) -> tuple[Any, Any, dict]:
    """(model, tokenizer, checkpoint config) of ``checkpoint`` (default: the one the manifest names),
    refused unless its weights are the ones the index ``index_dir`` was built from."""
    path = checkpoint or m.checkpoint
    model, tokenizer, ck_config = ckpt.load_checkpoint(path)
    if ck_config["files"]["model.safetensors"] != m.identity["checkpoint_sha256"]:
        raise PrismError(f"{index_dir}: the checkpoint {path} is not the one the index was built from")
    return model, tokenizer, ck_config


class IndexWide:
    """The index-wide parts of an index, read in every process that serves it."""

    def __init__(self, index_dir: str | Path, W: torch.Tensor | None = None) -> None:
        """``W``: the model's unembedding (the token vectors' exact part, ``engine/codec.py``): needed to
        score from the stored codes; without it the reads of tokens, sequences and documents work."""
        t0 = time.perf_counter()
        self.dir = Path(index_dir)
        self.manifest = read_complete_manifest(self.dir)
        self.cfg: IndexConfig = self.manifest.config
        older = sum(s.self_of != "codes" for s in self.manifest.shards)
        if older:
            log.warning(f"{self.dir}: {older} of {len(self.manifest.shards)} shards store the exact I(t, t), as "
                        "indexes built before 2026-12-07 do; `prism index --out DIR --upgrade` gives the fast path "
                        "the stored tokens' own (closer to exact mode, fewer documents re-ranked; docs/indexer.md)")
        self.calib = IndexCalibration.load(self.dir / layout.CALIBRATION)
        self.curv = self.calib.curvature
        self._codec = self.calib.codec(W) if W is not None else None
        self.damping_unit = self.curv.damping / self.cfg.damping  # (K, 1) or (1, 1): engine/curvature.py
        self.act_table = self.calib.act_table()
        self.sketch = Sketch(self.n_prototypes, self.curv.u_dim, self.cfg.embed_dim, self.cfg.sketch_buckets,
                             self.cfg.seed)
        self.n_cells = self.calib.cells.shape[0]
        self.tok_base, self.seq_base, self.doc_base = self.manifest.bases()
        self.n_tokens, self.n_seqs, self.n_docs = int(self.tok_base[-1]), int(self.seq_base[-1]), int(self.doc_base[-1])
        self.nprobe = self.manifest.calibration.faiss_nprobe if self.manifest.calibration else 1
        self.shard_of_unit = np.zeros(max((s.unit for s in self.manifest.shards), default=0) + 1, dtype=np.int64)
        self.shard_of_unit[[s.unit for s in self.manifest.shards]] = np.arange(len(self.manifest.shards))
        self.k = int(self.manifest.model.get("n_active", self.manifest.model.get("top_k", 8)))
        self.takedown = RemovedSet.of(self.dir, self.manifest)
        self.load_seconds = time.perf_counter() - t0

    def removed(self, docs: np.ndarray) -> np.ndarray:
        """Whether each of the global document ids ``docs`` was taken down (``engine/takedown.py``)."""
        return self.takedown.removed(docs)

    @property
    def n_prototypes(self) -> int:
        return self.curv.lam.shape[0]

    @property
    def codec(self) -> Any:
        """The token-vector codec (``engine/codec.py``)."""
        if self._codec is None:
            raise PrismError(f"{self.dir}: opened without the model's unembedding; scoring from the codes needs it")
        return self._codec

    def inv(self, damping: float) -> torch.Tensor:
        """(K, d) diagonal of (H_i + damping * unit_i * I)^{-1} in the Q basis."""
        return 1.0 / (self.curv.lam + damping * self.damping_unit)

    def query_embedding(self, G_pre: torch.Tensor) -> np.ndarray:
        """(1, D) the normalised sketch embedding of the preconditioned query columns ``G_pre`` (K, d)."""
        K = G_pre.shape[0]
        return normalise(self.sketch.embed_rows(torch.zeros(K, dtype=torch.long), torch.arange(K), G_pre, 1).numpy())

    def stored_list_sizes(self) -> np.ndarray | None:
        """(K * cells,) entries of each (prototype, cell) posting list over every shard, as the reduce
        wrote them (``post_sizes.npy``); None for an index without the file (or a stale one)."""
        path = self.dir / layout.POST_SIZES
        if path.is_file():
            sizes = np.load(path)
            if len(sizes) == self.n_prototypes * self.n_cells:
                return sizes
        return None


class Reads(Protocol):
    """The reads of an index the coordinator of a query makes: its index-wide parts, and sequences,
    documents and prototype contexts by global id."""

    dir: Path
    manifest: IndexManifest
    cfg: IndexConfig
    curv: Any
    calib: IndexCalibration
    n_cells: int
    act_table: np.ndarray
    n_tokens: int
    n_seqs: int
    n_docs: int
    tok_base: np.ndarray
    seq_base: np.ndarray
    doc_base: np.ndarray
    nprobe: int
    k: int
    load_seconds: float

    @property
    def n_prototypes(self) -> int: ...

    @property
    def list_sizes(self) -> np.ndarray:
        """(K * cells,) entries of each (prototype, cell) posting list over every shard."""
        ...

    def inv(self, damping: float) -> torch.Tensor: ...

    def query_embedding(self, G_pre: torch.Tensor) -> np.ndarray: ...

    def prefetch(self, seqs: np.ndarray, ctx: Any = None) -> None:
        """Say which sequences are read next (a reader of shards held elsewhere fetches them at once)."""
        ...

    def seq_of_tokens(self, tok: np.ndarray) -> np.ndarray:
        """The sequence of each global token row."""
        ...

    def doc_of_seqs(self, seqs: np.ndarray) -> np.ndarray:
        """The document of each global sequence id."""
        ...

    def sequences_of_documents(self, docs: np.ndarray) -> np.ndarray:
        """Every global sequence id of the documents ``docs`` (ascending)."""
        ...

    def trained(self, docs: np.ndarray) -> np.ndarray:
        """Whether the checkpoint trained on each of the global document ids ``docs``."""
        ...

    takedown: RemovedSet

    def removed(self, docs: np.ndarray) -> np.ndarray:
        """Whether each of the global document ids ``docs`` was taken down."""
        ...

    def seq_span(self, seq: int) -> tuple[int, int, int]:
        """(first global token row, end row, start position in its document) of one sequence."""
        ...

    def sequence_tokens(self, seq: int) -> tuple[list[int], list[int]]:
        """(input tokens, targets) of one sequence, as the model saw them."""
        ...

    def sequences_tokens(self, seqs: np.ndarray) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """(first global token row of each, (input tokens, targets) of each) of many sequences."""
        ...

    def document(self, doc: int) -> dict:
        """One document's record (``KeyError`` for an id that does not exist)."""
        ...

    def external_id(self, doc: int) -> str: ...

    def top_contexts(self, proto: int, n: int) -> list[tuple[int, float]]:
        """The ``n`` training tokens (global row, activation) that activate ``proto`` most."""
        ...

    def close(self) -> None: ...


def token_context(reader: Reads, row: int) -> tuple[int, int, int, list[int]]:
    """(sequence, document, position in the sequence, the sequence's input tokens) of one global token
    row: where a context shown for a token comes from."""
    seq = int(reader.seq_of_tokens(np.array([row]))[0])
    lo, _, _ = reader.seq_span(seq)
    tokens, _ = reader.sequence_tokens(seq)
    return seq, int(reader.doc_of_seqs(np.array([seq]))[0]), int(row) - lo, tokens


def document_table(index_dir: Path, columns: list[str]) -> Any:
    """Columns of every document of an index as one Arrow table, in global id order (``doc_id`` is the
    global id; shards in manifest order)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    m = read_complete_manifest(index_dir)
    cols = [c for c in columns if c != "doc_id"]
    parts = [pq.read_table(sh.dir(index_dir) / layout.DOCUMENTS, columns=cols) for sh in m.shards]
    table = pa.concat_tables(parts) if parts else pa.table({c: [] for c in cols})
    if "doc_id" in columns:
        table = table.add_column(0, "doc_id", pa.array(np.arange(table.num_rows, dtype=np.int64)))
    return table.select(columns)
