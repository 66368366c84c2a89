"""Sizing a job before it runs: disk per file, indexing memory and time, and the memory serving
will need (``prism index --dry-run``).

Counts come from the work units (file sizes, no reading) and the tokens per byte of a sample;
bytes per token and tokens per second from building a real shard of the sample in a temporary
directory with the real code; memory from the shapes involved. The real run records the estimate
beside its measurements, so its accuracy is visible in every manifest.
"""

from __future__ import annotations

import json
import re
import resource
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Any

from prism_tda.corpus import CorpusStats, WorkUnit, plan_units, read_unit
from prism_tda.engine import layout

from .calibrate import calibrate, faiss_spec

SAMPLE_DOCUMENTS = 256
PER_SEQUENCE = ("seq_tok0", "seq_doc", "seq_start", "seq_last_target", "sequences")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pq_code_bytes(spec: str) -> int | None:
    """Bytes of one product-quantised code of a FAISS factory string (``PQ32``, ``PQ32np``, ``PQ32x4``:
    sub-quantisers x bits); None when the spec has no PQ."""
    pq = re.search(r"PQ(\d+)(?:x(\d+))?", spec)
    return int(pq.group(1)) * int(pq.group(2) or 8) // 8 if pq else None


def estimate(ix, units: list[WorkUnit] | None = None) -> dict[str, Any]:
    """Estimate for Indexer ``ix`` (see :class:`.run.Indexer`); writes nothing to ``ix.out``."""
    mc, cfg = ix.model.cfg, ix.cfg
    units = units if units is not None else plan_units(ix.corpus, cfg.shard_bytes, fields=ix.fields)
    corpus_bytes = sum(u.bytes for u in units)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        # a sample corpus: the first documents of the first units, as one JSONL unit
        docs = []
        for u in units[:8]:
            docs += list(islice(read_unit(u, CorpusStats()), SAMPLE_DOCUMENTS // 8 or 1))
        sample = tmp / "sample.jsonl"
        sample.write_text("".join(json.dumps({"id": d.doc_id, "text": d.text}) + "\n" for d in docs))
        sample_units = plan_units([sample], 1 << 62)
        small = cfg.replace(calibration_tokens=min(cfg.calibration_tokens, 16_384), posting_cells=16,
                            faiss_spec="IDMap,Flat")
        out = tmp / "index"
        out.mkdir()
        calib, _ = calibrate(ix.model, ix.tokenizer, sample_units, small, out, device=ix.device,
                             autocast=ix.autocast, codec_iters=1)  # sizes and times need codes, not good ones
        from .shard import ShardBuilder

        builder = ShardBuilder(ix.model, ix.tokenizer, calib, small, out / layout.FAISS_TEMPLATE, device=ix.device,
                               autocast=ix.autocast)
        t0 = time.perf_counter()
        info = builder.build(out, sample_units[0])
        build_s = time.perf_counter() - t0
    n_tok_s, n_seq_s = max(info.n_tokens, 1), max(info.n_seqs, 1)
    text_bytes = sum(d.nbytes or len(d.text.encode()) for d in docs) or 1  # the records' bytes in their files
    n_tok = int(corpus_bytes * n_tok_s / text_bytes)
    n_seq = int(n_tok * n_seq_s / n_tok_s)
    n_docs = int(corpus_bytes * max(info.n_docs, 1) / text_bytes)
    D = cfg.embed_dim * cfg.sketch_buckets
    n_train = int(min(cfg.calibration_tokens, n_tok) * n_seq_s / n_tok_s)  # calibration sequences
    spec, _ = faiss_spec(cfg, n_seq, D, n_train)
    pq_bytes = pq_code_bytes(spec) or 4 * D
    n_cells = cfg.posting_cells
    disk: dict[str, float] = {}
    for name, b in info.bytes.items():
        if name in ("faiss", "stats", "post_offsets"):
            continue
        scale = n_seq / n_seq_s if name in PER_SEQUENCE else n_tok / n_tok_s
        disk[name] = b * scale
    n_shards = max(1, len(units))
    K, d = mc.n_prototypes, mc.d_model
    # the shards' parts: codes and ids per sequence (under an IVF template a shard stores its inverted
    # lists alone); the trained template (quantiser, codebooks) once, as an index-wide file
    nlist = int(spec.split(",")[0][3:]) if spec.startswith("IVF") else 0
    disk["faiss"] = n_seq * (pq_bytes + 8) + n_shards * 8 * nlist
    disk["faiss_template.index"] = 4 * D * nlist + 4 * 256 * D if nlist else 0
    disk["post_offsets"] = n_shards * 4 * (K * n_cells + 1)
    disk["stats"] = 8 * (d * d + K * d + 4 * K + 3)  # the index's, folded from the shards'
    disk["calibration+tables"] = 4 * (d * d + K * d + 2 * cfg.code_subquantizers * (1 << cfg.code_bits) * d
                                      // cfg.code_subquantizers + n_cells * d) + 64 * K + 32 * mc.vocab_size
    max_unit_tok = int(max((u.bytes for u in units), default=0) * n_tok_s / text_bytes)
    memory = {
        "model": sum(p.numel() * p.element_size() for p in ix.model.parameters()),
        "forward_batch": 4 * cfg.batch_size * mc.block_size * (3 * mc.vocab_size + 4 * d + K),
        "calibration_sample": min(cfg.calibration_tokens, n_tok) * (2 * d + 4 * d + 24 * mc.n_active),
        "shard_buffers": max_unit_tok * (4 + 20 * cfg.posting_entries) + max_unit_tok * 4 * 4,  # I(t,t), postings, text
        "python_and_libraries": 600 * 1024**2,
    }
    serving = {
        "model_and_calibration": memory["model"] + 4 * (d * d + 2 * K * d),
        "faiss_in_memory": disk["faiss"] + disk["faiss_template.index"],
        "per_shard_headers": n_shards * 8 * (K * n_cells + 1),
        "python_and_libraries": 700 * 1024**2,
    }
    tok_per_s = n_tok_s / max(build_s, 1e-9)
    seconds = {"calibrate": min(cfg.calibration_tokens, n_tok) / tok_per_s, "shards": n_tok / tok_per_s}
    return {
        "documents": n_docs, "sequences": n_seq, "tokens": n_tok, "shards": len(units), "corpus_bytes": corpus_bytes,
        "faiss_spec": spec, "disk_bytes": disk, "disk_total_bytes": sum(disk.values()),
        "disk_bytes_per_token": sum(disk.values()) / max(n_tok, 1),
        "peak_memory_bytes": sum(memory.values()), "memory_breakdown": memory,
        "serving_memory_bytes": sum(serving.values()), "serving_breakdown": serving,
        "serving_bytes_per_token_beyond_base": (serving["faiss_in_memory"] + serving["per_shard_headers"])
        / max(n_tok, 1),
        "seconds": seconds, "total_seconds": sum(seconds.values()),
        "calibration": {"documents": info.n_docs, "tokens": info.n_tokens, "tokens_per_s": tok_per_s,
                        "tokens_per_corpus_byte": n_tok_s / text_bytes},
    }


def compare(est: dict[str, Any], summary: dict[str, Any], wall_s: float, peak_rss: int) -> dict[str, Any]:
    """actual / estimated, per file and in total (1.0 = exact)."""
    out: dict[str, Any] = {"disk": {}}
    for t, v in est["disk_bytes"].items():
        if v and t in summary["bytes"]:
            out["disk"][t] = round(summary["bytes"][t] / v, 3)
    out["disk_total"] = round(summary["total_bytes"] / max(est["disk_total_bytes"], 1), 3)
    out["tokens"] = round(summary["tokens"] / max(est["tokens"], 1), 3)
    out["time"] = round(wall_s / max(est["total_seconds"], 1e-9), 3)
    out["peak_memory"] = round(peak_rss / max(est["peak_memory_bytes"], 1), 3)
    return out


def format_estimate(est: dict[str, Any]) -> str:
    def mb(x: float | None) -> str:
        return "n/a" if x is None else f"{x / 1024**2:,.1f} MB"

    lines = [f"corpus: {est['corpus_bytes'] / 1024**2:,.1f} MB in {est['shards']} work units: about "
             f"{est['documents']:,} documents, {est['sequences']:,} sequences, {est['tokens']:,} tokens",
             f"FAISS: {est['faiss_spec']}", "disk per file:"]
    lines += [f"  {k:24s} {mb(v)}" for k, v in est["disk_bytes"].items()]
    lines.append(f"  {'total':24s} {mb(est['disk_total_bytes'])} ({est['disk_bytes_per_token']:.1f} bytes/token)")
    lines.append(f"indexing peak memory: {mb(est['peak_memory_bytes'])}")
    lines += [f"  {k:24s} {mb(v)}" for k, v in est["memory_breakdown"].items()]
    lines.append(f"serving memory: {mb(est['serving_memory_bytes'])} "
                 f"({est['serving_bytes_per_token_beyond_base']:.2f} bytes/token beyond the model and libraries; "
                 "the per-token files are memory-mapped)")
    lines += [f"  {k:24s} {mb(v)}" for k, v in est["serving_breakdown"].items()]
    lines.append(f"time: {est['total_seconds']:,.0f} s (at {est['calibration']['tokens_per_s']:,.0f} tokens/s, "
                 f"measured on {est['calibration']['tokens']:,} tokens)")
    return "\n".join(lines)


__all__ = ["compare", "estimate", "format_estimate", "peak_rss_bytes"]
