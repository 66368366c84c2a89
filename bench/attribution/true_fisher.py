"""The true-Fisher lever on the tuning split (issue: LDS at or above EK-FAC).

The index's curvature is the empirical Fisher: each prototype block is ``(1/N) sum_t a_{t,i}^2 u_t
u_t^T`` with ``u_t = W^T (p_t - e_{y_t})``, the error signal of the token's *observed* target. The
true Fisher takes the expectation over targets drawn from the model's own prediction instead,
``E_{y ~ p_t}[u u^T] = W^T (diag p_t - p_t p_t^T) W``, which is what kronfluence's EK-FAC uses (it
samples the targets). Kept as the index keeps the empirical one, in the index's eigenbasis ``Q``, the
per-prototype corrections are ``(1/N) sum_t a_{t,i}^2 F_t`` with, for coordinate j and ``B = W Q``,
``F_tj = p_t . B_j^2 - (p_t . B_j)^2``: closed form, ``V d`` operations per token (the whole matrix
would be ``V d^2``; only its diagonal in ``Q`` is needed, as for the empirical corrections).

Primary setting, fixed before any number was seen: the true-Fisher corrections at the index's default
damping (per prototype, c = 0.03 x each block's own mean eigenvalue), ``cosine_max``, every document
scored, against the empirical corrections at the same settings (the served default), with a paired
bootstrap over the tuning split's subsets and queries. Ablations: c = 0.01 and 0.1; the global
damping at 1.0 x the mean eigenvalue (the earlier default) for both; the true Fisher with the last
block's output projections (the best exact combination of ``levers.py``) against the empirical one
with them; every aggregation of ``levers.py`` for each. Guard: every tuning verbatim fact's planted
copy ranked first (from the exact scores).

    python -m bench.attribution.true_fisher --work runs/bench_lds_fresh --seed 1 --subsets 16

Writes ``bench/results/attribution_true_fisher.json``; caches each setting's scores in the work folder
(``true_fisher_<setting>.npz``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import finish, index_documents
from bench.attribution.lds_report import interval, splits, top_only
from bench.attribution.levers import (
    PROJECTIONS,
    ProjectionCurvature,
    Segments,
    aggregate,
    block_corrections,
    corpus_pass,
    query_projection_G,
    token_scores,
)
from bench.attribution.run_eval import rank_of
from prism_tda.engine import Attributor, QuerySpec
from prism_tda.engine.curvature import damping_unit
from prism_tda.engine.scoring import Preconditioner

# name -> (curvature, damping scope, c, model parts); each "true_*" is paired with its "empirical_*" twin
SETTINGS = {
    "empirical_pp_0.03": ("empirical", "prototype", 0.03, ()),
    "true_pp_0.03": ("true", "prototype", 0.03, ()),
    "empirical_pp_0.01": ("empirical", "prototype", 0.01, ()),
    "true_pp_0.01": ("true", "prototype", 0.01, ()),
    "empirical_pp_0.1": ("empirical", "prototype", 0.1, ()),
    "true_pp_0.1": ("true", "prototype", 0.1, ()),
    "empirical_global_1.0": ("empirical", "global", 1.0, ()),
    "true_global_1.0": ("true", "global", 1.0, ()),
    "empirical_pp_0.03_projections": ("empirical", "prototype", 0.03, PROJECTIONS),
    "true_pp_0.03_projections": ("true", "prototype", 0.03, PROJECTIONS),
}
PRIMARY = ("true_pp_0.03", "cosine_max")
AGGS = ("cosine_max", "cosine_top4", "cosine_sum", "raw_sum", "tau_q50_max")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/bench_lds_fresh")
    ap.add_argument("--subsets", type=int, default=48, help="retrained subsets in the work folder")
    ap.add_argument("--tune-subsets", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1, help="as given to run_eval.py (subset draws)")
    ap.add_argument("--boot", type=int, default=1000)
    ap.add_argument("--no-projections", action="store_true", help="skip the two settings with the projections")
    ap.add_argument("--out", default="bench/results/attribution_true_fisher.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    work = Path(args.work)
    queries = json.loads((work / "queries.json").read_text())
    att = Attributor.open(work / "index")
    n_docs, K = att.reader.n_docs, att.reader.n_prototypes
    enc = [att.encode(QuerySpec(q["prompt"], q["completion"])) for q in queries]
    settings = {k: v for k, v in SETTINGS.items() if not (args.no_projections and v[3])}

    t0 = time.perf_counter()
    with torch.no_grad():
        ct = corpus_pass(att)
    pass_s = time.perf_counter() - t0
    counts = torch.from_numpy(np.bincount(ct.protos[ct.acts > 0].ravel(), minlength=K).astype(np.float64))
    lam = {"empirical": att.reader.curv.lam.float(), "true": block_corrections(ct, K, ct.fisher)}
    # the pass's own empirical corrections agree with the index's (the same tokens, the same basis)
    emp_here = block_corrections(ct, K, ct.ut.pow(2))
    emp_rel_err = float((emp_here - lam["empirical"]).norm() / lam["empirical"].norm())
    used = counts > 0
    ratio = (lam["true"][used].sum(1) / lam["empirical"][used].sum(1).clamp_min(1e-30)).numpy()

    need_proj = any(v[3] for v in settings.values())
    proj_curv = {n: ProjectionCurvature.fit(*ct.proj[n]) for n in PROJECTIONS} if need_proj else {}
    proj_q = [query_projection_G(att.model, q) for q in enc] if need_proj else [{} for _ in enc]
    seg = Segments(ct.docs, n_docs)

    scores: dict[str, dict[str, np.ndarray]] = {}
    timings = {}
    for name, (curv, scope, c, parts) in settings.items():
        path = work / f"true_fisher_{name}.npz"
        if path.exists():
            z = np.load(path)
            scores[name] = {a: z[a] for a in z.files}
            continue
        t1 = time.perf_counter()
        L = lam[curv]
        pre = Preconditioner(c, (1.0 / (L.double() + c * damping_unit(L, counts, scope).double())).float(), False)
        raws, I_qs, t_self, _ = token_scores(ct, enc, pre, parts, proj_curv, proj_q, match=False)
        taus = {"q50": float(np.percentile(t_self, 50))}
        per = [aggregate(seg, r, iq, t_self, taus, None) for r, iq in zip(raws, I_qs, strict=True)]
        scores[name] = {a: np.stack([p[a] for p in per]).astype(np.float32) for a in AGGS}
        np.savez(path, **scores[name])
        timings[name] = round(time.perf_counter() - t1, 1)
        print(f"[{name}] {timings[name]} s", flush=True)

    tune, _ = splits(work, queries, n_docs, args.subsets, args.tune_subsets, args.seed)
    draws = tune.draws(args.boot, args.seed + 13)
    docs = index_documents(work / "index", ["doc_id", "external_id"])
    ext_to_doc = dict(zip(docs["external_id"], docs["doc_id"], strict=True))
    tune_verbatim = [i for i in tune.queries if queries[i]["kind"] == "verbatim"]

    def verbatim_r1(S: np.ndarray) -> float:
        return float(np.mean([rank_of(S[i], {ext_to_doc[e] for e in queries[i]["planted"]}) == 1
                              for i in tune_verbatim]))

    boots = {(n, a, k): tune.boot(top_only(S, k), draws) for n, by in scores.items() for a, S in by.items()
             for k in (None, 128)}
    table = []
    for name, by in scores.items():
        twin = name.replace("true_", "empirical_", 1)
        for a, S in by.items():
            for k in (None, 128):
                point = tune.lds(top_only(S, k))
                row = {"setting": name, "aggregation": a, "returned": k or "all",
                       "lds_tune": interval(point, boots[(name, a, k)]), "verbatim_r1_tune": verbatim_r1(S)}
                if twin != name:
                    base = scores[twin][a]
                    row["diff_vs_empirical"] = interval(point - tune.lds(top_only(base, k)),
                                                        boots[(name, a, k)] - boots[(twin, a, k)])
                table.append(row)
    by_key = {(r["setting"], r["aggregation"], r["returned"]): r for r in table}
    res = {
        "work": str(work), "tokens": att.reader.n_tokens, "documents": n_docs,
        "tune_split": {"subsets": args.tune_subsets, "queries": len(tune.queries),
                       "verbatim_queries": len(tune_verbatim)},
        "corpus_pass_seconds": round(pass_s, 1), "setting_seconds": timings,
        "empirical_corrections_rel_err_vs_index": emp_rel_err,
        "true_over_empirical_trace_per_prototype": {
            "median": float(np.median(ratio)), "p10": float(np.percentile(ratio, 10)),
            "p90": float(np.percentile(ratio, 90))},
        "primary": by_key[(*PRIMARY, "all")],
        "served_default": by_key[("empirical_pp_0.03", "cosine_max", "all")],
        "best_on_tuning_split": max(table, key=lambda r: r["lds_tune"][0]),
        "best_guarded_on_tuning_split": max((r for r in table if r["verbatim_r1_tune"] == 1.0),
                                            key=lambda r: r["lds_tune"][0]),
        "table": sorted(table, key=lambda r: -r["lds_tune"][0]),
    }
    return finish(res, "attribution/true_fisher.py", argv, args.out, hide=("table",))


if __name__ == "__main__":
    main()
