"""Write ``fortunes_mc.jsonl``: a tiny multiple-choice task for lm-eval (``prism_fortunes.yaml``).

Each item is the first half of a one-line fortune from the bundled demo corpus and four candidate
second halves: its own and three of other fortunes. With ``--checkpoint``, only fortunes that the
checkpoint's training record says it never trained on are used (held-out text for that model).

    python -m bench.lm_eval.make_fortunes_mc --checkpoint runs/demo --n 40
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

import numpy as np

from prism_tda import demo_corpus_path
from prism_tda.model.checkpoint import load_record
from prism_tda.model.record import document_key

OUT = Path(__file__).with_name("fortunes_mc.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="keep only fortunes this checkpoint's training record never trained on")
    ap.add_argument("--n", type=int, default=40, help="items")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    docs = [json.loads(line) for line in gzip.open(demo_corpus_path(), "rt")]
    # one line, 8 to 16 words, no attribution: a sentence whose second half the first half predicts
    docs = [d for d in docs if "\n" not in d["text"] and 8 <= len(d["text"].split()) <= 16]
    if args.checkpoint:
        record = load_record(args.checkpoint)
        if record is None:
            raise SystemExit(f"{args.checkpoint}: no training record")
        windows, _ = record.lookup(np.array([document_key(d["id"], d["text"]) for d in docs], np.int64))
        docs = [d for d, w in zip(docs, windows, strict=True) if w == 0]
    rng = random.Random(args.seed)
    rng.shuffle(docs)
    halves = []
    for d in docs:
        words = d["text"].split()
        cut = len(words) // 2
        halves.append((d["id"], " ".join(words[:cut]), " " + " ".join(words[cut:])))
    items = []
    for i, (doc_id, context, ending) in enumerate(halves[: args.n]):
        others = [h[2] for j, h in enumerate(halves) if j != i]
        choices = rng.sample(others, 3) + [ending]
        rng.shuffle(choices)
        items.append({"id": doc_id, "context": context, "choices": choices, "label": choices.index(ending)})
    with open(args.out, "w") as fh:
        for item in items:
            fh.write(json.dumps(item) + "\n")
    print(f"{args.out}: {len(items)} items from {len(docs)} eligible fortunes")


if __name__ == "__main__":
    main()
