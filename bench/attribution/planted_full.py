"""Planted-fact evaluation of PRISM attribution (fast and exact) against BM25, in one run.

Builds the demo corpus plus invented facts (several copies each), trains the tiny PRISM model on
it (or reuses it), indexes the training split, and asks every fact with its verbatim and its
paraphrased prompt. Reports recall@1/@10 and MRR of the planted documents per method (``fast``: the
fast path's ranking, every one of its first 50 documents; ``served``: its answer, the documents whose
value opposes the output left out, which the ``canary_*`` keys read), prompt kind
and memorised / not memorised facts; top-10 overlap of the fast path with the exact path and the
candidate stage's recall of the exact top-10; time per query.

    python -m bench.attribution.planted_full --facts 30 --copies 6 --steps 1500

The whole demo corpus is too large for the baselines that need gradients of every training example
on 2 cores; ``run_eval.py`` compares all methods (and LDS) on a smaller corpus.
Writes ``bench/results/attribution_planted_full.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import finish, index_documents, served_ranking
from bench.attribution.planted import make_facts, write_corpus
from prism_tda.cli import build_configs
from prism_tda.corpus import is_validation
from prism_tda.engine import Attributor, QueryOptions, QuerySpec
from prism_tda.engine.present import left_out_opposed
from prism_tda.indexer.run import build_index
from prism_tda.model import checkpoint as ckpt
from prism_tda.model.train import Trainer


def rank_of(ranked: list[str], wanted: set[str]) -> int | None:
    for i, d in enumerate(ranked):
        if d in wanted:
            return i + 1
    return None


def summarise(ranks: list[int | None]) -> dict:
    n = max(len(ranks), 1)
    return {"n": len(ranks),
            "recall_at_1": sum(1 for r in ranks if r == 1) / n,
            "recall_at_10": sum(1 for r in ranks if r is not None and r <= 10) / n,
            "mrr": sum(1.0 / r for r in ranks if r is not None) / n}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--facts", type=int, default=30)
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--work", default="runs/bench_attribution")
    ap.add_argument("--candidates", type=int, default=None,
                    help="FAISS candidates (n_candidates; default: the served default, by the query kind)")
    ap.add_argument("--seed", type=int, default=0, help="the facts' draw (0: the facts every earlier run used)")
    ap.add_argument("--out", default="bench/results/attribution_planted_full.json")
    args = ap.parse_args(argv)
    work = Path(args.work)
    facts = make_facts(args.facts, args.copies, seed=args.seed)
    corpus = write_corpus(work, facts)

    model_cfg, train_cfg = build_configs("tiny", None, [f"train.max_steps={args.steps}"])
    t0 = time.perf_counter()
    trainer = Trainer(model_cfg, train_cfg, [str(corpus)], work / "run", progress=False).setup()
    if trainer.step < train_cfg.max_steps:
        trainer.fit()
    train_s = time.perf_counter() - t0
    ck = ckpt.resolve(work / "run")

    # index the training split only (what the model was trained on)
    train_corpus = work / "train.jsonl"
    with open(corpus) as src, open(train_corpus, "w") as dst:
        for line in src:
            if not is_validation(json.loads(line)["id"], train_cfg.val_fraction):
                dst.write(line)
    index_dir = work / f"index_{ck.name}"  # one index per checkpoint
    t0 = time.perf_counter()
    build_index(ck, [str(train_corpus)], index_dir, progress=False)
    index_s = time.perf_counter() - t0

    att = Attributor.open(index_dir)
    docs = index_documents(index_dir, ["doc_id", "external_id", "text"])
    ext = docs["external_id"]
    rss_prism = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    from rank_bm25 import BM25Okapi

    t0 = time.perf_counter()
    bm25 = BM25Okapi([t.lower().split() for t in docs["text"]])
    bm25_setup_s = time.perf_counter() - t0

    indexed = set(ext)
    tok = att.tokenizer
    queries = []  # (fact, kind, prompt, wanted, memorised)
    for f in facts:
        wanted = set(f.doc_ids) & indexed
        if not wanted:
            continue
        ids = tok.encode(f.prompt).ids
        gen = att.model.generate(torch.tensor([ids]), len(tok.encode(f.answer).ids))
        memorised = tok.decode(gen[0, len(ids):].tolist()).strip() == f.answer.strip()
        for kind, prompt in (("verbatim", f.prompt), ("paraphrase", f.paraphrase)):
            queries.append((f, kind, prompt, wanted, memorised))
    # exact: every training token recomputed, all queries in one pass (ranked as exact mode ranks: the
    # best token's cosine among the documents the checkpoint trained on)
    encoded = [att.encode(QuerySpec(prompt, f.answer)) for f, _, prompt, _, _ in queries]
    t0 = time.perf_counter()
    exact_all = att.exact_document_scores(encoded)
    exact_s = (time.perf_counter() - t0) / max(len(queries), 1)
    trained = att.reader.trained(np.arange(att.reader.n_docs))
    rows = []
    overlaps, cand_recalls, times = [], [], {"fast": [], "exact": [exact_s] * len(queries), "bm25": []}
    for (f, kind, prompt, wanted, memorised), q, exact in zip(queries, encoded, exact_all, strict=True):
        row = {"fact": f.fact_id, "kind": kind, "memorised": memorised}
        # the fast path's ranking (every document of its first 50 by score, as the exact ranking below), and
        # the served answer (the documents whose value opposes the output left out)
        r = att.attribute(QuerySpec(prompt, f.answer), QueryOptions(n_documents=50, n_candidates=args.candidates,
                                                                    keep_opposed=True))
        times["fast"].append(r.timings_ms.total / 1e3)
        served, _ = left_out_opposed(r.documents, [d.value for d in r.documents])  # the served rule
        res = {"fast": [ext[d.doc_id] for d in r.documents], "served": [ext[d.doc_id] for d in served]}
        # and the answer of 10 documents as served by default (its own cut, its near-tie settled there)
        r10 = att.attribute(QuerySpec(prompt, f.answer), QueryOptions(n_documents=10, n_candidates=args.candidates))
        res["served10"] = [ext[d.doc_id] for d in r10.documents]
        s = exact["cosine_max"]
        order = served_ranking(s, exact["cosine_sum"], trained, 50)[0][:50]  # exact mode's answer
        res["exact"] = [ext[int(d)] for d in order if np.isfinite(s[d]) and s[d] > 0]
        for mode in ("fast", "served", "served10", "exact"):
            row[mode] = rank_of(res[mode], wanted)
        top_f, top_e = set(res["fast"][:10]), set(res["exact"][:10])
        overlaps.append(len(top_f & top_e) / max(len(top_e), 1))
        cand_docs = {ext[int(d)] for d in att.candidate_documents(q, args.candidates)}
        row["candidate_recall_of_exact_top10"] = len(top_e & cand_docs) / max(len(top_e), 1)
        row["exact_top10_copies_in_candidates"] = len(top_e & wanted & cand_docs)
        cand_recalls.append(row["candidate_recall_of_exact_top10"])
        t1 = time.perf_counter()
        scores = bm25.get_scores((prompt + f.answer).lower().split())
        times["bm25"].append(time.perf_counter() - t1)
        row["bm25"] = rank_of([ext[i] for i in np.argsort(-scores)[:50]], wanted)
        rows.append(row)

    # near-ties of the exact ranking (more than 10 documents within 0.1% of the 10th-best score), per
    # aggregation, over the documents the checkpoint trained on, one per distinct text (identical
    # copies, planted or not, tie by construction) and the fact's own copies left out
    ext_arr = np.asarray(ext, dtype=object)
    first_of_text = np.zeros(len(ext_arr), dtype=bool)
    first_of_text[np.unique(np.asarray(docs["text"], dtype=object), return_index=True)[1]] = True

    def near_ties(sc: np.ndarray, wanted: set[str], k: int = 10) -> int:
        keep = trained & first_of_text & ~np.isin(ext_arr, list(wanted))
        s = np.sort(np.where(keep, sc, -np.inf))[::-1]
        kth = float(s[k - 1])
        return int((s >= kth - 1e-3 * abs(kth)).sum()) if np.isfinite(kth) else 0

    ties = {agg: [near_ties(e[agg], w) for e, (_, _, _, w, _) in zip(exact_all, queries, strict=True)]
            for agg in exact_all[0]} if exact_all else {}

    def group(method: str, kind: str, mem: bool | None = None) -> dict:
        return summarise([r[method] for r in rows if r["kind"] == kind and (mem is None or r["memorised"] == mem)])

    res: dict = {"per_method": {}}
    for m in ("fast", "served", "served10", "exact", "bm25"):
        res["per_method"][m] = {f"{k}{'' if mem is None else ('_memorised' if mem else '_not_memorised')}":
                                group(m, k, mem) for k in ("verbatim", "paraphrase") for mem in (None, True, False)}
    pm = res["per_method"]
    res |= {
        # the guards read the served answer; the agreement with exact (below) the fast path's ranking
        "canary_recall_at_10_verbatim": pm["served"]["verbatim"]["recall_at_10"],
        "canary_recall_at_10_paraphrase": pm["served"]["paraphrase"]["recall_at_10"],
        "canary_recall_at_10_verbatim_memorised": pm["served"]["verbatim_memorised"]["recall_at_10"],
        "canary_recall_at_10_verbatim_memorised_answer_of_10": pm["served10"]["verbatim_memorised"]["recall_at_10"],
        "canary_recall_at_1_verbatim_memorised_answer_of_10": pm["served10"]["verbatim_memorised"]["recall_at_1"],
        "canary_recall_at_10_paraphrase_fast_ranking": pm["fast"]["paraphrase"]["recall_at_10"],
        "candidate_recall_of_exact_top10_memorised": float(np.mean([r["candidate_recall_of_exact_top10"]
                                                                     for r in rows if r["memorised"]] or [np.nan])),
        "near_tie_query_share": float(np.mean([n > 10 for n in ties.get("cosine_max", [])] or [np.nan])),
        "near_tie_query_share_by_aggregation": {a: float(np.mean([n > 10 for n in v])) for a, v in ties.items()},
        "canary_mrr_verbatim_fast": pm["fast"]["verbatim"]["mrr"],
        "canary_mrr_verbatim_exact": pm["exact"]["verbatim"]["mrr"],
        "canary_mrr_verbatim_bm25": pm["bm25"]["verbatim"]["mrr"],
        "overlap_at_10_fast_vs_exact": float(np.mean(overlaps)),
        "candidate_recall_of_exact_top10": float(np.mean(cand_recalls)),
        "seconds_per_query_prism_fast": float(np.median(times["fast"])),
        "seconds_per_query_prism_exact": float(np.median(times["exact"])),
        "seconds_per_query_bm25": float(np.median(times["bm25"])),
        "setup_seconds": {"prism_train": round(train_s, 1), "prism_index": round(index_s, 1),
                          "prism_open": round(att.reader.load_seconds, 2), "bm25": round(bm25_setup_s, 2)},
        "peak_rss_mb_prism": rss_prism,
        "facts": len(facts), "copies": args.copies, "memorised_facts": len({r["fact"] for r in rows if r["memorised"]}),
        "queries": rows,
    }
    res["config"] = {"steps": args.steps, "candidates": args.candidates, "model": model_cfg.to_dict()}
    return finish(res, "attribution/planted_full.py", argv, args.out)


if __name__ == "__main__":
    main()
