"""Shards on Ray: one model replica per worker actor, one shard per task.

The driver plans the work units and calibrates; workers run the same :class:`~.shard.ShardBuilder`
as the single-process path, one unit per task, and write their shards to the shared index
directory; the driver records each shard in the manifest as it completes and then runs the reduce
step (statistics, prototype and vocabulary tables).

Ray core actors rather than Ray Data's actor pools: on small machines an actor pool whose
actors each hold a whole CPU starves Ray Data's read tasks and hangs. Actors here take a
fractional CPU, and the pool is bounded by ``workers``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from prism_tda.corpus import WorkUnit
from prism_tda.engine.layout import IndexManifest, ShardInfo

if TYPE_CHECKING:
    from .run import Indexer

log = logging.getLogger(__name__)


class _Worker:
    def __init__(self, checkpoint: str, out: str, cfg: dict[str, Any], threads: int,
                 val_fraction: float | None) -> None:
        import torch

        from prism_tda.engine.calibration import IndexCalibration
        from prism_tda.engine.layout import CALIBRATION, FAISS_TEMPLATE, IndexConfig
        from prism_tda.model import checkpoint as ckpt
        from prism_tda.model.device import autocast_for, pick_device

        from .shard import ShardBuilder

        torch.set_num_threads(max(1, threads))
        self.out = Path(out)
        config = IndexConfig.from_dict(cfg)
        device = pick_device()
        model, tokenizer, _ = ckpt.load_checkpoint(checkpoint, device=device)
        calib = IndexCalibration.load(self.out / CALIBRATION)
        self.builder = ShardBuilder(model, tokenizer, calib, config, self.out / FAISS_TEMPLATE, device=device,
                                    autocast=autocast_for(device, config.dtype), record=ckpt.load_record(checkpoint),
                                    val_fraction=val_fraction)

    def build(self, unit: WorkUnit) -> ShardInfo:
        return self.builder.build(self.out, unit)


def run_on_ray(ix: Indexer, manifest: IndexManifest, pending: list[WorkUnit], *, workers: int,
               address: str | None) -> None:
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=max(workers, 1), include_dashboard=False, log_to_driver=False,
                     object_store_memory=128 * 1024**2, ignore_reinit_error=True)
    try:
        n = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        cpus = ray.cluster_resources().get("CPU", n)
        per_actor = min(1.0, cpus / n) * 0.9  # fractional: leave room for Ray's own tasks
        gpus = 1 if ix.device.type == "cuda" and ray.cluster_resources().get("GPU", 0) >= n else 0
        Actor: Any = ray.remote(num_cpus=per_actor, num_gpus=gpus)(_Worker)
        threads = max(1, int(cpus // n))
        actors = [Actor.remote(str(ix.ck_path), str(ix.out), ix.cfg.to_dict(), threads, ix.val_fraction)
                  for _ in range(n)]
        queue = list(pending)
        running: dict[Any, tuple[Any, WorkUnit]] = {}
        total = sum(u.bytes for u in pending)
        with tqdm(total=total, desc=f"index (ray x{n})", unit="B", unit_scale=True, disable=not ix.progress,
                  dynamic_ncols=True) as bar:
            idle: list[Any] = list(actors)
            while queue or running:
                while queue and idle:
                    actor, s = idle.pop(), queue.pop(0)
                    running[actor.build.remote(s)] = (actor, s)
                done, _ = ray.wait(list(running), num_returns=1)
                for ref in done:
                    actor, s = running.pop(ref)
                    ix.complete(manifest, ray.get(ref))
                    bar.update(s.bytes)
                    idle.append(actor)
        for a in actors:
            ray.kill(a)
    finally:
        if started_here:
            ray.shutdown()
    log.info("ray forward stage done", extra={"workers": n, "pid": os.getpid()})
