"""The fast path's opponents (``opponents: true``: the documents that most oppose the output) against
exact mode's.

Exact mode ranks every document by its most negative score. The fast path's first stages (FAISS over
the sequences' sketches, the posting lists' best tokens) pick their candidates along the query's
gradient; for an opponents query they now search along its negation, where the most opposed tokens
and sequences are the best ones. Run on a revision before that change, the same command measures the
earlier behaviour.

Protocol: held-out queries at scale as in ``rerank_depth.py`` (48-token prompts and 16-token
continuations from documents of a file that is not indexed), exact scores of every document with the
sign reversed from one pass of the model (cached in ``--arrays``); the served defaults with
``opponents`` under ``cosine_max`` (and ``raw_sum``), every document allowed; strict overlap@10 with
exact mode's answer (its near-tie at the cut settled as served), tie-aware agreement (a returned
document within 0.1% of the exact 10th), the ratio of the returned scores' sum to the exact top 10's,
seconds per query; 95% bootstrap intervals over queries.

    python -m bench.attribution.opponents --index runs/scale_b/prefix_0001 \\
        --heldout runs/scale/corpus/part-006.jsonl --seed 14 --arrays runs/scale/opponents_seed14.npz
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from bench._common import finish, served_ranking
from bench.attribution.rerank_depth import TIE, cached_arrays, ci, open_queries, parse_draw
from prism_tda.engine import Attributor, QueryOptions, QuerySpec
from prism_tda.engine.exact import exhaustive

AGGREGATIONS = ("cosine_max", "raw_sum")


def exact_opponents(att: Attributor, queries: list[dict], arrays: Path | None) -> tuple[dict[str, np.ndarray], float]:
    """Per aggregation (and ``cosine_sum``, the near-tie's second measure), (queries, documents) exact
    scores with the most opposed highest (the scores negated), and the seconds of their one pass."""
    def compute() -> dict[str, np.ndarray]:
        encoded = [att.encode(QuerySpec(q["prompt"], q["completion"])) for q in queries]
        with torch.no_grad():
            tots = exhaustive(att.model, att.reader, encoded, att.preconditioner(None), sign=-1.0, progress=True)
        return {k: np.stack([-t.scores(-1.0)[k] for t in tots]) for k in (*AGGREGATIONS, "cosine_sum")}

    return cached_arrays(arrays, queries, compute)


def main(argv: list[str] | None = None) -> dict:
    args = parse_draw(argv, __doc__ or "", 14, "bench/results/opponents.json")
    att, queries, row_of = open_queries(args, args.queries)
    exact, exact_s = exact_opponents(att, queries, Path(args.arrays) if args.arrays else None)
    every = np.ones(att.reader.n_docs, dtype=bool)
    for q in queries[:2]:  # warm up
        att.attribute(QuerySpec(q["prompt"], q["completion"]), QueryOptions(opponents=True))
    rng = np.random.default_rng(0)
    res: dict = {"index": str(args.index), "tokens": att.reader.n_tokens, "documents": att.reader.n_docs,
                 "queries": [q["id"] for q in queries], "seed": args.seed, "exact_pass_seconds": round(exact_s, 1)}
    for agg in AGGREGATIONS:
        strict, tied, ratio, secs = [], [], [], []
        for i, q in enumerate(queries):
            s = exact[agg][i]
            top = served_ranking(s, exact["cosine_sum"][i], every, 10)[0][:10]
            top = top[s[top] > 0]
            kth = float(s[top[-1]]) if len(top) else 0.0
            t0 = time.perf_counter()
            out = att.attribute(QuerySpec(q["prompt"], q["completion"]),
                                QueryOptions(n_documents=10, aggregation=agg, opponents=True, include_untrained=True,
                                             keep_opposed=True))
            secs.append(time.perf_counter() - t0)
            got = [row_of[d.external_id] for d in out.documents]
            strict.append(len(set(got) & set(top.tolist())) / max(len(top), 1))
            tied.append(float(np.mean([s[d] >= kth - TIE * abs(kth) for d in got])) if got else 0.0)
            ratio.append(float(s[got].sum() / s[top].sum()) if len(top) and s[top].sum() > 0 else 1.0)
        res[agg] = {"overlap_at_10": ci(np.array(strict), rng), "tie_aware_at_10": ci(np.array(tied), rng),
                    "score_ratio_at_10": ci(np.array(ratio), rng),
                    "seconds_median": round(float(np.median(secs)), 3),
                    "per_query_overlap": [round(x, 2) for x in strict]}
    res["overlap_at_10_fast_vs_exact"] = res["cosine_max"]["overlap_at_10"][0]
    return finish(res, "attribution/opponents.py", argv, args.out)


if __name__ == "__main__":
    main()
