"""Load test of the HTTP service: latency and throughput of /v1/attribute and /v1/sql.

Starts `prism serve` on the index as a separate process (loopback), then for each endpoint and
each concurrency sends a fixed number of requests from that many client threads (one keep-alive
connection each) and records p50/p99 latency, requests per second and errors.

    prism demo --no-serve   # builds runs/demo/index
    python -m bench.service_load --index runs/demo/index

/v1/attribute: a 64-token prompt (cut from different training documents) plus a completion,
fast mode, top 10 (``--option`` adds fields to the body, e.g. ``influence=true``). /v1/sql: the
documents that most activate a prototype (a scan of the activations table). Writes
``bench/results/service.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from bench._common import finish, served
from prism_tda import demo_corpus_path
from prism_tda.engine import layout
from prism_tda.model.tokenizer import load_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts_of(tokenizer_path: Path, n: int, n_tokens: int = 64) -> list[str]:
    """n prompts of exactly n_tokens tokens, cut from the demo corpus's longer documents."""
    tok = load_tokenizer(tokenizer_path)
    out = []
    with gzip.open(demo_corpus_path(), "rt") as fh:
        for line in fh:
            ids = tok.encode(json.loads(line)["text"]).ids
            if len(ids) >= n_tokens:
                text = tok.decode(ids[:n_tokens])
                if len(tok.encode(text).ids) == n_tokens:
                    out.append(text)
            if len(out) == n:
                break
    return out


def run_load(url: str, make_body, n_requests: int, concurrency: int, path: str) -> dict:
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    counter = iter(range(n_requests))

    def client() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                try:
                    r = c.post(path, json=make_body(i))
                    ok = r.status_code == 200
                    why = f"{r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as e:
                    ok, why = False, repr(e)
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
                    if not ok:
                        errors.append(why)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = np.array(latencies) * 1e3
    return {"requests": n_requests, "concurrency": concurrency, "p50_ms": round(float(np.percentile(lat, 50)), 2),
            "p99_ms": round(float(np.percentile(lat, 99)), 2), "mean_ms": round(float(lat.mean()), 2),
            "max_ms": round(float(lat.max()), 2), "requests_per_s": round(n_requests / wall, 2),
            "errors": len(errors), "error_examples": errors[:3]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default="runs/demo/index")
    ap.add_argument("--requests", type=int, default=200, help="requests per endpoint and concurrency")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--endpoints", default="attribute,sql", help="which endpoints to load, comma-separated")
    ap.add_argument("--server", action="append", default=[], metavar="SETTING=VALUE",
                    help="a setting of the server (`prism serve`'s PRISM_* environment), e.g. torch_threads=1; "
                         "repeatable, recorded in the result")
    ap.add_argument("--workers", type=int, default=1, help="server processes (`prism serve --workers`)")
    ap.add_argument("--option", action="append", default=[], metavar="FIELD=JSON",
                    help="a field added to every /v1/attribute body, e.g. influence=true; repeatable, recorded in "
                         "the result")
    ap.add_argument("--out", default="bench/results/service.json")
    args = ap.parse_args(argv)
    server = dict(kv.split("=", 1) for kv in args.server)
    options = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.option)}
    wanted = {f"/v1/{e.strip()}" for e in args.endpoints.split(",")}
    index = Path(args.index).resolve()
    manifest = json.loads((index / layout.MANIFEST).read_text())
    prompts = prompts_of(Path(manifest["checkpoint"]) / "tokenizer.json", 50)
    n_protos = manifest["model"]["n_prototypes"]
    env = {f"PRISM_{k.upper()}": v for k, v in server.items()}
    with served(index, "demo", poll_s=0.2, env=env, options=("--workers", str(args.workers))) as (_, url, startup_s):
        bodies = {
            "/v1/attribute": lambda i: {"prompt": prompts[i % len(prompts)], "completion": " is a machine",
                                        "top_k": 10, "mode": "fast", **options},
            "/v1/sql": lambda i: {"sql": "SELECT doc_id, max(act) AS act FROM activations WHERE proto_id = "
                                         f"{(37 * i) % n_protos} GROUP BY doc_id ORDER BY act DESC LIMIT 10"},
        }
        results: dict[str, dict[str, dict]] = {}
        for path, body in bodies.items():
            if path not in wanted:
                continue
            run_load(url, body, 10, 2, path)  # warm-up
            for c in [int(x) for x in args.concurrency.split(",")]:
                results.setdefault(path, {})[str(c)] = r = run_load(url, body, args.requests, c, path)
                print(path, c, {k: r[k] for k in ("p50_ms", "p99_ms", "requests_per_s", "errors")}, flush=True)
    a = results.get("/v1/attribute", {})
    res = {
        "results": results, "server_startup_s": round(startup_s, 2),
        "prompt_tokens": 64, "completion": " is a machine",
        "targets": {"attribute_p50_ms_1_client": {"value": a.get("1", {}).get("p50_ms"), "target": 60},
                    "attribute_p99_ms_8_clients": {"value": a.get("8", {}).get("p99_ms"), "target": 400},
                    "errors": {"value": sum(r["errors"] for p in results.values() for r in p.values()), "target": 0}},
        "machine": {"cpu_cores": os.cpu_count()},
        "config": {"index": str(index), "requests": args.requests, "concurrency": args.concurrency,
                   "server": server, "workers": args.workers, "attribute_options": options},
    }
    return finish(res, "service_load.py", argv, args.out)


if __name__ == "__main__":
    main()
