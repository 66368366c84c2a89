"""The fast path with and without its FAISS sketch stage: time a query and what the answer holds.

The fast path's first stages are the posting lists (the query's heaviest prototypes' best tokens)
and, when ``n_candidates > 0``, the ``n_candidates`` sequences nearest the query's sketch embedding in
FAISS. This asks the same queries of one index under both, in process, the two arms alternating
query by query (the first of each pair swapped every query), and reports each arm's median time and
stage split, and how many of the one arm's 10 documents the other returns.

    python -m bench.sketch_stage_ab --index runs/demo/index --queries 100
    python -m bench.sketch_stage_ab --index runs/scale/prefix_0005 --heldout runs/scale/corpus/part-006.jsonl

Agreement with exact mode under each arm is measured by ``bench/attribution/near_ties.py --variants``
and ``bench/attribution/planted_full.py --candidates`` (docs/benchmarks.md).
Writes ``bench/results/sketch_stage_ab.json`` (one block per index, merged into the file).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from bench._common import alternating_arms, finish


def queries_for(index: Path, heldout: str | None, n: int, seed: int) -> list[tuple[str, str]]:
    """Held-out queries (a 48-token prompt and its 16-token continuation) from ``heldout``, or the
    service benchmark's 64-token prompts from the demo corpus with the completion " is a machine"."""
    manifest = json.loads((index / "manifest.json").read_text())
    tok = Path(manifest["checkpoint"]) / "tokenizer.json"
    if heldout:
        from bench.scale import held_out_queries

        return [(q["prompt"], q["completion"]) for q in held_out_queries(Path(heldout), tok, n, seed=seed)]
    from bench.service_load import prompts_of

    return [(p, " is a machine") for p in prompts_of(tok, n)]


def main(argv: list[str] | None = None) -> dict:
    from prism_tda.engine import Attributor, QueryOptions, QuerySpec

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", required=True)
    ap.add_argument("--heldout", help="a JSONL file of documents not indexed: held-out queries from it")
    ap.add_argument("--queries", type=int, default=60, help="queries asked (distinct prompts: at most 50)")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--candidates", type=int, default=256, help="the sketch arm's n_candidates")
    ap.add_argument("--out", default="bench/results/sketch_stage_ab.json")
    args = ap.parse_args(argv)
    index = Path(args.index)
    att = Attributor.open(index)
    prompts = queries_for(index, args.heldout, min(args.queries, 50), args.seed)
    arms = {"sketch": QueryOptions(n_candidates=args.candidates, include_untrained=True),
            "posting_only": QueryOptions(n_candidates=0, include_untrained=True)}
    for p in prompts[:3]:  # warm: the model, the tables, the pages the first queries touch
        for o in arms.values():
            att.attribute(QuerySpec(*p), o)
    ask = {k: (lambda i, o=o: att.attribute(QuerySpec(*prompts[i % len(prompts)]), o)) for k, o in arms.items()}
    block = {"queries": args.queries, "distinct_prompts": len(prompts), "tokens": att.reader.n_tokens,
             "faiss": att.reader.manifest.calibration.faiss_spec if att.reader.manifest.calibration else None,
             "sketch_n_candidates": args.candidates, **alternating_arms(args.queries, ask)}
    block["command"] = "python bench/sketch_stage_ab.py " + " ".join(sys.argv[1:] if argv is None else argv)
    block["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    block["p50_ratio_posting_only_to_sketch"] = round(block["posting_only"]["p50_ms"] / block["sketch"]["p50_ms"], 3)
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.is_file() else {}
    res.pop("machine", None)
    res.setdefault("indexes", {})[str(index)] = block
    print(json.dumps(block, indent=1))
    return finish(res, "sketch_stage_ab.py", argv, args.out)


if __name__ == "__main__":
    main()
