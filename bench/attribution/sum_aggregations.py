"""The fast path under the sum aggregations (``raw_sum``, ``cosine_sum``) against exact mode, in three
arms: a document scored over its candidate windows and re-ranked window only (``earlier``: the earlier
rule), over all of its windows (``whole``: ``scoring.WHOLE_DOCUMENT_SUMS``), and that with first stages
that also take the documents whose posting-list rows sum highest (``served``:
``attributor.SUM_DOCUMENTS``, the served setting).

Exact mode sums a document's token scores over every window of it. The earlier fast path shortlisted
by the sums over the candidate windows and scored a re-ranked document by its re-ranked window alone,
so a document of several windows scored a part of its sum. With the switch on, the shortlist scores
every window of the candidates' documents from the codes and a re-ranked document's score is its
whole sum, its re-ranked window exact and the others from the codes (as its ``value``).

Protocol: held-out queries at scale as in ``rerank_depth.py`` (48-token prompts, 16-token
continuations from documents of a file that is not indexed), exact ``raw_sum`` and ``cosine_sum``
from one pass of the model (cached in ``--arrays``); each aggregation in the three arms,
interleaved query by query; strict overlap@10 with exact mode's answer (its near-tie at the cut settled
as the served default settles it), the relative error of each returned document's score against its
exact sum (median over the returned documents), seconds per query. 95% bootstrap intervals over
queries, paired for the difference.

    python -m bench.attribution.sum_aggregations --index runs/scale_b/prefix_0001 \\
        --heldout runs/scale/corpus/part-006.jsonl --seed 20 --arrays runs/scale/sum_aggregations_seed20.npz
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench._common import finish, served_ranking
from bench.attribution.rerank_depth import (
    answers_summary,
    ci,
    exact_document_arrays,
    open_queries,
    parse_draw,
    record_answer,
)
from prism_tda.engine import QueryOptions, QuerySpec, scoring
from prism_tda.engine import attributor as attributor_module

AGGREGATIONS = ("raw_sum", "cosine_sum")
ARMS = ("earlier", "whole", "served")
# (scoring.WHOLE_DOCUMENT_SUMS, attributor.SUM_DOCUMENTS)
SETTINGS = {"earlier": (False, 0), "whole": (True, 0), "served": (True, attributor_module.SUM_DOCUMENTS)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_draw(argv, __doc__ or "", 13, "bench/results/sum_aggregations.json")
    att, queries, row_of = open_queries(args, args.queries)
    exact, exact_s = exact_document_arrays(att, queries, Path(args.arrays) if args.arrays else None, AGGREGATIONS)
    every = np.ones(att.reader.n_docs, dtype=bool)
    windows = np.bincount(att.reader.doc_of_seqs(np.arange(att.reader.n_seqs)), minlength=att.reader.n_docs)
    for q in queries[:2]:  # warm up
        att.attribute(QuerySpec(q["prompt"], q["completion"]))
    per: dict[str, dict[str, dict[str, list]]] = {a: {arm: {} for arm in ARMS} for a in AGGREGATIONS}
    was = scoring.WHOLE_DOCUMENT_SUMS, attributor_module.SUM_DOCUMENTS
    try:
        for i, q in enumerate(queries):
            for agg in AGGREGATIONS:
                s, second = exact[agg][i], exact["cosine_sum"][i]
                top = served_ranking(s, second, every, 10)[0][:10]
                for arm in ARMS if i % 2 else ARMS[::-1]:  # interleaved
                    scoring.WHOLE_DOCUMENT_SUMS, attributor_module.SUM_DOCUMENTS = SETTINGS[arm]
                    t0 = time.perf_counter()
                    res = att.attribute(QuerySpec(q["prompt"], q["completion"]),
                                        QueryOptions(n_documents=10, aggregation=agg, include_untrained=True,
                                                     keep_opposed=True))
                    record_answer(per[agg][arm], res, row_of, s, top, time.perf_counter() - t0, windows)
    finally:
        scoring.WHOLE_DOCUMENT_SUMS, attributor_module.SUM_DOCUMENTS = was
    rng = np.random.default_rng(0)
    out: dict = {}
    for agg in AGGREGATIONS:
        out[agg] = {}
        for arm, m in per[agg].items():
            out[agg][arm] = answers_summary(m, rng)
        for a, b in (("whole", "earlier"), ("served", "whole")):
            diff = np.array(per[agg][a]["strict"]) - np.array(per[agg][b]["strict"])
            out[agg][f"overlap_diff_{a}_{b}_ci"] = ci(diff, rng)
    res = {"index": str(args.index), "tokens": att.reader.n_tokens, "documents": att.reader.n_docs,
           "documents_with_several_windows": round(float(np.mean(windows > 1)), 3),
           "queries": [q["id"] for q in queries], "seed": args.seed, "sum_documents": SETTINGS["served"][1],
           "exact_pass_seconds": round(exact_s, 1), **out}
    return finish(res, "attribution/sum_aggregations.py", argv, args.out)


if __name__ == "__main__":
    main()
