"""Compaction: rewrite the shards that hold documents taken down (``engine/takedown.py``) without them.

A shard is rebuilt from its own documents table minus the removed documents, with the index's model
and calibration, so every kept document's rows come out as the first build wrote them (a window is
computed the same in any shard). The new shard goes to its own folder (the next *generation*,
``u000123.g1``); the index's statistics lose the removed documents' share (measured by building
them as a throwaway shard: the sums are additive over documents); the manifest is written, naming
the new generation, which is the one moment the index changes for a reader; then the old folder is
deleted. A compaction killed at any point is finished by running it again: each step checks what
the previous run left (a complete new shard is kept, statistics already corrected are marked in
``stats.safetensors``, folders of superseded generations are deleted).

A running server keeps serving the generation it loaded (its open files) until it reloads the index
(``POST /v1/admin/indexes/{name}/reload`` or SIGHUP); until then its SQL tables, which read the
shards' Parquet files by name, fail on the rewritten shards.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from prism_tda.corpus import WorkUnit
from prism_tda.engine import layout
from prism_tda.engine.calibration import IndexCalibration
from prism_tda.engine.curvature import CurvatureStats
from prism_tda.engine.reads import load_index_checkpoint, read_complete_manifest
from prism_tda.engine.takedown import read_removals
from prism_tda.model import checkpoint as ckpt
from prism_tda.model.device import autocast_for, pick_device

from .shard import ShardBuilder

log = logging.getLogger(__name__)

STAGE = ".compact"  # scratch folder of a compaction, inside the index


def _subtract(total: CurvatureStats, part: CurvatureStats) -> None:
    """Remove ``part``'s share of the additive sums (the max-merged ``max_cos`` keeps its value)."""
    for name in ("S", "lam", "count", "mass", "scalars"):
        setattr(total, name, getattr(total, name) - getattr(part, name))


def compact(index_dir: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Rewrite every shard holding a document taken down without it; returns what was done."""
    index_dir = Path(index_dir)
    t0 = time.perf_counter()
    m = read_complete_manifest(index_dir)
    gens = {sh.unit: sh.generation for sh in m.shards}
    todo: dict[int, set[int]] = {}
    for r in read_removals(index_dir):
        if gens.get(r.unit) == r.generation:
            todo.setdefault(r.unit, set()).add(r.local)
    stage = index_dir / STAGE
    if todo:
        model, tokenizer, ck_config = load_index_checkpoint(index_dir, m)
        device = pick_device()
        calib = IndexCalibration.load(index_dir / layout.CALIBRATION)
        train = ck_config.get("training", {}).get("train_config") or {}
        builder = ShardBuilder(model, tokenizer, calib, m.config, index_dir / layout.FAISS_TEMPLATE, device=device,
                               autocast=autocast_for(device, m.config.dtype), record=ckpt.load_record(m.checkpoint),
                               val_fraction=train.get("val_fraction"))
        stage.mkdir(exist_ok=True)
        for unit in tqdm(sorted(todo), desc="compact", unit="shard", disable=not progress):
            m = _rewrite(index_dir, m, unit, todo[unit], builder, stage)
    removed = sum(len(v) for v in todo.values())
    _sweep(index_dir, m)
    if todo:
        _refresh_tables(index_dir, m, builder.model, builder.tokenizer, builder.calib)
    shutil.rmtree(stage, ignore_errors=True)
    out = {"shards_rewritten": len(todo), "documents_removed": removed, "documents": m.documents,
           "tokens": m.tokens, "seconds": round(time.perf_counter() - t0, 3)}
    log.info("compacted", extra=out)
    return out


def _documents_file(docs: pa.Table, path: Path, unit: int) -> WorkUnit:
    """The documents as a Parquet corpus file (their ids in ``external_id``), read as work unit ``unit``."""
    pq.write_table(docs.select(["external_id", "text", "source", "title", "url"]), path)
    return WorkUnit(unit=unit, kind="parquet", file=str(path), id_field="external_id")


def _rewrite(index_dir: Path, m: layout.IndexManifest, unit: int, removed: set[int], builder: ShardBuilder,
             stage: Path) -> layout.IndexManifest:
    old = next(sh for sh in m.shards if sh.unit == unit)
    gen = old.generation + 1
    new_dir = layout.shard_dir(index_dir, unit, gen)
    docs = pq.read_table(old.dir(index_dir) / layout.DOCUMENTS)
    drop = np.zeros(docs.num_rows, dtype=bool)
    drop[sorted(removed)] = True
    # 1. the new generation, unless a killed run completed it already
    info = layout.read_shard_info(new_dir)
    if info is None:
        shutil.rmtree(new_dir, ignore_errors=True)
        kept = _documents_file(docs.filter(pa.array(~drop)), stage / f"u{unit}-kept.parquet", unit)
        info = builder.build(index_dir, kept, out=new_dir)
    info.generation = gen
    info.corpus = {**old.corpus, "documents": info.n_docs,
                   "removed_documents": int(old.corpus.get("removed_documents", 0)) + int(drop.sum())}
    layout.write_shard_info(new_dir, info)
    # 2. the index's statistics without the removed documents, once (marked by unit and generation)
    path = index_dir / layout.STATS
    t = load_file(str(path))
    done = {tuple(x) for x in t.pop("compacted", torch.zeros(0, 2, dtype=torch.int64)).tolist()}
    units = t.pop("units")
    if (unit, gen) not in done:
        gone_dir = stage / f"u{unit}-removed"
        shutil.rmtree(gone_dir, ignore_errors=True)
        gone = _documents_file(docs.filter(pa.array(drop)), stage / f"u{unit}-removed.parquet", unit)
        builder.build(index_dir, gone, out=gone_dir)
        total = CurvatureStats.from_tensors(t)
        _subtract(total, CurvatureStats.from_tensors(load_file(str(gone_dir / layout.STATS))))
        done.add((unit, gen))
        layout.atomic_write_bytes(path, save({**{k: v.contiguous() for k, v in total.tensors().items()},
                                              "units": units,
                                              "compacted": torch.tensor(sorted(done), dtype=torch.int64)}))
        shutil.rmtree(gone_dir, ignore_errors=True)
    (new_dir / layout.STATS).unlink(missing_ok=True)  # its sums are in the index's already (less the removed)
    # 3. the manifest names the new generation: from here on, readers opening the index see it
    m.add_shard(info)
    if m.summary is not None:
        m.summary.update(documents=m.documents, sequences=m.sequences, tokens=m.tokens)
    layout.write_manifest(index_dir, m)
    # 4. the old generation's files, the removed documents' text among them
    shutil.rmtree(old.dir(index_dir), ignore_errors=True)
    return m


def _sweep(index_dir: Path, m: layout.IndexManifest) -> None:
    """Delete the folders of superseded generations a killed compaction left behind."""
    current = {sh.dir(index_dir).name for sh in m.shards}
    units = {sh.unit for sh in m.shards}
    for d in (index_dir / layout.SHARDS).iterdir() if (index_dir / layout.SHARDS).is_dir() else ():
        name = d.name.split(".g")[0]
        if d.is_dir() and name.startswith("u") and name[1:].isdigit() and int(name[1:]) in units \
                and d.name not in current:
            shutil.rmtree(d, ignore_errors=True)


def _refresh_tables(index_dir: Path, m: layout.IndexManifest, model: Any, tokenizer: Any,
                    calib: IndexCalibration) -> None:
    """The posting-list sizes and the prototype table, from the shards and statistics as they are now."""
    from .run import write_tables

    t = load_file(str(index_dir / layout.STATS))
    t.pop("units", None)
    t.pop("compacted", None)
    n_lists = model.cfg.n_prototypes * calib.cells.shape[0]
    layout.write_array(index_dir / layout.POST_SIZES, layout.posting_list_sizes(
        [np.load(layout.array_file(sh.dir(index_dir), "post_offsets"), mmap_mode="r") for sh in m.shards], n_lists))
    write_tables(index_dir, model, tokenizer, CurvatureStats.from_tensors(t), calib)
