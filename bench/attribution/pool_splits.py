"""One estimate from several fresh report splits: the fixed-effect (inverse-variance) pool of a paired
difference that each split reports with its own 95% bootstrap interval.

Each split's standard error is read from its interval as ``(high - low) / (2 * 1.96)`` (the bootstrap
distribution taken as normal), the splits are weighted by ``1 / se^2``, and the pooled interval is
``pooled +- 1.96 * sqrt(1 / sum of weights)``. The splits are independent (each its own corpus draw,
model, retrained subsets and queries), which is what the pool assumes. By default: the ``influence``
option's difference against EK-FAC on every ``fresh_split_influence*`` block of ``attribution.json``
that ran the same rule (documents returned and both dampings, read from each block's report file).

    python -m bench.attribution.pool_splits
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

Z95 = 1.959964
RULE = ("returned", "influence_damping_served", "served_damping")  # what makes two splits' reports comparable


def pool(points: list[float], lows: list[float], highs: list[float]) -> dict:
    """The inverse-variance pool of estimates given with 95% intervals."""
    p, lo, hi = (np.asarray(v, np.float64) for v in (points, lows, highs))
    se = (hi - lo) / (2 * Z95)
    if not (se > 0).all():
        raise ValueError(f"every interval must have a width: {list(zip(lo, hi, strict=True))}")
    w = 1 / se**2
    est, se_pool = float((w * p).sum() / w.sum()), float(np.sqrt(1 / w.sum()))
    return {"estimate": round(est, 4), "ci95": [round(est - Z95 * se_pool, 4), round(est + Z95 * se_pool, 4)],
            "se": round(se_pool, 4), "weights": [round(float(x / w.sum()), 3) for x in w]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="bench/results/attribution.json")
    ap.add_argument("--prefix", default="fresh_split_influence")
    ap.add_argument("--keys", default="lds_diff_prism_fast_influence_ekfac_ci,lds_diff_prism_fast_ekfac_ci")
    ap.add_argument("--out-key", default="fresh_splits_influence_pooled")
    args = ap.parse_args(argv)
    path = Path(args.results)
    res = json.loads(path.read_text())
    blocks = {k: v for k, v in res.items() if k.startswith(args.prefix) and isinstance(v, dict)}
    rules = {}
    for name, b in blocks.items():  # the rule each split ran: its report file's settings
        src = json.loads(Path(b["source"]).read_text())
        rules[name] = tuple(src.get(k) for k in RULE)
    if len(set(rules.values())) != 1:
        raise SystemExit(f"{path}: the {args.prefix}* blocks ran different rules ({', '.join(RULE)}: {rules}); "
                         "pool only splits of one rule")
    out: dict = {"splits": sorted(blocks), "rule": dict(zip(RULE, next(iter(rules.values())), strict=True)),
                 "method": "fixed-effect inverse-variance pool of the splits' paired "
                 "differences; each split's se from its 95% bootstrap interval as (high - low) / 3.92"}
    for key in args.keys.split(","):
        try:
            triples = [blocks[b][key] for b in sorted(blocks)]
        except KeyError as e:
            raise SystemExit(f"{path}: block without {e}") from None
        out[key] = pool(*zip(*triples, strict=True))
    res[args.out_key] = out
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
