"""The fast path under ``cosine_match`` against exact mode, in three arms: each target token matched over
the candidate windows only (``earlier``: the earlier rule), over every window of a document
(``whole``: ``shards.WHOLE_DOCUMENT_MATCH``, every candidate's document), and the served setting
(``served``): first stages that also read each target token's own posting lists
(``attributor.MATCH_TARGET_TOKENS``), and every window of the documents shortlisted by their match over
the candidate windows (``shards.MATCH_SHORTLIST_FIRST``).

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
``--arrays``; the two rules interleaved query by query; strict overlap@10 with exact mode's answer, the
relative error of each returned document's score against its exact score (median over the returned
documents), seconds per query, windows re-ranked. 95% bootstrap intervals over queries, paired for the
difference.

    python -m bench.attribution.match_windows --index runs/scale_b/prefix_0001 \\
        --heldout runs/scale/corpus/part-006.jsonl --seed 15 --arrays runs/scale/match_windows_seed15.npz
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench._common import finish, served_ranking
from bench.attribution.rerank_depth import cached_arrays, ci, open_queries, parse_draw
from prism_tda.engine import Attributor, QueryOptions, QuerySpec, shards
from prism_tda.engine import attributor as attributor_module

ARMS = ("earlier", "whole", "served")
# (shards.WHOLE_DOCUMENT_MATCH, attributor.MATCH_TARGET_TOKENS, shards.MATCH_SHORTLIST_FIRST)
SETTINGS = {"earlier": (False, 0, False), "whole": (True, 0, False),
            "served": (True, attributor_module.MATCH_TARGET_TOKENS, shards.MATCH_SHORTLIST_FIRST)}


def exact_match(att: Attributor, queries: list[dict], arrays: Path | None) -> tuple[dict[str, np.ndarray], float]:
    """(queries, documents) exact ``cosine_match`` and ``cosine_sum`` scores, and the seconds of their one
    pass; from ``arrays`` when it holds these queries."""
    def compute() -> dict[str, np.ndarray]:
        encoded = [att.encode(QuerySpec(q["prompt"], q["completion"])) for q in queries]
        scores = att.exact_document_scores(encoded, match=True, progress=True)
        return {k: np.stack([s[k] for s in scores]) for k in ("cosine_match", "cosine_sum")}

    return cached_arrays(arrays, queries, compute)


def main(argv: list[str] | None = None) -> dict:
    args = parse_draw(argv, __doc__ or "", 15, "bench/results/match_windows.json")
    att, queries, row_of = open_queries(args, args.queries)
    exact, exact_s = exact_match(att, queries, Path(args.arrays) if args.arrays else None)
    every = np.ones(att.reader.n_docs, dtype=bool)
    windows = np.bincount(att.reader.doc_of_seqs(np.arange(att.reader.n_seqs)), minlength=att.reader.n_docs)
    opt = QueryOptions(n_documents=10, aggregation="cosine_match", include_untrained=True, keep_opposed=True)
    for q in queries[:2]:  # warm up
        att.attribute(QuerySpec(q["prompt"], q["completion"]), opt)
    per: dict[str, dict[str, list]] = {a: {} for a in ARMS}
    was = (shards.WHOLE_DOCUMENT_MATCH, attributor_module.MATCH_TARGET_TOKENS, shards.MATCH_SHORTLIST_FIRST)
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
                shards.WHOLE_DOCUMENT_MATCH, attributor_module.MATCH_TARGET_TOKENS, shards.MATCH_SHORTLIST_FIRST = \
                    SETTINGS[arm]
                rescored[0] = 0
                t0 = time.perf_counter()
                res = att.attribute(QuerySpec(q["prompt"], q["completion"]), opt)
                dt = time.perf_counter() - t0
                got = [row_of[d.external_id] for d in res.documents]
                err = [abs(d.score / s[r] - 1.0) for d, r in zip(res.documents, got, strict=True) if s[r] != 0]
                m = per[arm]
                m.setdefault("strict", []).append(len(set(got) & set(top.tolist())) / max(len(top), 1))
                m.setdefault("score_error", []).append(float(np.median(err)) if err else 0.0)
                m.setdefault("score_error_max", []).append(float(np.max(err)) if err else 0.0)
                m.setdefault("seconds", []).append(dt)
                m.setdefault("reranked", []).append(res.documents_reranked)
                m.setdefault("windows_rescored", []).append(rescored[0])
                m.setdefault("several_windows", []).append(float(np.mean(windows[got] > 1)) if got else 0.0)
    finally:
        shards.WHOLE_DOCUMENT_MATCH, attributor_module.MATCH_TARGET_TOKENS, shards.MATCH_SHORTLIST_FIRST = was
        attributor_module.exact_scores = scores_of
    rng = np.random.default_rng(0)
    out: dict = {}
    for arm, m in per.items():
        out[arm] = {"overlap_at_10": ci(np.array(m["strict"]), rng),
                    "score_relative_error_median": ci(np.array(m["score_error"]), rng),
                    "score_relative_error_max": round(float(np.max(m["score_error_max"])), 4),
                    "seconds_median": round(float(np.median(m["seconds"])), 3),
                    "documents_reranked_mean": round(float(np.mean(m["reranked"])), 1),
                    "windows_rescored_mean": round(float(np.mean(m["windows_rescored"])), 1),
                    "returned_with_several_windows": round(float(np.mean(m["several_windows"])), 3),
                    "per_query_overlap": [round(x, 2) for x in m["strict"]]}
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
