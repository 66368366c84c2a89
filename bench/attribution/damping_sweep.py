"""LDS and planted-fact ranks of PRISM's exact scores against the curvature damping.

Reuses a finished ``run_eval.py`` work directory (its index, queries and the losses of its subset
retrainings) and rescales the index's damping at query time (``I(t, t)`` is recomputed for each).

    python -m bench.attribution.damping_sweep --work runs/bench_lds

Writes ``bench/results/attribution_damping.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench._common import finish, index_documents
from bench.attribution.run_eval import rank_of, spearman, summarise
from prism_tda.engine import Attributor, QuerySpec

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/bench_lds")
    ap.add_argument("--multipliers", default="0.01,0.1,1,10,100", help="x the index's damping")
    ap.add_argument("--seed", type=int, default=0, help="as given to run_eval.py (subset draws)")
    ap.add_argument("--out", default="bench/results/attribution_damping.json")
    args = ap.parse_args(argv)
    work = Path(args.work)
    queries = json.loads((work / "queries.json").read_text())
    att = Attributor.open(work / "index")
    ext = {e: i for i, e in enumerate(index_documents(work / "index", ["external_id"])["external_id"]) if e is not None}
    n = att.reader.n_docs
    files = sorted((work / "lds").glob("subset_*.json"))
    rng = np.random.default_rng(args.seed)  # the same draws as run_eval.py
    masks = []
    for _ in files:
        m = np.zeros(n)
        m[rng.choice(n, n // 2, replace=False)] = 1
        masks.append(m)
    M, L = np.stack(masks), np.array([json.loads(f.read_text())["loss"] for f in files])
    base = att.reader.cfg.damping  # x the mean curvature eigenvalue
    rows = []
    for mult in [float(x) for x in args.multipliers.split(",")]:
        S = np.stack([att.document_scores(att.encode(QuerySpec(q["prompt"], q["completion"])), "exact",
                                          damping=base * mult)["cosine_max"] for q in queries])
        P = M @ S.T
        row = {"damping_multiplier": mult, "damping": float(base * mult * att.reader.damping_unit.mean())}
        for name, kinds in (("lds", ("verbatim", "heldout")), ("lds_facts", ("verbatim",)), ("lds_heldout", ("heldout",))):
            sel = [i for i, q in enumerate(queries) if q["kind"] in kinds]
            row[name] = float(np.mean([spearman(P[:, i], -L[:, i]) for i in sel]))
        for kind in ("verbatim", "paraphrase"):
            ranks = [rank_of(S[i], {ext[e] for e in q["planted"]}) for i, q in enumerate(queries) if q["kind"] == kind]
            row[kind] = summarise(ranks)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return finish({"rows": rows, "subsets": len(files), "queries": len(queries)}, "attribution/damping_sweep.py",
                  argv, args.out)


if __name__ == "__main__":
    main()
