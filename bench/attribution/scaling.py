"""Time per query against corpus size, per method, on one protocol, with the evaluation model of
``run_eval.py``.

For each corpus size (demo documents; sizes growing by 2x), index the corpus with PRISM and time:

- PRISM fast, one query at a time (as served), and PRISM exact;
- EK-FAC (kronfluence: factors fitted on that corpus), on two protocols: **one query per pass**
  over the training gradients (``ekfac_single``, what a served index is compared against) and
  **every query in one pass** (``ekfac_batched``, kronfluence's best case), from one fit;
- TRAK (up to ``--trak-max-docs``: featurising every training example is its set-up) and BM25.

Every method runs in its own process and reports set-up seconds, seconds per query and memory:
``rss_growth_mb`` is the process's peak resident memory (VmHWM) minus its resident memory when the
method starts (the interpreter with torch imported), the same for every method.

    python -m bench.attribution.scaling --model runs/bench_lds/model

Writes ``bench/results/attribution_scaling.json`` and ``docs/img/attribution_scaling.png``.
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
from prism_tda import demo_corpus_path

HERE = Path(__file__).resolve().parent

QUERIES = [("A computer", " is a machine"), ("Love is", " a many splendored thing"), ("The only way to", " be"),
           ("Never trust a", " man who"), ("It is better to", " have loved and lost"),
           ("Nothing is", " impossible"), ("Life is", " what happens"), ("A fool and his", " money")]


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _time_method(method: str, index_dir: str, out_json: str, queries: list[tuple[str, str]],
                 single_queries: int) -> None:
    torch.set_num_threads(2)
    base_mb = _rss_mb()
    from bench.attribution import baselines
    from prism_tda.engine import Attributor, QueryOptions, QuerySpec
    from prism_tda.engine import layout as store
    from prism_tda.model import checkpoint as ckpt
    from prism_tda.model.tokenizer import load_tokenizer

    index = Path(index_dir)
    work = Path(out_json).parent / f"{method}_store"
    out: dict = {}
    t0 = time.perf_counter()
    if method.startswith("prism"):
        att = Attributor.open(index)
        out["setup_seconds"] = time.perf_counter() - t0
        mode = method.split("_")[1]
        # every document of the corpus may answer, as every document is scored by EK-FAC: the corpus is
        # demo documents the evaluation model mostly never trained on, which the served default leaves out
        opt = QueryOptions(mode=mode, include_untrained=True)
        att.attribute(QuerySpec(*queries[0]), opt)  # warm
        res = [att.attribute(QuerySpec(p, c), opt) for p, c in queries]
        out["seconds_per_query"] = float(np.median([r.timings_ms.total / 1e3 for r in res]))
        out["documents_returned_mean"] = float(np.mean([len(r.documents) for r in res]))
    elif method in ("ekfac", "trak"):
        ck = ckpt.resolve(store.read_manifest(index).checkpoint)
        tok = load_tokenizer(ck / ckpt.TOKENIZER)
        kw = {"query_batch_size": len(queries), "single_queries": single_queries} if method == "ekfac" else {}
        r = baselines.score_index(method, index, [(tok.encode(p).ids, tok.encode(c).ids) for p, c in queries], work,
                                  **kw)
        out |= {"setup_seconds": r["fit_seconds"], "seconds_per_query": r["score_seconds"] / len(queries)}
        if method == "ekfac":
            out |= {"batched_queries": len(queries), "single_seconds": r["single_seconds"],
                    "single_seconds_per_query": r["single_seconds_per_query"],
                    "single_vs_batched_max_abs_diff": r["single_max_abs_diff"]}
    elif method == "bm25":
        docs = index_documents(index, ["text"])["text"]
        r = baselines.bm25_scores(docs, [p + c for p, c in queries])
        out |= {"setup_seconds": r["fit_seconds"], "seconds_per_query": r["score_seconds"] / len(queries)}
    out["peak_rss_mb"] = peak_rss_mb()
    out["rss_growth_mb"] = out["peak_rss_mb"] - base_mb
    Path(out_json).write_text(json.dumps(out))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/bench_lds/model", help="checkpoint directory (run_eval.py's model)")
    ap.add_argument("--sizes", default="1500,3000,6000,12000", help="documents (about 1.4 sequences each)")
    ap.add_argument("--single-queries", type=int, default=3, help="queries EK-FAC scores one per pass")
    ap.add_argument("--trak-max-docs", type=int, default=1000)
    ap.add_argument("--work", default="runs/bench_scaling")
    ap.add_argument("--out", default="bench/results/attribution_scaling.json")
    ap.add_argument("--plot", default="docs/img/attribution_scaling.png")
    args = ap.parse_args(argv)
    from prism_tda.engine import layout as store
    from prism_tda.indexer.run import build_index
    from prism_tda.model import checkpoint as ckpt

    ck = ckpt.resolve(args.model)
    work = Path(args.work)
    with gzip.open(demo_corpus_path(), "rt") as fh:
        demo = [json.loads(line) for line in fh]
    random.Random(7).shuffle(demo)
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        d = work / f"n{n}"
        d.mkdir(parents=True, exist_ok=True)
        corpus = d / "corpus.jsonl"
        with open(corpus, "w") as fh:
            for doc in demo[:n]:
                fh.write(json.dumps(doc) + "\n")
        t0 = time.perf_counter()
        built = d / "index_seconds.json"  # the build's time, kept for the runs that reuse the index
        if not index_complete(d / "index"):
            build_index(ck, [str(corpus)], d / "index", progress=False)
            built.write_text(json.dumps(time.perf_counter() - t0))
        index_s = json.loads(built.read_text()) if built.exists() else None  # None: built before it was kept
        n_seq = sum(sh.n_seqs for sh in store.read_manifest(d / "index").shards)
        for method in ("prism_fast", "prism_exact", "ekfac", "trak", "bm25"):
            if method == "trak" and n > args.trak_max_docs:
                continue
            res = d / f"{method}.json"
            if not res.exists():
                p = mp.get_context("spawn").Process(target=_time_method, args=(method, str(d / "index"), str(res),
                                                                              QUERIES, args.single_queries))
                p.start()
                p.join()
                if p.exitcode != 0:
                    raise SystemExit(f"{method} at {n} documents failed (exit code {p.exitcode})")
            r = json.loads(res.read_text())
            if method.startswith("prism"):
                r["index_seconds"] = index_s
            rows.append({"documents": n, "sequences": n_seq, "method": method, **r})
            print(json.dumps(rows[-1]), flush=True)

    by = {(r["documents"], r["method"]): r for r in rows}
    sizes = sorted({r["documents"] for r in rows})
    fast = {n: by[(n, "prism_fast")]["seconds_per_query"] for n in sizes}
    single = {n: by[(n, "ekfac")]["single_seconds_per_query"] / fast[n] for n in sizes}
    batched = {n: by[(n, "ekfac")]["seconds_per_query"] / fast[n] for n in sizes}
    largest = sizes[-1]
    res = {"rows": rows,
           "speedup_vs_ekfac_single_query_by_documents": single,
           "speedup_vs_ekfac_batched_by_documents": batched,
           "speedup_vs_ekfac_single_query": single[largest],
           "speedup_vs_ekfac_batched": batched[largest],
           "largest": {"documents": largest, "sequences": by[(largest, "prism_fast")]["sequences"],
                       "queries_batched": len(QUERIES), "queries_single": args.single_queries},
           "rss_growth_mb_largest": {m: by[(largest, m)]["rss_growth_mb"] for m in
                                     ("prism_fast", "prism_exact", "ekfac", "bm25") if (largest, m) in by}}

    try:
        import matplotlib
    except ImportError:  # the measurements stand without their figure
        print("matplotlib is not installed: no plot drawn", flush=True)
        res["plot"] = None
    else:
        res["plot"] = _plot(matplotlib, by, sizes, args.plot)
    return finish(res, "attribution/scaling.py", argv, args.out)


def _plot(matplotlib, by: dict, sizes: list[int], path: str) -> str:
    """Seconds per query against training sequences, per method, as a log-log figure at ``path``."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    curves = [("prism_fast", "seconds_per_query", "o-", "PRISM fast"),
              ("prism_exact", "seconds_per_query", "s--", "PRISM exact"),
              ("ekfac", "single_seconds_per_query", "^-", "EK-FAC, one query per pass"),
              ("ekfac", "seconds_per_query", "^:", f"EK-FAC, {len(QUERIES)} queries per pass"),
              ("trak", "seconds_per_query", "v-", "TRAK"), ("bm25", "seconds_per_query", "d:", "BM25")]
    for m, key, style, label in curves:
        pts = [(by[(n, m)]["sequences"] if "sequences" in by[(n, m)] else n, by[(n, m)][key])
               for n in sizes if (n, m) in by]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=label)
    ax.set(xscale="log", yscale="log", xlabel="training sequences", ylabel="seconds per query",
           title="Time per query vs corpus size (2 CPU cores)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


if __name__ == "__main__":
    main()
