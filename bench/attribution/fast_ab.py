"""Two settings of the fast path's query options (and first stages) against exact mode on the same held-out queries at
scale, interleaved query by query: strict overlap@10 and tie-aware agreement with exact, with 95%
bootstrap intervals over queries (paired for the difference), and seconds per query.

Queries and exact scores as in ``rerank_depth.py`` (48-token prompts and 16-token continuations from
documents of a file that is not indexed, a draw ``--seed`` that leaves out ``--exclude``'s draws,
exact ``cosine_max`` from one pass of the model cached in ``--arrays``). ``--first`` and ``--count``
pick a slice of the draw (a tuning or a report split).

    python -m bench.attribution.fast_ab --index runs/scale/prefix_0005 --heldout runs/scale/corpus/part-006.jsonl \\
        --seed 3 --exclude 2:24 --count 24 --arrays runs/scale/rerank_depth.npz \\
        --a '{}' --b '{"exact_tokens": 8}' --out bench/results/fast_ab_exact_tokens_tune.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from bench._common import finish
from bench.attribution.rerank_depth import agreement, arm_summary, ci, draw_args, open_draw
from prism_tda.engine import FirstStages, QueryOptions, QuerySpec


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    draw_args(ap)
    ap.add_argument("--first", type=int, default=0, help="the slice of the draw measured: its first query")
    ap.add_argument("--count", type=int, default=48, help="and how many")
    ap.add_argument("--a", type=json.loads, default={}, help="query options of arm a (JSON; {}: the served defaults)")
    ap.add_argument("--b", type=json.loads, required=True, help="query options of arm b (JSON)")
    ap.add_argument("--stages-a", type=json.loads, default={}, help="first-stage settings of arm a (JSON, FirstStages)")
    ap.add_argument("--stages-b", type=json.loads, default={}, help="and of arm b")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    att, drawn, exact, exact_s, row_of = open_draw(args, args.first + args.count)
    queries, exact = drawn[args.first:], exact[args.first:]
    arms_opt = {"a": args.a, "b": args.b}
    arms_stages = {"a": FirstStages(**args.stages_a), "b": FirstStages(**args.stages_b)}
    for q in queries[:2]:  # warm up
        att.attribute(QuerySpec(q["prompt"], q["completion"]))
    arms: dict[str, dict[str, list]] = {"a": {}, "b": {}}
    for i, q in enumerate(queries):  # interleaved: one machine state for both arms
        for arm in ("b", "a") if i % 2 else ("a", "b"):
            att.stages = arms_stages[arm]
            opt = dict(arms_opt[arm])
            depth = int(opt.pop("exact_rerank", QueryOptions().exact_rerank))
            for k, v in agreement(att, [q], exact[i : i + 1], row_of, depth, **opt).items():
                arms[arm].setdefault(k, []).extend(v)
    rng = np.random.default_rng(0)
    att.stages = FirstStages()
    out = {arm: arm_summary(m, rng, options=arms_opt[arm], stages=dataclasses.asdict(arms_stages[arm]))
           for arm, m in arms.items()}
    res = {"index": str(args.index), "tokens": att.reader.n_tokens, "documents": att.reader.n_docs,
           "queries": [q["id"] for q in queries], "seed": args.seed, "exclude": args.exclude,
           "first": args.first, "exact_pass_seconds": round(exact_s, 1), "arms": out,
           "overlap_diff_b_a_ci": ci(np.array(arms["b"]["strict"]) - np.array(arms["a"]["strict"]), rng),
           "tie_aware_diff_b_a_ci": ci(np.array(arms["b"]["tie_aware"]) - np.array(arms["a"]["tie_aware"]), rng),
           "seconds_ratio_b_a_median": round(float(np.median(np.array(arms["b"]["seconds"]) / np.array(arms["a"]["seconds"]))), 3)}
    return finish(res, "attribution/fast_ab.py", argv, args.out)


if __name__ == "__main__":
    main()
