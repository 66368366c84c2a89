"""Choosing the fast path's settings for large indexes on a tuning split, disjoint from what
``bench/scale.py`` reports: queries from another held-out file of the scale corpus.

For each setting: overlap@10 with the exact ranking (one exhaustive pass for every query) and
median latency in-process (one query at a time), on the first ``--shards`` shards of the real index.

    python -m bench.scale_tune --real runs/scale/real --shards 4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import finish
from bench.scale import held_out_queries, subset_index
from prism_tda.engine import Attributor, FirstStages, QueryOptions, QuerySpec, layout

# (name, first stages, query options): the defaults, then one change at a time
VARIANTS = [
    ("default", {}, {}),
    ("exact_tokens=8", {}, {"exact_tokens": 8}),
    ("exact_tokens=all", {}, {"exact_tokens": None}),
    ("exact_rerank=16", {}, {"exact_rerank": 16}),
    ("exact_rerank=64", {}, {"exact_rerank": 64}),
    ("token_candidates=128", {"token_candidates": 128}, {}),
    ("n_candidates=128", {}, {"n_candidates": 128}),
    ("row_budget=8192", {"row_budget": 8192}, {}),
]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", default="runs/scale/real")
    ap.add_argument("--corpus", default="runs/scale/corpus")
    ap.add_argument("--tuning-file", default="part-009.jsonl", help="held-out file of the corpus for tuning")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--queries", type=int, default=24)
    ap.add_argument("--work", default="runs/scale")
    ap.add_argument("--out", default="bench/results/scale_tune.json")
    args = ap.parse_args(argv)
    real = Path(args.real).resolve()
    m = layout.read_manifest(real)
    ix = subset_index(real, args.shards, Path(args.work) / f"prefix_{args.shards:04d}")
    qs = held_out_queries(Path(args.corpus) / args.tuning_file, Path(m.checkpoint) / "tokenizer.json", args.queries,
                          seed=3)
    att = Attributor.open(ix)
    specs = [QuerySpec(q["prompt"], q["completion"]) for q in qs]
    t0 = time.perf_counter()
    exact = att.exact_document_scores([att.encode(s) for s in specs], progress=True)
    exact_s = time.perf_counter() - t0
    tops = []
    for e in exact:
        s = e["cosine_max"]
        top = np.argsort(-s, kind="stable")[:10]
        tops.append(set(top[s[top] > 0].tolist()))
    rows = []
    for name, stages, opts in VARIANTS:
        v = Attributor.open(ix, stages=FirstStages(**stages))
        for s in specs[:3]:
            v.attribute(s, QueryOptions(n_documents=10, **opts))  # warm-up
        lat, ov = [], []
        for s, top in zip(specs, tops, strict=True):
            r = v.attribute(s, QueryOptions(n_documents=10, **opts))
            lat.append(r.timings_ms.total)
            ov.append(len({d.doc_id for d in r.documents} & top) / max(len(top), 1))
        rows.append({"variant": name, "overlap_at_10": round(float(np.mean(ov)), 3),
                     "p50_ms": round(float(np.median(lat)), 1)})
        print(rows[-1], flush=True)
    res = {"variants": rows, "tokens": att.reader.n_tokens, "queries": len(qs), "exact_pass_s": round(exact_s, 1),
           "tuning_file": args.tuning_file, "threads": torch.get_num_threads()}
    return finish(res, "scale_tune.py", argv, args.out)


if __name__ == "__main__":
    main()
