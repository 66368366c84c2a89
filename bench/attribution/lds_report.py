"""LDS with intervals, on a reported split disjoint from the split the settings were chosen on.

Reads ``run_eval.py``'s work folder (its queries, the retrained subsets' query losses and every
method's scores) and its results file, and writes ``bench/results/attribution.json``: that file's
content plus

- the split: the first ``--tune-subsets`` retrained subsets and half of the LDS queries (verbatim
  facts and held-out documents, halved per kind at random) choose PRISM's settings; the other
  subsets and queries are reported;
- PRISM's settings chosen on the tuning split, from ``levers.py``'s exact scores (run it first):
  curvature damping (global or per prototype), the model parts scored (prototypes, + the last
  block's output projections), the aggregation, and how many documents a query returns (the rest
  score 0, as a served answer); EK-FAC's damping chosen on the same split from ``run_eval.py``'s
  grid; TRAK, Bergson and BM25 run as configured in ``baselines.py``;
- every method's LDS on the reported split with a 95% bootstrap interval over queries and subsets
  (both resampled in each draw), and the paired difference PRISM - EK-FAC on the same draws;
- the fast path as served with the chosen settings (each query answered alone) when the engine serves
  them; the guards (planted facts, the memorised-facts corpus, near-ties at scale); and the speed-ups
  against EK-FAC on one protocol from ``scaling.py``'s results when present.

    python -m bench.attribution.lds_report
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy.stats import rankdata

from bench._common import finish, index_documents
from bench.attribution.run_eval import rank_of, summarise

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


def subset_losses(work: Path, n_subsets: int) -> np.ndarray:
    """(subsets, queries): each retrained subset's query losses, as ``run_eval.py`` wrote them."""
    return np.array([json.loads((work / "lds" / f"subset_{j:03d}.json").read_text())["loss"]
                     for j in range(n_subsets)])


def splits(work: Path, queries: list[dict], n_docs: int, n_subsets: int, tune_subsets: int,
           seed: int) -> tuple[Split, Split]:
    """The tuning and the reported split of a ``run_eval.py`` work folder: subsets by order (the first
    ``tune_subsets`` tune), LDS queries (verbatim facts and held-out documents) halved per kind at
    random; neither shares a subset or a query with the other."""
    masks = subset_masks(n_docs, n_subsets, seed)
    losses = subset_losses(work, n_subsets)
    rng = np.random.default_rng(12345)
    tune_q, report_q = [], []
    for kind in ("verbatim", "heldout"):
        idx = rng.permutation([i for i, q in enumerate(queries) if q["kind"] == kind])
        tune_q += idx[: len(idx) // 2].tolist()
        report_q += idx[len(idx) // 2 :].tolist()
    subsets = np.arange(n_subsets)
    return (Split(masks, losses, subsets[:tune_subsets], np.sort(tune_q)),
            Split(masks, losses, subsets[tune_subsets:], np.sort(report_q)))


def add_folder_args(ap) -> None:
    """The arguments naming a ``run_eval.py`` work folder's split, as ``folder_split`` takes them."""
    ap.add_argument("--work", default="runs/bench_lds_fresh")
    ap.add_argument("--subsets", type=int, default=16, help="retrained subsets in the work folder")
    ap.add_argument("--tune-subsets", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1, help="as given to run_eval.py (subset draws)")
    ap.add_argument("--split", choices=("tune", "all"), default="tune",
                    help="tune: lds_report.py's tuning split; all: every subset and LDS query of the folder "
                         "(a fresh folder, looked at once)")


def folder_split(work: Path, queries: list[dict], n_docs: int, n_subsets: int, tune_subsets: int, seed: int,
                 which: str) -> Split:
    """``tune``: the folder's tuning split (``splits``); ``all``: every subset and LDS query (verbatim facts
    and held-out documents) of a fresh folder that nothing was chosen on."""
    if which == "tune":
        return splits(work, queries, n_docs, n_subsets, tune_subsets, seed)[0]
    lds_q = np.array([i for i, q in enumerate(queries) if q["kind"] in ("verbatim", "heldout")])
    return Split(subset_masks(n_docs, n_subsets, seed), subset_losses(work, n_subsets), np.arange(n_subsets), lds_q)


def against(split: Split, ref: np.ndarray, n_boot: int, seed: int):
    """``row(S)``: LDS of the scores ``S`` on ``split`` with its 95% interval, and the paired difference
    against the reference scores ``ref`` (draws resample subsets and queries, the same for every S)."""
    draws = split.draws(n_boot, seed)
    ref_point, ref_b = split.lds(ref), split.boot(ref, draws)

    def row(S: np.ndarray) -> dict:
        b = split.boot(S, draws)
        point = split.lds(S)
        return {"lds": interval(point, b), "diff_vs_ekfac_all": interval(point - ref_point, b - ref_b)}
    return row


def interval(point: float, boots: np.ndarray) -> list[float]:
    return [round(point, 4), round(float(np.percentile(boots, 2.5)), 4), round(float(np.percentile(boots, 97.5)), 4)]


def on_best(values: np.ndarray, ranking: np.ndarray, k: int) -> np.ndarray:
    """``values`` of each query's ``k`` best documents by ``ranking``, 0 elsewhere."""
    out = np.zeros_like(values)
    best = np.argsort(-ranking, axis=1, kind="stable")[:, :k]
    np.put_along_axis(out, best, np.take_along_axis(values, best, 1), 1)
    return out


def top_only(S: np.ndarray, k: int | None) -> np.ndarray:
    """Each query's ``k`` best documents keep their scores, the others score 0 (None: all)."""
    return S if k is None or k >= S.shape[1] else on_best(S, S, k)


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


def index_scope(index: Path) -> str:
    """The damping scope an index serves, as ``levers.py`` names it (``global`` or ``per_prototype``)."""
    from prism_tda.engine.layout import read_manifest

    m = read_manifest(index)
    assert m is not None, index
    return "per_prototype" if m.config.damping_scope == "prototype" else "global"


def guards(out: dict, args: argparse.Namespace) -> None:
    """The keys that come from other results files, each with the file and date it came from: the
    memorised-facts corpus, the near-ties at scale, the speed-up against EK-FAC."""
    if Path(args.memorised).exists():
        mem = json.loads(Path(args.memorised).read_text())
        for k in ("canary_recall_at_10_verbatim_memorised", "candidate_recall_of_exact_top10_memorised"):
            out[k] = mem.get(k)
        out["memorised_corpus"] = {"file": args.memorised, "command": mem.get("command"), "date": mem.get("date")}
    if Path(args.near_ties).exists():
        nt = json.loads(Path(args.near_ties).read_text())
        out["near_tie_query_share"] = nt.get("near_tie_query_share")
        out["overlap_at_10_fast_vs_exact_scale"] = nt.get("overlap_at_10_fast_vs_exact")
        out["near_tie_corpus"] = {"file": args.near_ties, "tokens": nt.get("tokens"), "date": nt.get("date")}
    if Path(args.scaling).exists():
        sc = json.loads(Path(args.scaling).read_text())
        for k in ("speedup_vs_ekfac_single_query", "speedup_vs_ekfac_batched", "largest", "rss_growth_mb_largest",
                  "speedup_vs_ekfac_single_query_by_documents", "speedup_vs_ekfac_batched_by_documents"):
            if k in sc:
                out[k] = sc[k]
        prev = (out.get("speedup_source") or {}).get("previous")  # an earlier run kept beside it, if any
        out["speedup_source"] = {"file": args.scaling, "date": sc.get("date"), **({"previous": prev} if prev else {})}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/bench_lds_fresh")
    ap.add_argument("--results", default="bench/results/attribution_run48.json", help="run_eval.py's results")
    ap.add_argument("--scaling", default="bench/results/attribution_scaling_rerun.json")
    ap.add_argument("--subsets", type=int, default=48)
    ap.add_argument("--tune-subsets", type=int, default=16)
    ap.add_argument("--memorised", default="bench/results/attribution_memorised.json",
                    help="planted_full.py's results on the memorised-facts corpus (guards)")
    ap.add_argument("--near-ties", default="bench/results/near_ties_scale.json",
                    help="near_ties.py's results at >= 4M tokens (guard)")
    ap.add_argument("--returned", default="10,32,64,128,256,all", help="documents a query returns")
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1, help="as given to run_eval.py (subset draws)")
    ap.add_argument("--out", default="bench/results/attribution.json")
    ap.add_argument("--guards-only", action="store_true",
                    help="refresh only the keys taken from other results files (memorised corpus, near-ties, "
                         "speed-up) in --out, each stamped with its source's date; the LDS keys stay as they are")
    args = ap.parse_args(argv)
    if args.guards_only:
        res = json.loads(Path(args.out).read_text())
        guards(res, args)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
        return res
    work = Path(args.work)
    queries = json.loads((work / "queries.json").read_text())
    n_docs = np.load(work / "scores_prism_exact.npy").shape[1]
    tune, report = splits(work, queries, n_docs, args.subsets, args.tune_subsets, args.seed)
    tune_q, report_q = tune.queries, report.queries

    # PRISM's settings, chosen on the tuning split from the exact scores of levers.py (every setting of
    # damping and model parts it cached, under every aggregation) and how many documents a query returns
    returned: list[int | None] = [None if x == "all" else int(x) for x in args.returned.split(",")]
    specs = json.loads((work / "levers_settings.json").read_text())
    cands = {f"{name}/{a}": S for name in specs for a, S in np.load(work / f"levers_{name}.npz").items()}
    docs = index_documents(work / "index", ["doc_id", "external_id"])
    ext_to_doc = dict(zip(docs["external_id"], docs["doc_id"], strict=True))
    # the guard: each tuning verbatim fact's planted copy ranked first (DESIGN §2's reason for cosine_max)
    tune_verbatim = [i for i in tune_q if queries[i]["kind"] == "verbatim"]

    def verbatim_r1(S: np.ndarray) -> float:
        return float(np.mean([rank_of(S[i], {ext_to_doc[e] for e in queries[i]["planted"]}) == 1
                              for i in tune_verbatim]))

    table = []
    for key, S in cands.items():
        r1 = round(verbatim_r1(S), 4)  # the first document is the same whatever the number returned
        for k in returned:
            table.append({"setting": key.split("/")[0], "aggregation": key.split("/")[1], "returned": k or "all",
                          "lds_tune": round(tune.lds(top_only(S, k)), 4),
                          "lds_report": round(report.lds(top_only(S, k)), 4), "verbatim_r1_tune": r1})
    best = max(table, key=lambda r: r["lds_tune"])
    default = next(r for r in table if r["setting"] == "default" and r["aggregation"] == "cosine_max"
                   and r["returned"] == "all")
    k_best = None if best["returned"] == "all" else int(best["returned"])
    spec = specs[best["setting"]]
    print("chosen on the tuning split:", best, spec, flush=True)

    # EK-FAC's damping, chosen on the tuning split the same way (kronfluence's default and the grid)
    ek_cands = {"default_1e-8": work / "scores_ekfac.npy"} | {
        p.stem.removeprefix("scores_ekfac_damping_"): p for p in sorted(work.glob("scores_ekfac_damping_*.npy"))}
    ek_table = {name: round(tune.lds(np.load(p)), 4) for name, p in ek_cands.items() if p.exists()}
    ek_best = max(ek_table, key=lambda n: ek_table[n]) if ek_table else None

    # the reported split: every method, with intervals
    draws = report.draws(args.boot, args.seed + 1)
    methods: dict[str, np.ndarray] = {}
    # the fast path serves the index's damping scope (any multiplier) and the engine's aggregations, with
    # the prototypes alone: the best of those on the tuning split that keeps the guard is what it answers
    # with (the best setting overall, guard or not, is reported from its exact scores)
    att_scope = index_scope(work / "index")

    def servable(r: dict) -> bool:
        sp = specs[r["setting"]]
        return sp["damping"] == att_scope and not sp["parts"] and r["aggregation"] in AGGREGATIONS

    best_served = max((r for r in table if servable(r) and r["verbatim_r1_tune"] == 1.0), key=lambda r: r["lds_tune"])
    best_unguarded = max((r for r in table if servable(r)), key=lambda r: r["lds_tune"])
    k_served = None if best_served["returned"] == "all" else int(best_served["returned"])
    fast_k = k_served or n_docs
    served, served_s = served_scores(work, queries, n_docs, specs[best_served["setting"]]["c"],
                                     best_served["aggregation"], fast_k)
    methods["prism_fast"] = served
    methods["prism_exact_served_setting"] = top_only(
        cands[f"{best_served['setting']}/{best_served['aggregation']}"], k_served)
    methods["prism_exact"] = top_only(cands[f"{best['setting']}/{best['aggregation']}"], k_best)
    methods["prism_exact_default"] = cands["default/cosine_max"]
    methods["prism_fast_global_1.0_all_scored"] = np.load(work / "scores_prism_fast.npy")  # run_eval.py: the index it built
    for m in BASELINES:
        if (work / f"scores_{m}.npy").exists():
            methods[m] = np.load(work / f"scores_{m}.npy")
    if ek_best is not None:
        methods["ekfac_default_damping"] = methods["ekfac"]
        methods["ekfac"] = np.load(ek_cands[ek_best])
    boots = {m: report.boot(S, draws) for m, S in methods.items()}
    res = json.loads(Path(args.results).read_text()) if Path(args.results).exists() else {}
    out = {k: v for k, v in res.items() if not k.startswith("lds_")}
    out["lds_unsplit_all_subsets_and_queries"] = {k: v for k, v in res.items() if k.startswith("lds_")}
    for m, S in methods.items():
        point = report.lds(S)
        out[f"lds_{m}"] = round(point, 4)
        out[f"lds_{m}_ci"] = interval(point, boots[m])
    if "ekfac" in methods:
        for m in ("prism_fast", "prism_exact", "prism_exact_served_setting"):
            d = report.lds(methods[m]) - report.lds(methods["ekfac"])
            out[f"lds_diff_{m}_ekfac_ci"] = interval(d, boots[m] - boots["ekfac"])
        out["lds_diff_prism_ekfac_ci"] = out.get("lds_diff_prism_fast_ekfac_ci")
    if "lds_bergson" not in out:
        out["lds_bergson"] = None
        out["lds_bergson_reason"] = "no scores_bergson.npy: run run_eval.py with --methods ...,bergson"
    else:
        for m in ("prism_fast",):
            d = report.lds(methods[m]) - report.lds(methods["bergson"])
            out["lds_diff_prism_fast_bergson_ci"] = interval(d, boots[m] - boots["bergson"])
    out["prism_settings"] = {"chosen_on_tuning_split": best | {"spec": spec}, "default": default,
                             "served_chosen_on_tuning_split": best_served | {"spec": specs[best_served["setting"]]},
                             "served_unguarded_best_on_tuning_split": best_unguarded,
                             "served_index_damping_scope": att_scope,
                             "guard": "verbatim_r1_tune == 1.0 (the tuning split's verbatim facts, exact scores)",
                             "fast_returned_documents": fast_k,
                             "fast_seconds_per_query_median": served_s, "table": table}
    out["ekfac_settings"] = {"chosen_on_tuning_split": ek_best, "lds_tune": ek_table}
    # planted facts under the served setting chosen here (run_eval.py's canary keys are the index default's)
    for kind in ("verbatim", "paraphrase"):
        ranks = [rank_of(served[i], {ext_to_doc[e] for e in q["planted"]}) for i, q in enumerate(queries)
                 if q["kind"] == kind]
        out[f"canary_recall_at_10_{kind}_served_setting"] = summarise(ranks)["recall_at_10"]
    guards(out, args)
    out["lds_split"] = {"subsets_tune": args.tune_subsets, "subsets_report": args.subsets - args.tune_subsets,
                        "queries_tune": len(tune_q), "queries_report": len(report_q),
                        "query_kinds": ["verbatim", "heldout"], "bootstrap_draws": args.boot,
                        "interval": "95% percentile bootstrap; each draw resamples subsets and queries"}
    out.pop("speedup_vs_ekfac_per_query", None)
    # the fresh splits' reports written into the same file by influence_lds.py --merge-into stay
    prev = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    out.update({k: v for k, v in prev.items() if k.startswith(("fresh_split_influence", "fresh_splits_influence"))})
    return finish(out, "attribution/lds_report.py", argv, args.out)


if __name__ == "__main__":
    main()
