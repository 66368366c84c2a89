"""Whether re-scoring a shortlisted document's best rows in its other candidate sequences brings the fast
path's top 10 closer to exact mode's, and what it costs.

The re-rank first scores each shortlisted document's best sequence (by approximate score) exactly; a
long document's best token by exact score can sit in another of its sequences, and then its exact
score is underestimated and a near-tied document takes its place. With ``ROWS_ELSEWHERE``
(``engine/shards.py``), a document's ``exact_tokens`` best rows in its other candidate sequences are
re-scored too, once no unscored document can reach the top, where their approximate scores could
still reach the n-th exact score (the adaptive rule's bar).

Protocol: held-out queries at scale as in ``rerank_depth.py`` (48-token prompts and 16-token
continuations from documents of a file that is not indexed), a draw that leaves out every earlier
draw (``--exclude SEED:N,...``), exact ``cosine_max`` from one pass of the model (cached in
``--arrays``); the served defaults with and without the rows elsewhere, interleaved query by query;
strict overlap@10 and tie-aware agreement (``rerank_depth.TIE``) with 95% bootstrap intervals over
queries, paired for the difference; seconds per query (median and mean) and documents re-ranked.

    python -m bench.attribution.rows_elsewhere --index runs/scale/prefix_0005 \\
        --heldout runs/scale/corpus/part-006.jsonl --seed 4 --exclude 2:24,3:48 \\
        --arrays runs/scale/rows_elsewhere.npz --out bench/results/rows_elsewhere.json
"""

from __future__ import annotations

import argparse
from types import ModuleType

import numpy as np

import prism_tda.engine.shards as shards
from bench._common import finish
from bench.attribution.rerank_depth import agreement, arm_summary, ci, draw_args, open_draw
from prism_tda.engine import QueryOptions, QuerySpec


def switch_ab(argv: list[str] | None, doc: str, module: ModuleType, switch: str, name: str, out: str) -> dict:
    """The served defaults with the engine's switch ``module.switch`` on and off, interleaved query by
    query on a draw (``rerank_depth.draw_args``); written to ``--out`` (default ``out``) under
    ``name``'s script."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    draw_args(ap)
    ap.add_argument("--queries", type=int, default=48)
    ap.add_argument("--out", default=out)
    args = ap.parse_args(argv)
    att, queries, exact, exact_s, row_of = open_draw(args, args.queries)
    depth = QueryOptions().exact_rerank
    for q in queries[:2]:  # warm up
        att.attribute(QuerySpec(q["prompt"], q["completion"]))
    arms: dict[str, dict[str, list]] = {"with": {}, "without": {}}
    was = getattr(module, switch)
    try:
        for i, q in enumerate(queries):  # interleaved: one machine state for both arms
            for arm in ("without", "with") if i % 2 else ("with", "without"):
                setattr(module, switch, arm == "with")
                m = agreement(att, [q], exact[i : i + 1], row_of, depth)
                for k, v in m.items():
                    arms[arm].setdefault(k, []).extend(v)
    finally:
        setattr(module, switch, was)
    rng = np.random.default_rng(0)
    summ = {arm: arm_summary(m, rng) for arm, m in arms.items()}
    diff = np.array(arms["with"]["strict"]) - np.array(arms["without"]["strict"])
    res = {"index": str(args.index), "tokens": att.reader.n_tokens, "documents": att.reader.n_docs,
           "queries": [q["id"] for q in queries], "seed": args.seed, "exclude": args.exclude,
           "exact_pass_seconds": round(exact_s, 1), "exact_rerank": depth, "switch": f"{module.__name__}.{switch}",
           "arms": summ, "overlap_diff_with_without_ci": ci(diff, rng),
           "overlap_at_10_fast_vs_exact": summ["with"]["overlap_at_10"][0]}
    return finish(res, name, argv, args.out)


def main(argv: list[str] | None = None) -> dict:
    return switch_ab(argv, __doc__ or "", shards, "ROWS_ELSEWHERE", "attribution/rows_elsewhere.py",
                     "bench/results/rows_elsewhere.json")


if __name__ == "__main__":
    main()
