"""Combinations of document scores, measured from the per-document scores ``near_ties.py --arrays`` saved
(no other pass of the model): ``base+w*other`` adds ``w`` times one score to another, for every query of
each saved run, and reports what ``near_ties.py`` reports for a score (near-tie share, planted facts'
recall at 1 and 10).

    python -m bench.attribution.near_ties_combine --arrays scale=runs/scale/near_ties_arrays.npz \\
        --arrays memorised=runs/bench_mem/near_ties_arrays.npz --combos 'cosine_match+0.05*cosine_top8' \\
        --out bench/results/near_ties_combine.json

Exploratory by construction: the queries are those of the runs that saved the arrays, so a combination
picked here must be confirmed on queries it was not picked on.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from bench._common import finish
from bench.attribution.near_ties import near_ties

COMBO = re.compile(r"^(?P<base>[\w.]+)(?:\+(?P<w>[0-9.eE+-]+)\*(?P<other>[\w.]+))?$")


def scores(arrays: np.lib.npyio.NpzFile, qi: int, combo: str) -> np.ndarray:
    m = COMBO.match(combo)
    if m is None:
        raise SystemExit(f"--combos: {combo!r} is not 'score' or 'score+weight*score'")
    s = arrays[f"{qi}/{m['base']}"].copy()
    if m["other"]:
        s += float(m["w"]) * arrays[f"{qi}/{m['other']}"]
    return s


def measure(path: Path, combos: list[str]) -> dict:
    a = np.load(path, allow_pickle=False)
    queries = json.loads(str(a["queries"]))
    ext, first = a["external_id"], a["first_of_text"]
    out: dict = {}
    for combo in combos:
        ties, ties_distinct, held_out = [], [], []
        ranks: dict[str, list[int | None]] = {}
        for qi, q in enumerate(queries):
            s = scores(a, qi, combo)
            keep = ~np.isin(ext, q.get("wanted", []))
            ties.append(near_ties(s, keep) > 10)
            ties_distinct.append(near_ties(s, keep & first) > 10)
            if q["kind"] == "held_out":
                held_out.append(ties[-1])
            if "wanted" in q:
                order = np.argsort(-s, kind="stable")[:1000]
                hits = np.nonzero(np.isin(ext[order], q["wanted"]))[0]
                ranks.setdefault(q["kind"], []).append(int(hits[0]) + 1 if len(hits) else None)
        row = {"near_tie_query_share": round(float(np.mean(ties)), 3),
               "near_tie_query_share_distinct_texts": round(float(np.mean(ties_distinct)), 3),
               "near_tie_query_share_held_out": round(float(np.mean(held_out)), 3) if held_out else None}
        for kind, r in ranks.items():
            for k in (1, 10):
                row[f"{kind}_recall_at_{k}"] = round(float(np.mean([(x or 10**9) <= k for x in r])), 3)
        out[combo] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arrays", action="append", required=True, help="NAME=PATH of a near_ties.py --arrays file")
    ap.add_argument("--combos", required=True, help="comma-separated: score or score+weight*score")
    ap.add_argument("--out", default="bench/results/near_ties_combine.json")
    args = ap.parse_args(argv)
    combos = [c.strip() for c in args.combos.split(",") if c.strip()]
    runs = dict(a.split("=", 1) for a in args.arrays)
    res = {"runs": {name: str(path) for name, path in runs.items()},
           "by_run": {name: measure(Path(path), combos) for name, path in runs.items()}}
    return finish(res, "attribution/near_ties_combine.py", argv, args.out)


if __name__ == "__main__":
    main()
