"""What a faster fast path would cost in agreement with exact mode, on the service's own queries.

The served fast path's time goes to its first stages (the posting rows scored from the codes), the
shortlist (the candidate windows scored from the codes) and the exact re-rank (``docs/benchmarks.md``).
Each is bounded by a setting chosen for agreement with exact mode. This asks the demo queries of
``bench/service_load.py`` (64-token prompts cut from the demo corpus, completion " is a machine";
by default prompts 65-112, which no results file asked before) under the served settings and under cheaper
ones, and reports for each its time per query and its agreement with exact mode's answer:

- exact mode's answer: one exact pass of the model over every token of the index for all queries at
  once (``bench/attribution/near_ties.py``: ``exact_pass``), its top 10 as served (``cosine_max``, a
  near-tie at the cut settled by the documents' summed cosines);
- per setting, in process, one query at a time, the settings taking turns query by query (the order
  rotating) so that the machine's drift falls on all of them alike: milliseconds per query (median,
  p90), strict overlap@10 and the tie-aware share (a returned document whose exact score is within
  0.1% of the exact 10th-best counts as right), with 95% intervals over queries (2,000 seeded
  resamples), and documents re-ranked.

As ``near_ties.py`` compares them, every document may be returned (``include_untrained``,
``keep_opposed``), so that the fast path and exact mode rank the same set.

    python -m bench.speed_agreement --index runs/demo/index
    python -m bench.speed_agreement --index runs/scale/real --heldout runs/scale/corpus/part-006.jsonl --seed 31

With ``--heldout``, the queries are instead ``bench/scale.py``'s held-out ones (a 48-token prompt and
its 16-token continuation from documents that are not indexed; ``--seed`` draws them).

Writes ``bench/results/speed_agreement.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import finish, served_ranking
from bench.attribution.near_ties import exact_pass, scores_of
from bench.attribution.rerank_depth import TIE, ci
from bench.scale import held_out_queries
from bench.service_load import prompts_of
from prism_tda.engine import Attributor, QueryOptions, QuerySpec
from prism_tda.engine.reads import document_table

# name: (QueryOptions fields, FirstStages fields); the first is the served default
SETTINGS: dict[str, tuple[dict, dict]] = {
    "served": ({}, {}),
    "row_budget_16k": ({}, {"row_budget": 1 << 14}),
    "row_budget_8k_tokens_256": ({}, {"row_budget": 1 << 13, "token_candidates": 256}),
    "shortlist_64": ({"exact_rerank": 64}, {}),
    "shortlist_32": ({"exact_rerank": 32}, {}),
    "no_tie_settling": ({"tie_break": "score"}, {}),
    "all_cheaper": ({"exact_rerank": 32}, {"row_budget": 1 << 13, "token_candidates": 256}),
}


def interval(v: list[float]) -> list[float]:
    """The 95% bootstrap interval of the mean over queries (``rerank_depth.ci``'s 2,000 seeded resamples)."""
    return ci(np.asarray(v, dtype=float), np.random.default_rng(0))[1:]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default="runs/demo/index")
    ap.add_argument("--first-prompt", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=48, help="queries asked")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--completion", default=" is a machine")
    ap.add_argument("--heldout", help="a JSONL file of documents not indexed: held-out queries from it instead")
    ap.add_argument("--seed", type=int, default=31, help="with --heldout: the draw of held-out documents")
    ap.add_argument("--repeats", type=int, default=2, help="times each setting asks each query (timing)")
    ap.add_argument("--settings", type=json.loads, default=None,
                    help='JSON {name: [QueryOptions fields, FirstStages fields]} instead of the built-in ones')
    ap.add_argument("--out", default="bench/results/speed_agreement.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    settings = {k: tuple(v) for k, v in args.settings.items()} if args.settings else SETTINGS
    att = Attributor.open(args.index)
    ext = np.asarray(document_table(Path(args.index), ["external_id"]).column("external_id").to_pylist(), dtype=object)
    row_of = {str(e): i for i, e in enumerate(ext)}
    tok_path = Path(att.manifest.checkpoint) / "tokenizer.json"
    if args.heldout:
        drawn = held_out_queries(Path(args.heldout), tok_path, args.prompts, seed=args.seed)
        specs = [QuerySpec(q["prompt"], q["completion"]) for q in drawn]
        asked = f"{len(specs)} held-out queries of {args.heldout} (seed {args.seed})"
    else:
        prompts = prompts_of(tok_path, args.first_prompt + args.prompts, args.prompt_tokens)[args.first_prompt :]
        specs = [QuerySpec(p, args.completion) for p in prompts]
        asked = f"prompts {args.first_prompt + 1}-{args.first_prompt + len(specs)} of the demo prompts, " \
                f"completion {args.completion!r}"
    encoded = [att.encode(s) for s in specs]
    pre = att.preconditioner(None)
    t0 = time.perf_counter()
    tokens, doc_norm2, doc_self_sum, doc_proto = exact_pass(att, encoded)
    pass_s = time.perf_counter() - t0
    n = att.reader.n_docs
    everything = np.ones(n, dtype=bool)
    exact = []  # per query: (exact top 10 as served, exact cosine_max per document, its 10th best)
    for enc, tok in zip(encoded, tokens, strict=True):
        sc = scores_of(tok, pre.self_influence(enc.G), doc_norm2, doc_self_sum, {}, n, doc_proto,
                       enc.prototypes.numpy())
        s = sc["cosine_max"]
        ranking = served_ranking(s, sc["cosine_sum"], everything)[0]
        exact.append(({str(ext[d]) for d in ranking[:10] if s[d] > 0}, s, float(np.sort(s)[::-1][9])))
    base = att.stages
    names = list(settings)
    for s in specs[:2]:  # warm-up
        att.attribute(s, QueryOptions(n_documents=10))
    ms: dict[str, list[float]] = {k: [] for k in names}
    strict: dict[str, list[float]] = {k: [] for k in names}
    tied: dict[str, list[float]] = {k: [] for k in names}
    reranked: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(args.repeats):
        for qi, spec in enumerate(specs):
            turn = (qi + rep) % len(names)
            for name in names[turn:] + names[:turn]:
                opts, stages = settings[name]
                att.stages = dataclasses.replace(base, **stages)
                t1 = time.perf_counter()
                res = att.attribute(spec, QueryOptions(n_documents=10, include_untrained=True, keep_opposed=True,
                                                       **opts))
                ms[name].append(1e3 * (time.perf_counter() - t1))
                if rep == 0:
                    top, s, kth = exact[qi]
                    got = [d.external_id for d in res.documents]
                    strict[name].append(len(set(got) & top) / max(len(top), 1))
                    tied[name].append(float(np.mean([s[row_of[g]] >= kth - TIE * abs(kth) for g in got])) if got
                                      else 0.0)
                    reranked[name].append(res.documents_reranked)
    att.stages = base
    out = {}
    for name in names:
        opts, stages = settings[name]
        out[name] = {
            "query_options": opts, "first_stages": dataclasses.asdict(dataclasses.replace(base, **stages)),
            "ms_p50": round(float(np.median(ms[name])), 1), "ms_p90": round(float(np.percentile(ms[name], 90)), 1),
            "ms_p50_vs_served": round(float(np.median(ms[name]) / np.median(ms[names[0]])), 3),
            "overlap_at_10": round(float(np.mean(strict[name])), 3), "overlap_at_10_ci95": interval(strict[name]),
            "tie_aware_at_10": round(float(np.mean(tied[name])), 3), "tie_aware_at_10_ci95": interval(tied[name]),
            "documents_reranked_mean": round(float(np.mean(reranked[name])), 2),
        }
    res = {"index": args.index, "tokens": att.reader.n_tokens, "documents": n, "queries": len(specs),
           "asked": asked, "repeats": args.repeats, "exact_pass_seconds": round(pass_s, 1),
           "settings": out}
    return finish(res, "speed_agreement.py", argv, args.out)


if __name__ == "__main__":
    main()
