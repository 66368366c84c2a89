"""Candidate recall of the exact top 10 under two indexes of one checkpoint and corpus that differ in
how tokens are filed in the posting lists (``index.posting_by``), on the same queries.

For each work folder (``run_eval.py``'s, with ``queries.json``, or ``planted_full.py``'s, with
``facts.json``: each fact asked verbatim and paraphrased): every query's exact top 10 (``cosine_max``
over every trained document, one exact pass over the corpus, cached in the folder as
``exact_cosine_max.npy``), then for each index the share of those documents among the fast path's
candidates at the default ``n_candidates``, and the time the first stages took. Both indexes share
their calibration (the same sample and seed), so their exact scores are the same.

    python -m bench.attribution.posting_ab --case seed4=runs/bench_lds_seed4:index_share:index \\
        --case memorised=runs/bench_mem:index_share_step_0002000:index_step_0002000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import finish


def queries_of(work: Path) -> list[tuple[str, str, str]]:
    """(label, prompt, completion) of every query of a work folder."""
    if (work / "queries.json").exists():
        return [(f"{q['kind']}:{q.get('fact') or i}", q["prompt"], q["completion"])
                for i, q in enumerate(json.loads((work / "queries.json").read_text()))]
    facts = json.loads((work / "facts.json").read_text())
    return [(f"{kind}:{f['fact_id']}", f[key], f["answer"]) for f in facts
            for kind, key in (("verbatim", "prompt"), ("paraphrase", "paraphrase"))]


def run_case(work: Path, index_a: Path, index_b: Path, n_candidates: int) -> dict:
    from prism_tda.engine import Attributor, QuerySpec

    atts = {"a": Attributor.open(index_a), "b": Attributor.open(index_b)}
    rules = {k: a.manifest.config.posting_by for k, a in atts.items()}
    qs = queries_of(work)
    specs = [QuerySpec(p, c) for _, p, c in qs]
    cache = work / "exact_cosine_max.npy"
    if cache.exists() and np.load(cache).shape[0] == len(specs):
        S = np.load(cache)
    else:
        enc = [atts["a"].encode(s) for s in specs]
        S = np.stack([e["cosine_max"] for e in atts["a"].exact_document_scores(enc)])
        np.save(cache, S)
    trained = atts["a"].reader.trained(np.arange(atts["a"].reader.n_docs))
    out: dict = {"work": str(work), "queries": len(qs), "n_candidates": n_candidates, "indexes": {}}
    for key, att in atts.items():
        recall, ms, short = [], [], []
        for (label, _, _), spec, s in zip(qs, specs, S, strict=True):
            s = np.where(trained, s, -np.inf)
            top = [int(d) for d in np.argsort(-s, kind="stable")[:10] if s[d] > 0]
            q = att.encode(spec)
            t0 = time.perf_counter()
            cand = set(att.candidate_documents(q, n_candidates).tolist())
            ms.append(1e3 * (time.perf_counter() - t0))
            missed = [d for d in top if d not in cand]
            recall.append(1 - len(missed) / max(len(top), 1))
            if missed:
                short.append({"query": label, "missed": [att.reader.external_id(d) for d in missed]})
        out["indexes"][rules[key]] = {
            "index": str(index_a if key == "a" else index_b),
            "candidate_recall_of_exact_top10": float(np.mean(recall)),
            "queries_short": len(short), "short": short,
            "first_stages_ms_median": float(np.median(ms)),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", required=True, metavar="NAME=WORK:INDEX_A:INDEX_B",
                    help="a work folder and two of its indexes (folder names inside it); repeatable")
    ap.add_argument("--candidates", type=int, default=256)
    ap.add_argument("--out", default="bench/results/posting_ab.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    res: dict = {"cases": {}}
    for case in args.case:
        name, spec = case.split("=", 1)
        work, a, b = spec.split(":")
        res["cases"][name] = run_case(Path(work), Path(work) / a, Path(work) / b, args.candidates)
        for rule, r in res["cases"][name]["indexes"].items():
            print(f"{name} {rule}: candidate recall {r['candidate_recall_of_exact_top10']:.4f}, "
                  f"{r['queries_short']} queries short", flush=True)
    return finish(res, "attribution/posting_ab.py", argv, args.out)


if __name__ == "__main__":
    main()
