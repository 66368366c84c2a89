"""Scale: disk, serving memory, latency and fast-vs-exact agreement as the corpus grows by 4x.

**Real sizes** come from one index over a prefix of the scale corpus (``bench/scale_corpus.py``:
Debian documentation, the fortunes and planted facts), built by ``prism index`` with the demo
model in shards of about 1M tokens. The smaller real sizes are that index's first shards: an index
is its shards plus a manifest, and a manifest over the first n shards is exactly the index of
those documents under the same calibration (built the same way by ``--append``). Index time per
size is the calibration plus those shards' build seconds; the whole build's wall time is reported
beside it.

**Synthetic sizes** (labelled so in the results) merge every real shard into one shard of the
size a default build makes (``index.shard_bytes`` 64 MB: about 23M tokens of this corpus) and copy
its files (real values, a repeated corpus) under new work-unit numbers until the index holds 4x
and 16x the largest real size; each copy's FAISS ids are rewritten to its unit. They measure
serving cost (disk, memory, latency), not attribution quality.

The demo model never trained on this corpus, so its training record marks every document
untrained; every query here asks for them (``include_untrained``), as an audit of outside text would.

For every size: ``prism serve`` is started on the index as its own process, time to ``/readyz``,
``POST /v1/attribute`` (fast mode, top 10, a 48-token prompt and its 16-token continuation from
held-out documents of the corpus, one query at a time) p50/p99, and the server's anonymous memory
(``RssAnon``) after the queries, against the same server on an empty index (no shards); at the
largest size also p50/p99 with 8 clients at once (``--clients``). Overlap@10
of the fast path with the exact ranking (every token recomputed) is measured in-process at one
real size.

    python -m bench.scale_corpus --out runs/scale/corpus
    prism index --checkpoint runs/demo --out runs/scale/real --set index.shard_bytes=3145728 \\
        --corpus runs/scale/corpus/part-000.jsonl runs/scale/corpus/part-001.jsonl runs/scale/corpus/part-002.jsonl
    python -m bench.scale --real runs/scale/real --work runs/scale

Writes ``bench/results/scale.json`` and ``docs/img/scale.png`` (with matplotlib installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shutil
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from bench._common import finish, served, served_ranking
from bench.scale_corpus import MANIFEST
from prism_tda.engine import layout
from prism_tda.indexer.merge import merge_index
from prism_tda.model.tokenizer import load_tokenizer
from prism_tda.procmem import status_bytes, tree_bytes

TOP_FILES = layout.INDEX_FILES


# --------------------------------------------------------------------------- indexes of each size
def subset_index(real: Path, n_shards: int, out: Path) -> Path:
    """The index of ``real``'s first ``n_shards`` shards: a manifest, links to the shared files and shards."""
    m = layout.read_manifest(real)
    if out.exists():
        shutil.rmtree(out)
    (out / layout.SHARDS).mkdir(parents=True)
    for name in TOP_FILES[1:]:
        (out / name).symlink_to((real / name).resolve())
    for sh in m.shards[:n_shards]:
        layout.shard_dir(out, sh.unit).symlink_to(layout.shard_dir(real, sh.unit).resolve())
    m.shards = m.shards[:n_shards]
    m.units = [u for u in m.units if u.unit in {s.unit for s in m.shards}]
    (out / layout.MANIFEST).write_text(json.dumps(m.to_dict(), indent=2))
    return out


def synthetic_index(real: Path, copies: int, out: Path) -> Path:
    """``copies`` copies (files copied, not linked) of one shard that merges every real shard."""
    return merge_index(real, out, copies, progress=lambda c, dt: print(f"synthetic copy {c}/{copies} ({dt:.0f} s)",
                                                                       flush=True))


disk_bytes = layout.disk_bytes


# --------------------------------------------------------------------------- queries
def held_out_queries(corpus_file: Path, tokenizer_path: Path, n: int, seed: int = 0) -> list[dict]:
    """A 48-token prompt and its 16-token continuation from documents of a file that is not indexed."""
    tok = load_tokenizer(tokenizer_path)
    rng = np.random.default_rng(seed)
    lines = corpus_file.read_text().splitlines()
    out = []
    for i in rng.permutation(len(lines)):
        d = json.loads(lines[i])
        if d.get("source") == "planted":
            continue
        ids = tok.encode(d["text"]).ids
        if len(ids) >= 64:
            out.append({"prompt": tok.decode(ids[:48]), "completion": tok.decode(ids[48:64]), "id": d["id"]})
        if len(out) == n:
            break
    return out


def overlap_queries(corpus_file: Path, tokenizer_path: Path, n: int, skip: int = 0) -> list[dict]:
    """The fast-vs-exact measurement's held-out queries: ``n`` of :func:`held_out_queries`'s draw (seed 2)
    after its first ``skip``. The draw is one seeded order, so the first ``skip`` are exactly the queries
    of a run with ``n = skip``: a later run with ``skip`` asks only queries no earlier run asked."""
    return [dict(q, kind="held_out") for q in held_out_queries(corpus_file, tokenizer_path, skip + n, seed=2)[skip:]]


def planted_queries(corpus: Path, files: list[str]) -> list[dict]:
    """Verbatim planted facts whose copies are all in the indexed files."""
    indexed = set()
    for f in files:
        with open(f) as fh:
            for line in fh:
                if '"planted"' in line:
                    indexed.add(json.loads(line)["id"])
    facts = json.loads((corpus / "facts.json").read_text())
    return [{"prompt": f["prompt"], "completion": f["answer"], "id": f["fact_id"], "doc_ids": f["doc_ids"]}
            for f in facts if set(f["doc_ids"]) <= indexed]


# --------------------------------------------------------------------------- serving
OPTIONS: dict = {}  # QueryOptions fields every fast query also sends (``--options``)


def _body(q: dict) -> dict:
    return {"prompt": q["prompt"], "completion": q["completion"], "top_k": 10, "mode": "fast", "include_untrained": True,
            **OPTIONS}


def concurrent_latency(url: str, queries: list[dict], n_requests: int, clients: int) -> dict:
    """p50/p99 of ``n_requests`` queries sent by ``clients`` threads at once (one connection each)."""
    from bench.service_load import run_load

    r = run_load(url, lambda i: _body(queries[i % len(queries)]), n_requests, clients, "/v1/attribute")
    if r["errors"]:
        raise SystemExit(f"{clients} clients: {r['errors']} errors, e.g. {r['error_examples'][:1]}")
    return {k: r[k] for k in ("requests", "concurrency", "p50_ms", "p99_ms", "mean_ms", "requests_per_s")}


def serve_and_measure(index: Path, queries: list[dict], n_requests: int, clients: int = 0) -> dict:
    """One query at a time (``n_requests`` after five to warm up), then with ``clients`` > 1 the same
    number from that many clients at once (``concurrent``)."""
    with served(index, "scale") as (server, url, ready_s):
        anon_ready = status_bytes(server.pid)
        lat, timings, scored = [], [], []
        with httpx.Client(base_url=url, timeout=120) as c:
            for i in range(n_requests + 5):
                body = _body(queries[i % len(queries)])
                t = time.perf_counter()
                r = c.post("/v1/attribute", json=body)
                dt = time.perf_counter() - t
                if r.status_code != 200:
                    raise SystemExit(f"{index}: {r.status_code} {r.text[:300]}")
                if i >= 5:  # the first five warm the server up
                    lat.append(1e3 * dt)
                    timings.append(r.json()["timings_ms"])
                    scored.append(r.json()["tokens_scored"])
        lat_a = np.array(lat)
        concurrent = concurrent_latency(url, queries, n_requests, clients) if clients > 1 else None
        return {
            "concurrent": concurrent,
            "ready_s": round(ready_s, 2), "requests": len(lat),
            "p50_ms": round(float(np.percentile(lat_a, 50)), 1), "p99_ms": round(float(np.percentile(lat_a, 99)), 1),
            "mean_ms": round(float(lat_a.mean()), 1),
            "server_timings_ms_median": {k: round(float(np.median([t[k] for t in timings])), 1) for k in timings[0]},
            "tokens_scored_median": int(np.median(scored)),
            "rss_anon_bytes_ready": anon_ready, "rss_anon_bytes": status_bytes(server.pid),
            "rss_file_bytes": status_bytes(server.pid, "RssFile"), "vm_rss_bytes": status_bytes(server.pid, "VmRSS"),
            "tree_rss_anon_bytes": tree_bytes(server.pid),
        }


# --------------------------------------------------------------------------- fast vs exact
def overlap_fast_exact(index: Path, queries: list[dict], k: int = 10, arms: dict | None = None) -> dict:
    """The served fast path's top ``k`` against exact mode's on ``queries`` (one exact pass). ``arms``: other
    first-stage settings (name: ``FirstStages``) measured on the same queries and exact pass, the arms
    alternating per query; their summaries and paired differences against the served one go under
    ``arms``."""
    import torch

    from prism_tda.engine import Attributor, QueryOptions, QuerySpec

    torch.set_num_threads(os.cpu_count() or 1)
    att = Attributor.open(index)
    specs = [QuerySpec(q["prompt"], q["completion"]) for q in queries]
    encoded = [att.encode(s) for s in specs]
    settings = {"served": att.stages, **(arms or {})}
    fast: dict[str, list] = {a: [] for a in settings}
    secs: dict[str, float] = {a: 0.0 for a in settings}
    for i, s in enumerate(specs):
        names = list(settings) if i % 2 == 0 else list(settings)[::-1]
        for a in names:
            att.stages = settings[a]
            t0 = time.perf_counter()
            fast[a].append([d.doc_id for d in att.attribute(s, QueryOptions(n_documents=k, include_untrained=True,
                                                                                keep_opposed=True,  # the ranking
                                                                                **OPTIONS)).documents])
            secs[a] += time.perf_counter() - t0
    att.stages = settings["served"]
    t0 = time.perf_counter()
    exact = att.exact_document_scores(encoded, progress=True)
    exact_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    draws = rng.integers(0, len(queries), (1000, len(queries)))

    def ci(x: np.ndarray) -> list[float]:
        b = x[draws].mean(1)
        return [round(float(np.percentile(b, 2.5)), 3), round(float(np.percentile(b, 97.5)), 3)]

    def summary(arm: str) -> dict:
        per_query = []
        for q, f, e in zip(queries, fast[arm], exact, strict=True):
            s = e["cosine_max"]
            top = served_ranking(s, e["cosine_sum"], np.ones(len(s), dtype=bool), k)[0][:k]  # exact mode's answer
            top = top[s[top] > 0]
            # beside the strict set overlap: the exact score mass the fast top-k keeps (no tolerance to
            # choose), and how many documents score within 0.1% of the exact k-th best (near-ties, where
            # the strict overlap is decided by the last digits)
            kth = float(s[top[-1]]) if len(top) else 0.0
            ratio = float(s[f].sum() / s[top].sum()) if len(top) and s[top].sum() > 0 else 1.0
            per_query.append({"id": q["id"], "kind": q["kind"],
                              "overlap": len(set(f) & set(top.tolist())) / max(len(top), 1),
                              "score_ratio": round(ratio, 4), "near_ties": int((s >= kth - 1e-3 * abs(kth)).sum())})
        ov = np.array([p["overlap"] for p in per_query])
        ratio = np.array([p["score_ratio"] for p in per_query])
        tied = np.array([p["near_ties"] > k for p in per_query])
        kinds = sorted({p["kind"] for p in per_query})
        return {"tokens": att.reader.n_tokens, "queries": len(queries), "overlap_at_10": round(float(ov.mean()), 3),
                "ci95": ci(ov),
                "score_ratio_at_10": round(float(ratio.mean()), 4), "score_ratio_ci95": ci(ratio),
                "queries_with_near_ties": int(tied.sum()),
                "overlap_at_10_without_near_ties": round(float(ov[~tied].mean()), 3) if (~tied).any() else None,
                "overlap_at_10_with_near_ties": round(float(ov[tied].mean()), 3) if tied.any() else None,
                "by_kind": {kd: round(float(np.mean([p["overlap"] for p in per_query if p["kind"] == kd])), 3)
                            for kd in kinds},
                "fast_seconds_per_query": round(secs[arm] / len(queries), 3), "exact_pass_seconds": round(exact_s, 1),
                "per_query": per_query}

    out = summary("served")
    if arms:
        base = np.array([p["overlap"] for p in out["per_query"]])
        out["arms"] = {}
        for a, st in arms.items():
            m = summary(a)
            diff = np.array([p["overlap"] for p in m["per_query"]]) - base
            out["arms"][a] = {"stages": dataclasses.asdict(st), **m, "overlap_diff_vs_served": round(float(diff.mean()), 3),
                              "overlap_diff_ci95": ci(diff)}
        out["stages"] = dataclasses.asdict(settings["served"])
    return out


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in res["sizes"] if s["tokens"] > 0]
    x = [s["tokens"] for s in rows]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    for a in ax:
        a.set_xscale("log")
        a.set_xlabel("indexed tokens")
        for s in rows:
            if s["synthetic"]:
                a.axvspan(s["tokens"] / 1.5, s["tokens"] * 1.5, color="0.92", zorder=0)
    ax[0].plot(x, [s["disk_bytes_per_token"] for s in rows], "o-")
    ax[0].axhline(64, ls="--", c="r", lw=1)
    ax[0].set_ylabel("disk bytes / token")
    ax[0].set_ylim(0, 80)
    ax[1].plot(x, [s["serve"]["rss_anon_bytes"] / 2**20 for s in rows], "o-", label="RssAnon")
    ax[1].plot(x, [s["serve"]["rss_file_bytes"] / 2**20 for s in rows], "s:", label="RssFile (page cache)")
    ax[1].set_ylabel("server memory (MiB)")
    ax[1].legend(fontsize=8)
    ax[2].plot(x, [s["serve"]["p50_ms"] for s in rows], "o-", label="p50")
    ax[2].plot(x, [s["serve"]["p99_ms"] for s in rows], "s:", label="p99")
    ax[2].set_ylabel("/v1/attribute fast (ms)")
    ax[2].set_ylim(0, None)
    ax[2].legend(fontsize=8)
    fig.suptitle("Scale (grey: synthetic sizes, copies of the real shards)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- sizing
def sizing_10b(res: dict, *, tokens: float = 10e9, d: int = 768, K: int = 4096, k: int = 8, V: int = 50_257,
               block: int = 1024, n_params: float = 124e6, text_bytes_per_token: float = 4.0,
               shard_text_bytes: float = 64 * 2**20, node_ram: float = 64 * 2**30) -> dict:
    """Disk, serving memory, nodes and indexing compute for a 124M-parameter, K=4096 model over 10B
    tokens, from the per-token figures measured here. Assumptions are named in the result."""
    by_file = res["disk_bytes_per_token_by_file"]
    real = [s for s in res["sizes"] if not s["synthetic"] and s["tokens"]][-1]
    demo_text = sum(real["disk_bytes"].get(f, 0) for f in ("documents",)) / real["tokens"]
    corpus_bytes_per_token = 1 / 0.363  # this corpus under the demo tokenizer (measured on a sample)
    per_token = {  # the layout's arrays at k active prototypes, 16 x 12-bit codes, 2 posting entries
        "tokens": 2, "protos": 2 * k, "acts": k, "codes": by_file.get("codes", 24), "self": 2,
        "post_tokens": by_file.get("post_tokens", 8),
        # documents: zstd text, scaled by the tokenizer's bytes per token
        "documents": demo_text * text_bytes_per_token / corpus_bytes_per_token,
        # per sequence: the seq_* arrays and sequences.parquet (measured per sequence) and an IVF-PQ32 entry
        "per_sequence": (sum(by_file.get(f, 0) for f in ("seq_tok0", "seq_doc", "seq_start", "seq_last_target",
                                                         "sequences")) * 128 + 40) / block,
    }
    shard_tokens = shard_text_bytes / text_bytes_per_token
    n_shards = tokens / shard_tokens
    per_shard = {"post_offsets": 4 * K * 256, "proto_top": 8 * K * 32}
    per_token["per_shard_fixed"] = sum(per_shard.values()) / shard_tokens
    index_fixed = 4 * (d * d + K * d) * 2 + 16 * 4096 * (d // 16) * 4 + 8 * K * 256  # calibration, stats, list sizes
    disk = tokens * sum(per_token.values()) + index_fixed
    anon_per_token = max(res["serve_anon_bytes_per_token"], 0.0)
    empty = res["sizes"][0]["serve"]["rss_anon_bytes"]
    ram_process = empty + 4 * n_params + 4 * (d * d + K * d) + 8 * K * 256 + anon_per_token * tokens
    # indexing: forward FLOPs per token (2 x parameters + the vocabulary products for u_t), measured
    # CPU throughput on the demo model scaled by FLOPs; a GPU figure from an assumed sustained rate
    flops_per_token = 2 * n_params + 2 * 2 * V * d
    return {
        "assumptions": {"tokens": tokens, "d_model": d, "n_prototypes": K, "n_active": k, "vocab": V,
                        "block_size": block, "parameters": n_params, "text_bytes_per_token": text_bytes_per_token,
                        "shard_text_bytes": shard_text_bytes, "codes": "16 x 12-bit (as measured here)",
                        "gpu_sustained_flops": 200e12, "node_ram_bytes": node_ram},
        "disk_bytes_per_token": {k2: round(v, 2) for k2, v in per_token.items()},
        "disk_total_tb": round(disk / 1e12, 2),
        "shards": int(np.ceil(n_shards)),
        "serving_process_ram_gb": round(ram_process / 1e9, 2),
        "serving_page_cache_note": "the per-token arrays stay on disk; queries touch posting prefixes and the "
                                   "candidates' rows (about 100k tokens x 48 bytes per query)",
        "nodes_by_ram": int(np.ceil(ram_process / (0.5 * node_ram))),
        "indexing_flops": flops_per_token * tokens,
        "indexing_gpu_hours_at_assumed_rate": round(flops_per_token * tokens / 200e12 / 3600, 1),
    }


def sixteenth_of(sizes: list[dict], big: dict) -> dict:
    """The size closest to 1/16 of ``big``'s tokens (for the 16x latency growth)."""
    return min(sizes, key=lambda s: abs(np.log(s["tokens"] * 16 / big["tokens"])))


def rerank_as_real(res: dict) -> dict:
    """Synthetic sizes repeat the real corpus, so each shortlisted window has copies and the re-rank
    runs every distinct window once (``engine/scoring.py``): their re-rank stage costs a fraction of
    what a corpus of that size without repeats would. These keys replace each synthetic size's median
    re-rank by the largest real size's, in the p50 and in the 16x growth (an estimate, said to be one)."""
    sizes = [s for s in res["sizes"] if s["tokens"]]
    real = [s for s in sizes if not s["synthetic"]]
    if not real or not sizes[-1]["synthetic"]:
        return {}
    rr = real[-1]["serve"]["server_timings_ms_median"].get("rerank", 0.0)

    def p50(s: dict) -> float:
        t = s["serve"]["server_timings_ms_median"]
        return s["serve"]["p50_ms"] - (t.get("rerank", 0.0) - rr if s["synthetic"] else 0.0)

    big = sizes[-1]
    small = sixteenth_of(sizes, big)
    return {"p50_ms_largest_rerank_as_real": round(p50(big), 1),
            "latency_growth_16x_rerank_as_real": round(p50(big) / p50(small), 2) if small is not big else None,
            "rerank_ms_median_largest": big["serve"]["server_timings_ms_median"].get("rerank"),
            "rerank_ms_median_largest_real": rr,
            "rerank_as_real_note": "synthetic sizes repeat the corpus; their re-rank runs each distinct window "
                                   "once, so p50 is re-estimated with the largest real size's re-rank"}


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", default="runs/scale/real", help="the real index (built as above)")
    ap.add_argument("--corpus", default="runs/scale/corpus")
    ap.add_argument("--work", default="runs/scale")
    ap.add_argument("--build-log", default="runs/scale/real_build.log",
                    help="the build's output under /usr/bin/time -v (for its wall time and peak RSS)")
    ap.add_argument("--synthetic", default="4,16", help="synthetic sizes, as multiples of the real index")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients at the largest size (0: none)")
    ap.add_argument("--keep-overlap", action="store_true",
                    help="carry the fast-vs-exact part of --out over instead of measuring it again")
    ap.add_argument("--overlap-shards", type=int, default=0,
                    help="measure fast vs exact on the first N shards (0: every real shard)")
    ap.add_argument("--overlap-queries", type=int, default=24, help="held-out queries (plus planted facts)")
    ap.add_argument("--overlap-skip", type=int, default=0,
                    help="skip the first N held-out queries of the draw (queries an earlier run looked at); with "
                         "N > 0, --overlap-only writes the block --overlap-key and leaves the headline key alone")
    ap.add_argument("--overlap-key", default="overlap_fresh", help="the block --overlap-skip writes")
    ap.add_argument("--stages-b", type=json.loads, default=None,
                    help='with --overlap-only: also measure the fast path under these FirstStages fields, e.g. '
                         '\'{"best_cells": 8}\' (same queries and exact pass)')
    ap.add_argument("--options", type=json.loads, default={},
                    help='QueryOptions fields every fast query also sends, e.g. \'{"exact_rerank": 32}\'')
    ap.add_argument("--out", default="bench/results/scale.json")
    ap.add_argument("--plot", default="docs/img/scale.png")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --out and stop")
    ap.add_argument("--overlap-only", action="store_true",
                    help="measure fast vs exact again and update that part of --out (the sizes are kept)")
    args = ap.parse_args(argv)
    OPTIONS.update(args.options)
    if args.plot_only:
        res = json.loads(Path(args.out).read_text())
        plot(res, Path(args.plot))
        return res
    real, work, corpus = Path(args.real).resolve(), Path(args.work), Path(args.corpus)
    m = layout.read_manifest(real)
    if m is None or not m.complete:
        raise SystemExit(f"{real}: not a complete index")
    tok_path = Path(m.checkpoint) / "tokenizer.json"
    indexed = sorted({u.file for u in m.units})
    held_file = sorted(p for p in corpus.glob("part-*.jsonl") if str(p.resolve()) not in indexed)[-1]

    def measure_overlap() -> dict:
        n_ov = args.overlap_shards or len(m.shards)
        ov_ix = subset_index(real, n_ov, work / f"prefix_{n_ov:04d}")
        ov_queries = overlap_queries(held_file, tok_path, args.overlap_queries, args.overlap_skip)
        if not args.overlap_skip:  # the planted facts were asked by the first run already
            ov_queries += [dict(q, kind="planted") for q in planted_queries(corpus, indexed)]
        from prism_tda.engine import FirstStages

        arms = {"b": FirstStages(**args.stages_b)} if args.stages_b else None
        return overlap_fast_exact(ov_ix, ov_queries, arms=arms)

    if args.overlap_only:
        res = json.loads(Path(args.out).read_text())
        ov = measure_overlap()
        ov["command"] = "python -m bench.scale " + " ".join(sys.argv[1:] if argv is None else argv)
        ov["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        if args.overlap_skip:  # fresh queries: beside the headline, which stays the first run's
            ov["held_out_queries_skipped"] = args.overlap_skip
            res[args.overlap_key] = ov
        else:
            res["overlap"], res["overlap_at_10_fast_vs_exact"] = ov, ov["overlap_at_10"]
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(json.dumps({k: v for k, v in ov.items() if k != "per_query"}, indent=2))
        return res
    queries = held_out_queries(held_file, tok_path, 60, seed=1)
    # sizes: the first shard, then the prefixes closest to 4x and 16x it; every shard last
    cum = np.cumsum([s.n_tokens for s in m.shards])
    counts = [0, 1]
    for f in (4, 16):
        n = int(np.argmin(np.abs(cum - cum[0] * f))) + 1
        if n not in counts:
            counts.append(n)
    if counts[-1] != len(m.shards):
        counts.append(len(m.shards))
    sizes = []
    calib_s = m.calibration.seconds if m.calibration else 0.0
    for n in counts:
        ix = subset_index(real, n, work / f"prefix_{n:04d}")
        sizes.append({"index": str(ix), "shards": n, "synthetic": False, "tokens": int(cum[n - 1]) if n else 0,
                      "index_seconds": round(calib_s + sum(s.seconds for s in m.shards[:n]), 1)})
    for c in (int(x) for x in args.synthetic.split(",") if x):
        ix = synthetic_index(real, c, work / f"synthetic_x{c}")
        sizes.append({"index": str(ix), "shards": c, "synthetic": True, "tokens": int(cum[-1]) * c,
                      "index_seconds": None})
    for s in sizes:
        ix = Path(s["index"])
        d = disk_bytes(ix)
        s["disk_bytes"] = d
        s["disk_bytes_per_token"] = round(sum(d.values()) / s["tokens"], 2) if s["tokens"] else None
        s["serve"] = serve_and_measure(ix, queries, args.requests, args.clients if s is sizes[-1] else 0)
        print(json.dumps({k: s[k] for k in ("shards", "tokens", "synthetic", "disk_bytes_per_token")}
                         | {k: s["serve"][k] for k in ("ready_s", "p50_ms", "p99_ms", "rss_anon_bytes")}), flush=True)
    empty = sizes[0]["serve"]["rss_anon_bytes"]
    for s in sizes[1:]:
        s["serve_anon_bytes_per_token"] = round((s["serve"]["rss_anon_bytes"] - empty) / s["tokens"], 3)
    kept: dict = {}
    if args.keep_overlap:  # the exact pass is long: the last run's measurement, said to be so
        earlier = json.loads(Path(args.out).read_text())
        overlap = earlier["overlap"]
        overlap["kept_from_earlier_run"] = True
        # and the blocks of fresh queries (--overlap-skip), each measured once: a re-run keeps them
        kept = {k: dict(v, kept_from_earlier_run=True) for k, v in earlier.items()
                if k.startswith("overlap_") and isinstance(v, dict)}
    else:
        overlap = measure_overlap()
    real_sizes = [s for s in sizes if not s["synthetic"] and s["tokens"]]
    largest_real, largest = real_sizes[-1], sizes[-1]
    by_tokens = {s["tokens"]: s for s in sizes if s["tokens"]}

    def p50_growth(big: dict) -> float | None:
        small = sixteenth_of(list(by_tokens.values()), big)
        return round(big["serve"]["p50_ms"] / small["serve"]["p50_ms"], 2) if small is not big else None

    build: dict = {}
    log = Path(args.build_log)
    if not log.is_file():  # the build's own record of its wall time
        build["wall_s"] = (m.summary.get("timings") or {}).get("last_run_wall_s") if m.summary else None
    else:
        for line in log.read_text().splitlines():
            if "Elapsed (wall clock)" in line:
                parts = line.rsplit(" ", 1)[1].split(":")
                build["wall_s"] = round(sum(float(x) * 60**i for i, x in enumerate(reversed(parts))), 1)
            if "Maximum resident set size" in line:
                build["peak_rss_bytes"] = int(line.rsplit(" ", 1)[1]) * 1024
    res = {
        "sizes": sizes,
        "disk_bytes_per_token": largest_real["disk_bytes_per_token"],
        "disk_bytes_per_token_by_file": {k: round(v / largest_real["tokens"], 2)
                                         for k, v in sorted(largest_real["disk_bytes"].items(), key=lambda x: -x[1])},
        "serve_anon_bytes_per_token": largest["serve_anon_bytes_per_token"],
        "serve_anon_bytes_per_token_largest_real": largest_real["serve_anon_bytes_per_token"],
        "latency_growth_16x": p50_growth(largest),
        "latency_growth_16x_real": p50_growth(largest_real),
        "p50_ms_largest": largest["serve"]["p50_ms"],
        "p99_ms_largest": largest["serve"]["p99_ms"],
        **({f"p99_ms_largest_{args.clients}_clients": largest["serve"]["concurrent"]["p99_ms"],
            f"p50_ms_largest_{args.clients}_clients": largest["serve"]["concurrent"]["p50_ms"]}
           if largest["serve"].get("concurrent") else {}),
        "p50_ms_largest_real": largest_real["serve"]["p50_ms"],
        "overlap_at_10_fast_vs_exact": overlap["overlap_at_10"],
        "overlap": overlap,
        "largest_real_tokens": largest_real["tokens"],
        "largest_served_tokens": largest["tokens"],
        "real_build": {"tokens": int(cum[-1]), "shards": len(m.shards), **build,
                       "tokens_per_s": round(int(cum[-1]) / build["wall_s"], 1) if build.get("wall_s") else None,
                       "calibration_s": calib_s, "faiss": m.calibration.faiss_spec if m.calibration else None},
        "corpus": {"source": "bench/scale_corpus.py: Debian documentation packages, fortunes, planted facts (real text)",
                   "indexed_files": indexed, "held_out_file": str(held_file),
                   # which text this was (per source, and each file's hash): scale_corpus.py's manifest
                   "manifest": json.loads((corpus / MANIFEST).read_text()) if (corpus / MANIFEST).is_file() else None},
        "model": m.model,
        "targets": {"disk_bytes_per_token": 64, "serve_anon_bytes_per_token": 8, "latency_growth_16x": 2.0,
                    "p50_ms_largest": 100, "overlap_at_10_fast_vs_exact": 0.9, "largest_real_tokens": 16e6,
                    "largest_served_tokens": 256e6},
        "config": {k: v for k, v in vars(args).items()},
    }
    res.update(kept)
    res["sizing_124m_k4096_10b"] = sizing_10b(res)
    res.update(rerank_as_real(res))
    if args.plot:
        plot(res, Path(args.plot))
    return finish(res, "scale.py", argv, args.out)


if __name__ == "__main__":
    main()
