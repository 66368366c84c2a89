"""The fast path under ``cosine_match`` against exact mode, in three arms: each target token matched over
the candidate windows only (``earlier``: the earlier rule), over every window of a document
(``whole``: ``shards.WHOLE_DOCUMENT_MATCH``, every candidate's document), and the served setting
(``served``): first stages that also read each target token's own posting lists
(``attributor.MATCH_TARGET_TOKENS``), and every window of the documents shortlisted by their match over
the candidate windows (``attributor.MATCH_SHORTLIST_FIRST``).

``cosine_match`` scores a document by the mean over the query's target tokens of each one's best cosine
in the document. Exact mode takes that best over every window of the document. The earlier fast path
took it over the document's *candidate* windows (those the first stages found), which all re-ranked, so
a target token whose best match sits in another window was matched worse than exact mode matches it.
With the switch on, the shortlist scores every window of the candidates' documents from the codes, and
a shortlisted document re-ranks in the windows that hold one of its ``shards.MATCH_ROWS`` best rows per
target token by approximate match cosine. The first stages rank tokens against the whole query; a
document that matches every target token well need not hold one token close to the whole query, so the
served setting also takes each target token's ``MATCH_TARGET_TOKENS`` best tokens from its own lists.

Protocol: held-out queries at scale as in ``rerank_depth.py`` (48-token prompts, 16-token
continuations from documents of a file that is not indexed), exact ``cosine_match`` (and ``cosine_sum``,
which settles a near-tie at the cut as the served answer does) from one pass of the model, cached in
``--arrays``; the three arms interleaved query by query; strict overlap@10 with exact mode's answer, the
relative error of each returned document's score against its exact score (median over the returned
documents), seconds per query, windows re-ranked. 95% bootstrap intervals over queries, paired for the
difference.

    python -m bench.attribution.match_windows --index runs/scale_b/prefix_0001 \\
        --heldout runs/scale/corpus/part-006.jsonl --seed 18 --arrays runs/scale/match_windows_seed18.npz
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
from prism_tda.engine import QueryOptions, QuerySpec, shards
from prism_tda.engine import attributor as attributor_module

ARMS = ("earlier", "whole", "served")
# (shards.WHOLE_DOCUMENT_MATCH, attributor.MATCH_TARGET_TOKENS, attributor.MATCH_SHORTLIST_FIRST)
SETTINGS = {"earlier": (False, 0, False), "whole": (True, 0, False),
            "served": (True, attributor_module.MATCH_TARGET_TOKENS, attributor_module.MATCH_SHORTLIST_FIRST)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_draw(argv, __doc__ or "", 15, "bench/results/match_windows.json")
    att, queries, row_of = open_queries(args, args.queries)
    exact, exact_s = exact_document_arrays(att, queries, Path(args.arrays) if args.arrays else None,
                                           ("cosine_match", "cosine_sum"), match=True)
    every = np.ones(att.reader.n_docs, dtype=bool)
    windows = np.bincount(att.reader.doc_of_seqs(np.arange(att.reader.n_seqs)), minlength=att.reader.n_docs)
    opt = QueryOptions(n_documents=10, aggregation="cosine_match", include_untrained=True, keep_opposed=True)
    for q in queries[:2]:  # warm up
        att.attribute(QuerySpec(q["prompt"], q["completion"]), opt)
    per: dict[str, dict[str, list]] = {a: {} for a in ARMS}
    was = (shards.WHOLE_DOCUMENT_MATCH, attributor_module.MATCH_TARGET_TOKENS, attributor_module.MATCH_SHORTLIST_FIRST)
    scores_of = attributor_module.exact_scores
    rescored = [0]

    def counted(model, reader, G, pre, seqs, **kw):  # the windows the re-rank recomputes
        rescored[0] += len(seqs)
        return scores_of(model, reader, G, pre, seqs, **kw)

    attributor_module.exact_scores = counted
    try:
        for i, q in enumerate(queries):
            s = exact["cosine_match"][i]
            top = served_ranking(s, exact["cosine_sum"][i], every, 10)[0][:10]
            for arm in ARMS if i % 2 else ARMS[::-1]:  # interleaved
                shards.WHOLE_DOCUMENT_MATCH, attributor_module.MATCH_TARGET_TOKENS, attributor_module.MATCH_SHORTLIST_FIRST = \
                    SETTINGS[arm]
                rescored[0] = 0
                t0 = time.perf_counter()
                res = att.attribute(QuerySpec(q["prompt"], q["completion"]), opt)
                record_answer(per[arm], res, row_of, s, top, time.perf_counter() - t0, windows)
                per[arm].setdefault("windows_rescored", []).append(rescored[0])
    finally:
        shards.WHOLE_DOCUMENT_MATCH, attributor_module.MATCH_TARGET_TOKENS, attributor_module.MATCH_SHORTLIST_FIRST = was
        attributor_module.exact_scores = scores_of
    rng = np.random.default_rng(0)
    out: dict = {}
    for arm, m in per.items():
        out[arm] = answers_summary(m, rng)

    def diff(a: str, b: str) -> list:
        return ci(np.array(per[a]["strict"]) - np.array(per[b]["strict"]), rng)

    res = {"index": str(args.index), "tokens": att.reader.n_tokens, "documents": att.reader.n_docs,
           "documents_with_several_windows": round(float(np.mean(windows > 1)), 3),
           "queries": [q["id"] for q in queries], "seed": args.seed, "match_rows": shards.MATCH_ROWS,
           "match_target_tokens": SETTINGS["served"][1], "exact_pass_seconds": round(exact_s, 1), **out,
           "overlap_diff_whole_earlier_ci": diff("whole", "earlier"),
           "overlap_diff_served_whole_ci": diff("served", "whole"),
           "overlap_at_10_fast_vs_exact": out["served"]["overlap_at_10"][0]}
    return finish(res, "attribution/match_windows.py", argv, args.out)


if __name__ == "__main__":
    main()
