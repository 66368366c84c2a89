"""PRISM attribution against EK-FAC (kronfluence), TRAK (traker) and BM25, with LDS, in one run.

1. Corpus: invented facts (several copies each) plus demo documents, ``--docs`` in all; the
   validation split (by document id) gives held-out queries. The facts do not depend on ``--seed``
   (the same 30 on every split: the seed draws the demo documents, the model and the subsets); their
   answers are drawn from 12 phrases, so most facts share theirs with another fact (``--answers
   unique`` gives each one of its own; ``planted_answers.py`` splits recall by it).
2. Train a small PRISM model on the training split, index it.
3. Queries: every fact's verbatim and paraphrased prompt with its answer as completion, and
   held-out documents (first tokens as prompt, the next ones as completion).
4. Score every (query, training document) pair with PRISM exact, PRISM fast (as served: FAISS
   candidates + exact re-rank, 0 outside the candidates), EK-FAC, TRAK and BM25. Each method runs in
   its own process, which reports its own set-up time, time per query and peak RSS.
5. LDS: retrain the model from scratch on ``--subsets`` random halves of the training documents
   (same recipe, same number of epochs), measure each query's loss, and take per query the Spearman
   correlation between a method's predicted subset effect (sum of its scores over the subset) and
   the measured loss decrease; LDS is the mean over queries.

    pip install --no-deps kronfluence==1.0.1 traker==0.3.2
    pip install accelerate einops einconv opt-einsum rank-bm25
    python -m bench.attribution.run_eval

Writes ``bench/results/attribution.json``. Everything under ``--work`` is reused on a rerun
(trained models, subset losses, method scores), so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import random
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import finish, index_complete, index_documents, peak_rss_mb
from bench.attribution.planted import make_facts
from prism_tda import demo_corpus_path
from prism_tda.cli import build_configs
from prism_tda.corpus import is_validation

HERE = Path(__file__).resolve().parent

# the evaluation model: small enough to retrain many times on 2 cores
MODEL = ["model.vocab_size=2048", "model.block_size=64", "model.n_layer=2", "model.n_head=4",
         "model.d_model=128", "model.n_prototypes=256", "model.n_active=8", "train.eval_every=100000",
         "train.ckpt_every=100000", "train.warmup_steps=30"]
# PRISM as served (cosine, best token per document), and other aggregations of its exact token scores
PRISM_VARIANTS = ["prism_exact_cosine_sum", "prism_exact_raw_sum", "prism_exact_raw_max"]
METHODS = ["prism_fast", "prism_exact", *PRISM_VARIANTS, "ekfac", "trak", "bergson", "bm25"]


# --------------------------------------------------------------------------- corpus and queries
def build_corpus(work: Path, n_docs: int, n_facts: int, copies: int, seed: int,
                 answers: str = "drawn") -> tuple[Path, list, list[dict]]:
    """The corpus file, the facts, and the demo documents left out of the corpus (never trained on by
    any model of the run: held-out queries beyond the validation split come from them)."""
    facts = make_facts(n_facts, copies, answers=answers)
    with gzip.open(demo_corpus_path(), "rt") as fh:
        demo = [json.loads(line) for line in fh]
    rng = random.Random(seed)
    rng.shuffle(demo)
    docs = [{"id": d, "source": "planted", "title": f.fact_id, "text": f.text} for f in facts for d in f.doc_ids]
    n_demo = max(n_docs - len(docs), 0)
    outside = demo[n_demo:]
    docs += demo[:n_demo]
    rng.shuffle(docs)
    path = work / "corpus.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for d in docs:
            fh.write(json.dumps(d) + "\n")
    return path, facts, outside


def split(corpus: Path, val_fraction: float) -> tuple[list[dict], list[dict]]:
    docs = [json.loads(line) for line in open(corpus)]
    return ([d for d in docs if not is_validation(d["id"], val_fraction)],
            [d for d in docs if is_validation(d["id"], val_fraction)])


def make_queries(facts, indexed_ids: set[str], heldout: list[dict], tok, n_heldout: int) -> list[dict]:
    qs = []
    for f in facts:
        wanted = sorted(set(f.doc_ids) & indexed_ids)
        if wanted:
            for kind, prompt in (("verbatim", f.prompt), ("paraphrase", f.paraphrase)):
                qs.append({"kind": kind, "fact": f.fact_id, "prompt": prompt, "completion": f.answer,
                           "planted": wanted})
    for d in heldout:
        ids = tok.encode(d["text"]).ids
        if len(ids) >= 24:
            qs.append({"kind": "heldout", "doc": d["id"], "prompt": tok.decode(ids[:16]),
                       "completion": tok.decode(ids[16:32])})
        if sum(q["kind"] == "heldout" for q in qs) >= n_heldout:
            break
    for q in qs:
        q["prompt_ids"] = tok.encode(q["prompt"]).ids
        q["completion_ids"] = tok.encode(q["completion"]).ids
    return qs


def train(corpus: Path, out: Path, steps: int, tokenizer: Path | None = None) -> Path:
    from prism_tda.model import checkpoint as ckpt
    from prism_tda.model.train import Trainer

    if (out / "latest").exists():
        return ckpt.resolve(out)
    model_cfg, train_cfg = build_configs("tiny", None, MODEL + [f"train.max_steps={steps}"])
    t = Trainer(model_cfg, train_cfg, [str(corpus)], out, tokenizer_path=tokenizer, progress=False).setup()
    return t.fit()


# --------------------------------------------------------------------------- methods (each in a child process)
def _prism_served(work: Path, index_dir: Path, queries: list[dict], candidates: int | None) -> dict:
    """The served path alone: open the index, answer fast queries."""
    from prism_tda.engine import Attributor, QueryOptions, QuerySpec

    t0 = time.perf_counter()
    att = Attributor.open(index_dir)
    setup = time.perf_counter() - t0
    ts = [att.attribute(QuerySpec(q["prompt"], q["completion"]), QueryOptions(n_candidates=candidates))
          .timings_ms.total / 1e3 for q in queries]
    return {"setup_seconds": setup, "seconds_per_query": float(np.median(ts))}


def _prism(work: Path, index_dir: Path, queries: list[dict], candidates: int | None) -> dict:
    """PRISM's fast and exact scores of every document (exact: all queries in one pass), the fast path's
    agreement with the exact top 10 as its candidate pool widens, and the candidates' recall."""
    from prism_tda.engine import Attributor, QueryOptions, QuerySpec

    t0 = time.perf_counter()
    att = Attributor.open(index_dir)
    out: dict = {"setup_seconds": time.perf_counter() - t0}
    res: dict[str, list] = {m: [] for m in ("prism_fast", "prism_exact", *PRISM_VARIANTS)}
    times: dict[str, list[float]] = {"fast": [], "exact": []}
    top: dict[str, list] = {"fast": [], "exact": []}
    cand_recall = []
    specs = [QuerySpec(q["prompt"], q["completion"]) for q in queries]
    encoded = [att.encode(s) for s in specs]
    t_ex = time.perf_counter()
    all_exact = att.exact_document_scores(encoded)
    times["exact"] = [(time.perf_counter() - t_ex) / len(queries)] * len(queries)  # one pass, shared
    for spec, qq, exact in zip(specs, encoded, all_exact, strict=True):
        # the fast path's ranking against the exhaustive one: every one of its first 10
        r = att.attribute(spec, QueryOptions(n_candidates=candidates, keep_opposed=True))
        times["fast"].append(r.timings_ms.total / 1e3)
        top["fast"].append([d.doc_id for d in r.documents])
        s = exact["cosine_max"]
        best = np.argsort(-s, kind="stable")[:10]
        top["exact"].append(best[s[best] > 0].tolist())
        res["prism_fast"].append(att.document_scores(qq, "fast", candidates)["cosine_max"])
        res["prism_exact"].append(exact["cosine_max"])
        for v in PRISM_VARIANTS:
            res[v].append(exact[v.removeprefix("prism_exact_")])
        cand_docs = set(att.candidate_documents(qq, candidates).tolist())
        cand_recall.append(len(set(top["exact"][-1]) & cand_docs) / max(len(top["exact"][-1]), 1))
    for k, v in res.items():
        np.save(work / f"scores_{k}.npy", np.stack(v).astype(np.float32))
    out["overlap_by_candidates"] = {}
    groups = (("all", ("verbatim", "paraphrase", "heldout")), ("facts", ("verbatim", "paraphrase")),
              ("heldout", ("heldout",)))
    # the served default (None), then FAISS's pool widened
    for nc in (candidates, 2 * candidates, 4 * candidates) if candidates else (candidates, 256, 1024):
        ov = [len({d.doc_id for d in att.attribute(spec, QueryOptions(n_candidates=nc, keep_opposed=True)).documents} & set(e))
              / max(len(e), 1) for spec, e in zip(specs, top["exact"], strict=True)]
        out["overlap_by_candidates"][nc] = {k: float(np.mean([o for o, q in zip(ov, queries, strict=True)
                                                               if q["kind"] in kinds])) for k, kinds in groups}
    return out | {"seconds_per_query_fast": float(np.median(times["fast"])),
                  "seconds_per_query_exact": float(np.median(times["exact"])),
                  "top10_fast": top["fast"], "top10_exact": top["exact"], "candidate_recall": cand_recall}


def _baseline(method: str, work: Path, index_dir: Path, queries: list[dict], n_docs: int) -> dict:
    """EK-FAC, TRAK or Bergson: a document's score is the sum over its sequences."""
    from bench.attribution import baselines
    from prism_tda.engine import layout

    kw: dict = {"single_queries": 8} if method in ("ekfac", "bergson") else {}
    if method == "ekfac":
        kw["damping_scales"] = baselines.EKFAC_DAMPING_SCALES
    r = baselines.score_index(method, index_dir, [(q["prompt_ids"], q["completion_ids"]) for q in queries],
                              work / f"{method}_store", **kw)

    def per_document(seq_scores: np.ndarray) -> np.ndarray:
        per_doc = np.zeros((len(queries), n_docs), dtype=np.float64)
        np.add.at(per_doc.T, np.asarray(r["seq_doc"]), seq_scores.T.astype(np.float64))
        return per_doc.astype(np.float32)

    np.save(work / f"scores_{method}.npy", per_document(r["scores"]))
    for c, s in r.get("scores_by_damping", {}).items():
        np.save(work / f"scores_{method}_damping_{c:g}.npy", per_document(s))
    out = {"setup_seconds": r["fit_seconds"], "score_seconds": r["score_seconds"],
           "seconds_per_query": r["score_seconds"] / len(queries), "n_train_sequences": len(r["seq_doc"]),
           "n_params": sum(p.numel() for p in r["model"].parameters())}
    out |= {k: r[k] for k in ("proj_dim", "single_seconds_per_query", "single_max_abs_diff",
                              "bytes_per_train_example", "faiss_bytes_per_train_example", "store_dim",
                              "projection_dim") if k in r}
    if "bytes_per_train_example" in r:  # the store (and its FAISS index) per training token
        shards = layout.read_manifest(index_dir).shards
        per_seq = r["bytes_per_train_example"] + r.get("faiss_bytes_per_train_example", 0)
        out["bytes_per_token"] = per_seq * sum(s.n_seqs for s in shards) / sum(s.n_tokens for s in shards)
    return out


def _bm25(work: Path, queries: list[dict], texts: list[str]) -> dict:
    from bench.attribution import baselines

    r = baselines.bm25_scores(texts, [q["prompt"] + q["completion"] for q in queries])
    np.save(work / "scores_bm25.npy", r["scores"].astype(np.float32))
    return {"setup_seconds": r["fit_seconds"], "seconds_per_query": r["score_seconds"] / len(queries)}


def _run_method(method: str, work: Path, index_dir: Path, queries: list[dict], candidates: int) -> None:
    torch.set_num_threads(2)
    docs = index_documents(index_dir, ["doc_id", "text"])
    if method == "prism_served":
        out = _prism_served(work, index_dir, queries, candidates)
    elif method == "prism":
        out = _prism(work, index_dir, queries, candidates)
    elif method in ("ekfac", "trak", "bergson"):
        out = _baseline(method, work, index_dir, queries, len(docs["doc_id"]))
    elif method == "bm25":
        out = _bm25(work, queries, docs["text"])
    else:
        raise ValueError(f"unknown method {method!r}")
    out = {"method": method, **out, "peak_rss_mb": peak_rss_mb()}
    (work / f"method_{method}.json").write_text(json.dumps(out))


def run_method(method: str, work: Path, index_dir: Path, queries: list[dict], candidates: int) -> dict:
    done = work / f"method_{method}.json"
    if not done.exists():
        p = mp.get_context("spawn").Process(target=_run_method, args=(method, work, index_dir, queries, candidates))
        t0 = time.perf_counter()
        p.start()
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"method {method} failed (exit code {p.exitcode})")
        print(f"[{method}] {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(done.read_text())


# --------------------------------------------------------------------------- metrics
def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra = np.argsort(np.argsort(a, kind="stable"), kind="stable").astype(float)
    rb = np.argsort(np.argsort(b, kind="stable"), kind="stable").astype(float)
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def rank_of(scores: np.ndarray, wanted: set[int]) -> int | None:
    order = np.argsort(-scores, kind="stable")[:50]
    for i, d in enumerate(order):
        if int(d) in wanted and scores[d] != 0:
            return i + 1
    return None


def summarise(ranks: list[int | None]) -> dict:
    n = max(len(ranks), 1)
    return {"n": len(ranks), "recall_at_1": sum(r == 1 for r in ranks) / n,
            "recall_at_10": sum(r is not None and r <= 10 for r in ranks) / n,
            "mrr": sum(1.0 / r for r in ranks if r is not None) / n}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=2000, help="documents in the corpus (facts included)")
    ap.add_argument("--facts", type=int, default=30)
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--epochs", type=float, default=4.0, help="passes over the training tokens")
    ap.add_argument("--subsets", type=int, default=32, help="LDS retrainings on random halves (>= 16)")
    ap.add_argument("--heldout", type=int, default=40,
                    help="held-out document queries (validation documents first, then demo documents left out of the corpus)")
    ap.add_argument("--candidates", type=int, default=None,
                    help="FAISS candidates (n_candidates; default: the served default, by the query kind)")
    ap.add_argument("--methods", default=",".join(["prism", "ekfac", "trak", "bm25"]))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answers", choices=("drawn", "unique"), default="drawn",
                    help="planted facts' answers: drawn from 12 phrases (facts share them) or one of its own per fact")
    ap.add_argument("--model-only", action="store_true",
                    help="stop after training and indexing the evaluation model (for scaling.py)")
    ap.add_argument("--work", default="runs/bench_lds")
    ap.add_argument("--out", default="bench/results/attribution.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    work = Path(args.work)
    corpus, facts, outside = build_corpus(work, args.docs, args.facts, args.copies, args.seed, args.answers)
    _, train_cfg = build_configs("tiny", None, MODEL)
    train_docs, val_docs = split(corpus, train_cfg.val_fraction)
    train_path = work / "train.jsonl"
    with open(train_path, "w") as fh:
        for d in train_docs:
            fh.write(json.dumps(d) + "\n")

    from prism_tda.indexer.run import build_index
    from prism_tda.model import checkpoint as ckpt
    from prism_tda.model.tokenizer import load_tokenizer

    # steps for a number of epochs over the training tokens (tokenizer of a first, probing run)
    t0 = time.perf_counter()
    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        from prism_tda.model.tokenizer import train_tokenizer

        train_tokenizer([d["text"] for d in train_docs], 2048).save(str(tok_path))
    tok = load_tokenizer(tok_path)
    n_tokens = sum(len(tok.encode(d["text"]).ids) + 1 for d in train_docs)
    tokens_per_step = train_cfg.batch_size * 64

    def steps_for(n: int) -> int:
        return max(int(args.epochs * n / tokens_per_step), 50)

    full_steps = steps_for(n_tokens)
    timings_path = work / "timings.json"  # set-up times of work a rerun reuses
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    fresh = not (work / "model" / "latest").exists()
    ck = train(corpus, work / "model", full_steps, tok_path)
    if fresh:
        timings["prism_train"] = time.perf_counter() - t0
    index_dir = work / "index"
    t0 = time.perf_counter()
    if not index_complete(index_dir):
        build_index(ck, [str(train_path)], index_dir, progress=False)
        timings["prism_index"] = time.perf_counter() - t0
    timings_path.write_text(json.dumps(timings))
    if args.model_only:
        return {"model": str(ck), "index": str(index_dir), "timings": timings}
    docs = index_documents(index_dir, ["doc_id", "external_id"])
    ext_to_doc = dict(zip(docs["external_id"], docs["doc_id"], strict=True))
    n_docs = len(ext_to_doc)
    # held-out queries: the validation split first, then documents outside the corpus when more are asked
    queries = make_queries(facts, set(ext_to_doc), val_docs + outside, tok, args.heldout)
    (work / "queries.json").write_text(json.dumps(queries, indent=1))

    # memorised facts: greedy decoding of the full model completes the answer
    model, _, _ = ckpt.load_checkpoint(ck)
    for q in queries:
        if q["kind"] != "heldout":
            x = torch.tensor([q["prompt_ids"]])
            y = model.generate(x, len(q["completion_ids"]))
            q["memorised"] = tok.decode(y[0, x.shape[1]:].tolist()).strip() == q["completion"].strip()

    # ---- each method scores every (query, document) pair
    info = {m: run_method(m, work, index_dir, queries, args.candidates) for m in args.methods.split(",")}
    info["prism_served"] = run_method("prism_served", work, index_dir, queries, args.candidates)
    scores = {m: np.load(work / f"scores_{m}.npy") for m in METHODS if (work / f"scores_{m}.npy").exists()}

    # ---- LDS: retrain on random halves, measure query losses
    from bench.attribution import baselines

    rng = np.random.default_rng(args.seed)
    doc_ids_sorted = np.array(sorted(ext_to_doc.values()))
    masks, losses = [], []
    lds_dir = work / "lds"
    lds_dir.mkdir(exist_ok=True)
    query_ds = baselines.TokenDataset.from_queries([(q["prompt_ids"], q["completion_ids"]) for q in queries],
                                                   model.cfg.block_size)
    full_loss = baselines.query_losses(model, query_ds)
    doc_by_ext = {d["id"]: d for d in train_docs}
    lds_s = 0.0
    for j in range(args.subsets):
        pick = rng.choice(n_docs, n_docs // 2, replace=False)
        mask = np.zeros(n_docs, dtype=bool)
        mask[doc_ids_sorted[pick]] = True
        masks.append(mask)
        res_path = lds_dir / f"subset_{j:03d}.json"
        if not res_path.exists():
            sub = lds_dir / f"subset_{j:03d}.jsonl"
            inv = {v: k for k, v in ext_to_doc.items()}
            with open(sub, "w") as fh:
                for d in np.nonzero(mask)[0]:
                    fh.write(json.dumps(doc_by_ext[inv[int(d)]]) + "\n")
                for d in val_docs:  # held out by id in every run, as in the full run
                    fh.write(json.dumps(d) + "\n")
            n_sub = sum(len(tok.encode(doc_by_ext[inv[int(d)]]["text"]).ids) + 1 for d in np.nonzero(mask)[0])
            t0 = time.perf_counter()
            sub_ck = train(sub, lds_dir / f"run_{j:03d}", steps_for(n_sub), tok_path)
            m_j, _, _ = ckpt.load_checkpoint(sub_ck)
            loss_j = baselines.query_losses(m_j, query_ds)
            res_path.write_text(json.dumps({"loss": loss_j.tolist(), "seconds": time.perf_counter() - t0}))
            print(f"[lds] subset {j + 1}/{args.subsets}: {time.perf_counter() - t0:.0f} s", flush=True)
        losses.append(json.loads(res_path.read_text())["loss"])
        lds_s += json.loads(res_path.read_text())["seconds"]
    masks_a, losses_a = np.stack(masks).astype(np.float64), np.asarray(losses)  # (M, n_docs), (M, n_queries)

    def lds(method: str, kinds: tuple[str, ...]) -> float:
        sel = [i for i, q in enumerate(queries) if q["kind"] in kinds]
        pred = masks_a @ scores[method][sel].T.astype(np.float64)  # (M, n_sel)
        return float(np.mean([spearman(pred[:, n], -losses_a[:, i]) for n, i in enumerate(sel)]))

    # ---- planted facts
    res: dict = {"per_method": {}}
    for m in scores:
        per = {}
        for kind in ("verbatim", "paraphrase"):
            for mem in (None, True, False):
                ranks = [rank_of(scores[m][i], {ext_to_doc[e] for e in q["planted"]})
                         for i, q in enumerate(queries)
                         if q["kind"] == kind and (mem is None or q["memorised"] == mem)]
                per[f"{kind}{'' if mem is None else ('_memorised' if mem else '_not_memorised')}"] = summarise(ranks)
        per["lds"] = lds(m, ("verbatim", "heldout"))
        per["lds_heldout"] = lds(m, ("heldout",))
        per["lds_facts"] = lds(m, ("verbatim",))
        per["lds_paraphrase"] = lds(m, ("paraphrase",))
        res["per_method"][m] = per
    pm = res["per_method"]
    pr = info["prism"]
    overlaps = [len(set(f) & set(e)) / max(len(e), 1) for f, e in zip(pr["top10_fast"], pr["top10_exact"], strict=True)]
    ek = info.get("ekfac", {})
    res |= {f"lds_{m}": pm[m]["lds"] for m in pm}
    res |= {
        "canary_recall_at_10_verbatim": pm["prism_fast"]["verbatim"]["recall_at_10"],
        "canary_recall_at_10_paraphrase": pm["prism_fast"]["paraphrase"]["recall_at_10"],
        "overlap_at_10_fast_vs_exact": float(np.mean(overlaps)),
        "candidate_recall_of_exact_top10": float(np.mean(pr["candidate_recall"])),
        "overlap_at_10_by_candidates": pr["overlap_by_candidates"],
        "seconds_per_query_prism_fast": info["prism_served"]["seconds_per_query"],
        "seconds_per_query_prism_exact": pr["seconds_per_query_exact"],
        "seconds_per_query_ekfac": ek.get("seconds_per_query"),
        "seconds_per_query_trak": info.get("trak", {}).get("seconds_per_query"),
        "seconds_per_query_bm25": info.get("bm25", {}).get("seconds_per_query"),
        "speedup_vs_ekfac_per_query": (ek["seconds_per_query"] / info["prism_served"]["seconds_per_query"]) if ek else None,
        # as served (index open + fast queries); with the exact reference path and scoring of every document
        "peak_rss_mb_prism": info["prism_served"]["peak_rss_mb"],
        "peak_rss_mb_prism_with_exact": pr["peak_rss_mb"],
        "peak_rss_mb_ekfac": ek.get("peak_rss_mb"),
        "peak_rss_mb_trak": info.get("trak", {}).get("peak_rss_mb"),
        "peak_rss_mb_bm25": info.get("bm25", {}).get("peak_rss_mb"),
        "setup_seconds": {"prism_train": round(timings.get("prism_train", float("nan")), 1),
                          "prism_index": round(timings.get("prism_index", float("nan")), 1),
                          "prism_open": round(pr["setup_seconds"], 2),
                          **{m: round(info[m]["setup_seconds"], 1) for m in info if not m.startswith("prism")}},
        "lds_retrain_seconds": round(lds_s, 1),  # sum over the subset runs (incl. query losses)
        "corpus": {"documents": n_docs, "train_tokens": n_tokens, "validation_documents": len(val_docs),
                   "train_sequences": ek.get("n_train_sequences"), "facts": len(facts), "copies": args.copies},
        "queries": {k: sum(q["kind"] == k for q in queries) for k in ("verbatim", "paraphrase", "heldout")},
        "memorised_facts": sum(q.get("memorised", False) for q in queries if q["kind"] == "verbatim"),
        "full_model_mean_query_loss": float(full_loss.mean()),
        "subset_loss_spread": float(losses_a.std(0).mean()),
        "methods": {m: {k: v for k, v in info[m].items() if k not in ("top10_fast", "top10_exact", "candidate_recall")}
                    for m in info},
    }
    res["config"] = {"subsets": args.subsets, "answers": args.answers, "epochs": args.epochs, "full_steps": full_steps,
                     "candidates": args.candidates, "model": model.cfg.to_dict()}
    return finish(res, "attribution/run_eval.py", argv, args.out)


if __name__ == "__main__":
    main()
