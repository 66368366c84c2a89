"""Sizing a job before it runs: disk per table, peak memory and time (``prism index --dry-run``).

Counts come from planning the corpus in memory (tokenization only, nothing written); bytes per
token and tokens per second from a calibration run of the real code on a sample of sequences
written to a temporary directory; peak memory from the shapes involved. The real run records the
estimate beside its measurements, so its accuracy is visible in every manifest.
"""

from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from prism_tda.engine import layout as store
from prism_tda.engine.tokens import run_batch

from .forward import ShardProcessor
from .plan import plan_shards

CALIBRATION_SEQUENCES = 64


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def estimate(ix, *, calibration_sequences: int = CALIBRATION_SEQUENCES) -> dict[str, Any]:
    """Estimate for Indexer ``ix`` (see :class:`.run.Indexer`); writes nothing to ``ix.out``."""
    mc, cfg = ix.model.cfg, ix.cfg
    t0 = time.perf_counter()
    shards, stats = plan_shards(ix.corpus, ix.tokenizer, mc.block_size, cfg, ix.schemas, None, progress=False)
    plan_s = time.perf_counter() - t0
    n_docs = sum(s.n_docs for s in shards)
    n_seqs = sum(s.n_seqs for s in shards)
    n_tok = sum(s.n_tokens for s in shards)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        sample_cfg = cfg.replace(shard_documents=max(1, min(cfg.shard_documents, calibration_sequences)))
        sample, _ = plan_shards(ix.corpus, ix.tokenizer, mc.block_size, sample_cfg, ix.schemas, tmp,
                                progress=False, max_documents=1)
        s0 = sample[0]
        proc = ShardProcessor(ix.model, torch.eye(mc.d_model), ix.u_dim, ix.schemas, batch_size=cfg.batch_size,
                              device=ix.device, autocast=ix.autocast, act_mantissa_bits=cfg.act_mantissa_bits)
        run_batch(ix.model, [[0] * 8], [[0] * 8], device=ix.device)  # warm-up
        t1 = time.perf_counter()
        proc.process(tmp, 0)
        fwd_s = time.perf_counter() - t1
        per_tok = {t: store.dir_bytes(tmp / t) / max(s0.n_tokens, 1)
                   for t in ("sequences", "activations", "token_grads")}
        doc_bytes_per_doc = store.dir_bytes(tmp / "documents") / max(s0.n_docs, 1)
        tok_per_s = s0.n_tokens / max(fwd_s, 1e-9)

    K, d, V = mc.n_prototypes, mc.d_model, mc.vocab_size
    D = cfg.embed_dim * cfg.sketch_buckets
    disk = {
        "documents": doc_bytes_per_doc * n_docs,
        "sequences": per_tok["sequences"] * n_tok,
        "activations": per_tok["activations"] * n_tok,
        "token_grads": per_tok["token_grads"] * n_tok,
        "stats": len(shards) * 8 * (d * d + K * ix.u_dim + 3 * K + 3),
        "embeddings": 4 * n_seqs * D,
        "faiss.index": 4 * n_seqs * D if cfg.faiss_spec == "Flat" else None,
        "curvature.safetensors": 4 * (d * d + K * ix.u_dim) + 8 * (d * d + 3 * K),
    }
    T = mc.block_size
    n_batch_tok = cfg.batch_size * T
    max_shard_tok = max((s.n_tokens for s in shards), default=0)
    memory = {
        "model": sum(p.numel() * p.element_size() for p in ix.model.parameters()),
        "forward_batch": 4 * n_batch_tok * (3 * V + 4 * d + K),  # logits, softmax, log-softmax; z/u; similarities
        "shard_buffers": max_shard_tok * (2 * ix.u_dim + 16 * mc.n_active + 16),
        "statistics": 8 * (2 * d * d + 2 * K * ix.u_dim),
        # embedding stage: a shard's Q^T u in fp32 and one column per (sequence, prototype) pair
        "embedding_stage": 4 * max_shard_tok * ix.u_dim * (1 + mc.n_active // 2),
        "faiss_build": 4 * n_seqs * D * (2 if cfg.faiss_spec == "Flat" else 1),
        "python_and_libraries": 600 * 1024**2,
    }
    seconds = {"plan": plan_s, "forward": n_tok / tok_per_s, "finalize": 0.15 * n_tok / tok_per_s}
    return {
        "documents": n_docs, "sequences": n_seqs, "tokens": n_tok, "shards": len(shards),
        "bad_records": stats.n_bad, "disk_bytes": disk,
        "disk_total_bytes": sum(v for v in disk.values() if v), "peak_memory_bytes": sum(memory.values()),
        "memory_breakdown": memory, "seconds": seconds, "total_seconds": sum(seconds.values()),
        "calibration": {"sequences": s0.n_seqs, "tokens": s0.n_tokens, "tokens_per_s": tok_per_s},
    }


def compare(est: dict[str, Any], summary: dict[str, Any], wall_s: float, peak_rss: int) -> dict[str, Any]:
    """actual / estimated, per table and in total (1.0 = exact)."""
    out: dict[str, Any] = {"disk": {}}
    for t, v in est["disk_bytes"].items():
        if v:
            out["disk"][t] = round(summary["bytes"].get(t, 0) / v, 3)
    out["disk_total"] = round(summary["total_bytes"] / max(est["disk_total_bytes"], 1), 3)
    out["time"] = round(wall_s / max(est["total_seconds"], 1e-9), 3)
    out["peak_memory"] = round(peak_rss / max(est["peak_memory_bytes"], 1), 3)
    return out


def format_estimate(est: dict[str, Any]) -> str:
    def mb(x):
        return "n/a" if x is None else f"{x / 1024**2:,.1f} MB"

    lines = [f"corpus: {est['documents']:,} documents, {est['sequences']:,} sequences, {est['tokens']:,} tokens, "
             f"{est['shards']} shards, {est['bad_records']} bad records",
             "disk per table:"]
    lines += [f"  {k:24s} {mb(v)}" for k, v in est["disk_bytes"].items()]
    lines.append(f"  {'total':24s} {mb(est['disk_total_bytes'])}")
    lines.append(f"peak memory: {mb(est['peak_memory_bytes'])}")
    lines += [f"  {k:24s} {mb(v)}" for k, v in est["memory_breakdown"].items()]
    lines.append(f"time: {est['total_seconds']:,.0f} s "
                 f"(forward at {est['calibration']['tokens_per_s']:,.0f} tokens/s, measured on "
                 f"{est['calibration']['tokens']:,} tokens)")
    return "\n".join(lines)


__all__ = ["compare", "estimate", "format_estimate", "peak_rss_bytes"]
