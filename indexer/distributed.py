"""The forward stage on Ray: one model replica per worker actor, one shard per task.

The driver plans the shards and fits the curvature basis; workers run the same
:class:`~.forward.ShardProcessor` as the single-process path over the shards' ``sequences``
parts and write the same part files to the shared index directory; the driver records each shard
in the manifest as it completes and then runs the reduce step (statistics, embeddings, FAISS).

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

from prism_tda.engine.layout import IndexManifest, ShardEntry, ShardForward

if TYPE_CHECKING:
    from .run import Indexer

log = logging.getLogger(__name__)


class _Worker:
    def __init__(self, checkpoint: str, out: str, cfg: dict[str, Any], threads: int) -> None:
        import torch
        from safetensors.torch import load_file

        from prism_tda.engine import layout as store
        from prism_tda.engine.layout import IndexConfig
        from prism_tda.model import checkpoint as ckpt
        from prism_tda.model.device import autocast_for, pick_device

        from .forward import ShardProcessor

        torch.set_num_threads(max(1, threads))
        self.out = Path(out)
        config = IndexConfig.from_dict(cfg)
        device = pick_device()
        model, _, _ = ckpt.load_checkpoint(checkpoint, device=device)
        u_dim = min(config.u_rank or model.cfg.d_model, model.cfg.d_model)
        Q = load_file(str(self.out / "basis.safetensors"))["Q"]
        schemas = store.schemas(model.cfg.vocab_size, model.cfg.n_prototypes, u_dim)
        self.proc = ShardProcessor(model, Q, u_dim, schemas, batch_size=config.batch_size, device=device,
                                   autocast=autocast_for(device, config.dtype),
                                   act_mantissa_bits=config.act_mantissa_bits)

    def process(self, shard: int) -> ShardForward:
        return self.proc.process(self.out, shard)


def run_on_ray(ix: Indexer, manifest: IndexManifest, pending: list[ShardEntry], *, workers: int,
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
        actors = [Actor.remote(str(ix.ck_path), str(ix.out), ix.cfg.to_dict(), threads) for _ in range(n)]
        queue = list(pending)
        running: dict[Any, tuple[Any, ShardEntry]] = {}
        total = sum(s.n_tokens for s in pending)
        with tqdm(total=total, desc=f"index (ray x{n})", unit="tok", unit_scale=True, disable=not ix.progress,
                  dynamic_ncols=True) as bar:
            idle: list[Any] = list(actors)
            while queue or running:
                while queue and idle:
                    actor, s = idle.pop(), queue.pop(0)
                    running[actor.process.remote(s.shard)] = (actor, s)
                done, _ = ray.wait(list(running), num_returns=1)
                for ref in done:
                    actor, s = running.pop(ref)
                    ix._complete(manifest, s, ray.get(ref))
                    bar.update(s.n_tokens)
                    idle.append(actor)
        for a in actors:
            ray.kill(a)
    finally:
        if started_here:
            ray.shutdown()
    log.info("ray forward stage done", extra={"workers": n, "pid": os.getpid()})
