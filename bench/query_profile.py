"""Where one fast query's time goes, in process: the engine's own timings per stage, over the same
queries as ``bench/service_load.py`` (64-token prompts cut from the demo corpus, completion
" is a machine", top 10), one query at a time, after two to warm up.

    python -m bench.query_profile --index runs/demo/index

Writes ``bench/results/query_profile.json``: per stage the median and p90 milliseconds, the
documents re-ranked, and the wall time per query.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench._common import add_demo_query_args, demo_queries, finish

STAGES = ("query_forward", "candidates", "shortlist", "rerank", "score", "details", "total")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_demo_query_args(ap, "bench/results/query_profile.json", repeats=3)
    args = ap.parse_args(argv)
    att, specs, opt = demo_queries(args)
    for s in specs[:2]:
        att.attribute(s, opt)
    wall, stages, reranked = [], {k: [] for k in STAGES}, []
    for _ in range(args.repeats):
        for s in specs:
            t0 = time.perf_counter()
            res = att.attribute(s, opt)
            wall.append(1e3 * (time.perf_counter() - t0))
            for k in STAGES:
                stages[k].append(getattr(res.timings_ms, k, float("nan")))
            reranked.append(getattr(res, "documents_reranked", float("nan")))

    def summary(v: list[float]) -> dict:
        return {"p50": round(float(np.median(v)), 1), "p90": round(float(np.percentile(v, 90)), 1)}

    res = {
        "queries": len(wall), "index": args.index, "tokens": att.reader.n_tokens,
        "wall_ms": summary(wall), "stages_ms": {k: summary(v) for k, v in stages.items()},
        "documents_reranked_mean": round(float(np.mean(reranked)), 2),
        "torch_threads": torch.get_num_threads(),
    }
    return finish(res, "query_profile.py", argv, args.out)


if __name__ == "__main__":
    main()
