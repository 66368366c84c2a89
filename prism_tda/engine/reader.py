"""Reading an index's shards in this process: every shard's files through memory maps, so opening
costs O(shards), not O(tokens), and the OS page cache (not the process) holds what queries touch.
:class:`IndexReader` implements the coordinator's reads (``engine/reads.py``) and everything the
shard side reads (token data, posting lists, FAISS).

Ids are global: a shard's tokens, sequences and documents follow those of the shards before it
(in work-unit order). Token rows are addressed globally (``tok_base[s] + local``).
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from prism_tda.errors import PrismError

from . import kernels, layout
from .arrays import unique
from .curvature import self_influence
from .kernels import code_terms, over_parts
from .layout import DOC_ROW_GROUP, ShardInfo
from .reads import IndexWide

DOC_GROUPS_CACHED = 64  # decoded Parquet row groups of documents kept, over every shard
ID_GROUPS_CACHED = 1024  # row groups' external ids kept, over every shard (~9 MB at most)


def open_faiss(path: Path):
    """A FAISS index file, memory-mapped where FAISS supports it for the spec."""
    import faiss

    try:
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError:
        return faiss.read_index(str(path))


def _mapped(f: Path) -> np.ndarray:
    """An array file memory-mapped read-only, as a plain array over the map (the map lives as long as
    the array or a view of it; plain arrays index without ``np.memmap``'s per-call bookkeeping, which
    a query over many shards pays thousands of times)."""
    return np.asarray(np.load(f, mmap_mode="r"))


class Shard:
    """One shard's memory-mapped arrays, FAISS part and documents."""

    tokens: np.ndarray
    protos: np.ndarray
    acts: np.ndarray
    codes: np.ndarray
    self: np.ndarray
    post_offsets: np.ndarray
    post_tokens: np.ndarray
    proto_top: np.ndarray
    seq_tok0: np.ndarray
    seq_doc: np.ndarray
    seq_start: np.ndarray
    seq_last_target: np.ndarray
    code_dir: np.ndarray | None  # packed bits (layout.OPTIONAL_ARRAYS); None in older indexes
    faiss: Any  # a whole FAISS index (Flat template; older shards), or None
    faiss_lists: Any  # the shard's inverted lists under the index's IVF template, or None
    _faiss_owner: Any  # an empty IVF index that owns faiss_lists (layout.read_shard_lists), or None
    faiss_entries: int  # entries of the FAISS part

    def __init__(self, path: Path, info: ShardInfo) -> None:
        self.path, self.info = path, info
        for name in layout.ARRAYS:
            f = layout.array_file(path, name)
            if not f.is_file():
                raise PrismError(f"{f}: missing (rebuild the shard: delete {path} and run `prism index` again)")
            setattr(self, name, _mapped(f))
        for name in layout.OPTIONAL_ARRAYS:
            f = layout.array_file(path, name)
            setattr(self, name, _mapped(f) if f.is_file() else None)
        # the FAISS part: inverted lists under the index's IVF template, or a whole index (Flat; older shards)
        self.faiss, self.faiss_lists, self._faiss_owner = None, None, None
        if (path / layout.SHARD_IVF).is_file():
            self._faiss_owner = layout.read_shard_lists(path / layout.SHARD_IVF)
            self.faiss_lists = self._faiss_owner.invlists
            self.faiss_entries = layout.list_entries(self.faiss_lists)
        else:
            self.faiss = open_faiss(path / layout.SHARD_FAISS)
            self.faiss_entries = int(self.faiss.ntotal)
        self._docs = pq.ParquetFile(path / layout.DOCUMENTS)
        # one Parquet reader must not be read from two threads at once (pyarrow crashes the process)
        self._docs_lock = threading.Lock()
        md = self._docs.metadata  # documents per row group, as written (every group but the last)
        self.group_rows = md.row_group(0).num_rows if md.num_row_groups and md.row_group(0).num_rows else DOC_ROW_GROUP

    def close(self) -> None:
        """Let go of the shard's files: its memory maps (each holds a file descriptor), FAISS part and
        Parquet reader. Views still held elsewhere keep their pages until they go."""
        for name in layout.ARRAYS:
            self.__dict__.pop(name, None)
        self.code_dir = None
        self.faiss = self.faiss_lists = self._faiss_owner = None  # a view over the lists first, their owner last
        self._docs = None

    def targets(self, local: np.ndarray) -> np.ndarray:
        """The token each of the ``local`` rows predicts: the next input token of its window, or the
        window's stored last target."""
        seq = np.searchsorted(self.seq_tok0, local, side="right") - 1
        last = local + 1 >= self.seq_tok0[seq + 1]
        nxt = np.minimum(local + 1, len(self.tokens) - 1)
        return np.asarray(np.where(last, self.seq_last_target[seq], self.tokens[nxt]), dtype=np.int64)

    def code_dirs(self, local: np.ndarray) -> np.ndarray:
        """(n,) bool: whether the codes of the ``local`` rows are of their direction (``engine/codec.py``)."""
        if self.code_dir is None:
            return np.zeros(len(local), dtype=bool)
        local = np.asarray(local, np.int64)
        return ((self.code_dir[local >> 3] >> (7 - (local & 7))) & 1).astype(bool)

    def doc_group(self, group: int) -> dict[str, list]:
        with self._docs_lock:
            table = self._docs.read_row_group(group)
        return table.to_pydict()

    def external_id_group(self, group: int) -> list[str]:
        """The external ids of one row group of documents (that column alone: no text decoded)."""
        with self._docs_lock:
            col = self._docs.read_row_group(group, columns=["external_id"]).column("external_id")
        return [str(x) for x in col.to_pylist()]

    @functools.cached_property
    def trained(self) -> np.ndarray:
        """(n_docs,) bool: whether the checkpoint trained on each document (the trainer's split, as
        the indexer recorded it); one column of the documents table, read on first use. Indexes
        written before the column existed count every document as trained."""
        if "trained" not in self._docs.schema_arrow.names:
            return np.ones(self.info.n_docs, dtype=bool)
        with self._docs_lock:
            col = self._docs.read(columns=["trained"]).column("trained")
        return np.asarray(col.fill_null(True).to_numpy(zero_copy_only=False), dtype=bool)


@dataclass
class TokenData:
    """What the index stores of a set of tokens (global rows)."""

    protos: np.ndarray  # (n, k) int64
    acts: np.ndarray  # (n, k) float32, 0 where inactive
    self_influence: np.ndarray  # (n,) I(t, t) at the index's damping
    targets: np.ndarray  # (n,) the predicted token


class IndexReader(IndexWide):
    """The index-wide parts and the shards at some positions, memory-mapped in this process."""

    def __init__(self, index_dir: str | Path, W: torch.Tensor | None = None, shards: list[int] | None = None) -> None:
        """``W``: the model's unembedding (the token vectors' exact part, ``engine/codec.py``).
        ``shards``: the positions (in the manifest's order) of the shards this reader opens (default:
        all). Ids stay global whichever are open; reading a shard that is not open is an error."""
        t0 = time.perf_counter()
        super().__init__(index_dir, W)
        infos = self.manifest.shards
        self.held = list(range(len(infos))) if shards is None else sorted(set(shards))
        if any(not 0 <= s < len(infos) for s in self.held):
            raise PrismError(f"{self.dir}: shard positions {self.held} out of range (the index has {len(infos)})")
        self.shards = [Shard(infos[s].dir(self.dir), infos[s]) for s in self.held]
        self._at = {s: sh for s, sh in zip(self.held, self.shards, strict=True)}
        self._faiss_keep: Any = None  # what the stacked lists point into (set by _stack_ivf)
        self.stacked = self._stack_ivf()
        # decoded document row groups, the most recent few over every shard (bounded memory)
        self._doc_group = functools.lru_cache(maxsize=DOC_GROUPS_CACHED)(
            lambda s, g: self.shard(s).doc_group(g))
        # and their external ids alone, which every answer shows (a few KB a group: many more kept)
        self._id_group = functools.lru_cache(maxsize=ID_GROUPS_CACHED)(
            lambda s, g: self.shard(s).external_id_group(g))
        self.load_seconds = time.perf_counter() - t0

    def close(self) -> None:
        """Let go of every open shard's files (the reader is unusable afterwards)."""
        self._doc_group.cache_clear()
        self._id_group.cache_clear()
        self.stacked = self._faiss_keep = None  # it reads the shards' FAISS lists in place: it goes first
        for sh in self.shards:
            sh.close()
        self.shards, self._at = [], {}

    def shard(self, s: int) -> Shard:
        """The open shard at position ``s``."""
        sh = self._at.get(int(s))
        if sh is None:
            raise PrismError(f"{self.dir}: shard {s} is not open in this process (open: {self.held})")
        return sh

    def held_shards(self) -> list[tuple[int, Shard]]:
        """(position, shard) of every open shard, in order."""
        return list(zip(self.held, self.shards, strict=True))

    # --------------------------------------------------------------------------- addressing
    def _split(self, rows: np.ndarray, base: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(shard, positions in ``rows``, local ids) for the global ids ``rows`` per shard."""
        sh = np.searchsorted(base, rows, side="right") - 1
        if not len(sh):
            return []
        if sh.min() == sh.max():  # one shard (the usual case)
            s = int(sh[0])
            return [(s, np.arange(len(rows)), rows - base[s])]
        # grouped by shard in one stable sort (none when the ids ascend), positions ascending in each
        order = np.arange(len(sh)) if bool((sh[1:] >= sh[:-1]).all()) else np.argsort(sh, kind="stable")
        ss = sh[order]
        cuts = np.flatnonzero(ss[1:] != ss[:-1]) + 1
        return [(int(ss[a]), order[a:b], rows[order[a:b]] - base[ss[a]])
                for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(ss)], strict=True)]

    def token_data(self, tok: np.ndarray) -> TokenData:
        n, k = len(tok), self.k
        protos = np.zeros((n, k), dtype=np.int64)
        acts = np.zeros((n, k), dtype=np.float32)
        self_inf = np.zeros(n, dtype=np.float64)
        targets = np.zeros(n, dtype=np.int64)
        for s, at, local in self._split(tok, self.tok_base):
            sh = self.shard(s)
            p = sh.protos[local].astype(np.int64)
            protos[at] = p
            acts[at] = self.act_table[p, sh.acts[local]]
            self_inf[at] = sh.self[local].astype(np.float64) * sh.info.self_scale
            targets[at] = sh.targets(local)
        return TokenData(protos, acts, self_inf, targets)

    def scored_token_data(self, tok: np.ndarray, col: np.ndarray, m_tab: np.ndarray, y_tab: np.ndarray,
                          d_tab: np.ndarray | None, inv: np.ndarray) -> tuple[TokenData, np.ndarray]:
        """:meth:`token_data` of the tokens ``tok`` and each slot's term of their approximate score (n, k),
        in one compiled pass over the shards' arrays (``engine/kernels.py``): ``col`` (K,) each
        prototype's column of the query's lookup tables (or -1): ``m_tab`` and ``d_tab``
        (n_sub, P, 2^bits), ``y_tab`` (P, V); ``inv`` (K, d) the curvature at the index's damping."""
        n, k = len(tok), self.k
        codec = self.codec
        n_cent = 1 << codec.bits
        dir_cent = np.zeros((0, 0), np.float32) if codec.flat_dir_centroids is None else codec.flat_dir_centroids.numpy()
        d_tab = np.zeros((0, 0, 0), np.float32) if d_tab is None else d_tab
        split = self._split(tok, self.tok_base)
        parts = []
        for s, at, local in split:
            m, sh = len(local), self.shard(s)
            parts.append((at, np.empty((m, k), np.int64), np.empty((m, k), np.float32),
                          sh.self[local].astype(np.float64) * sh.info.self_scale, sh.targets(local),
                          np.empty((m, k), np.float32)))

        def part(i: int, sl: slice) -> None:
            """The terms of the rows ``sl`` of the ``i``-th shard's part (every shard's part on the threads
            at once: at many shards each holds few of the rows)."""
            s, _, local = split[i]
            _, p_, a_, t_self, tg, v_ = parts[i]
            sh = self.shard(s)
            rows = np.ascontiguousarray(local[sl], np.int64)
            code_dir = np.zeros(0, np.uint8) if sh.code_dir is None else sh.code_dir
            code_terms(rows, sh.protos, sh.acts, self.act_table, sh.codes, code_dir,
                       t_self[sl], tg[sl], codec.bits, codec.n_sub, n_cent, col, m_tab, y_tab, d_tab, dir_cent, inv,
                       p_[sl], a_[sl], v_[sl], len(sh.protos) >= kernels.GATHER_MIN_ROWS)

        over_parts([len(local) for _, _, local in split], part, torch.get_num_threads())
        if len(parts) == 1:  # one shard: its arrays are the answer
            _, protos, acts, self_inf, targets, terms = parts[0]
        else:
            protos, acts = np.zeros((n, k), np.int64), np.zeros((n, k), np.float32)
            terms, self_inf, targets = np.zeros((n, k), np.float32), np.zeros(n), np.zeros(n, np.int64)
            for at, p_, a_, t_self, tg, v_ in parts:
                protos[at], acts[at], self_inf[at], targets[at], terms[at] = p_, a_, t_self, tg, v_
        return TokenData(protos, acts, self_inf, targets), terms

    def token_codes(self, tok: np.ndarray) -> np.ndarray:
        """The packed codes (n, code_bytes) of the tokens ``tok``."""
        codes = np.zeros((len(tok), self.codec.code_bytes), dtype=np.uint8)
        for s, at, local in self._split(tok, self.tok_base):
            codes[at] = self.shard(s).codes[local]
        return codes

    def token_code_dirs(self, tok: np.ndarray) -> np.ndarray:
        """(n,) bool: which of the tokens ``tok`` store the codes of their direction."""
        out = np.zeros(len(tok), dtype=bool)
        for s, at, local in self._split(tok, self.tok_base):
            out[at] = self.shard(s).code_dirs(local)
        return out

    def direction_lengths(self, packed: np.ndarray, protos: np.ndarray, acts: np.ndarray, targets: np.ndarray,
                          stored_self: np.ndarray) -> np.ndarray:
        """(n,) the length of each direction-coded token vector (packed codes, active prototypes and
        activations, targets, stored ``I(t, t)``): the one that gives its decoded direction the stored
        ``I(t, t)``, which the index keeps exactly (the codes hold no length)."""
        unit = self.codec.decode(packed, targets, np.ones(len(packed), dtype=bool))
        i_unit = self_influence(unit, protos, acts, self.inv(self.cfg.damping))
        return np.sqrt(stored_self / np.maximum(i_unit, 1e-30)).astype(np.float32)

    def token_vectors(self, tok: np.ndarray, data: TokenData | None = None) -> torch.Tensor:
        """Approximate ``Q^T u_t`` (n, d) of the tokens ``tok`` from their stored codes (``data``: their
        :meth:`token_data`, when the caller has it)."""
        data = data if data is not None else self.token_data(tok)
        packed = self.token_codes(tok)
        dirs = self.token_code_dirs(tok)
        U = self.codec.decode(packed, data.targets, dirs)
        if dirs.any():
            at = np.nonzero(dirs)[0]
            length = self.direction_lengths(packed[at], data.protos[at], data.acts[at], data.targets[at],
                                            data.self_influence[at])
            U[torch.from_numpy(at)] *= torch.from_numpy(length)[:, None]
        return U

    def prefetch(self, seqs: np.ndarray, ctx: Any = None) -> None:
        """Say which sequences are read next (a reader of shards held elsewhere fetches them at once;
        this one reads its memory maps when asked)."""

    def seq_of_tokens(self, tok: np.ndarray) -> np.ndarray:
        out = np.zeros(len(tok), dtype=np.int64)
        for s, at, local in self._split(tok, self.tok_base):
            out[at] = self.seq_base[s] + np.searchsorted(self.shard(s).seq_tok0, local, side="right") - 1
        return out

    def doc_of_seqs(self, seqs: np.ndarray) -> np.ndarray:
        out = np.zeros(len(seqs), dtype=np.int64)
        for s, at, local in self._split(seqs, self.seq_base):
            out[at] = self.doc_base[s] + self.shard(s).seq_doc[local]
        return out

    def trained(self, docs: np.ndarray) -> np.ndarray:
        """Whether the checkpoint trained on each of the global document ids ``docs``."""
        out = np.ones(len(docs), dtype=bool)
        for s, at, local in self._split(np.asarray(docs, np.int64), self.doc_base):
            out[at] = self.shard(s).trained[local]
        return out

    def seq_span(self, seq: int) -> tuple[int, int, int]:
        """(first global token row, end row, start position in its document) of one sequence."""
        s = int(np.searchsorted(self.seq_base, seq, side="right") - 1)
        local = seq - self.seq_base[s]
        sh = self.shard(s)
        base = int(self.tok_base[s])
        return base + int(sh.seq_tok0[local]), base + int(sh.seq_tok0[local + 1]), int(sh.seq_start[local])

    def rows_of_sequences(self, seqs: np.ndarray) -> np.ndarray:
        """Global token rows of the given sequences."""
        parts = []
        for s, _, local in self._split(np.sort(seqs), self.seq_base):
            t0 = self.shard(s).seq_tok0
            parts.append(self.tok_base[s] + ranges(t0[local], t0[local + 1]))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def sequences_of_documents(self, docs: np.ndarray) -> np.ndarray:
        """Every global sequence id of the given documents (ascending)."""
        parts = []
        for s, _, local in self._split(unique(np.asarray(docs, np.int64)), self.doc_base):
            sh = self.shard(s)
            parts.append(self.seq_base[s] + ranges(np.searchsorted(sh.seq_doc, local, side="left"),
                                                   np.searchsorted(sh.seq_doc, local, side="right")))
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def rows_of_documents(self, docs: np.ndarray) -> np.ndarray:
        """Global token rows of the given documents (ascending)."""
        parts = []
        for s, _, local in self._split(unique(np.asarray(docs, np.int64)), self.doc_base):
            sh = self.shard(s)
            seqs = ranges(np.searchsorted(sh.seq_doc, local, side="left"), np.searchsorted(sh.seq_doc, local, side="right"))
            parts.append(self.tok_base[s] + ranges(sh.seq_tok0[seqs], sh.seq_tok0[seqs + 1]))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def tokens_of_documents(self, docs: np.ndarray) -> int:
        """How many tokens the given documents hold (without listing their rows)."""
        total = 0
        for s, _, local in self._split(unique(np.asarray(docs, np.int64)), self.doc_base):
            sh = self.shard(s)
            lo, hi = np.searchsorted(sh.seq_doc, local, side="left"), np.searchsorted(sh.seq_doc, local, side="right")
            total += int((sh.seq_tok0[hi] - sh.seq_tok0[lo]).sum())
        return total

    def sequence_tokens(self, seq: int) -> tuple[list[int], list[int]]:
        """(input tokens, targets) of one sequence, as the model saw them."""
        lo, hi, _ = self.seq_span(seq)
        s = int(np.searchsorted(self.tok_base, lo, side="right") - 1)
        local = np.arange(lo, hi) - self.tok_base[s]
        sh = self.shard(s)
        return sh.tokens[local].astype(np.int64).tolist(), sh.targets(local).tolist()

    def sequences_tokens(self, seqs: np.ndarray) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """(first global token row of each, (input tokens, targets) of each) of the sequences ``seqs``,
        as the model saw them: one read per shard."""
        seqs = np.asarray(seqs, np.int64)
        first = np.zeros(len(seqs), np.int64)
        out: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.int64), np.zeros(0, np.int64))] * len(seqs)
        for s, at, local in self._split(seqs, self.seq_base):
            sh = self.shard(s)
            t0, t1 = np.asarray(sh.seq_tok0[local], np.int64), np.asarray(sh.seq_tok0[local + 1], np.int64)
            rows = ranges(t0, t1)
            first[at] = self.tok_base[s] + t0
            cut = np.cumsum(t1 - t0)[:-1]
            toks, tgts = np.split(np.asarray(sh.tokens[rows], np.int64), cut), np.split(sh.targets(rows), cut)
            for i, tk, tg in zip(at, toks, tgts, strict=True):
                out[i] = (tk, tg)
        return first, out

    # --------------------------------------------------------------------------- first stages
    @functools.cached_property
    def list_sizes(self) -> np.ndarray:
        """(K * cells,) entries of each (prototype, cell) posting list over every shard (read on first use)."""
        return self._list_sizes()

    def open_list_sizes(self) -> np.ndarray:
        """(K * cells,) entries of each posting list in the open shards."""
        return layout.posting_list_sizes([sh.post_offsets for sh in self.shards],
                                         len(self.calib.curvature.lam) * self.n_cells)

    def _list_sizes(self) -> np.ndarray:
        """Over every shard: as the reduce wrote them (``post_sizes.npy``), checked against the shards'
        own offsets when all are open; an index without the file sums its shards' offsets."""
        sizes = self.stored_list_sizes()
        all_open = len(self.shards) == len(self.manifest.shards)
        if sizes is not None and (not all_open or int(sizes.sum()) == sum(len(sh.post_tokens) for sh in self.shards)):
            return sizes
        if not all_open:
            raise PrismError(f"{self.dir / layout.POST_SIZES}: missing or stale; a reader of part of the index "
                             f"needs it (run `prism index` again to rewrite it)")
        return self.open_list_sizes()

    def _stack_ivf(self):
        """The shards' IVF parts as one index: they share the trained template, so their inverted lists
        are stacked (read in place, not copied) under one coarse quantiser and a query searches every
        shard at once. None for other FAISS specs (searched shard by shard)."""
        import faiss

        if not self.shards:
            return None
        try:
            parts = [sh.faiss_lists if sh.faiss_lists is not None else faiss.extract_index_ivf(sh.faiss).invlists
                     for sh in self.shards]
        except RuntimeError:
            return None
        merged = faiss.read_index(str(self.dir / layout.FAISS_TEMPLATE))
        ivf = faiss.extract_index_ivf(merged)
        lists = faiss.InvertedListsPtrVector()  # type: ignore[attr-defined]
        for part in parts:
            lists.push_back(part)
        stacked = faiss.HStackInvertedLists(lists.size(), lists.data())
        ivf.replace_invlists(stacked, False)
        ivf.ntotal = merged.ntotal = sum(sh.faiss_entries for sh in self.shards)
        self._faiss_keep = (parts, lists, stacked)  # the stacked lists point into these
        return merged

    def _shard_faiss(self, sh: Shard) -> Any:
        """A shard's FAISS part as an index of its own: its whole index, or (lists under the IVF
        template) a copy of the template over its lists, built on first use (searching shard by shard
        is the path of indexes whose parts cannot be stacked; an IVF index's are)."""
        if sh.faiss is None:
            sh.faiss = layout.over_template(self.dir / layout.FAISS_TEMPLATE, sh.faiss_lists, own=False)  # goes before its lists
        return sh.faiss

    def search_embedding(self, e: np.ndarray, n: int, nprobe: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(similarities, global sequence ids) of the ``n`` sequences nearest to the query embedding
        ``e``, best first (equal similarities: lower id first, so parts searched apart merge into the
        same answer)."""
        import faiss

        ivf_params = faiss.SearchParametersIVF(nprobe=nprobe or self.nprobe)  # type: ignore[call-arg]
        if self.stacked is not None:
            params = (ivf_params if isinstance(self.stacked, faiss.IndexIVF)
                      else faiss.SearchParametersPreTransform(index_params=ivf_params))  # type: ignore[call-arg]
            d, i = self.stacked.search(e, min(n, max(self.stacked.ntotal, 1)), params=params)
            ok = i[0] >= 0
            sc, ids = d[0][ok], i[0][ok]
        else:
            scores, found = [], []
            for sh in self.shards:
                index = self._shard_faiss(sh)
                if index.ntotal == 0:
                    continue
                d, i = index.search(e, min(n, index.ntotal),
                                    params=ivf_params if isinstance(index, faiss.IndexIVF) else None)
                ok = i[0] >= 0
                scores.append(d[0][ok])
                found.append(i[0][ok])
            if not found:
                return np.zeros(0, np.float32), np.zeros(0, np.int64)
            sc, ids = np.concatenate(scores), np.concatenate(found)
        unit, local = layout.split_faiss_ids(ids)
        seqs = self.seq_base[self.shard_of_unit[unit]] + local
        top = np.lexsort((seqs, -sc))[:n]
        return sc[top], seqs[top]

    def top_contexts(self, proto: int, n: int) -> list[tuple[int, float]]:
        """The ``n`` training tokens (global row, activation) that activate ``proto`` most, over every
        shard (each shard keeps its top tokens per prototype)."""
        rows, acts = [], []
        for s, sh in self.held_shards():
            local = sh.proto_top[proto]
            local = local[local >= 0]
            if len(local) and self.takedown.any():
                local = local[~self.removed(self.doc_of_seqs(self.seq_of_tokens(self.tok_base[s] + local)))]
            if len(local):
                slot = (sh.protos[local] == proto).argmax(1)
                acts.append(self.act_table[proto, sh.acts[local, slot]])
                rows.append(self.tok_base[s] + local)
        if not rows:
            return []
        r, a = np.concatenate(rows), np.concatenate(acts)
        order = np.lexsort((r, -a))[:n]
        return [(int(r[i]), float(a[i])) for i in order]

    # --------------------------------------------------------------------------- documents
    def _doc_place(self, doc: int) -> tuple[int, int, int]:
        """(shard, row group, row in the group) of the document ``doc``; KeyError outside the index."""
        s = int(np.searchsorted(self.doc_base, doc, side="right") - 1)
        if not 0 <= s < len(self.manifest.shards) or not 0 <= doc < self.n_docs:
            raise KeyError(doc)
        local = int(doc - self.doc_base[s])
        rows = self.shard(s).group_rows
        return s, local // rows, local % rows

    def document(self, doc: int) -> dict:
        s, g, r = self._doc_place(doc)
        rec = {k: v[r] for k, v in self._doc_group(s, g).items()}
        rec["doc_id"] = int(doc)
        return rec

    def external_id(self, doc: int) -> str:
        s, g, r = self._doc_place(doc)
        return self._id_group(s, g)[r]


def ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, e)`` for each pair."""
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    lens = ends - starts
    if len(lens) == 0 or lens.sum() == 0:
        return np.zeros(0, np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return np.arange(lens.sum(), dtype=np.int64) + offsets
