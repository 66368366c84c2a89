"""The fast path over one index as an earlier version stored it (the exact ``I(t, t)`` per token) and as
this version stores it (the stored token's own, ``prism index --upgrade``): time a query and what the
answer holds.

Both copies hold the same codes; only ``self.npy`` differs, so the first stages' approximate cosines
differ, and with them the candidates, the shortlist and how many documents the adaptive re-rank
recomputes. The same queries are asked of both, in process, the two arms alternating query by query
(the first of each pair swapped every query); each arm's median time, stage split and documents
re-ranked are reported, with how many of the one arm's 10 documents the other returns.

    cp -a runs/demo/index runs/demo_exactself_index       # before `prism index --upgrade`
    python -m bench.stored_self_ab --before runs/demo_exactself_index --after runs/demo/index --queries 100
    python -m bench.stored_self_ab --before runs/scale/prefix_0005_exactself --after runs/scale/prefix_0005 \\
        --heldout runs/scale/corpus/part-006.jsonl --queries 60

Agreement with exact mode under each arm: ``bench/attribution/near_ties.py`` on each copy
(docs/benchmarks.md, "The stored token's own length"). Writes ``bench/results/stored_self_ab.json``
(one block per index, merged into the file).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from bench._common import alternating_arms, finish
from bench.sketch_stage_ab import queries_for


def main(argv: list[str] | None = None) -> dict:
    from prism_tda.engine import Attributor, QueryOptions, QuerySpec

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the index as an earlier version stored it (self_of exact)")
    ap.add_argument("--after", required=True, help="the same index upgraded (self_of codes)")
    ap.add_argument("--heldout", help="a JSONL file of documents not indexed: held-out queries from it")
    ap.add_argument("--queries", type=int, default=60, help="queries asked (distinct prompts: at most 50)")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--out", default="bench/results/stored_self_ab.json")
    args = ap.parse_args(argv)
    arms = {"before": Attributor.open(args.before), "after": Attributor.open(args.after)}
    kinds = {k: {s.self_of for s in a.reader.manifest.shards} for k, a in arms.items()}
    if kinds != {"before": {"exact"}, "after": {"codes"}}:
        raise SystemExit(f"--before must hold the exact I(t, t) and --after the stored token's; they hold {kinds}")
    if arms["before"].reader.n_tokens != arms["after"].reader.n_tokens:
        raise SystemExit("--before and --after are not copies of one index (their token counts differ)")
    prompts = queries_for(Path(args.after), args.heldout, min(args.queries, 50), args.seed)
    opt = QueryOptions(include_untrained=True)
    for p in prompts[:3]:  # warm: the model, the tables, the pages the first queries touch
        for a in arms.values():
            a.attribute(QuerySpec(*p), opt)
    ask = {k: (lambda i, a=a: a.attribute(QuerySpec(*prompts[i % len(prompts)]), opt)) for k, a in arms.items()}
    block = {"queries": args.queries, "distinct_prompts": len(prompts), "tokens": arms["after"].reader.n_tokens,
             **alternating_arms(args.queries, ask, reranked=True)}
    block["p50_ratio_after_to_before"] = round(block["after"]["p50_ms"] / block["before"]["p50_ms"], 3)
    block["command"] = "python bench/stored_self_ab.py " + " ".join(sys.argv[1:] if argv is None else argv)
    block["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.is_file() else {}
    res.pop("machine", None)
    res.setdefault("indexes", {})[str(args.after)] = block
    print(json.dumps(block, indent=1))
    return finish(res, "stored_self_ab.py", argv, args.out)


if __name__ == "__main__":
    main()
