"""What running the last block only at the scored positions (``PRISM.hidden_at``) saves in a served
query, against the whole model on every position, interleaved query by query in one process.

Same queries as ``bench/query_profile.py`` (64-token prompts cut from the demo corpus, completion
" is a machine", top 10), each asked once per arm per repeat, the arm order alternating; the switch is
``prism_tda.engine.tokens.LAST_BLOCK_AT_POSITIONS`` (it touches the query encode and the re-rank).
Per arm: the median and p90 of the wall time and of the re-rank and query-forward stages; the paired
difference of the medians per query with a 95% bootstrap interval; and whether both arms return the
same documents in the same order, with the largest score difference.

    python -m bench.rerank_forward_ab --index runs/demo/index
"""

from __future__ import annotations

import argparse

import torch

import prism_tda.engine.tokens as tokens
from bench._common import add_demo_query_args, demo_queries, finish, interleaved_queries, paired_summary

ARMS = ("whole", "last_block_at_positions")
STAGES = ("query_forward", "rerank", "total")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_demo_query_args(ap, "bench/results/rerank_forward_ab.json", repeats=5)
    args = ap.parse_args(argv)
    att, specs, opt = demo_queries(args)
    was = tokens.LAST_BLOCK_AT_POSITIONS

    def arm(on: bool):
        def put() -> None:
            tokens.LAST_BLOCK_AT_POSITIONS = on
        return put

    try:
        times, answers = interleaved_queries(att, specs, opt, {ARMS[0]: arm(False), ARMS[1]: arm(True)},
                                             args.repeats, STAGES)
    finally:
        tokens.LAST_BLOCK_AT_POSITIONS = was
    ab = paired_summary(times, answers, ("wall", *STAGES))
    res = {
        "index": args.index, "tokens": att.reader.n_tokens, "queries": len(specs), "repeats": args.repeats,
        "arms": ab["arms"], "diff_last_block_minus_whole": ab["diff"],
        "same_documents_and_order": ab["same_documents_and_order"], "max_score_diff": ab["max_score_diff"],
        "torch_threads": torch.get_num_threads(),
    }
    return finish(res, "rerank_forward_ab.py", argv, args.out)


if __name__ == "__main__":
    main()
