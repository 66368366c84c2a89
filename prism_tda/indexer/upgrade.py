"""Upgrading an index's shards in place to what this version's indexer writes, without running the
model over the corpus again.

Today this is one thing: the stored ``I(t, t)`` becomes that of the token as the index holds it (its
codes decoded, with its stored activations; ``indexer/shard.py``, ``stored_self``) where a shard
written before holds the exact value (``ShardInfo.self_of == "exact"``). Both are functions of what
the shard stores and the index's calibration and checkpoint, so an upgraded shard holds what a fresh
build of it would. Each shard's new array replaces the old one atomically, then its ``shard.json``
says so, then the manifest; a run killed at any point is finished by running it again (a shard
already upgraded is skipped, and recomputing one gives the same array). A running server keeps the
values it loaded until it reloads the index.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from prism_tda.engine import layout
from prism_tda.engine.calibration import IndexCalibration
from prism_tda.engine.reader import Shard
from prism_tda.engine.reads import load_index_checkpoint, read_complete_manifest

from .shard import stored_self

log = logging.getLogger(__name__)

CHUNK = 1 << 16  # tokens decoded at once


def upgrade(index_dir: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Bring every shard of the complete index ``index_dir`` to this version's stored values; returns
    what was done."""
    index_dir = Path(index_dir)
    t0 = time.perf_counter()
    m = read_complete_manifest(index_dir)
    todo = [sh for sh in m.shards if (layout.read_shard_info(sh.dir(index_dir)) or sh).self_of != "codes"]
    tokens = 0
    if todo:
        model, _, _ = load_index_checkpoint(index_dir, m)
        calib = IndexCalibration.load(index_dir / layout.CALIBRATION)
        codec, act_table = calib.codec(model.W), calib.act_table()
        inv = calib.curvature.inv().numpy().astype(np.float64)
        bar = tqdm(total=sum(sh.n_tokens for sh in todo), desc="upgrade", unit="tok", unit_scale=True,
                   disable=not progress)
        for info in todo:
            _upgrade_shard(info.dir(index_dir), info, codec, act_table, inv, bar.update)
            tokens += info.n_tokens
        bar.close()
    # the manifest last: each shard's own shard.json says what it holds
    shards = [layout.read_shard_info(sh.dir(index_dir)) or sh for sh in m.shards]
    if any(a.self_of != b.self_of for a, b in zip(shards, m.shards, strict=True)):
        layout.write_manifest(index_dir, dataclasses.replace(m, shards=[
            dataclasses.replace(old, self_of=new.self_of) for old, new in zip(m.shards, shards, strict=True)]))
    out = {"shards_upgraded": len(todo), "tokens": tokens, "shards": len(m.shards),
           "seconds": round(time.perf_counter() - t0, 3)}
    log.info("upgraded", extra=out)
    return out


def _upgrade_shard(path: Path, info: layout.ShardInfo, codec, act_table: np.ndarray, inv: np.ndarray,
                   on_tokens) -> None:
    sh = Shard(path, info)
    try:
        n = len(sh.tokens)
        new = np.empty(n, dtype=np.float16)
        scale = info.self_scale
        for lo in range(0, n, CHUNK):
            local = np.arange(lo, min(n, lo + CHUNK), dtype=np.int64)
            exact = sh.self[local].astype(np.float32) * scale
            value = stored_self(codec, act_table, inv, np.asarray(sh.codes[local]), sh.code_dirs(local),
                                sh.targets(local), sh.protos[local].astype(np.int64), np.asarray(sh.acts[local]),
                                exact)
            new[local] = (value / scale).astype(np.float16)
            on_tokens(len(local))
    finally:
        sh.close()
    size = layout.write_array(layout.array_file(path, "self"), new)
    shard = layout.read_shard_info(path) or info
    layout.write_shard_info(path, dataclasses.replace(shard, self_of="codes", bytes={**shard.bytes, "self": size}))
