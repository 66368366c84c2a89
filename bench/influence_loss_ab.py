"""What the `influence` option's loss costs written two ways, interleaved in one process: the masked
positions taken out of the (B, T, V) logits by a boolean index (``indexed``, the engine's form before
2026-12-06, kept here as the reference) against every position passed to the cross-entropy with the
others ignored (``ignored``, ``engine/influence.py``'s ``_loss``). Same gradient; the boolean index's
backward scatters into a zeroed (B, T, V) tensor.

Same queries as ``bench/query_profile.py`` (64-token prompts cut from the demo corpus, completion
" is a machine"). For each answer size (the first ``--documents`` documents by score, none left out),
each query's full-model influence is computed once per arm per repeat, the arm order alternating; then
the influence curvature is fitted on ``--fit-sequences`` sequences once per arm per repeat. Per arm:
the median milliseconds; the paired difference with a 95% bootstrap interval over the calls; the ratio
of the arms' medians; and the largest difference between the arms' values, relative to the largest
value (0: bit-identical).

    python -m bench.influence_loss_ab --index runs/demo/index
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch
import torch.nn.functional as F

import prism_tda.engine.influence as inf
from bench._common import add_demo_query_args, demo_queries, finish

ARMS = ("indexed", "ignored")


def indexed_loss(model, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """The earlier form of ``engine/influence.py``'s ``_loss``: the masked positions by a boolean index."""
    logits = model(x).logits.float()
    if generator is not None:
        with torch.no_grad():
            probs = torch.softmax(logits.detach(), -1).reshape(-1, logits.shape[-1])
            y = torch.multinomial(probs, 1, generator=generator).reshape(y.shape)
    return F.cross_entropy(logits[mask], y[mask], reduction="sum")


def paired(before: list[float], after: list[float], seed: int = 0) -> dict:
    b, a = np.asarray(before), np.asarray(after)
    d = a - b
    rng = np.random.default_rng(seed)
    boot = [float(np.median(d[rng.integers(0, len(d), len(d))])) for _ in range(2000)]
    return {"ms_p50": {ARMS[0]: round(float(np.median(b)), 1), ARMS[1]: round(float(np.median(a)), 1)},
            "diff_ms_p50": round(float(np.median(d)), 1),
            "diff_ms_ci95": [round(float(np.percentile(boot, 2.5)), 1), round(float(np.percentile(boot, 97.5)), 1)],
            "ratio_of_medians": round(float(np.median(a) / np.median(b)), 3), "calls": len(d)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_demo_query_args(ap, "bench/results/influence_loss_ab.json", repeats=4)
    ap.add_argument("--documents", default="10,128", help="answer sizes, comma-separated")
    ap.add_argument("--fit-sequences", type=int, default=256)
    args = ap.parse_args(argv)
    att, specs, opt = demo_queries(args)
    ek, reader = att.ekfac(), att.local_reader("influence")
    losses = {ARMS[0]: indexed_loss, ARMS[1]: inf._loss}
    was = inf._loss
    res: dict = {"index": args.index, "tokens": att.reader.n_tokens, "queries": len(specs),
                 "repeats": args.repeats, "by_documents": {}}
    try:
        queries = [att.encode(s) for s in specs]
        for nd in (int(v) for v in args.documents.split(",")):
            o = dataclasses.replace(opt, n_documents=nd, keep_opposed=True)
            docs = [np.array([d.doc_id for d in att.attribute(s, o).documents], np.int64) for s in specs]
            times: dict[str, list[float]] = {a: [] for a in ARMS}
            rel = 0.0
            for rep in range(args.repeats):
                for q, dd in zip(queries, docs, strict=True):
                    vals = {}
                    for a in ARMS if rep % 2 == 0 else ARMS[::-1]:
                        inf._loss = losses[a]
                        t0 = time.perf_counter()
                        vals[a] = inf.document_influence(att.model, ek, reader, q.token_ids, q.target_positions,
                                                         q.target_ids, dd)
                        times[a].append(1e3 * (time.perf_counter() - t0))
                    scale = max(float(np.abs(vals[ARMS[0]]).max(initial=0.0)), 1e-30)
                    rel = max(rel, float(np.abs(vals[ARMS[0]] - vals[ARMS[1]]).max(initial=0.0)) / scale)
            res["by_documents"][str(nd)] = {**paired(times[ARMS[0]], times[ARMS[1]]), "max_rel_value_diff": rel,
                                            "sequences_mean": float(np.mean([
                                                len(inf.document_sequences(reader, dd)[0]) for dd in docs]))}
        times = {a: [] for a in ARMS}
        fits: dict[str, inf.EKFAC] = {}
        for rep in range(max(2, args.repeats // 2)):
            for a in ARMS if rep % 2 == 0 else ARMS[::-1]:
                inf._loss = losses[a]
                t0 = time.perf_counter()
                fits[a] = inf.fit(att.model, reader, max_sequences=args.fit_sequences, seed=0)
                times[a].append(1e3 * (time.perf_counter() - t0))
        lam = [float((fits[ARMS[0]].lam[n] - fits[ARMS[1]].lam[n]).abs().max() / fits[ARMS[0]].lam[n].abs().max())
               for n in fits[ARMS[0]].lam]
        res["fit"] = {**paired(times[ARMS[0]], times[ARMS[1]]), "sequences": args.fit_sequences,
                      "max_rel_eigenvalue_diff": max(lam)}
    finally:
        inf._loss = was
    res["torch_threads"] = torch.get_num_threads()
    return finish(res, "influence_loss_ab.py", argv, args.out)


if __name__ == "__main__":
    main()
