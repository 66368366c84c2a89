"""One shard: one work unit of the corpus read, tokenised, cut into windows, run through the model
once, and written as a self-contained directory (``engine/layout.py``).

Everything a shard stores comes from that single pass and the index's calibration, so shards are
built independently, in any order, on any worker, and appended later. Arrays are filled batch by
batch in memory-mapped temporary files (a shard never holds its token vectors in memory) and
renamed into place; ``shard.json`` is written last and marks the shard complete.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import save as st_save
from tokenizers import Tokenizer

from prism_tda.corpus import CorpusStats, WorkUnit, is_validation, read_unit
from prism_tda.engine.calibration import IndexCalibration
from prism_tda.engine.codec import TokenCodec
from prism_tda.engine.curvature import CurvatureStats
from prism_tda.engine.layout import (
    DOC_ROW_GROUP,
    DOCUMENTS,
    SEQUENCES,
    STATS,
    IndexConfig,
    ShardInfo,
    array_file,
    atomic_write_bytes,
    dir_bytes,
    faiss_ids,
    np_id_type,
    schemas,
    shard_dir,
    write_array,
    write_shard_faiss,
    write_shard_info,
    write_table,
)
from prism_tda.engine.sketch import Sketch, embed_sequences, normalise
from prism_tda.engine.tokens import run_batch, width_batches
from prism_tda.fsutil import fsync_dir
from prism_tda.model import PRISM
from prism_tda.model.record import TrainingRecord, document_key
from prism_tda.model.tokenizer import eos_id

from .calibrate import windows

ENCODE_CHUNK = 1024  # documents tokenised at once
TOP_CONTEXTS = 32  # per prototype: the shard's tokens that activate it most (prototype pages)


def stored_self(codec: TokenCodec, act_table: np.ndarray, inv64: np.ndarray, packed: np.ndarray, is_dir: np.ndarray,
                targets: np.ndarray, protos: np.ndarray, act_codes: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """(n,) the ``I(t, t)`` a shard stores: that of what the index holds of each token, the vector its
    codes decode to with its stored activations, so that a score from the codes divided by it is the
    cosine of the stored token (``engine/scoring.py``, ``approx_scores``). Dividing by the exact value
    instead biased every code-scored cosine down by the codes' relative error squared (a k-means
    reconstruction is shorter than the vector), most for the tokens that match the query best, which
    then lost their place to direction-coded tokens of equal exact score (docs/benchmarks.md). A
    direction-coded token keeps its ``exact`` value: its codes hold no length, and the reader gives
    the decoded direction the length that makes its ``I(t, t)`` this one. ``inv64``: (K, d) the
    curvature's inverse eigenvalues in float64."""
    out = np.asarray(exact, dtype=np.float32).copy()
    at = np.flatnonzero(~np.asarray(is_dir, dtype=bool))
    if len(at):
        # in float64, one row at a time in numpy's fixed order: the value must not depend on the batch
        # or on how many threads a process runs (a resumed or compacted shard stores the same values; a
        # direction-coded token's exact value comes from the forward pass and may not: docs/indexer.md)
        u2 = codec.decode(packed[at], targets[at]).numpy().astype(np.float64) ** 2  # (n, d)
        a2 = act_table[protos[at], act_codes[at]].astype(np.float64) ** 2  # (n, k)
        total = np.zeros(len(at))
        for j in range(a2.shape[1]):
            total += a2[:, j] * (u2 * inv64[protos[at, j]]).sum(1)
        out[at] = total
    return out


class _TopByPrototype:
    """The ``n`` (activation, token row) pairs of largest activation per prototype, kept batch by batch."""

    def __init__(self, K: int, n: int) -> None:
        self.act = np.full((K, n), -np.inf, dtype=np.float32)
        self.row = np.full((K, n), -1, dtype=np.int64)

    def add(self, proto: np.ndarray, act: np.ndarray, row: np.ndarray) -> None:
        K, n = self.act.shape
        p = np.concatenate([np.repeat(np.arange(K), n), proto])
        a = np.concatenate([self.act.reshape(-1), act])
        r = np.concatenate([self.row.reshape(-1), row])
        order = np.lexsort((r, -a, p))  # by prototype, largest activation first (ties: lower row)
        p, a, r = p[order], a[order], r[order]
        rank = np.arange(len(p)) - np.searchsorted(p, p)
        keep = rank < n
        self.act[p[keep], rank[keep]] = a[keep]
        self.row[p[keep], rank[keep]] = r[keep]


class _Arrays:
    """Memory-mapped ``.npy`` files filled in place under temporary names, published together."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.tmp: dict[str, Path] = {}
        self.arrays: dict[str, np.memmap] = {}

    def new(self, name: str, dtype, shape) -> np.ndarray:
        path = self.out / f".{name}.npy.tmp-{os.getpid()}"
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
        self.tmp[name], self.arrays[name] = path, arr
        return arr

    def publish(self) -> dict[str, int]:
        sizes = {}
        for name, arr in self.arrays.items():
            arr.flush()
            with open(self.tmp[name], "rb+") as fh:
                os.fsync(fh.fileno())
            del arr
            os.replace(self.tmp[name], array_file(self.out, name))
            sizes[name] = array_file(self.out, name).stat().st_size
        self.arrays.clear()
        fsync_dir(self.out)
        return sizes


class ShardBuilder:
    """Builds shards with one model replica and the index's calibration."""

    def __init__(self, model: PRISM, tokenizer: Tokenizer, calib: IndexCalibration, cfg: IndexConfig,
                 faiss_template: Path, *, device: torch.device | str = "cpu",
                 autocast: contextlib.AbstractContextManager | None = None, record: TrainingRecord | None = None,
                 val_fraction: float | None = None) -> None:
        """``record``: the checkpoint's training record, which says whether each document was trained on
        (``model/record.py``); a checkpoint without one falls back to its validation split
        (``val_fraction``), as indexes built before records did."""
        self.model, self.tokenizer, self.calib, self.cfg = model, tokenizer, calib, cfg
        self.faiss_template = Path(faiss_template)
        self.device, self.autocast, self.val_fraction = device, autocast, val_fraction
        self.record = record
        mc = model.cfg
        self.K, self.d, self.k = mc.n_prototypes, mc.d_model, mc.n_active
        self.codec = calib.codec(model.W)
        self.Q = calib.curvature.Q.to(device)
        self.inv = calib.curvature.inv()
        self.inv64 = self.inv.numpy().astype(np.float64)  # stored_self's, converted once
        self.act_table = calib.act_table()
        self.inv_sqrt = calib.curvature.inv_sqrt()
        self.sketch = Sketch(self.K, self.d, cfg.embed_dim, cfg.sketch_buckets, cfg.seed)
        self.schemas = schemas(mc.vocab_size, self.K)
        self.tok_dtype, self.proto_dtype = np_id_type(mc.vocab_size), np_id_type(self.K)

    # ------------------------------------------------------------------------------ read
    def _read(self, unit: WorkUnit) -> tuple[pa.Table, list[list[int]], list[list[int]], list[int], list[int],
                                             CorpusStats]:
        """The unit's documents table and windows (tokens, targets, document, start)."""
        stats = CorpusStats()
        docs = list(read_unit(unit, stats))
        if self.record is not None:
            seen, held = self.record.lookup(np.array([document_key(d.doc_id, d.text) for d in docs], np.int64))
            trained_of = (seen > 0).tolist()
            self.outside_record = int((~held).sum())
        else:
            trained_of = [True if self.val_fraction is None else not is_validation(d.doc_id, self.val_fraction)
                          for d in docs]
            self.outside_record = 0
        eos = eos_id(self.tokenizer)
        block, stride = self.model.cfg.block_size, self.cfg.stride or self.model.cfg.block_size
        cols: dict[str, list] = {f.name: [] for f in self.schemas["documents"]}
        toks, tgts, seq_doc, seq_start = [], [], [], []
        for c0 in range(0, len(docs), ENCODE_CHUNK):
            chunk = docs[c0 : c0 + ENCODE_CHUNK]
            for j, (doc, enc) in enumerate(zip(chunk, self.tokenizer.encode_batch([d.text for d in chunk]),
                                               strict=True)):
                ids = enc.ids or [eos]
                trained = trained_of[c0 + j]
                for k, v in (("doc", c0 + j), ("external_id", doc.doc_id), ("source", doc.source),
                             ("title", doc.title), ("url", doc.url), ("text", doc.text), ("n_tokens", len(ids)),
                             ("trained", trained)):
                    cols[k].append(v)
                for start, t, y in windows(ids, eos, block, stride):
                    toks.append(t)
                    tgts.append(y)
                    seq_doc.append(c0 + j)
                    seq_start.append(start)
        return pa.Table.from_pydict(cols, schema=self.schemas["documents"]), toks, tgts, seq_doc, seq_start, stats

    # ------------------------------------------------------------------------------ build
    def build(self, index_dir: Path, unit: WorkUnit, on_tokens: Callable[[int], object] | None = None,
              out: Path | None = None) -> ShardInfo:
        """Build the shard of ``unit`` in ``index_dir`` (or in the folder ``out``); ``shard.json`` last."""
        import faiss

        t_start = time.perf_counter()
        out = out if out is not None else shard_dir(index_dir, unit.unit)
        out.mkdir(parents=True, exist_ok=True)
        docs, toks, tgts, seq_doc, seq_start, cstats = self._read(unit)
        n_seq = len(toks)
        tok0 = np.zeros(n_seq + 1, dtype=np.int64)
        np.cumsum([len(t) for t in toks], out=tok0[1:])
        N = int(tok0[-1])
        cfg, k = self.cfg, self.k
        arrays = _Arrays(out)
        tokens = arrays.new("tokens", self.tok_dtype, (N,))
        protos = arrays.new("protos", self.proto_dtype, (N, k))
        acts = arrays.new("acts", np.uint8, (N, k))
        codes = arrays.new("codes", np.uint8, (N, self.codec.code_bytes))
        self_raw = np.zeros(N, dtype=np.float32)
        code_dir = np.zeros(N, dtype=bool)
        post_proto, post_cell, post_share, post_tok = [], [], [], []
        index = faiss.read_index(str(self.faiss_template))
        stats = CurvatureStats(self.K, self.d)
        top = _TopByPrototype(self.K, TOP_CONTEXTS)
        m = min(cfg.posting_entries, k)
        n_cells = self.calib.cells.shape[0]
        # batches of sequences of one padded width (a document shorter than the context pads less),
        # each written at its own rows: the files come out in sequence order whatever the batches' order
        for seq, width in width_batches(np.diff(tok0), cfg.batch_size, self.model.cfg.block_size):
            tb = run_batch(self.model, [toks[i] for i in seq], [tgts[i] for i in seq], device=self.device,
                           autocast=self.autocast, width=width)
            ut = tb.u @ self.Q  # (n, d) Q^T u_t
            stats.add(tb, ut)
            rows = (torch.from_numpy(tok0[seq])[tb.row.cpu()] + tb.pos.cpu()).numpy()  # token rows in the shard
            a, p = tb.acts.float().cpu(), tb.proto_idx.cpu()
            utc = ut.float().cpu()
            tokens[rows] = tb.token_ids.cpu().numpy()
            protos[rows] = p.numpy()
            act_codes = self.calib.quantize_acts(a, p)
            acts[rows] = act_codes
            packed, is_dir = self.codec.encode(ut, tb.targets)
            codes[rows], code_dir[rows] = packed, is_dir
            # each active prototype's part of I(t, t) = sum_i a_i^2 sum_j (Q^T u)_j^2 / (lam_ij + lam)
            part = a.pow(2) * torch.einsum("nd,nkd->nk", utc.pow(2), self.inv[p])  # (n, k)
            total = part.sum(1)
            self_raw[rows] = stored_self(self.codec, self.act_table, self.inv64, packed, is_dir,
                                         tb.targets.cpu().numpy(), p.numpy(), act_codes, total.numpy())
            share = part / total.clamp_min(1e-30)[:, None]
            # the first h entries: the prototypes carrying most of I(t, t); the rest: the most active others
            h = {"share": m, "both": (m + 1) // 2, "activation": 0}[cfg.posting_by]
            by_share = share.topk(h, dim=1).indices
            rest = a.masked_fill(torch.zeros_like(a, dtype=torch.bool).scatter_(1, by_share, True), -1.0)
            top_slot = torch.cat([by_share, rest.topk(m - h, dim=1).indices], 1)
            top_share = share.gather(1, top_slot)
            cell = self.calib.cell_of(utc)
            live = top_share > 0
            post_proto.append(p.gather(1, top_slot)[live].numpy())
            post_cell.append(cell[:, None].expand(-1, m)[live].numpy())
            post_share.append(top_share[live].numpy())
            post_tok.append(np.broadcast_to(rows[:, None], (len(rows), m))[live.numpy()])
            # the sequences' sketch embeddings, into this shard's FAISS part
            tok, slot = (a > 0).nonzero(as_tuple=True)
            top.add(p[tok, slot].numpy(), a[tok, slot].numpy(), rows[tok.numpy()])
            e = embed_sequences(self.sketch, tb.row.cpu()[tok], p[tok, slot], a[tok, slot], tok, utc, self.inv_sqrt,
                                len(seq)).numpy()
            index.add_with_ids(normalise(e), faiss_ids(unit.unit, seq.astype(np.int64)))
            if on_tokens is not None:
                on_tokens(len(rows))
        sizes = {}
        # posting lists: by (prototype, cell), strongest share first
        pp, pc = np.concatenate(post_proto or [np.zeros(0)]), np.concatenate(post_cell or [np.zeros(0)])
        ps, pt = np.concatenate(post_share or [np.zeros(0)]), np.concatenate(post_tok or [np.zeros(0)])
        key = pp.astype(np.int64) * n_cells + pc.astype(np.int64)
        order = np.lexsort((pt, -ps, key))  # equal shares: the lower row first (batch order does not matter)
        sizes["post_tokens"] = write_array(array_file(out, "post_tokens"), pt[order].astype(np.uint32))
        offsets = np.searchsorted(key[order], np.arange(self.K * n_cells + 1))
        sizes["post_offsets"] = write_array(array_file(out, "post_offsets"),
                                            offsets.astype(np.uint32 if len(pt) < 2**32 else np.uint64))
        sizes["proto_top"] = write_array(array_file(out, "proto_top"), top.row)
        positive = self_raw[self_raw > 0]
        # a power of two near the median: float16's range centred on the shard's values, and a scale
        # that a last-bit difference in one token's float32 I(t, t) (a forward pass in another process)
        # does not move, so a rebuilt shard differs from the first at most in that token's rounding
        self_scale = float(2.0 ** np.round(np.log2(np.median(positive)))) if len(positive) else 1.0
        sizes["self"] = write_array(array_file(out, "self"), (self_raw / self_scale).astype(np.float16))
        sizes["code_dir"] = write_array(array_file(out, "code_dir"), np.packbits(code_dir))
        sizes.update(arrays.publish())
        last_target = np.array([y[-1] for y in tgts], dtype=self.tok_dtype)
        for name, arr in (("seq_tok0", tok0), ("seq_doc", np.asarray(seq_doc, np.int32)),
                          ("seq_start", np.asarray(seq_start, np.int32)), ("seq_last_target", last_target)):
            sizes[name] = write_array(array_file(out, name), arr)
        seqs = pa.table({"seq": np.arange(n_seq, dtype=np.int32), "doc": np.asarray(seq_doc, np.int32),
                         "start_token": np.asarray(seq_start, np.int32),
                         "n_tokens": np.diff(tok0).astype(np.int16), "tok0": tok0[:-1]}, schema=self.schemas["sequences"])
        sizes["sequences"] = write_table(out / SEQUENCES, seqs)
        sizes["documents"] = write_table(out / DOCUMENTS, docs, row_group_size=DOC_ROW_GROUP)
        sizes["faiss"] = write_shard_faiss(index, out)
        atomic_write_bytes(out / STATS, st_save({k: v.contiguous() for k, v in stats.tensors().items()}))
        sizes["stats"] = (out / STATS).stat().st_size
        info = ShardInfo(unit=unit.unit, n_docs=docs.num_rows, n_seqs=n_seq, n_tokens=N, self_scale=self_scale,
                         bytes=sizes, corpus={**cstats.to_dict(), "trained_documents": int(docs["trained"].to_numpy().sum()),
                                              "outside_record": self.outside_record},
                         seconds=round(time.perf_counter() - t_start, 3),
                         stats={"loss_sum": float(stats.scalars[1]), "top_cos_sum": float(stats.scalars[2]),
                                "direction_codes": int(code_dir.sum())}, self_of="codes")
        write_shard_info(out, info)
        assert dir_bytes(out) > 0
        return info
