"""How deep the fast path re-ranks (``exact_rerank``: the shortlist's size, of which the adaptive rule
re-scores only what could still reach the n-th exact score), chosen on fresh held-out queries at scale
and reported on others.

At millions of tokens the top of a query's ranking is a band of documents within a fraction of a
percent of each other, narrower than the stored codes' error: the exact top 10 sits among the first
few dozen to a few hundred documents of the approximate order, so a shortlist of 32 cuts some of it
off before the re-rank sees it. This measures the fast path's agreement with exact mode (strict
overlap@10 and tie-aware: a returned document within 0.1% of the exact 10th-best score counts) and
its time per query, for each setting.

Protocol, fixed before the queries were drawn:

- Queries: 48-token prompts and their 16-token continuations from documents of a file that is not
  indexed (``bench/scale.py``'s ``held_out_queries``), drawn with ``--seed``, leaving out the draw of
  ``--exclude-seed`` (the queries ``near_ties.py`` reports on, looked at many times); the first
  ``--tune`` are the tuning split, the next ``--report`` the report split.
- Exact: every document's exact ``cosine_max`` for every query, one pass of the model over the index
  (``Attributor.exact_document_scores``), saved to ``--arrays`` and reused when its queries match.
- Choice, on the tuning split only: the smallest setting whose strict overlap@10 is >= 0.9; if none
  is, the one with the highest (ties: the smaller).
- With ``--margins``, then the adaptive rule's margin (``engine.scoring.RERANK_MARGIN``: how far
  below the n-th exact score, in multiples of the largest approximation error seen, a shortlisted
  document may be and still be re-scored) at the chosen depth, on the tuning split: the smallest
  whose strict and tie-aware agreement both equal the current margin's.
- Report: the chosen setting and ``--baseline`` (the served default when this was first run) on the
  report split, with 95% bootstrap intervals over queries (paired for the difference), seconds per
  query and documents re-ranked.

    python -m bench.attribution.rerank_depth --index runs/scale/prefix_0005 --heldout runs/scale/corpus/part-006.jsonl \\
        --arrays runs/scale/rerank_depth.npz --out bench/results/rerank_depth.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

import prism_tda.engine.scoring as scoring
from bench._common import finish
from bench.attribution.lds_paired import interval
from bench.scale import held_out_queries
from prism_tda.engine import Attributor, QueryOptions, QuerySpec
from prism_tda.engine.reads import document_table

TIE = 1e-3  # the near-tie band: 0.1% of the exact 10th-best score


def draw(heldout: Path, tok: Path, n: int, seed: int, exclude: list[tuple[int, int]]) -> list[dict]:
    """``n`` held-out queries of the draw ``seed``, none of them in the draws ``exclude`` ((seed, size) each)."""
    gone = {q["id"] for s, k in exclude for q in held_out_queries(heldout, tok, k, s)}
    qs = [q for q in held_out_queries(heldout, tok, n + len(gone), seed) if q["id"] not in gone]
    if len(qs) < n:
        raise SystemExit(f"{heldout}: only {len(qs)} held-out queries of >= 64 tokens, {n} asked")
    return qs[:n]


def draw_args(ap: argparse.ArgumentParser, exclude: str = "2:24,3:48") -> None:
    """The arguments of a draw of held-out queries at scale with its exact scores (:func:`open_draw`)."""
    ap.add_argument("--index", required=True)
    ap.add_argument("--heldout", required=True, help="a JSONL file of documents not indexed")
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--exclude", default=exclude, help="earlier draws to leave out, SEED:N each")
    ap.add_argument("--arrays", help="the exact scores (.npz) of the draw, saved and reused")


def parse_draw(argv: list[str] | None, doc: str, seed: int, out: str, queries: int = 32) -> argparse.Namespace:
    """The arguments of a script over one draw (:func:`draw_args`, no earlier draw left out by default),
    ``--queries`` of it and ``--out``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    draw_args(ap, exclude="")
    ap.set_defaults(seed=seed)
    ap.add_argument("--queries", type=int, default=queries)
    ap.add_argument("--out", default=out)
    return ap.parse_args(argv)


def open_queries(args: argparse.Namespace, n: int) -> tuple[Attributor, list[dict], dict[str, int]]:
    """(the index opened, the draw's ``n`` queries, each document's row by external id), from
    :func:`draw_args`' arguments."""
    torch.set_num_threads(os.cpu_count() or 1)
    att = Attributor.open(args.index)
    tok = Path(att.manifest.checkpoint) / "tokenizer.json"
    exclude = [(int(a), int(b)) for a, b in (p.split(":") for p in args.exclude.split(",") if p)]
    queries = draw(Path(args.heldout), tok, n, args.seed, exclude)
    ext = document_table(Path(args.index), ["external_id"]).column("external_id").to_pylist()
    return att, queries, {str(e): i for i, e in enumerate(ext)}


def cached_arrays(arrays: Path | None, queries: list[dict], compute) -> tuple[dict[str, np.ndarray], float]:
    """(named (queries, documents) arrays, the seconds ``compute()`` took to make them): read from
    ``arrays`` when it holds exactly these queries, else computed and saved there."""
    ids = [q["id"] for q in queries]
    if arrays is not None and arrays.is_file():
        a = np.load(arrays)
        if json.loads(str(a["ids"])) == ids:
            return {k: a[k] for k in a.files if k not in ("ids", "seconds")}, float(a["seconds"])
    t0 = time.perf_counter()
    out = compute()
    secs = time.perf_counter() - t0
    if arrays is not None:
        arrays.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(arrays, ids=np.asarray(json.dumps(ids)), seconds=secs, **out)
    return out, secs


def exact_document_arrays(att: Attributor, queries: list[dict], arrays: Path | None, keys: tuple[str, ...],
                          match: bool = False) -> tuple[dict[str, np.ndarray], float]:
    """Per aggregation of ``keys``, (queries, documents) exact scores from one pass of the model
    (``match``: ``cosine_match`` too), and the seconds it took; from ``arrays`` when it holds these
    queries (:func:`cached_arrays`)."""
    def compute() -> dict[str, np.ndarray]:
        encoded = [att.encode(QuerySpec(q["prompt"], q["completion"])) for q in queries]
        scores = att.exact_document_scores(encoded, match=match, progress=True)
        return {k: np.stack([s[k] for s in scores]) for k in keys}

    return cached_arrays(arrays, queries, compute)


def record_answer(m: dict[str, list], res, row_of: dict[str, int], exact: np.ndarray, top: np.ndarray, seconds: float,
                  windows: np.ndarray) -> None:
    """Add one fast answer ``res`` to ``m``: its strict overlap with exact mode's top ``top``, the relative
    error of its scores against the exact ones ``exact`` (median and largest over the returned documents),
    its time, the documents it re-ranked, the share of returned documents longer than one window
    (``windows``: each document's count)."""
    got = [row_of[d.external_id] for d in res.documents]
    err = [abs(d.score / exact[r] - 1.0) for d, r in zip(res.documents, got, strict=True) if exact[r] != 0]
    m.setdefault("strict", []).append(len(set(got) & set(top.tolist())) / max(len(top), 1))
    m.setdefault("score_error", []).append(float(np.median(err)) if err else 0.0)
    m.setdefault("score_error_max", []).append(float(np.max(err)) if err else 0.0)
    m.setdefault("seconds", []).append(seconds)
    m.setdefault("reranked", []).append(res.documents_reranked)
    m.setdefault("several_windows", []).append(float(np.mean(windows[got] > 1)) if got else 0.0)


def answers_summary(m: dict[str, list], rng: np.random.Generator) -> dict:
    """:func:`record_answer`'s lists over queries: means with 95% intervals, the largest error, time."""
    return {"overlap_at_10": ci(np.array(m["strict"]), rng),
            "score_relative_error_median": ci(np.array(m["score_error"]), rng),
            "score_relative_error_max": round(float(np.max(m["score_error_max"])), 4),
            "seconds_median": round(float(np.median(m["seconds"])), 3),
            "documents_reranked_mean": round(float(np.mean(m["reranked"])), 1),
            **({"windows_rescored_mean": round(float(np.mean(m["windows_rescored"])), 1)}
               if "windows_rescored" in m else {}),
            "returned_with_several_windows": round(float(np.mean(m["several_windows"])), 3),
            "per_query_overlap": [round(x, 2) for x in m["strict"]]}


def open_draw(args: argparse.Namespace, n: int) -> tuple[Attributor, list[dict], np.ndarray, float, dict[str, int]]:
    """(the index opened, the draw's ``n`` queries, their exact ``cosine_max`` by document, the seconds
    of that pass, each document's row by external id), from :func:`draw_args`' arguments."""
    att, queries, row_of = open_queries(args, n)
    exact, exact_s = exact_scores(att, queries, Path(args.arrays) if args.arrays else None)
    return att, queries, exact, exact_s, row_of


def arm_summary(m: dict, rng: np.random.Generator, **extra: object) -> dict:
    """One setting's :func:`agreement` over queries: means with 95% intervals, time, re-ranked documents."""
    return {**extra, "overlap_at_10": ci(np.array(m["strict"]), rng), "tie_aware_at_10": ci(np.array(m["tie_aware"]), rng),
            "seconds_median": round(float(np.median(m["seconds"])), 3),
            "seconds_mean": round(float(np.mean(m["seconds"])), 3),
            "documents_reranked_mean": round(float(np.mean(m["reranked"])), 2),
            "per_query_overlap": [round(x, 2) for x in m["strict"]]}


def exact_scores(att: Attributor, queries: list[dict], arrays: Path | None) -> tuple[np.ndarray, float]:
    """(queries, documents) exact ``cosine_max`` and the seconds its pass took, from ``arrays`` when it
    holds these queries (as its first ones)."""
    ids = [q["id"] for q in queries]
    if arrays is not None and arrays.is_file():
        a = np.load(arrays)
        have = json.loads(str(a["ids"]))
        if have[: len(ids)] == ids:
            return a["cosine_max"][: len(ids)], float(a["seconds"]) if "seconds" in a else float("nan")
    encoded = [att.encode(QuerySpec(q["prompt"], q["completion"])) for q in queries]
    t0 = time.perf_counter()
    scores = np.stack([s["cosine_max"] for s in att.exact_document_scores(encoded, progress=True)])
    secs = time.perf_counter() - t0
    if arrays is not None:
        arrays.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(arrays, ids=np.asarray(json.dumps(ids)), cosine_max=scores, seconds=secs)
    return scores, secs


def agreement(att: Attributor, queries: list[dict], exact: np.ndarray, row_of: dict[str, int], depth: int,
              n: int = 10, **options: object) -> dict:
    """The fast path at ``exact_rerank=depth`` (else as served or as ``options``, every document allowed)
    against exact: per query strict overlap@n, tie-aware agreement, seconds and documents re-ranked."""
    strict, tied, secs, reranked = [], [], [], []
    for q, s in zip(queries, exact, strict=True):
        top = [d for d in np.argsort(-s, kind="stable")[:n] if s[d] > 0]
        kth = float(s[top[-1]]) if top else 0.0
        t0 = time.perf_counter()
        res = att.attribute(QuerySpec(q["prompt"], q["completion"]),
                            QueryOptions(**{"n_documents": n, "include_untrained": True, "exact_rerank": depth,
                                            "keep_opposed": True, **options}))
        secs.append(time.perf_counter() - t0)
        reranked.append(res.documents_reranked)
        got = [row_of[d.external_id] for d in res.documents]
        strict.append(len(set(got) & set(top)) / max(len(top), 1))
        tied.append(float(np.mean([s[d] >= kth - TIE * abs(kth) for d in got])) if got else 0.0)
    return {"strict": strict, "tie_aware": tied, "seconds": secs, "reranked": reranked}


def ci(v: np.ndarray, rng: np.random.Generator, draws: int = 2000) -> list[float]:
    """Mean and 95% percentile bootstrap interval over queries."""
    return interval(v, rng.integers(0, len(v), size=(draws, len(v))))


def summary(m: dict) -> dict:
    return {"overlap_at_10": round(float(np.mean(m["strict"])), 3),
            "tie_aware_at_10": round(float(np.mean(m["tie_aware"])), 3),
            "seconds_per_query_median": round(float(np.median(m["seconds"])), 3),
            "seconds_per_query_p90": round(float(np.percentile(m["seconds"], 90)), 3),
            "documents_reranked_mean": round(float(np.mean(m["reranked"])), 2)}


def choose(tune: dict[int, dict], target: float = 0.9) -> int:
    """The smallest depth whose tuning strict overlap reaches ``target``; else the best (smaller on ties)."""
    ok = [d for d in sorted(tune) if tune[d]["overlap_at_10"] >= target]
    if ok:
        return ok[0]
    return max(sorted(tune), key=lambda d: (tune[d]["overlap_at_10"], -d))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", required=True)
    ap.add_argument("--heldout", required=True, help="a JSONL file of documents not indexed")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--exclude-seed", type=int, default=2, help="leave out this draw's queries (-1: none)")
    ap.add_argument("--exclude-n", type=int, default=24, help="the size of that draw")
    ap.add_argument("--tune", type=int, default=24)
    ap.add_argument("--report", type=int, default=24)
    ap.add_argument("--depths", default="32,64,128,256", help="exact_rerank settings to measure on the tuning split")
    ap.add_argument("--baseline", type=int, default=32, help="the setting the chosen one is compared with")
    ap.add_argument("--margins", default="", help="adaptive margins to measure at the chosen depth (e.g. 2,1,0.5)")
    ap.add_argument("--arrays", help="the exact scores (.npz), saved and reused")
    ap.add_argument("--out", default="bench/results/rerank_depth.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    att = Attributor.open(args.index)
    tok = Path(att.manifest.checkpoint) / "tokenizer.json"
    queries = draw(Path(args.heldout), tok, args.tune + args.report, args.seed,
                   [] if args.exclude_seed < 0 else [(args.exclude_seed, args.exclude_n)])
    ext = document_table(Path(args.index), ["external_id"]).column("external_id").to_pylist()
    row_of = {str(e): i for i, e in enumerate(ext)}
    exact, exact_s = exact_scores(att, queries, Path(args.arrays) if args.arrays else None)
    tq, rq = queries[: args.tune], queries[args.tune:]
    te, re_ = exact[: args.tune], exact[args.tune:]
    base = args.baseline
    depths = sorted({int(d) for d in args.depths.split(",")} | {base})
    for q in tq[:2]:  # warm up
        att.attribute(QuerySpec(q["prompt"], q["completion"]))
    tune = {d: summary(agreement(att, tq, te, row_of, d)) for d in depths}
    chosen = choose(tune)
    rng = np.random.default_rng(0)
    rep = {d: agreement(att, rq, re_, row_of, d) for d in sorted({base, chosen})}
    report = {}
    for d, m in rep.items():
        report[d] = {**summary(m), "overlap_at_10_ci": ci(np.array(m["strict"]), rng),
                     "tie_aware_at_10_ci": ci(np.array(m["tie_aware"]), rng)}
    diff = np.array(rep[chosen]["strict"]) - np.array(rep[base]["strict"])
    margins: dict = {}
    if args.margins:
        current = scoring.RERANK_MARGIN
        ms = sorted({float(m) for m in args.margins.split(",")} | {current})
        try:
            tune_m = {}
            for m in ms:
                scoring.RERANK_MARGIN = m
                tune_m[m] = summary(agreement(att, tq, te, row_of, chosen))
            same = [m for m in ms if all(tune_m[m][k] == tune_m[current][k] for k in ("overlap_at_10", "tie_aware_at_10"))]
            pick = min(same)
            report_m = {}
            for m in sorted({current, pick}):
                scoring.RERANK_MARGIN = m
                report_m[m] = summary(agreement(att, rq, re_, row_of, chosen))
        finally:
            scoring.RERANK_MARGIN = current
        margins = {"depth": chosen, "current": current, "tune": tune_m, "chosen": pick, "report": report_m}
    res = {"index": str(args.index), "tokens": att.reader.n_tokens, "documents": att.reader.n_docs,
           "queries": {"tune": [q["id"] for q in tq], "report": [q["id"] for q in rq]},
           "exact_pass_seconds": round(exact_s, 1), "baseline": base, "served_default": QueryOptions().exact_rerank,
           "tune": tune, "chosen": chosen,
           "report": report, "overlap_diff_chosen_baseline_ci": ci(diff, rng), **({"margins": margins} if margins else {}),
           "overlap_at_10_fast_vs_exact": report[chosen]["overlap_at_10"]}
    return finish(res, "attribution/rerank_depth.py", argv, args.out)


if __name__ == "__main__":
    main()
