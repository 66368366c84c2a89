"""The floor of the indexer's per-token work on this machine, stage by stage, against the bare forward.

On one batch of the index's own sequences (``--batch`` of its longest, cut to one length), each
stage timed alone (median of ``--repeats`` after a warm-up), in microseconds per token:

- ``bare_forward``: ``model(x)``, backbone and logits (the baseline of ``bench/index_throughput.py``);
- the indexer's forward (``engine/tokens.py: run_batch``) and its parts: the backbone (``hidden``),
  the prototype head, the logits, the softmax over the vocabulary, ``u_t = W^T (p_t - e_y)``;
- the codes (``engine/codec.py``): each codebook's nearest-centroid search with the index's own
  codebooks (FAISS on a CPU), and the whole ``encode`` (both codebooks, the choice between them);

and the ceiling each puts on the shard stage's ratio to the bare forward (the ratio if nothing
else cost anything).

    python -m bench.index_floor --index runs/demo/index

Writes ``bench/results/index_floor.json``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from bench._common import finish
from prism_tda.engine import Attributor
from prism_tda.engine.tokens import run_batch


def timed(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default="runs/demo/index")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/index_floor.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    att = Attributor.open(args.index)
    model, reader, codec = att.model, att.reader, att.reader.codec
    # the longest windows (the full context on a real corpus), spread over the index, cut to one length
    lengths = np.array([reader.seq_span(s)[1] - reader.seq_span(s)[0] for s in range(reader.n_seqs)])
    longest = np.sort(np.argsort(-lengths, kind="stable")[: 8 * args.batch])
    seqs = longest[:: max(1, len(longest) // args.batch)][: args.batch]
    width = int(lengths[seqs].min())
    toks, tgts = ([t[:width] for t in v] for v in zip(*(reader.sequence_tokens(int(s)) for s in seqs), strict=True))
    x = torch.tensor(toks)
    n = x.numel()
    W = model.W.detach()
    with torch.no_grad():
        z = model.hidden(x).reshape(n, -1)
        logits = z @ W.T
        p = torch.softmax(logits, -1)
        tb = run_batch(model, toks, tgts)
        ut = tb.u @ reader.curv.Q
        m = ((ut + codec.target_rows(tb.targets)) * codec.scale).numpy().astype(np.float32)
        xs = (ut * codec.scale).numpy().astype(np.float32)
        unit = np.ascontiguousarray(xs / np.linalg.norm(xs, axis=1, keepdims=True).clip(1e-30))
        t = {
            "bare_forward": timed(lambda: model(x), args.repeats),
            "indexer_forward": timed(lambda: run_batch(model, toks, tgts), args.repeats),
            "backbone": timed(lambda: model.hidden(x), args.repeats),
            "prototype_head": timed(lambda: model.head(z), args.repeats),
            "logits": timed(lambda: z @ W.T, args.repeats),
            "softmax": timed(lambda: torch.log_softmax(logits, -1).exp_(), args.repeats),
            "error_signal_u": timed(lambda: p @ W, args.repeats),
            "codes_m": timed(lambda: codec._pq.compute_codes(m), args.repeats),
        }
        if codec.has_directions:
            t["codes_direction"] = timed(lambda: codec._pq_dir.compute_codes(unit), args.repeats)
        t["encode"] = timed(lambda: codec.encode(ut, tb.targets), args.repeats)
    us = {k: round(1e6 * v / n, 2) for k, v in t.items()}
    fwd = us["bare_forward"]
    res = {
        "index": args.index, "tokens_per_batch": n, "codes": {"subquantizers": codec.n_sub, "bits": codec.bits,
                                                              "directions": codec.has_directions},
        "us_per_token": us,
        "ceiling_ratio": {
            "indexer_forward_alone": round(fwd / us["indexer_forward"], 3),
            "indexer_forward_and_encode": round(fwd / (us["indexer_forward"] + us["encode"]), 3),
        },
        "torch_threads": torch.get_num_threads(),
    }
    return finish(res, "index_floor.py", argv, args.out)


if __name__ == "__main__":
    main()
