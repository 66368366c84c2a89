"""One block of ``attribution.json`` under the names issue 24's report asks for, for one fresh split.

Measures nothing: it copies, from the files that measured them, the LDS rows of the served default
on the fresh split (``influence_lds.py --merge-into``'s block: EK-FAC, TRAK, Bergson, BM25, and the
served answer by value), the planted-fact guards of the served answer (``value_rules.py``'s file), and
the two measures taken on their own corpora (the near-tie share at >= 4M tokens, the memorised-facts
recalls), each with the file it came from. ``lds_prism_fast`` here is the served default (documents
by their value, the opposed left out), not the first documents by score as in the split's own block.

    python -m bench.attribution.fresh_report --block served_default_seed10 \\
        --value-rules bench/results/attribution_value_rules_seed10.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path("bench/results")
BASELINES = ("ekfac", "trak", "bergson", "bm25")


def compose(att: dict, block: str, value_rules: dict, near_ties: dict, memorised: dict, sources: dict) -> dict:
    """The report block: every key issue 24's report names, from the blocks and files given."""
    if block not in att:
        raise KeyError(f"attribution.json: no block {block!r} (write it with influence_lds.py --merge-into)")
    b = att[block]
    guard = value_rules["guard"]
    out = {"lds_prism_fast": b["lds_prism_fast_value"], "lds_prism_fast_ci": b["lds_prism_fast_value_ci"],
           "lds_diff_prism_ekfac_ci": b["lds_diff_prism_fast_value_ekfac_ci"]}
    for m in BASELINES:
        out[f"lds_{m}"], out[f"lds_{m}_ci"] = b[f"lds_{m}"], b[f"lds_{m}_ci"]
    out |= {"lds_prism_fast_influence": b["lds_prism_fast_influence"],
            "lds_diff_prism_fast_influence_ekfac_ci": b["lds_diff_prism_fast_influence_ekfac_ci"],
            "canary_recall_at_10_verbatim": guard["canary_recall_at_10_verbatim_served"],
            "canary_recall_at_10_paraphrase": guard["canary_recall_at_10_paraphrase_served"],
            "near_tie_query_share": near_ties["near_tie_query_share"],
            "near_tie_query_share_ci95": near_ties.get("near_tie_query_share_ci95"),
            "canary_recall_at_10_verbatim_memorised": memorised["canary_recall_at_10_verbatim_memorised"],
            "candidate_recall_of_exact_top10_memorised": memorised["candidate_recall_of_exact_top10_memorised"],
            "served_default": (f"{b['value_returned']} documents returned, those whose value opposes the output "
                               "left out, each kept document's value as its score, the index's damping"),
            "split": b["split"], "sources": {"lds": f"attribution.json {block}", **sources}}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(RESULTS / "attribution.json"))
    ap.add_argument("--block", required=True, help="the fresh split's block (influence_lds.py --merge-key)")
    ap.add_argument("--value-rules", required=True, help="value_rules.py's file for the same split")
    ap.add_argument("--near-ties", default=str(RESULTS / "stored_cosine_scale.json"))
    ap.add_argument("--memorised", default=str(RESULTS / "attribution_memorised.json"))
    ap.add_argument("--out-key", default="fresh_split_report")
    args = ap.parse_args(argv)
    path = Path(args.results)
    att = json.loads(path.read_text())
    files = {"guards": args.value_rules, "near_tie_query_share": args.near_ties, "memorised": args.memorised}
    read = {k: json.loads(Path(v).read_text()) for k, v in files.items()}
    att[args.out_key] = compose(att, args.block, read["guards"], read["near_tie_query_share"], read["memorised"],
                                {k: Path(v).name for k, v in files.items()})
    path.write_text(json.dumps(att, indent=2) + "\n")
    print(json.dumps(att[args.out_key], indent=2))
    return att[args.out_key]


if __name__ == "__main__":
    main()
