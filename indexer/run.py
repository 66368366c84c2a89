"""The indexing job: plan -> curvature basis -> per-shard forward (local or Ray) -> reduce ->
embeddings -> FAISS -> prototype and vocab tables. Every stage resumes from what is on disk."""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from prism_tda.corpus import fingerprint
from prism_tda.engine import layout as store
from prism_tda.engine.curvature import Curvature, finalize, fit_basis
from prism_tda.engine.layout import (
    IDENTITY_FIELDS,
    IndexConfig,
    IndexManifest,
    Plan,
    ShardEntry,
    ShardForward,
)
from prism_tda.engine.sketch import Sketch
from prism_tda.engine.tokens import run_batch
from prism_tda.errors import PrismError
from prism_tda.model import checkpoint as ckpt
from prism_tda.model.device import autocast_for, pick_device
from prism_tda.model.metrics import usage_stats

from .embed import build_faiss, save_embeddings, shard_embeddings
from .estimate import compare, estimate, peak_rss_bytes
from .forward import ShardProcessor, ShardStats
from .plan import plan_shards

log = logging.getLogger(__name__)


class IndexMismatchError(PrismError):
    """An existing index was built from another model, tokenizer, corpus or config."""


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "pyarrow", "faiss-cpu", "faiss-gpu", "tokenizers", "safetensors", "ray", "prism-tda"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def identity(ck_config: dict, corpus: list[str], cfg: IndexConfig) -> dict[str, Any]:
    return {
        "checkpoint_sha256": ck_config["files"]["model.safetensors"],
        "tokenizer_sha256": ck_config["files"]["tokenizer.json"],
        "corpus_fingerprint": fingerprint(corpus),
        "block_size": ck_config["model"]["block_size"],
        **{f"index.{k}": getattr(cfg, k) for k in IDENTITY_FIELDS},
    }


class Indexer:
    def __init__(self, checkpoint: str | Path, corpus: list[str], out: str | Path, cfg: IndexConfig | None = None,
                 *, progress: bool = True) -> None:
        self.ck_path = ckpt.resolve(checkpoint).absolute()
        self.corpus = [str(Path(c).absolute()) for c in corpus]
        self.out = Path(out)
        self.cfg = cfg or IndexConfig()
        self.progress = progress
        self.device = pick_device()
        self.model, self.tokenizer, self.ck_config = ckpt.load_checkpoint(self.ck_path, device=self.device)
        if self.model.head is None:
            raise PrismError(f"{self.ck_path}: a dense-baseline checkpoint has no prototypes to index")
        mc = self.model.cfg
        self.u_dim = min(self.cfg.u_rank or mc.d_model, mc.d_model)
        self.schemas = store.schemas(mc.vocab_size, mc.n_prototypes, self.u_dim)
        self.autocast = autocast_for(self.device, self.cfg.dtype)
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------------------ stages
    def _open_manifest(self) -> IndexManifest:
        ident = identity(self.ck_config, self.corpus, self.cfg)
        m = store.read_manifest(self.out)
        if m is not None:
            old = m.identity
            diff = {k: (old.get(k), v) for k, v in ident.items() if old.get(k) != v}
            if diff:
                raise IndexMismatchError(
                    f"{self.out / store.MANIFEST}: this index was built with different inputs "
                    f"(stored, given): {diff}. Use another --out, or delete the index to rebuild it."
                )
            return m
        return IndexManifest(identity=ident, checkpoint=str(self.ck_path), corpus=self.corpus, config=self.cfg,
                             model=self.ck_config["model"], versions=_versions())

    def _plan(self, m: IndexManifest) -> None:
        if m.plan is not None:
            return
        t0 = time.perf_counter()
        m.shards, stats = plan_shards(self.corpus, self.tokenizer, self.model.cfg.block_size, self.cfg,
                                      self.schemas, self.out, progress=self.progress)
        m.plan = Plan(corpus=stats.to_dict(), documents=sum(s.n_docs for s in m.shards),
                      sequences=sum(s.n_seqs for s in m.shards), tokens=sum(s.n_tokens for s in m.shards))
        m.timings["plan_s"] = round(time.perf_counter() - t0, 3)
        store.write_manifest(self.out, m)
        if stats.n_bad:
            log.warning("bad corpus records", extra={"bad_by_reason": dict(stats.bad)})

    def _basis(self, m: IndexManifest) -> torch.Tensor:
        path = self.out / "basis.safetensors"
        if path.is_file():
            return load_file(str(path))["Q"]
        t0 = time.perf_counter()
        toks: list[list[int]] = []
        tgts: list[list[int]] = []
        for s in m.shards:
            seqs = pq.read_table(self.out / "sequences" / store.part_name(s.shard),
                                 columns=["token_ids", "target_ids"]).to_pydict()
            toks += seqs["token_ids"][: self.cfg.basis_sequences - len(toks)]
            tgts += seqs["target_ids"][: self.cfg.basis_sequences - len(tgts)]
            if len(toks) >= self.cfg.basis_sequences:
                break
        d = self.model.cfg.d_model
        S = torch.zeros(d, d, dtype=torch.float64)
        for b in range(0, len(toks), self.cfg.batch_size):
            tb = run_batch(self.model, toks[b : b + self.cfg.batch_size], tgts[b : b + self.cfg.batch_size],
                           device=self.device, autocast=self.autocast)
            u = tb.u.double().cpu()
            S += u.T @ u
        Q, evals = fit_basis(S)
        from safetensors.torch import save

        store.atomic_write_bytes(path, save({"Q": Q.contiguous(), "eigvals": evals.contiguous()}))
        m.timings["basis_s"] = round(time.perf_counter() - t0, 3)
        return Q

    def _forward_local(self, m: IndexManifest, Q: torch.Tensor, pending: list[ShardEntry]) -> None:
        proc = ShardProcessor(self.model, Q, self.u_dim, self.schemas, batch_size=self.cfg.batch_size,
                              device=self.device, autocast=self.autocast, act_mantissa_bits=self.cfg.act_mantissa_bits)
        total = sum(s.n_tokens for s in pending)
        with tqdm(total=total, desc="index", unit="tok", unit_scale=True, disable=not self.progress,
                  dynamic_ncols=True) as bar:
            for s in pending:
                res = proc.process(self.out, s.shard, on_tokens=bar.update)
                self._complete(m, s, res)

    def _complete(self, m: IndexManifest, s: ShardEntry, res: ShardForward) -> None:
        s.forward = res
        store.write_manifest(self.out, m)
        log.debug("shard complete", extra={"shard": s.shard, "activation_rows": res.activation_rows})

    def _reduce(self, m: IndexManifest, Q: torch.Tensor) -> tuple[Curvature, ShardStats]:
        mc = self.model.cfg
        total = ShardStats(mc.n_prototypes, mc.d_model, self.u_dim)
        for s in m.shards:
            part = load_file(str(self.out / "stats" / store.part_name(s.shard, "safetensors")))
            total.merge(ShardStats.from_tensors(part))
        n_tok = int(total.scalars[0])
        curv = finalize(Q, total.lam, total.count, n_tok, self.cfg.damping)
        curv.save(self.out / "curvature.safetensors", S=total.S, count=total.count, mass=total.mass,
                  max_cos=total.max_cos, scalars=total.scalars)
        return curv, total

    def _embed(self, m: IndexManifest, curv: Curvature) -> Sketch:
        mc = self.model.cfg
        sketch = Sketch(mc.n_prototypes, self.u_dim, self.cfg.embed_dim, self.cfg.sketch_buckets, self.cfg.seed)
        todo = [s for s in m.shards if not s.embedded]
        for s in tqdm(todo, desc="embed", unit="shard", disable=not self.progress or not todo):
            e = shard_embeddings(self.out, s.shard, s.seq_start, s.n_seqs, curv, sketch)
            save_embeddings(self.out, s.shard, e)
            s.embedded = True
            store.write_manifest(self.out, m)
        return sketch

    def _tables(self, total: ShardStats) -> None:
        sig = self.model.signatures(n=10)[1]  # (K, 10) top signature tokens of W p_i
        tok = self.tokenizer

        def text(i: int) -> str:
            return tok.decode([i])

        K = self.model.cfg.n_prototypes
        count, mass = total.count.numpy(), total.mass.numpy()
        protos = pa.Table.from_pydict({
            "proto_id": np.arange(K), "n_tokens": count.astype(np.int64), "mass": mass,
            "mean_act": np.where(count > 0, mass / np.maximum(count, 1), 0).astype(np.float32),
            "top_tokens": [[text(int(i)) for i in row] for row in sig.tolist()], "label": [None] * K,
        }, schema=self.schemas["prototypes"])
        store.write_table(self.out / "prototypes.parquet", protos)
        V = tok.get_vocab_size()
        vocab = pa.Table.from_pydict({"token_id": np.arange(V), "token": [text(i) for i in range(V)]},
                                     schema=self.schemas["vocab"])
        store.write_table(self.out / "vocab.parquet", vocab)

    # ------------------------------------------------------------------------------ run
    def run(self, *, workers: int | None = None, ray_address: str | None = None) -> dict[str, Any]:
        t_start = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        m = self._open_manifest()
        if m.complete and m.summary is not None:
            log.info("index already complete", extra={"index": str(self.out)})
            return m.summary
        est_file = self.out / "estimate.json"
        if est_file.is_file():
            est = json.loads(est_file.read_text())
        else:
            est = estimate(self)
            store.atomic_write_bytes(est_file, json.dumps(est, indent=2).encode())
        removed = store.clean_temporaries(self.out)
        if removed:
            log.info("removed temporary files of an interrupted run", extra={"files": removed})
        self._plan(m)
        Q = self._basis(m)
        pending = [s for s in m.shards if s.forward is None]
        if pending:
            log.info("indexing", extra={"shards_pending": len(pending), "shards": len(m.shards),
                                        "tokens": sum(s.n_tokens for s in pending)})
        t0 = time.perf_counter()
        if pending and (workers or ray_address):
            from .distributed import run_on_ray

            run_on_ray(self, m, pending, workers=workers or 0, address=ray_address)
        elif pending:
            self._forward_local(m, Q, pending)
        fwd_s = time.perf_counter() - t0
        m.timings["forward_s"] = round(m.timings.get("forward_s", 0) + fwd_s, 3)
        t0 = time.perf_counter()
        curv, total = self._reduce(m, Q)
        sketch = self._embed(m, curv)
        n = build_faiss(self.out, [s.shard for s in m.shards], sketch.dim, self.cfg.faiss_spec,
                        self.cfg.faiss_train_size, self.cfg.seed)
        self._tables(total)
        m.timings["finalize_s"] = round(time.perf_counter() - t0, 3)
        m.timings["last_run_wall_s"] = round(time.perf_counter() - t_start, 3)
        summary = self._summary(m, total, curv, n)
        summary["peak_rss_bytes"] = peak_rss_bytes()
        summary["estimate_vs_actual"] = compare(est, summary, m.timings["last_run_wall_s"], summary["peak_rss_bytes"])
        m.summary, m.complete = summary, True
        store.write_manifest(self.out, m)
        return summary

    def _summary(self, m: IndexManifest, total: ShardStats, curv: Curvature, n_faiss: int) -> dict[str, Any]:
        n_tok = int(total.scalars[0])
        tables = ("documents", "sequences", "activations", "token_grads", "stats", "embeddings")
        bytes_ = {t: store.dir_bytes(self.out / t) for t in tables}
        for f in ("prototypes.parquet", "vocab.parquet", "curvature.safetensors", "basis.safetensors", "faiss.index"):
            bytes_[f] = store.dir_bytes(self.out / f)
        rows = sum(s.forward.activation_rows for s in m.shards if s.forward is not None)
        usage = usage_stats(total.mass)
        plan = m.plan
        assert plan is not None
        return {
            "documents": plan.documents, "sequences": plan.sequences, "tokens": n_tok,
            "activation_rows": rows, "faiss_vectors": n_faiss,
            "bad_records": plan.corpus["bad_records"], "bad_by_reason": plan.corpus["bad_by_reason"],
            "bytes": bytes_, "total_bytes": sum(bytes_.values()),
            "activation_bytes_per_token": bytes_["activations"] / max(n_tok, 1),
            "total_bytes_per_token": sum(bytes_.values()) / max(n_tok, 1),
            "mean_loss": float(total.scalars[1]) / max(n_tok, 1),
            "R1bar": float(total.max_cos.mean()), "R2": float(total.scalars[2]) / max(n_tok, 1),
            **usage, "damping": float(curv.damping),
            "timings": m.timings,
        }


def build_index(checkpoint: str | Path, corpus: list[str], out: str | Path, cfg: IndexConfig | None = None, *,
                workers: int | None = None, ray_address: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Index ``corpus`` with the PRISM model at ``checkpoint`` into ``out``; resumes a partial index."""
    return Indexer(checkpoint, corpus, out, cfg, progress=progress).run(workers=workers, ray_address=ray_address)
