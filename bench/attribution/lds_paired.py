"""LDS per query with bootstrap intervals, and paired differences between score files of the same
evaluation (``run_eval.py``'s work folder): the fast path against the exact path, a fast path that
scores every candidate exactly, and an earlier layout's fast scores when given. Two protocols: every
document the fast path scored keeps its score (the candidates' approximate scores included), and
"served": only the documents a query returns (its top ``--returned``, exactly re-ranked) score,
the rest 0; the exact path restricted to its own top ``--returned`` is the like-for-like reference.

    python -m bench.attribution.lds_paired [--previous DIR_WITH_OLD_scores_prism_*.npy]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench.attribution.lds_report import top_only
from bench.attribution.run_eval import spearman
from prism_tda.engine import Attributor, QueryOptions, QuerySpec


def interval(x: np.ndarray, idx: np.ndarray) -> list[float]:
    """[mean, 2.5%, 97.5%] of the mean of ``x`` over bootstrap resamples ``idx``."""
    b = x[idx].mean(1)
    return [round(float(x.mean()), 3), round(float(np.percentile(b, 2.5)), 3), round(float(np.percentile(b, 97.5)), 3)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work", default="runs/bench_lds")
    ap.add_argument("--previous", help="folder with an earlier run's scores_prism_fast.npy and scores_prism_exact.npy")
    ap.add_argument("--subsets", type=int, default=32)
    ap.add_argument("--returned", type=int, default=32, help="documents a served query returns")
    ap.add_argument("--out", default="bench/results/attribution_lds_paired.json")
    args = ap.parse_args()
    work = Path(args.work)
    queries = json.loads((work / "queries.json").read_text())
    n_docs = np.load(work / "scores_prism_exact.npy").shape[1]
    rng = np.random.default_rng(0)  # the same draws as run_eval.py
    masks, losses = [], []
    for j in range(args.subsets):
        mask = np.zeros(n_docs, bool)
        mask[rng.choice(n_docs, n_docs // 2, replace=False)] = True
        masks.append(mask)
        losses.append(json.loads((work / "lds" / f"subset_{j:03d}.json").read_text())["loss"])
    M, L = np.stack(masks).astype(float), np.asarray(losses)
    sel = [i for i, q in enumerate(queries) if q["kind"] in ("verbatim", "heldout")]  # as run_eval's "lds"

    def per_query(S: np.ndarray) -> np.ndarray:
        pred = M @ S.T.astype(float)
        return np.array([spearman(pred[:, i], -L[:, i]) for i in sel])

    att = Attributor.open(work / "index")
    t0 = time.perf_counter()
    every = np.stack([att.document_scores(att.encode(QuerySpec(q["prompt"], q["completion"])), "fast", 256,
                                          exact_rerank=100_000)["cosine_max"] for q in queries])
    print("every candidate re-ranked: s/query", round((time.perf_counter() - t0) / len(queries), 3))
    # what a served query returns: its n documents (here the default shortlist, 32), exactly scored;
    # every other document scores 0
    k = args.returned
    t0 = time.perf_counter()
    served = np.zeros_like(every)
    for i, q in enumerate(queries):
        a = att.attribute(QuerySpec(q["prompt"], q["completion"]), QueryOptions(n_documents=k, exact_rerank=k))
        for d in a.documents:
            served[i, d.doc_id] = d.score
    print("served:", k, "documents, s/query", round((time.perf_counter() - t0) / len(queries), 3))
    fast, exact = np.load(work / "scores_prism_fast.npy"), np.load(work / "scores_prism_exact.npy")
    v = {"fast": per_query(fast), "exact": per_query(exact), "fast_every_candidate_reranked": per_query(every),
         f"fast_served_top{k}": per_query(served), f"exact_top{k}": per_query(top_only(exact, k))}
    idx = np.random.default_rng(1).integers(0, len(sel), (2000, len(sel)))
    out = {kk: interval(x, idx) for kk, x in v.items()}
    out["fast_minus_exact"] = interval(v["fast"] - v["exact"], idx)
    out[f"fast_served_top{k}_minus_exact_top{k}"] = interval(v[f"fast_served_top{k}"] - v[f"exact_top{k}"], idx)
    if args.previous:
        prev = np.load(Path(args.previous) / "scores_prism_fast.npy")
        old = per_query(prev)
        out["previous_fast"] = interval(old, idx)
        out["previous_exact"] = interval(per_query(np.load(Path(args.previous) / "scores_prism_exact.npy")), idx)
        out["fast_minus_previous_fast"] = interval(v["fast"] - old, idx)
        old_top = per_query(top_only(prev, k))
        out[f"previous_fast_top{k}"] = interval(old_top, idx)
        out[f"fast_served_top{k}_minus_previous_fast_top{k}"] = interval(v[f"fast_served_top{k}"] - old_top, idx)
    out["n_queries"] = len(sel)
    out["subsets"] = args.subsets
    out["command"] = "python -m bench.attribution.lds_paired " + " ".join(sys.argv[1:])
    print(json.dumps(out))
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
