"""LDS of the served answer with its documents' full-model influence (the query option ``influence``).

``shortlist_influence.py`` showed that PRISM's best 64 documents hold EK-FAC's LDS when each keeps
EK-FAC's value; the engine now computes such a value itself for the documents it returns
(``engine/influence.py``: EK-FAC over every linear layer, fitted beside the index). This measures it
as served, one query at a time:

- ``prism_fast``: the fast path at the served setting (the returned documents' scores, 0 elsewhere);
- ``prism_fast_influence``: the answer with ``influence``: the first ``k`` by score less those whose
  full-model influence opposes the output, each with its value (damping chosen on the tuning split
  from ``--dampings``; with ``--split all`` give the one chosen);
- ``ekfac_all``: kronfluence's EK-FAC scores of every document (``run_eval.py``'s, its damping chosen
  on the tuning split: kronfluence's default);
- ``ekfac_on_served``: kronfluence's values of the same returned documents (is the engine's value as
  good as the library's?); ``ekfac_on_score_top``: kronfluence's values of the first ``k`` by score,
  none left out (what leaving out the opposed documents changes);

- ``values``: the fast path's answer at ``--value-k`` documents (64, the protocol of ``lds_prism_fast``)
  scored two ways: by each document's score (``prism_fast``) and by its value (``prism_fast_value``: its
  tokens' raw prototype-space influences summed over every token of it, as each answer carries it);
  ``--values-only`` measures only these;

with paired bootstrap differences against ``ekfac_all``, the agreement of the engine's values with
kronfluence's on the returned documents (Pearson and Spearman per query), the guard (the verbatim
facts' planted copy first: the ranking is the score's, so it is ``prism_fast``'s), and the seconds
per query with and without ``influence``.

    python -m bench.attribution.influence_lds --work runs/bench_lds_fresh --subsets 16 --split tune
    python -m bench.attribution.influence_lds --work runs/bench_lds_seed3 --subsets 32 --split all \\
        --seed 3 --dampings 1e-4 --out bench/results/attribution_influence_seed3.json

``--baselines-only`` adds the rows of the baselines scored since that run (``run_eval.py --methods
...,trak,bergson`` on the same folder) to its results file ``--out`` and the ``--merge-key`` block, on
the same bootstrap draws, without asking the engine anything; it first recomputes ``ekfac_all`` and
stops unless it equals the file's (the same split and draws).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from bench._common import finish, index_documents
from bench.attribution.lds_report import Split, add_folder_args, against, folder_split, on_best
from bench.attribution.run_eval import rank_of


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_folder_args(ap)
    ap.add_argument("--k", type=int, default=64, help="documents a query returns (the served setting)")
    ap.add_argument("--served-damping", type=float, default=0.01,
                    help="the fast path's curvature damping (the served setting chosen on the tuning split)")
    ap.add_argument("--dampings", default="1e-8,1e-6,1e-4,1e-2,1e-1",
                    help="influence damping(s), x each layer's mean eigenvalue (the served one, the engine's "
                         "default, is always measured and timed)")
    ap.add_argument("--value-k", type=int, default=64,
                    help="documents returned for the value rows (the fast path's LDS protocol: 64)")
    ap.add_argument("--values-only", action="store_true",
                    help="only the fast path without influence at --value-k: its scores and its documents' values")
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--out", default="bench/results/attribution_influence_tune.json")
    ap.add_argument("--merge-into", help="also write the report's LDS keys into this results file "
                                         "(bench/results/attribution.json) under --merge-key")
    ap.add_argument("--merge-key", default="fresh_split_influence",
                    help="the block of the results file to write (one per fresh split: "
                         "fresh_split_influence is seed 4's, fresh_split_influence_seed6 seed 6's)")
    ap.add_argument("--baselines-only", action="store_true",
                    help="only add the rows of the baselines' score files (trak, bergson, bm25) to --out and "
                         "the --merge-key block of --merge-into, on the same draws")
    args = ap.parse_args(argv)
    if args.baselines_only:
        return add_baselines(args)
    import torch

    from prism_tda.engine import Attributor, QueryOptions, QuerySpec
    from prism_tda.engine import layout as store
    from prism_tda.engine.influence import DEFAULT_DAMPING, fit_index

    torch.set_num_threads(2)
    work, queries, E, split = reference(args)
    n_docs = E.shape[1]
    dampings = sorted({float(x) for x in args.dampings.split(",")} | {DEFAULT_DAMPING})
    fitted = None
    if not (work / "index" / store.EKFAC).exists():
        fitted = fit_index(work / "index", progress=True)
    att = Attributor.open(work / "index")
    S = np.zeros((len(queries), n_docs))
    V = {c: np.zeros((len(queries), n_docs)) for c in dampings}
    K = np.zeros((len(queries), n_docs), dtype=bool)  # the documents served with influence
    t_plain, t_inf, agree, opposed, t_val = [], [], [], [], []
    opt = dict(n_documents=args.k, exact_rerank=max(32, args.k), damping=args.served_damping)
    # the value rows: the fast path's answer at --value-k, by score and by its documents' values
    S_k, V_k = np.zeros((len(queries), n_docs)), np.zeros((len(queries), n_docs))
    opt_k = dict(n_documents=args.value_k, exact_rerank=max(32, args.value_k), damping=args.served_damping)
    for n, i in enumerate(split.queries):
        q = queries[i]
        spec = QuerySpec(q["prompt"], q["completion"])
        t0 = time.perf_counter()
        at_k = att.attribute(spec, QueryOptions(**opt_k))
        t_val.append(time.perf_counter() - t0)
        for d in at_k.documents:
            S_k[i, d.doc_id], V_k[i, d.doc_id] = d.score, d.value
        if args.values_only:
            continue
        t0 = time.perf_counter()
        plain = att.attribute(spec, QueryOptions(**opt, keep_opposed=True))  # the first k by score
        t_plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        served = att.attribute(spec, QueryOptions(**opt, influence=True))  # as served: ranking + values
        t_inf.append(time.perf_counter() - t0)
        docs = np.array([d.doc_id for d in served.documents], np.int64)
        kept = set(docs.tolist())  # the score's order, less the documents the whole model says oppose
        assert docs.tolist() == [d.doc_id for d in plain.documents if d.doc_id in kept]
        opposed.append(served.opposed_by_influence / max(1, len(plain.documents)))
        for d in plain.documents:
            S[i, d.doc_id] = d.score
        K[i, docs] = True
        V[DEFAULT_DAMPING][i, docs] = [d.influence for d in served.documents]
        others = [c for c in dampings if c != DEFAULT_DAMPING]
        if others:
            for c, r in zip(others, att.influence(att.encode(spec), docs, others), strict=True):
                V[c][i, docs] = r
        if len(docs) > 2:
            v, e = V[DEFAULT_DAMPING][i, docs], E[i, docs]
            agree.append((float(np.corrcoef(v, e)[0, 1]), float(spearmanr(v, e).correlation)))
        if n % 20 == 0:
            print(f"{n}/{len(split.queries)} queries, {np.median(t_inf):.3f} s with influence", flush=True)
    row = against(split, E, args.boot, args.seed + 11)
    values = {"returned": args.value_k, "prism_fast": row(S_k), "prism_fast_value": row(V_k),
              "seconds_per_query_median": round(float(np.median(t_val)), 4)}
    if args.values_only:
        res_v = {"work": str(work), "split": args.split, "documents": n_docs, "subsets": len(split.L),
                 "queries": len(split.queries), "served_damping": args.served_damping, "ekfac_all": row(E),
                 "values": values, **baseline_rows(work, row)}
        return finish(res_v, "attribution/influence_lds.py", argv, args.out)

    res: dict = {"work": str(work), "split": args.split, "documents": n_docs, "values": values, "subsets": len(split.L),
                 "queries": len(split.queries), "returned": args.k, "served_damping": args.served_damping,
                 "influence_damping_served": DEFAULT_DAMPING, "influence_fit": fitted,
                 "ekfac_all": row(E), "prism_fast": row(S),
                 "prism_fast_influence": {f"{c:g}": row(V[c]) for c in dampings},
                 "ekfac_on_served": row(np.where(K, E, 0.0)),
                 "ekfac_on_score_top": row(on_best(E, S, args.k)),
                 "opposed_share_mean": round(float(np.mean(opposed)), 4),
                 **baseline_rows(work, row),
                 "agreement_with_kronfluence_on_returned": {
                     "pearson_median": round(float(np.median([a for a, _ in agree])), 4),
                     "spearman_median": round(float(np.median([b for _, b in agree])), 4)},
                 "seconds_per_query_median": {"fast": round(float(np.median(t_plain)), 4),
                                              "fast_with_influence": round(float(np.median(t_inf)), 4)}}
    docs_t = index_documents(work / "index", ["doc_id", "external_id"])
    ext_to_doc = dict(zip(docs_t["external_id"], docs_t["doc_id"], strict=True))
    verbatim = [i for i in split.queries if queries[i]["kind"] == "verbatim"]
    res["verbatim_r1_served_order"] = float(np.mean([rank_of(S[i], {ext_to_doc[e] for e in queries[i]["planted"]}) == 1
                                                     for i in verbatim]))
    best = max(dampings, key=lambda c: res["prism_fast_influence"][f"{c:g}"]["lds"][0])
    res["influence_damping_best_here"] = best
    out = finish(res, "attribution/influence_lds.py", argv, args.out)
    if args.merge_into:
        merge(Path(args.merge_into), out, args.out, args.merge_key)
    return out


BASELINES = ("trak", "bergson", "bm25")


def reference(args: argparse.Namespace) -> tuple[Path, list[dict], np.ndarray, Split]:
    """The work folder, its queries, EK-FAC's scores of every document (the reference) and the split."""
    work = Path(args.work)
    queries = json.loads((work / "queries.json").read_text())
    E = np.load(work / "scores_ekfac.npy").astype(np.float64)
    split = folder_split(work, queries, E.shape[1], args.subsets, args.tune_subsets, args.seed, args.split)
    return work, queries, E, split


def baseline_rows(work: Path, row) -> dict:
    """``row`` of each baseline whose score file the work folder holds."""
    files = {m: work / f"scores_{m}.npy" for m in BASELINES}
    return {m: row(np.load(f).astype(np.float64)) for m, f in files.items() if f.exists()}


def add_baselines(args: argparse.Namespace) -> dict:
    """``--baselines-only``: the baselines' rows added to the earlier run's results file ``args.out``
    (and its block of ``args.merge_into``), after checking the split and draws reproduce its EK-FAC row."""
    out = Path(args.out)
    if not out.is_file():
        raise SystemExit(f"{out}: no results file to add to (run without --baselines-only first)")
    res = json.loads(out.read_text())
    work, _, E, split = reference(args)
    row = against(split, E, args.boot, args.seed + 11)
    again = row(E)
    if again != res["ekfac_all"] or len(split.queries) != res["queries"] or len(split.L) != res["subsets"]:
        raise SystemExit(f"{out}: its EK-FAC row {res['ekfac_all']} is not reproduced ({again}, "
                         f"{len(split.L)} subsets, {len(split.queries)} queries): another split or draws")
    added = baseline_rows(work, row)
    if not added:
        raise SystemExit(f"{work}: no baseline score file (scores_{{{','.join(BASELINES)}}}.npy)")
    res |= added
    res.setdefault("baselines_added", []).append({
        "methods": list(added), "command": "python bench/attribution/influence_lds.py " + " ".join(sys.argv[1:]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
    out.write_text(json.dumps(res, indent=2))
    if args.merge_into:
        merge(Path(args.merge_into), res, str(out), args.merge_key)
    print(json.dumps(added, indent=2))
    return res


def lds_keys(name: str, row: dict) -> dict:
    """A ``row``'s LDS, its interval and its paired difference against EK-FAC, under ``name``."""
    return {f"lds_{name}": row["lds"][0], f"lds_{name}_ci": row["lds"],
            f"lds_diff_{name}_ekfac_ci": row["diff_vs_ekfac_all"]}


def versus_ekfac(row: dict) -> dict:
    """A ``row``'s paired difference against EK-FAC as an estimate and its 95% interval."""
    point, low, high = row["diff_vs_ekfac_all"]
    return {"estimate": point, "ci95": [low, high]}


def merge(path: Path, res: dict, source: str, key: str = "fresh_split_influence") -> None:
    """The fresh split's LDS keys of ``res`` into the block ``key`` of the results file ``path`` (the rest
    of it unchanged)."""
    att = json.loads(path.read_text())
    served = res["prism_fast_influence"][f"{res['influence_damping_served']:g}"]
    values = res.get("values")
    block = {**lds_keys("prism_fast_influence", served), **lds_keys("prism_fast", res["prism_fast"]),
             "lds_ekfac": res["ekfac_all"]["lds"][0], "lds_ekfac_ci": res["ekfac_all"]["lds"],
             **({**lds_keys("prism_fast_value", values["prism_fast_value"]),
                 **lds_keys("prism_fast_at_value_k", values["prism_fast"]),
                 "value_returned": values["returned"],
                 "value_vs_ekfac": versus_ekfac(values["prism_fast_value"]),
                 "score_at_value_k_vs_ekfac": versus_ekfac(values["prism_fast"])} if values else {}),
             **{f"lds_{m}": res[m]["lds"][0] for m in BASELINES if m in res},
             **{f"lds_{m}_ci": res[m]["lds"] for m in BASELINES if m in res},
             **{f"lds_diff_{m}_ekfac_ci": res[m]["diff_vs_ekfac_all"] for m in BASELINES if m in res},
             "verbatim_r1_served_order": res["verbatim_r1_served_order"],
             "opposed_share_mean": res.get("opposed_share_mean"),
             "seconds_per_query_median": res["seconds_per_query_median"],
             "split": {k: res[k] for k in ("work", "subsets", "queries", "documents", "returned")},
             "source": source, "date": res.get("date")}
    att[key] = block
    path.write_text(json.dumps(att, indent=2) + "\n")


if __name__ == "__main__":
    main()
