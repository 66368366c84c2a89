"""Agreement of the served fast path with the exact path, and its cost, by first-stage setting.

Queries are continuations of training documents (a prompt of ``--prompt-tokens`` tokens, the next
``--completion-tokens`` as completion) on an existing index; for each setting of the fast path's
token-level first stage (``proto_candidates`` / ``row_budget``; 0 = FAISS candidates only) it
reports the top-10 overlap with the exact path and the time per query.

    python -m bench.attribution.fast_vs_exact --index runs/demo/index

Writes ``bench/results/fast_vs_exact.json``.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench._common import finish, index_documents
from prism_tda.engine import Attributor, FirstStages, QueryOptions, QuerySpec

SETTINGS = [(0, 0), (8, 1 << 15), (8, 1 << 16), (16, 1 << 16), (8, 1 << 18)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default="runs/demo/index")
    ap.add_argument("--queries", type=int, default=40)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--completion-tokens", type=int, default=16)
    ap.add_argument("--candidates", type=int, default=None,
                    help="FAISS candidates (n_candidates; default: the served default, by the query kind)")
    ap.add_argument("--out", default="bench/results/fast_vs_exact.json")
    args = ap.parse_args(argv)
    att = Attributor.open(args.index)
    texts = index_documents(args.index, ["text"])["text"]
    rng = np.random.default_rng(0)
    queries = []
    need = args.prompt_tokens + args.completion_tokens
    for i in rng.permutation(len(texts)):
        ids = att.tokenizer.encode(texts[i]).ids
        if len(ids) >= need:
            queries.append((att.tokenizer.decode(ids[: args.prompt_tokens]),
                            att.tokenizer.decode(ids[args.prompt_tokens : need])))
        if len(queries) == args.queries:
            break
    exact, t_exact = [], []
    for p, c in queries:
        r = att.attribute(QuerySpec(p, c), QueryOptions(mode="exact"))
        exact.append({d.doc_id for d in r.documents})
        t_exact.append(r.timings_ms.total / 1e3)
    rows = []
    for pc, budget in SETTINGS:
        att.stages = FirstStages(proto_candidates=pc, row_budget=budget)
        ov, ts = [], []
        for (p, c), e in zip(queries, exact, strict=True):
            r = att.attribute(QuerySpec(p, c), QueryOptions(n_candidates=args.candidates))
            ts.append(r.timings_ms.total / 1e3)
            ov.append(len({d.doc_id for d in r.documents} & e) / max(len(e), 1))
        rows.append({"proto_candidates": pc, "row_budget": budget, "overlap_at_10": float(np.mean(ov)),
                     "seconds_per_query_median": float(np.median(ts)), "seconds_per_query_p90": float(np.percentile(ts, 90))})
        print(rows[-1], flush=True)
    res = {"rows": rows, "seconds_per_query_exact_median": float(np.median(t_exact)), "queries": len(queries),
           "index_documents": len(texts)}
    return finish(res, "attribution/fast_vs_exact.py", argv, args.out)


if __name__ == "__main__":
    main()
