"""Two indexes of one checkpoint and corpus, side by side on the planted-fact queries: fast-path
latency at the default settings (interleaved, one query per call, so both see the same machine
state) and whether each puts a fact's copies in its top 10.

    python -m bench.attribution.index_ab --work runs/bench_mem --a runs/bench_mem/index_old \\
        --b runs/bench_mem/index_step_0002000 --out bench/results/attribution_index_ab.json

``--work`` is a ``planted_full`` work directory (its facts); ``--a`` is the baseline.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench._common import finish
from bench.attribution.planted import Fact
from prism_tda.engine import Attributor, QueryOptions, QuerySpec
from prism_tda.engine.layout import disk_bytes, read_manifest


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--a", required=True, help="baseline index")
    ap.add_argument("--b", required=True, help="changed index")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/attribution_index_ab.json")
    args = ap.parse_args(argv)
    facts = [Fact(**f) for f in json.loads((Path(args.work) / "facts.json").read_text())]
    queries = [(f, p) for f in facts for p in (f.prompt, f.paraphrase)]
    atts = {"a": Attributor.open(args.a), "b": Attributor.open(args.b)}
    opt = QueryOptions(n_documents=10)
    times: dict[str, list[float]] = {"a": [], "b": []}
    hits: dict[str, list[bool]] = {"a": [], "b": []}
    for att in atts.values():  # warm both (first-use reads) before timing
        att.attribute(QuerySpec(queries[0][1], queries[0][0].answer), opt)
    for rnd in range(args.rounds):
        for i, (f, prompt) in enumerate(queries):
            order = ("a", "b") if (i + rnd) % 2 == 0 else ("b", "a")
            for k in order:
                t0 = time.perf_counter()
                r = atts[k].attribute(QuerySpec(prompt, f.answer), opt)
                times[k].append(time.perf_counter() - t0)
                if rnd == 0:
                    ids = {atts[k].reader.external_id(d.doc_id) for d in r.documents}
                    hits[k].append(bool(ids & set(f.doc_ids)))
    res: dict = {"queries": len(queries), "rounds": args.rounds}
    for k, path in (("a", args.a), ("b", args.b)):
        t = np.array(times[k])
        m = read_manifest(Path(path))
        res[k] = {"index": str(path), "p50_ms": float(np.median(t) * 1e3), "p90_ms": float(np.quantile(t, 0.9) * 1e3),
                  "recall_at_10_any_copy": float(np.mean(hits[k])),
                  "bytes_per_token": sum(disk_bytes(Path(path)).values()) / max(m.tokens if m else 1, 1),
                  "direction_code_share": (m.summary or {}).get("direction_code_share") if m else None}
    res["p50_ratio_b_over_a"] = res["b"]["p50_ms"] / res["a"]["p50_ms"]
    return finish(res, "attribution/index_ab.py", argv, args.out)


if __name__ == "__main__":
    main()
