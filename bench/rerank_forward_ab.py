"""What running the last block only at the scored positions (``PRISM.hidden_at``) saves in a served
query, against the whole model on every position, interleaved query by query in one process.

Same queries as ``bench/query_profile.py`` (64-token prompts cut from the demo corpus, completion
" is a machine", top 10), each asked once per arm per repeat, the arm order alternating; the switch is
``prism_tda.engine.tokens.LAST_BLOCK_AT_POSITIONS`` (it touches the query encode and the re-rank).
Per arm: the median and p90 of the wall time and of the re-rank and query-forward stages; the paired
difference of the medians per query with a 95% bootstrap interval; and whether both arms return the
same documents in the same order, with the largest score difference.

    python -m bench.rerank_forward_ab --index runs/demo/index
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

import prism_tda.engine.tokens as tokens
from bench._common import finish
from bench.service_load import prompts_of
from prism_tda.engine import Attributor, QueryOptions, QuerySpec

ARMS = ("whole", "last_block_at_positions")
STAGES = ("query_forward", "rerank", "total")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default="runs/demo/index")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--completion", default=" is a machine")
    ap.add_argument("--out", default="bench/results/rerank_forward_ab.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    att = Attributor.open(args.index)
    prompts = prompts_of(Path(att.manifest.checkpoint) / "tokenizer.json", args.prompts, args.prompt_tokens)
    specs = [QuerySpec(p, args.completion) for p in prompts]
    opt = QueryOptions(n_documents=10)
    was = tokens.LAST_BLOCK_AT_POSITIONS
    # per arm, per query: wall and stage times over the repeats, and the last answer
    times = {a: {k: [[] for _ in specs] for k in ("wall", *STAGES)} for a in ARMS}
    answers: dict[str, list] = {a: [None] * len(specs) for a in ARMS}
    try:
        for s in specs[:2]:  # warm up both arms
            for a in ARMS:
                tokens.LAST_BLOCK_AT_POSITIONS = a == ARMS[1]
                att.attribute(s, opt)
        for r in range(args.repeats):
            for i, s in enumerate(specs):
                for a in ARMS if (r + i) % 2 else ARMS[::-1]:
                    tokens.LAST_BLOCK_AT_POSITIONS = a == ARMS[1]
                    t0 = time.perf_counter()
                    res = att.attribute(s, opt)
                    times[a]["wall"][i].append(1e3 * (time.perf_counter() - t0))
                    for k in STAGES:
                        times[a][k][i].append(getattr(res.timings_ms, k))
                    answers[a][i] = [(d.doc_id, d.score) for d in res.documents]
    finally:
        tokens.LAST_BLOCK_AT_POSITIONS = was

    rng = np.random.default_rng(0)

    def summary(v: list[list[float]]) -> dict:
        flat = np.concatenate(v)
        return {"p50": round(float(np.median(flat)), 2), "p90": round(float(np.percentile(flat, 90)), 2)}

    def paired(k: str) -> dict:
        d = np.array([np.median(b) - np.median(w) for w, b in zip(times[ARMS[0]][k], times[ARMS[1]][k], strict=True)])
        boot = [float(np.median(rng.choice(d, len(d)))) for _ in range(2000)]
        return {"median_ms": round(float(np.median(d)), 2),
                "ci95_ms": [round(float(np.percentile(boot, 2.5)), 2), round(float(np.percentile(boot, 97.5)), 2)]}

    same_order = sum([x[0] for x in w] == [x[0] for x in b] for w, b in zip(*answers.values(), strict=True))
    score_diff = max(abs(x[1] - y[1]) for w, b in zip(*answers.values(), strict=True)
                     for x, y in zip(w, b, strict=False))
    res = {
        "index": args.index, "tokens": att.reader.n_tokens, "queries": len(specs), "repeats": args.repeats,
        "arms": {a: {k: summary(v) for k, v in times[a].items()} for a in ARMS},
        "diff_last_block_minus_whole": {k: paired(k) for k in ("wall", *STAGES)},
        "same_documents_and_order": f"{same_order}/{len(specs)}",
        "max_score_diff": float(score_diff), "torch_threads": torch.get_num_threads(),
    }
    return finish(res, "rerank_forward_ab.py", argv, args.out)


if __name__ == "__main__":
    main()
