"""Whether copying the exact scores of tied documents' best rows to every candidate window that holds
the same text up to them brings the fast path's top 10 closer to exact mode's, and what it costs.

When more documents share a stretch of text (a licence header, a repeated document) than the shortlist
holds, their best tokens tie exactly and exact mode keeps the lowest document ids; the fast path kept
whichever the shortlist happened to hold (their compressed scores differ in the last digits). With
``PREFIX_COPIES`` (``engine/scoring.py``, ``prefix_copies``) the re-rank, when two of the n best tie
exactly, copies each of the n best rows to the candidate windows holding the same tokens from their
start through that row: a causal model scores them the same.

Protocol as ``rows_elsewhere.py``: held-out queries at scale, a draw that leaves out every earlier draw
(``--exclude SEED:N,...``), exact ``cosine_max`` from one pass of the model (cached in ``--arrays``),
the served defaults with and without, interleaved query by query; strict overlap@10 and tie-aware
agreement with 95% bootstrap intervals over queries, paired for the difference; seconds per query.

    python -m bench.attribution.prefix_copies --index runs/scale/prefix_0005 \\
        --heldout runs/scale/corpus/part-006.jsonl --seed 6 --exclude 2:24,3:48,4:48,5:48 \\
        --arrays runs/scale/prefix_copies_report.npz --out bench/results/prefix_copies.json
"""

from __future__ import annotations

from bench.attribution.rows_elsewhere import switch_ab
from prism_tda.engine import scoring


def main(argv: list[str] | None = None) -> dict:
    return switch_ab(argv, __doc__ or "", scoring, "PREFIX_COPIES", "attribution/prefix_copies.py",
                     "bench/results/prefix_copies.json")


if __name__ == "__main__":
    main()
