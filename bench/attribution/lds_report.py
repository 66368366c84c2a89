"""LDS with intervals, on a reported split disjoint from the split the settings were chosen on.

Reads ``run_eval.py``'s work folder (its queries, the retrained subsets' query losses and every
method's scores) and its results file, and writes ``bench/results/attribution.json``: that file's
content plus

- the split: the first ``--tune-subsets`` retrained subsets and half of the LDS queries (verbatim
  facts and held-out documents, halved per kind at random) choose PRISM's settings; the other
  subsets and queries are reported;
- PRISM's settings chosen on the tuning split: curvature damping (an exact pass per value), the
  aggregation (best token or sum, cosine or raw, or each target token matched apart) and how many
  documents a query returns (the rest score 0, as a served answer); EK-FAC, TRAK, Bergson and BM25
  run as configured in ``baselines.py``;
- every method's LDS on the reported split with a 95% bootstrap interval over queries and subsets
  (both resampled in each draw), and the paired difference PRISM - EK-FAC on the same draws;
- the fast path as served with the chosen settings (each query answered alone), and the speed-ups
  against EK-FAC on one protocol from ``scaling.py``'s results when present.

    python -m bench.attribution.lds_report
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from scipy.stats import rankdata

from bench._common import finish

HERE = Path(__file__).resolve().parent

AGGREGATIONS = ("cosine_max", "cosine_sum", "raw_max", "raw_sum", "cosine_match")
BASELINES = ("ekfac", "trak", "bergson", "bm25")


def subset_masks(n_docs: int, n_subsets: int, seed: int) -> np.ndarray:
    """The retrained subsets' document masks, drawn as ``run_eval.py`` draws them."""
    rng = np.random.default_rng(seed)
    masks = np.zeros((n_subsets, n_docs), dtype=bool)
    for j in range(n_subsets):
        masks[j, rng.choice(n_docs, n_docs // 2, replace=False)] = True
    return masks


def spearman_cols(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman correlation of each column of ``a`` with the same column of ``b`` (ties averaged)."""
    ra, rb = rankdata(a, axis=0), rankdata(b, axis=0)
    ra -= ra.mean(0)
    rb -= rb.mean(0)
    den = np.sqrt((ra**2).sum(0) * (rb**2).sum(0))
    return np.where(den > 0, (ra * rb).sum(0) / np.where(den > 0, den, 1.0), 0.0)


class Split:
    """LDS of score matrices (queries x documents) on a set of subsets and queries."""

    def __init__(self, masks: np.ndarray, losses: np.ndarray, subsets: np.ndarray, queries: np.ndarray) -> None:
        self.M = masks[subsets].astype(np.float64)  # (S, D)
        self.L = losses[np.ix_(subsets, queries)]  # (S, Q)
        self.queries = queries

    def pred(self, scores: np.ndarray) -> np.ndarray:
        return self.M @ scores[self.queries].T.astype(np.float64)  # (S, Q)

    def lds(self, scores: np.ndarray) -> float:
        return float(spearman_cols(self.pred(scores), -self.L).mean())

    def draws(self, n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(seed)
        S, Q = self.L.shape
        return [(rng.integers(0, S, S), rng.integers(0, Q, Q)) for _ in range(n)]

    def boot(self, scores: np.ndarray, draws) -> np.ndarray:
        P = self.pred(scores)
        return np.array([spearman_cols(P[np.ix_(s, q)], -self.L[np.ix_(s, q)]).mean() for s, q in draws])


def interval(point: float, boots: np.ndarray) -> list[float]:
    return [round(point, 4), round(float(np.percentile(boots, 2.5)), 4), round(float(np.percentile(boots, 97.5)), 4)]


def top_only(S: np.ndarray, k: int | None) -> np.ndarray:
    """Each query's ``k`` best documents keep their scores, the others score 0 (None: all)."""
    if k is None or k >= S.shape[1]:
        return S
    out = np.zeros_like(S)
    best = np.argsort(-S, axis=1, kind="stable")[:, :k]
    np.put_along_axis(out, best, np.take_along_axis(S, best, 1), 1)
    return out


def exact_scores_at(work: Path, queries: list[dict], damping: float) -> dict[str, np.ndarray]:
    """Every aggregation's exact scores at one damping (cached in the work folder)."""
    path = work / f"scores_prism_exact_damping_{damping:g}.npz"
    if path.exists():
        z = np.load(path)
        if all(a in z for a in AGGREGATIONS):
            return {a: z[a] for a in AGGREGATIONS}
    from prism_tda.engine import Attributor, QuerySpec

    att = Attributor.open(work / "index")
    enc = [att.encode(QuerySpec(q["prompt"], q["completion"])) for q in queries]
    t0 = time.perf_counter()
    res = att.exact_document_scores(enc, damping=damping, match=True)
    out = {a: np.stack([r[a] for r in res]).astype(np.float32) for a in AGGREGATIONS}
    np.savez(path, **out)
    print(f"[damping {damping:g}] exact pass {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def served_scores(work: Path, queries: list[dict], n_docs: int, damping: float, aggregation: str,
                  k: int) -> tuple[np.ndarray, float]:
    """The fast path as served, one query at a time: the returned documents' scores, 0 elsewhere."""
    from prism_tda.engine import Attributor, QueryOptions, QuerySpec

    att = Attributor.open(work / "index")
    S = np.zeros((len(queries), n_docs), dtype=np.float32)
    ts = []
    for i, q in enumerate(queries):
        a = att.attribute(QuerySpec(q["prompt"], q["completion"]),
                          QueryOptions(n_documents=k, exact_rerank=max(32, k), damping=damping,
                                       aggregation=aggregation))  # type: ignore[arg-type]
        ts.append(a.timings_ms.total / 1e3)
        for d in a.documents:
            S[i, d.doc_id] = d.score
    return S, float(np.median(ts))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/bench_lds")
    ap.add_argument("--results", default="bench/results/attribution_run48.json", help="run_eval.py's results")
    ap.add_argument("--scaling", default="bench/results/attribution_scaling.json")
    ap.add_argument("--subsets", type=int, default=48)
    ap.add_argument("--tune-subsets", type=int, default=16)
    ap.add_argument("--dampings", default="0.1,0.3,1,3,10")
    ap.add_argument("--returned", default="10,32,64,128,256,all", help="documents a query returns")
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/attribution.json")
    args = ap.parse_args(argv)
    work = Path(args.work)
    queries = json.loads((work / "queries.json").read_text())
    n_docs = np.load(work / "scores_prism_exact.npy").shape[1]
    masks = subset_masks(n_docs, args.subsets, args.seed)
    losses = np.array([json.loads((work / "lds" / f"subset_{j:03d}.json").read_text())["loss"]
                       for j in range(args.subsets)])

    # the split: subsets by order, LDS queries halved per kind at random
    rng = np.random.default_rng(12345)
    tune_q, report_q = [], []
    for kind in ("verbatim", "heldout"):
        idx = rng.permutation([i for i, q in enumerate(queries) if q["kind"] == kind])
        tune_q += idx[: len(idx) // 2].tolist()
        report_q += idx[len(idx) // 2 :].tolist()
    subsets = np.arange(args.subsets)
    tune = Split(masks, losses, subsets[: args.tune_subsets], np.sort(tune_q))
    report = Split(masks, losses, subsets[args.tune_subsets :], np.sort(report_q))

    # PRISM's settings, chosen on the tuning split from its exact scores
    dampings = [float(x) for x in args.dampings.split(",")]
    returned: list[int | None] = [None if x == "all" else int(x) for x in args.returned.split(",")]
    table = []
    for dmp in dampings:
        ex = exact_scores_at(work, queries, dmp)
        for agg in AGGREGATIONS:
            for k in returned:
                table.append({"damping": dmp, "aggregation": agg, "returned": k or "all",
                              "lds_tune": round(tune.lds(top_only(ex[agg], k)), 4),
                              "lds_report": round(report.lds(top_only(ex[agg], k)), 4)})
    best = max(table, key=lambda r: r["lds_tune"])
    default = next(r for r in table if r["damping"] == 1.0 and r["aggregation"] == "cosine_max"
                   and r["returned"] == "all")
    k_best = None if best["returned"] == "all" else int(best["returned"])
    print("chosen on the tuning split:", best, flush=True)

    # the reported split: every method, with intervals
    draws = report.draws(args.boot, args.seed + 1)
    methods: dict[str, np.ndarray] = {}
    fast_k = k_best or n_docs
    served, served_s = served_scores(work, queries, n_docs, best["damping"], best["aggregation"], fast_k)
    methods["prism_fast"] = served
    methods["prism_exact"] = top_only(exact_scores_at(work, queries, best["damping"])[best["aggregation"]], k_best)
    methods["prism_exact_default"] = exact_scores_at(work, queries, 1.0)["cosine_max"]
    methods["prism_fast_default_all_scored"] = np.load(work / "scores_prism_fast.npy")
    for m in BASELINES:
        if (work / f"scores_{m}.npy").exists():
            methods[m] = np.load(work / f"scores_{m}.npy")
    boots = {m: report.boot(S, draws) for m, S in methods.items()}
    res = json.loads(Path(args.results).read_text()) if Path(args.results).exists() else {}
    out = {k: v for k, v in res.items() if not k.startswith("lds_")}
    out["lds_unsplit_all_subsets_and_queries"] = {k: v for k, v in res.items() if k.startswith("lds_")}
    for m, S in methods.items():
        point = report.lds(S)
        out[f"lds_{m}"] = round(point, 4)
        out[f"lds_{m}_ci"] = interval(point, boots[m])
    if "ekfac" in methods:
        for m in ("prism_fast", "prism_exact"):
            d = report.lds(methods[m]) - report.lds(methods["ekfac"])
            out[f"lds_diff_{m.replace('prism_', 'prism_')}_ekfac_ci"] = interval(d, boots[m] - boots["ekfac"])
        out["lds_diff_prism_ekfac_ci"] = out["lds_diff_prism_fast_ekfac_ci"]
    if "lds_bergson" not in out:
        out["lds_bergson"] = None
        out["lds_bergson_reason"] = "no scores_bergson.npy: run run_eval.py with --methods ...,bergson"
    else:
        for m in ("prism_fast",):
            d = report.lds(methods[m]) - report.lds(methods["bergson"])
            out["lds_diff_prism_fast_bergson_ci"] = interval(d, boots[m] - boots["bergson"])
    out["prism_settings"] = {"chosen_on_tuning_split": best, "default": default,
                             "fast_returned_documents": fast_k, "fast_seconds_per_query_median": served_s,
                             "table": table}
    out["lds_split"] = {"subsets_tune": args.tune_subsets, "subsets_report": args.subsets - args.tune_subsets,
                        "queries_tune": len(tune_q), "queries_report": len(report_q),
                        "query_kinds": ["verbatim", "heldout"], "bootstrap_draws": args.boot,
                        "interval": "95% percentile bootstrap; each draw resamples subsets and queries"}
    if Path(args.scaling).exists():
        sc = json.loads(Path(args.scaling).read_text())
        for k in ("speedup_vs_ekfac_single_query", "speedup_vs_ekfac_batched", "largest", "rss_growth_mb_largest",
                  "speedup_vs_ekfac_single_query_by_documents", "speedup_vs_ekfac_batched_by_documents"):
            if k in sc:
                out[k] = sc[k]
    out.pop("speedup_vs_ekfac_per_query", None)
    return finish(out, "attribution/lds_report.py", argv, args.out)


if __name__ == "__main__":
    main()
