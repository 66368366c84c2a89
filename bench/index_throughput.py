"""Indexer throughput against the model's bare forward pass, bytes per token, and scaling.

The bare forward pass (``model(x)``: backbone + logits, no autograd) runs on exactly the batches
the indexer runs (each shard's sequences grouped by length rounded up to 16, ``batch_size`` at a
time; also reported on batches of consecutive sequences, as the indexer ran them before), in the same process, so
``throughput_ratio`` (the shard stage: forward, codes, posting lists, FAISS adds, files) says how
close indexing comes to the physical limit, and
``whole_job_ratio`` the same for the whole job (planning, calibration, shards, reduce) at the
largest scale. Timed at 1x, 4x and 16x the corpus size.

    prism demo   # or any PRISM checkpoint
    python -m bench.index_throughput --checkpoint runs/demo --docs 1000

Writes ``bench/results/index.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import finish, index_sequences
from prism_tda import demo_corpus_path
from prism_tda.cli.train import merge_overrides
from prism_tda.engine.tokens import width_batches
from prism_tda.indexer import IndexConfig
from prism_tda.indexer.run import build_index
from prism_tda.model import checkpoint as ckpt


def make_corpus(path: Path, n_docs: int) -> Path:
    """The first n_docs of the demo corpus, cycled with new ids when n_docs exceeds it."""
    with gzip.open(demo_corpus_path(), "rt") as fh:
        docs = [json.loads(line) for line in fh]
    with open(path, "w") as out:
        for i in range(n_docs):
            d = dict(docs[i % len(docs)])
            d["id"] = f"{d['id']}#{i // len(docs)}"
            out.write(json.dumps(d) + "\n")
    return path


def indexer_batches(index_dir: Path, batch_size: int, block: int) -> list[tuple[np.ndarray, int]]:
    """The batches (sequence ids, padded width) the shard builder runs: in each shard, its sequences
    grouped by length rounded up to 16, ``batch_size`` at a time (``engine/tokens.py: width_batches``)."""
    from prism_tda.engine.reader import IndexReader

    r = IndexReader(index_dir)
    out = []
    for s in range(len(r.manifest.shards)):
        lo, hi = int(r.seq_base[s]), int(r.seq_base[s + 1])
        lengths = np.array([r.seq_span(i)[1] - r.seq_span(i)[0] for i in range(lo, hi)])
        out += [(lo + at, w) for at, w in width_batches(lengths, batch_size, block)]
    return out


@torch.no_grad()
def bare_forward_tokens_per_s(checkpoint: str | Path, index_dir: Path, batches: list[tuple[np.ndarray, int]], *,
                              device: torch.device | str = "cpu",
                              autocast: contextlib.AbstractContextManager | None = None) -> float:
    """``model(x)`` (backbone and logits, no autograd) over the index's sequences in ``batches``
    (sequence ids, padded width), on ``device`` under ``autocast`` (the indexer's: bf16 on CUDA)."""
    model, _, _ = ckpt.load_checkpoint(checkpoint, device=device)
    rows = index_sequences(index_dir)["token_ids"]
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    n_tok = 0
    sync()
    t0 = time.perf_counter()
    for seqs, width in batches:
        batch = [rows[i] for i in seqs]
        x = torch.zeros(len(batch), max(width, *(len(r) for r in batch)), dtype=torch.long)
        for i, r in enumerate(batch):
            x[i, : len(r)] = torch.as_tensor(r)
        with autocast or contextlib.nullcontext():
            model(x.to(device))
        n_tok += sum(len(r) for r in batch)
    sync()
    return n_tok / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="runs/demo")
    ap.add_argument("--docs", type=int, default=1000, help="documents at 1x")
    ap.add_argument("--scales", default="1,4,16")
    ap.add_argument("--work", default="runs/bench_index")
    ap.add_argument("--set", action="append", default=[], metavar="index.NAME=VALUE",
                    help="an index setting other than its default, as `prism index --set` takes it, e.g. "
                         "index.code_bits=8; repeatable, recorded in the result's config")
    ap.add_argument("--out", default="bench/results/index.json")
    args = ap.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = IndexConfig.from_dict(merge_overrides({"index": {}}, None, args.set)["index"], where="--set")
    res: dict = {"scaling": []}
    scales = [int(s) for s in args.scales.split(",")]
    for scale in scales:
        corpus = make_corpus(work / f"corpus_{scale}x.jsonl", args.docs * scale)
        out = work / f"index_{scale}x"
        t0 = time.perf_counter()
        s = build_index(args.checkpoint, [str(corpus)], out, cfg, progress=False)
        wall = time.perf_counter() - t0
        res["scaling"].append({"scale": scale, "documents": s["documents"], "tokens": s["tokens"],
                               "wall_s": round(wall, 2), "seconds_per_million_tokens": wall / s["tokens"] * 1e6,
                               "timings": s["timings"]})
        if scale == scales[0]:  # the bare forward on the first scale's batches (1x by default)
            block = ckpt.read_config(ckpt.resolve(args.checkpoint))["model"]["block_size"]
            fwd = bare_forward_tokens_per_s(args.checkpoint, out, indexer_batches(out, cfg.batch_size, block))
            n_seqs = len(index_sequences(out)["token_ids"])
            consecutive = [(np.arange(b, min(b + cfg.batch_size, n_seqs)), 0) for b in range(0, n_seqs, cfg.batch_size)]
            res |= {
                "forward_tokens_per_s": fwd,
                # the same forward on batches of consecutive sequences (how the indexer batched before)
                "forward_tokens_per_s_consecutive_batches": bare_forward_tokens_per_s(args.checkpoint, out, consecutive),
                # the shard stage: every shard's forward, codes, postings, FAISS adds and files
                "shard_stage_tokens_per_s": s["tokens"] / s["timings"]["shards_s"],
                "shard_stage_ratio": s["tokens"] / s["timings"]["shards_s"] / fwd,
                "whole_job_ratio_1x": s["tokens"] / wall / fwd,
                "total_bytes_per_token": s["total_bytes_per_token"],
                "bytes_per_token_by_file": s["bytes_per_token"],
                "estimate_vs_actual": s.get("estimate_vs_actual"),
                "grounding": {k: s[k] for k in ("R1bar", "R2", "effective_prototypes", "dead_prototypes")},
            }
    # Whole job (plan, calibration, shards, reduce) at the largest scale, where the fixed costs are
    # amortised as they are on a real corpus.
    last = res["scaling"][-1]
    res["index_tokens_per_s"] = last["tokens"] / last["wall_s"]
    res["whole_job_ratio"] = res["index_tokens_per_s"] / res["forward_tokens_per_s"]
    res["shard_stage_ratio_largest"] = last["tokens"] / last["timings"]["shards_s"] / res["forward_tokens_per_s"]
    # the targets' ratios: indexing against the bare forward pass on the same batches
    res["throughput_ratio"] = res["shard_stage_ratio"]
    base = res["scaling"][0]["seconds_per_million_tokens"]
    for row in res["scaling"]:
        row["cost_per_token_vs_1x"] = round(row["seconds_per_million_tokens"] / base, 3)
    model_cfg = ckpt.read_config(ckpt.resolve(args.checkpoint))["model"]
    res["config"] = {"index": cfg.to_dict(), "model": model_cfg, "checkpoint": args.checkpoint}
    return finish(res, "index_throughput.py", argv, args.out)


if __name__ == "__main__":
    main()
