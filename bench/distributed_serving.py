"""Serving from Ray actors against one process, on one machine: latency, answers, shard-side work.

One index (default: the first 4 shards of the scale index, 4.1M real tokens; ``bench/scale.py``)
is served by ``prism serve`` as its own process, first alone (every shard in the server's memory
maps: the single-process path) and then with ``--ray-address local --ray-actors N`` for N = 1, 2
and 4 (a Ray started by the server on this machine; actors of half a CPU each). For each, the same
held-out queries (a 48-token prompt and its 16-token continuation from a file that is not indexed)
are sent one at a time over HTTP (fast mode, top 10; five warm-up requests first), and

- p50 / p99 of the request latency; ``fanout_overhead_p50`` = p50 with N holders / single p50;
- whether each answer equals the single-process one (documents, order, scores to 1e-6);
- what the holders did (their ``/metrics``): seconds per query in each call, queue time, rows.

**Projection** (not measured: one machine here): per query the shard side costs ``S`` seconds of
holder time in all (summed over holders, measured with one holder) and the API ``C`` seconds
(encode, plan, merge, exact re-rank, presentation: the request time minus the holders' part). With
N nodes each holding 1/N of the shards and as fast as this machine, the shard side serves
``N / S`` queries per second; each added node adds ``1 / S``, until the API's ``1 / C`` per API
core binds (API replicas scale apart).

    python -m bench.distributed_serving --index runs/scale/prefix_0004

Writes ``bench/results/distributed.json``.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import httpx
import numpy as np

from bench._common import finish, served
from bench.scale import held_out_queries
from prism_tda.engine import layout

METRIC = re.compile(r'^(prism_shard_\w+?)(_sum|_count|_total)?\{([^}]*)\} ([0-9.e+-]+)$')


def shard_metrics(text: str) -> dict:
    """{(name, method or "", holder): value} of the prism_shard_* series."""
    out: dict = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3)))
        out[(m.group(1) + (m.group(2) or ""), labels.get("method", ""), labels.get("holder", ""))] = float(m.group(4))
    return out


def run(index: Path, queries: list[dict], n: int, options: tuple[str, ...]) -> dict:
    with served(index, "dist", options=options) as (server, url, ready_s):
        lat, answers, timings = [], [], []
        with httpx.Client(base_url=url, timeout=300) as c:
            before = None
            for i in range(n + 5):
                q = queries[i % len(queries)]
                body = {"prompt": q["prompt"], "completion": q["completion"], "top_k": 10, "mode": "fast"}
                if i == 5:
                    before = shard_metrics(c.get("/metrics").text)
                t = time.perf_counter()
                r = c.post("/v1/attribute", json=body)
                dt = time.perf_counter() - t
                if r.status_code != 200:
                    raise SystemExit(f"{index} {options}: {r.status_code} {r.text[:300]}")
                if i >= 5:
                    lat.append(1e3 * dt)
                    answers.append([(d["doc_id"], d["score"]) for d in r.json()["documents"]])
                    timings.append(r.json()["timings_ms"])
            after = shard_metrics(c.get("/metrics").text)
            holders = c.get("/readyz").json()["indexes"][0].get("shard_holders")
    a = np.array(lat)
    res = {"options": list(options), "ready_s": round(ready_s, 1), "requests": n, "holders": holders,
           "p50_ms": round(float(np.percentile(a, 50)), 1), "p99_ms": round(float(np.percentile(a, 99)), 1),
           "mean_ms": round(float(a.mean()), 1),
           "server_timings_ms_median": {k: round(float(np.median([t[k] for t in timings])), 1) for k in timings[0]},
           "_answers": answers}
    if before is not None and after:
        per: dict = {}
        for (name, method, holder), v in after.items():
            delta = v - before.get((name, method, holder), 0.0)
            if name in ("prism_shard_call_seconds_sum", "prism_shard_queue_seconds_sum"):
                key = "call_ms_per_query" if name.startswith("prism_shard_call") else "queue_ms_per_query"
                per.setdefault(key, {}).setdefault(method, {})[holder] = round(1e3 * delta / n, 2)
            elif name == "prism_shard_rows_scored_total":
                per.setdefault("rows_per_query", {})[holder] = round(delta / n)
        calls = per.get("call_ms_per_query", {})
        per["holder_ms_per_query_total"] = round(sum(v for m in calls.values() for v in m.values()), 1)
        per["holder_ms_per_query_max_holder"] = round(max(
            (sum(m.get(h, 0.0) for m in calls.values()) for h in {h for m in calls.values() for h in m}), default=0.0), 1)
        res["shard_side"] = per
    return res


def same(a: list, b: list) -> bool:
    return [d for d, _ in a] == [d for d, _ in b] and np.allclose([s for _, s in a], [s for _, s in b], rtol=1e-6)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", default="runs/scale/prefix_0004")
    ap.add_argument("--queries-file", default="runs/scale/corpus/part-008.jsonl",
                    help="JSONL of documents that are not in the index (the queries' source)")
    ap.add_argument("--tokenizer", default=None, help="default: the index's checkpoint's")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--holders", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", default="bench/results/distributed.json")
    args = ap.parse_args(argv)
    index = Path(args.index).resolve()
    m = layout.read_manifest(index)
    assert m is not None and m.complete, f"{index}: not a complete index"
    tok = Path(args.tokenizer) if args.tokenizer else Path(m.checkpoint) / "tokenizer.json"
    queries = held_out_queries(Path(args.queries_file), tok, args.requests)
    res: dict = {"index": str(index), "shards": len(m.shards), "tokens": m.tokens,
                 "protocol": "prism serve as its own process; POST /v1/attribute fast, top 10, one query at a "
                             "time over HTTP, 5 warm-up requests; the same held-out queries for every run"}
    single = run(index, queries, args.requests, ())
    res["single"] = single
    for h in args.holders:
        r = run(index, queries, args.requests, ("--ray-address", "local", "--ray-actors", str(h)))
        r["answers_equal_single"] = float(np.mean([same(a, b) for a, b in zip(r["_answers"], single["_answers"],
                                                                               strict=True)]))
        r["fanout_overhead_p50"] = round(r["p50_ms"] / single["p50_ms"], 3)
        res[f"ray_{h}"] = r
    for r in [res["single"], *(res[f"ray_{h}"] for h in args.holders)]:
        r.pop("_answers")
    if 2 in args.holders:
        res["fanout_overhead_p50"] = res["ray_2"]["fanout_overhead_p50"]
        res["fanout_overhead_target"] = 1.5
    if 1 in args.holders and "shard_side" in res["ray_1"]:
        S = res["ray_1"]["shard_side"]["holder_ms_per_query_total"] / 1e3
        C = max(res["ray_1"]["mean_ms"] / 1e3 - S, 1e-3)
        res["projection"] = {
            "what": "not measured: N nodes like this machine, each holding 1/N of the shards; API apart",
            "shard_side_s_per_query": round(S, 4), "api_s_per_query": round(C, 4),
            "qps_per_added_node": round(1 / S, 2), "api_qps_per_core": round(1 / C, 2),
            "qps_by_nodes": {n: round(min(n / S, 1 / C), 2) for n in (1, 2, 4, 8, 16)},
        }
    return finish(res, "distributed_serving.py", argv, args.out)


if __name__ == "__main__":
    main()
