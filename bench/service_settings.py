"""The attribution endpoint's latency and throughput under the server's compute settings: server
processes (``--workers``), attributions that run at once in each (``compute_concurrency``) and torch's
intra-op threads (``torch_threads``, which the compiled scoring follows too), each setting loaded as ``bench/service_load.py`` loads it
(1 and 8 clients, 200 requests each), repeated, in alternating order so drift hits every setting.

    python -m bench.service_settings --index runs/demo_b/index

Writes ``bench/results/service_settings.json``: per setting each run's p50/p99 and requests per
second, and their medians over the repeats.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from bench import service_load
from bench._common import finish


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default="runs/demo/index")
    ap.add_argument("--settings", default="1:2:default,1:2:1,1:1:default,1:3:1,2:1:1",
                    help="workers:compute_concurrency:torch_threads, comma-separated ('default': torch's own)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--out", default="bench/results/service_settings.json")
    args = ap.parse_args(argv)
    settings = [tuple(s.split(":")) for s in args.settings.split(",")]
    runs: dict[str, list[dict]] = {":".join(s): [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for w, c, t in settings if rep % 2 == 0 else settings[::-1]:
                server = ["--server", f"compute_concurrency={c}"] + ([] if t == "default" else
                                                                      ["--server", f"torch_threads={t}"])
                r = service_load.main(["--index", args.index, "--endpoints", "attribute", "--workers", w, "--requests",
                                       str(args.requests), *server, "--out", str(Path(tmp) / "run.json")])
                a = r["results"]["/v1/attribute"]
                runs[f"{w}:{c}:{t}"].append({f"{k}_{n}": a[n][k] for n in a for k in ("p50_ms", "p99_ms", "requests_per_s")}
                                        | {"errors": sum(a[n]["errors"] for n in a)})
    summary = {s: {k: round(float(np.median([r[k] for r in rs])), 2) for k in rs[0]} for s, rs in runs.items()}
    res = {"settings": summary, "runs": runs, "repeats": args.repeats, "requests": args.requests,
           "index": args.index,
           "key": "workers:compute_concurrency:torch_threads; _1 and _8: clients; 'default' threads: torch's own"}
    return finish(res, "service_settings.py", argv, args.out)


if __name__ == "__main__":
    main()
