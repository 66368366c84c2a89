"""Training loop for PRISM and the dense baseline: single process, or DDP under ``torchrun``.

AdamW with linear warm-up and cosine decay, gradient clipping, periodic held-out evaluation,
bf16 autocast on CUDA, optional ``torch.compile``, atomic checkpoints every ``ckpt_every``
steps, and exact resumption (the batch of a step depends only on the seed and the step).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: this module binds ``group.WORLD`` as a default
# argument of its functions when it is first imported (DDP imports it), and a process group held there
# outlives ``destroy_process_group``. Its gloo threads then run until the interpreter tears down, and a
# thread that needs the GIL at that moment aborts the process ("terminate called without an active
# exception", SIGABRT) after the work is done. Imported now, the defaults are None (the default group).
import torch.distributed.nn.functional  # noqa: F401  isort: skip
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm

from prism_tda.corpus import Fields, fingerprint
from prism_tda.errors import ConfigError

from . import checkpoint as ckpt
from .config import ModelConfig, TrainConfig
from .data import get_batch, load_or_build, split_documents
from .device import autocast_for, pick_device
from .metrics import evaluate, usage_stats
from .model import PRISM, ModelOutput
from .record import TrainingRecord, window_starts
from .tokenizer import load_tokenizer, train_tokenizer

log = logging.getLogger(__name__)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))) * (cfg.lr - cfg.min_lr)


class Trainer:
    """Owns one training run in ``out_dir`` (a run directory, see :mod:`.checkpoint`)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        corpus: list[str],
        out_dir: str | Path,
        *,
        tokenizer_path: str | Path | None = None,
        progress: bool = True,
        resume: bool = True,
        fields: Fields | None = None,
    ) -> None:
        self.model_cfg, self.cfg = model_cfg, train_cfg
        self.corpus = [str(Path(c).absolute()) for c in corpus]
        self.fields = fields or Fields()
        self.out = Path(out_dir)
        self.tokenizer_path = tokenizer_path
        self.progress = progress
        self.resume = resume
        self.step = 0
        self.tokens_seen = 0
        self.last_eval: dict[str, float] = {}
        self._last_batch_z: torch.Tensor | None = None
        self._last_batch_zhat: torch.Tensor | None = None

    # ----------------------------------------------------------------------------- set-up
    def setup(self) -> Trainer:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = pick_device()
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.is_main = self.rank == 0
        self.out.mkdir(parents=True, exist_ok=True)
        self.autocast = autocast_for(self.device, self.cfg.dtype, cpu_bf16_when_native=True)

        resume_from = None
        if self.resume and (self.out / "latest").is_file():
            resume_from = ckpt.resolve(self.out)
        self.tokenizer = self._tokenizer(resume_from)
        cfg = self.model_cfg
        if resume_from is None:
            cfg = cfg.replace(vocab_size=self.tokenizer.get_vocab_size())
        else:
            stored = ModelConfig.from_dict(ckpt.read_config(resume_from)["model"])
            want = cfg.replace(vocab_size=stored.vocab_size)
            if want != stored:
                diff = {k: (v, want.to_dict()[k]) for k, v in stored.to_dict().items() if want.to_dict()[k] != v}
                raise ConfigError(
                    f"{self.out}: run was trained with a different model config (stored, given): {diff}; "
                    "use a new --out or --no-resume"
                )
            cfg = stored
        self.model_cfg = cfg

        corpus_fp = fingerprint(self.corpus)
        fields_key = "" if self.fields.is_default else json.dumps(self.fields.to_dict())
        key = hashlib.sha256(
            (self.tokenizer.to_str() + corpus_fp + str(self.cfg.val_fraction) + "record-v1" + fields_key).encode()
        ).hexdigest()
        if self.is_main:
            self.data = load_or_build(self.corpus, self.tokenizer, self.cfg.val_fraction, self.out / "data", key,
                                      progress=self.progress, fields=self.fields)
        self._barrier()
        if not self.is_main:
            self.data = load_or_build(self.corpus, self.tokenizer, self.cfg.val_fraction, self.out / "data", key,
                                      progress=False, fields=self.fields)

        torch.manual_seed(self.cfg.seed)
        self.model = PRISM(cfg).to(self.device)
        self.optimizer = self._optimizer()
        K = cfg.n_prototypes if cfg.head == "prism" else 0
        self.usage = torch.full((K,), 1.0 / max(K, 1), dtype=torch.float64)
        corpus_info: dict[str, Any] = {"corpus_fingerprint": corpus_fp, "corpus_files": self.corpus}
        if not self.fields.is_default:
            corpus_info["corpus_fields"] = self.fields.to_dict()
        self.record = TrainingRecord.empty(self.data.doc_keys, corpus_info)
        if resume_from is not None:
            self._load(resume_from)
        elif self.model.head is not None and self.cfg.proto_init == "data":
            self._init_prototypes()
        self.ddp = DDP(self.model) if self.world > 1 else None
        self.fwd: Callable[..., ModelOutput] = self.ddp or self.model
        if self.cfg.compile:
            self.fwd = torch.compile(self.fwd)
        return self

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _tokenizer(self, resume_from: Path | None) -> Tokenizer:
        if resume_from is not None:
            return load_tokenizer(resume_from / ckpt.TOKENIZER)
        if self.tokenizer_path is not None:
            return load_tokenizer(self.tokenizer_path)
        path = self.out / "tokenizer.json"
        if self.is_main:
            docs, _ = split_documents(self.corpus, self.cfg.val_fraction, self.fields)
            t0 = time.perf_counter()
            tok = train_tokenizer((d.text for is_val, d in docs if not is_val), self.model_cfg.vocab_size)
            tok.save(str(path))
            log.info("trained tokenizer", extra={"vocab_size": tok.get_vocab_size(), "seconds": round(time.perf_counter() - t0, 1)})
        self._barrier()
        return load_tokenizer(path)

    def _optimizer(self) -> torch.optim.Optimizer:
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, p in self.model.named_parameters():
            (decay if p.dim() >= 2 and not name.endswith("prototypes") else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.cfg.lr, betas=(self.cfg.beta1, self.cfg.beta2))

    @torch.no_grad()
    def _init_prototypes(self) -> None:
        """Place the prototypes on random token states of the untrained model (k-means style)."""
        head = self.model.head
        assert head is not None
        K = head.n_prototypes
        x, _ = get_batch(self.data.train, step=-1, seed=self.cfg.seed, block=self.model_cfg.block_size,
                         batch_size=max(1, math.ceil(K / self.model_cfg.block_size)))
        z = self.model.hidden(x.to(self.device)).reshape(-1, self.model_cfg.d_model)
        g = torch.Generator().manual_seed(self.cfg.seed)
        pick = torch.randperm(z.shape[0], generator=g)[:K]
        if pick.numel() < K:
            pick = torch.randint(0, z.shape[0], (K,), generator=g)
        head.prototypes.copy_(torch.nn.functional.normalize(z[pick.to(z.device)], dim=-1))

    # ------------------------------------------------------------------------ train step
    def forward_backward(self, step: int) -> dict[str, float]:
        """Accumulate this process's gradients for ``step``; return its averaged loss terms."""
        self.model.train()
        c, mc = self.cfg, self.model_cfg
        sums: dict[str, float] = {}
        mass = torch.zeros(self.usage.numel(), device=self.device)
        for micro in range(c.grad_accum):
            x, y = get_batch(self.data.train, step=step, seed=c.seed, block=mc.block_size, batch_size=c.batch_size,
                             micro=micro, grad_accum=c.grad_accum, rank=self.rank, world=self.world)
            x, y = x.to(self.device), y.to(self.device)
            sync = self.ddp is None or micro == c.grad_accum - 1
            with contextlib.nullcontext() if self.ddp is None or sync else self.ddp.no_sync():
                with self.autocast:  # forward under autocast, backward outside it
                    out = self.fwd(x, y)
                assert out.loss is not None  # targets were given
                (out.loss / c.grad_accum).backward()
            for k, v in {"loss": out.loss, **out.losses, **out.metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach()) / c.grad_accum
            if out.head is not None and out.z is not None:
                assert out.head.mass is not None  # computed with the losses
                mass += out.head.mass
                self._last_batch_z = out.z.detach().reshape(-1, mc.d_model).float()
                self._last_batch_zhat = out.head.zhat.detach()
        self._mass = mass
        return sums

    def train_step(self, step: int) -> dict[str, float]:
        lr = lr_at(step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.forward_backward(step)
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        self.optimizer.step()
        stats["lr"] = lr
        if self.model.head is not None:
            self._update_usage()
            c = self.cfg
            if c.reseed_every and (step + 1) % c.reseed_every == 0 and step < c.reseed_until * c.max_steps:
                stats["reseeded"] = self._reseed()
        self.tokens_seen += self.cfg.batch_size * self.cfg.grad_accum * self.world * self.model_cfg.block_size
        self._record_step(step)
        return stats

    def _record_step(self, step: int) -> None:
        """Count the documents step ``step``'s windows covered (every rank's, on every rank: the windows
        depend only on the seed and the step)."""
        c, block = self.cfg, self.model_cfg.block_size
        starts = window_starts(len(self.data.train), step=step, seed=c.seed, block=block,
                               total=c.batch_size * c.grad_accum * self.world)
        self.record.add_windows(self.data.doc_start, starts, block + 1)
        self.record.step = step + 1

    def _update_usage(self) -> None:
        mass = self._mass
        if self.world > 1:
            dist.all_reduce(mass)
        share = (mass / mass.sum().clamp_min(1e-12)).double().cpu()
        self.usage.mul_(self.cfg.usage_ema).add_(share, alpha=1 - self.cfg.usage_ema)

    @torch.no_grad()
    def _reseed(self) -> int:
        """Move idle prototypes onto the worst-reconstructed token states of the last batch."""
        head = self.model.head
        assert head is not None and self._last_batch_z is not None
        K = head.n_prototypes
        idle = (self.usage < self.cfg.reseed_min_share / K).nonzero().flatten()
        n = int(idle.numel())
        if n == 0:
            return 0
        if self.is_main:
            z, zhat = self._last_batch_z, self._last_batch_zhat
            assert z is not None and zhat is not None  # set by the training step before any re-seeding
            err = (z - zhat).pow(2).sum(-1) / z.pow(2).sum(-1).clamp_min(1e-6)
            order = err.argsort(descending=True)
            cand = order[torch.arange(n, device=order.device) % order.numel()]
            P = head.prototypes.data
            live = torch.ones(K, dtype=torch.bool)
            live[idle] = False
            scale = P[live.to(P.device)].norm(dim=-1).mean() if live.any() else 1.0
            P[idle.to(P.device)] = torch.nn.functional.normalize(z[cand], dim=-1) * scale
        if self.world > 1:
            dist.broadcast(head.prototypes.data, 0)
        st = self.optimizer.state.get(head.prototypes, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                st[key][idle.to(st[key].device)] = 0.0
        self.usage[idle] = 1.0 / K
        return n

    # ------------------------------------------------------------------------ checkpoints
    def _trainer_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        meta = {"step": self.step, "tokens_seen": self.tokens_seen, "train_config": self.cfg.to_dict(),
                "corpus": self.corpus, "last_eval": self.last_eval}
        tensors = {"usage": self.usage, "rng_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            tensors["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        return meta, tensors

    def save(self, summary: dict[str, Any] | None = None) -> Path:
        path = self.out / f"step_{self.step:07d}"
        if self.is_main:
            meta, tensors = self._trainer_state()
            training = {"step": self.step, "tokens_seen": self.tokens_seen, "train_config": self.cfg.to_dict(),
                        "eval": self.last_eval, "data": self.data.stats, **(summary or {})}
            ckpt.save_checkpoint(path, self.model, self.tokenizer, training=training, optimizer=self.optimizer,
                                 trainer_state=meta, trainer_tensors=tensors, record=self.record)
            tmp = self.out / "latest.tmp"
            tmp.write_text(path.name)
            os.replace(tmp, self.out / "latest")
            old = sorted(p for p in self.out.glob("step_*") if p.is_dir())[: -self.cfg.keep_checkpoints]
            for p in old:
                shutil.rmtree(p, ignore_errors=True)
        self._barrier()
        return path

    def _load(self, path: Path) -> None:
        model, _, _ = ckpt.load_checkpoint(path, device=self.device)
        self.model.load_state_dict(model.state_dict())
        meta, tensors = ckpt.load_training_state(path, self.optimizer)
        self.step, self.tokens_seen = int(meta["step"]), int(meta["tokens_seen"])
        self.last_eval = meta.get("last_eval", {})
        stored = meta["train_config"]
        for field in ("seed", "batch_size", "grad_accum"):
            if stored[field] != getattr(self.cfg, field):
                raise ConfigError(f"{path}: cannot resume with train.{field}={getattr(self.cfg, field)}, "
                                  f"the run used {stored[field]}")
        self.usage = tensors["usage"].double()
        stored_record = TrainingRecord.load(path, self.record.corpus)
        if stored_record is not None and np.array_equal(stored_record.keys, self.record.keys):
            self.record = stored_record
        else:  # a checkpoint from before training records, or its data cache rebuilt: recount its steps
            for s in range(self.step):
                self._record_step(s)
        torch.set_rng_state(tensors["rng_cpu"])
        if "rng_cuda" in tensors and self.device.type == "cuda":
            torch.cuda.set_rng_state(tensors["rng_cuda"], self.device)
        log.info("resumed", extra={"checkpoint": str(path), "step": self.step})

    # ------------------------------------------------------------------------ main loop
    def evaluate(self) -> dict[str, float]:
        return evaluate(self.model, self.data.val, batch_size=self.cfg.batch_size, max_tokens=self.cfg.eval_tokens,
                        device=self.device, autocast=self.autocast)

    def fit(self, max_steps: int | None = None) -> Path:
        """Train until ``max_steps`` (default ``cfg.max_steps``); returns the final checkpoint."""
        c = self.cfg
        stop = c.max_steps if max_steps is None else min(max_steps, c.max_steps)
        metrics_f = self.out / "metrics.jsonl"
        t_start = time.perf_counter()
        tok_per_step = c.batch_size * c.grad_accum * self.world * self.model_cfg.block_size
        bar = tqdm(total=c.max_steps, initial=self.step, desc=f"train {self.model_cfg.head}", unit="step",
                   disable=not (self.progress and self.is_main), dynamic_ncols=True)
        t_last, done_last = time.perf_counter(), self.step
        with open(metrics_f, "a") if self.is_main else open(os.devnull, "w") as mf:
            while self.step < stop:
                stats = self.train_step(self.step)
                self.step += 1
                bar.update(1)
                rec: dict[str, Any] = {"step": self.step, "tokens": self.tokens_seen, **stats}
                if self.step % c.eval_every == 0 or self.step == c.max_steps:
                    self.last_eval = self.evaluate()
                    rec |= {f"eval/{k}": v for k, v in self.last_eval.items()}
                    if self.model.head is not None:
                        rec |= {f"usage/{k}": v for k, v in usage_stats(self.usage).items()}
                now = time.perf_counter()
                if now - t_last > 1.0 or self.step == stop:
                    tps = (self.step - done_last) * tok_per_step / (now - t_last)
                    rec["tokens_per_s"] = tps
                    bar.set_postfix(loss=f"{stats['loss']:.3f}", ce=f"{stats['ce']:.3f}", tok_s=f"{tps:,.0f}")
                    t_last, done_last = now, self.step
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                if self.step % c.ckpt_every == 0 and self.step != stop:
                    self.save()
        bar.close()
        wall = time.perf_counter() - t_start
        summary = {"wall_seconds": round(wall, 2)}
        path = self.save(summary)
        if self.is_main:
            log.info("training done", extra={"checkpoint": str(path), "step": self.step, **self.last_eval})
        return path

    def close(self) -> None:
        """Tear down data parallelism while the interpreter is whole: wait for every rank, drop the DDP
        wrapper (its reducer holds the process group), then destroy the group, which joins its
        threads. Idempotent; the model stays usable in this process."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier()  # no rank tears down the process group while another still uses it
            self.ddp = None
            self.fwd = torch.compile(self.model) if self.cfg.compile else self.model
            gc.collect()  # the reducer and its hooks go now, not at interpreter exit
            dist.destroy_process_group()
