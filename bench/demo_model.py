"""What a user sees of a demo model: its validation perplexity, grounding, and how well its prototypes'
labels describe what they fire on.

For each model (a run or checkpoint directory and an index of the demo corpus built with it):

- ``val_ppl`` and ``val_bits_per_byte``: next-token loss over every validation document of the
  bundled corpus (``train.val_fraction``'s split, which no model trained on), each document tokenised
  by the model's own tokenizer and followed by end-of-text, as training streams them; bits per byte
  compare models whose tokenizers differ;
- ``R1bar``, ``R2`` and prototype usage over the same tokens (``model/metrics.py``);
- the labels (``engine/steering.py: prototype_labels``, as the Prototypes page shows them), per
  prototype with at least 5 indexed top contexts:
  - ``label_support``: the share of its top 10 contexts (the 6 tokens either side of the activating
    token, widened to whole words) that contain one of its label's words; ``label_grounded_share``: the share of prototypes
    whose label words occur in most (> half) of their top contexts;
  - ``category_purity``: the share of its top 10 contexts whose document is in the most common
    category (the demo corpus's fortune files: ``art``, ``computers``, ...), against the same share for
    10 documents drawn at random with the corpus's category frequencies (``category_purity_random``).

    python -m bench.demo_model --model old=runs/demo:runs/demo/index --model new=runs/demo_v2:runs/demo_v2/index

Writes ``bench/results/demo_model.json``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from bench._common import finish
from prism_tda import demo_corpus_path
from prism_tda.engine.reader import IndexReader
from prism_tda.engine.reads import document_table, token_context
from prism_tda.engine.steering import prototype_labels, word_window, words
from prism_tda.model import checkpoint as ckpt
from prism_tda.model.data import _Stream, split_documents
from prism_tda.model.metrics import evaluate

N_CONTEXTS = 10


def validation(tokenizer, val_fraction: float) -> tuple[np.ndarray, int]:
    """The validation documents as one token stream, and their text's bytes (one more per document for
    its end-of-text)."""
    docs, _ = split_documents([demo_corpus_path()], val_fraction)
    s = _Stream(tokenizer)
    n_bytes = 0
    for is_val, d in docs:
        if is_val:
            s.add(d)
            n_bytes += len(d.text.encode()) + 1
    return s.arrays()[0], n_bytes


def label_quality(reader: IndexReader, model, tokenizer, categories: list[str], seed: int = 0) -> dict:
    labels = prototype_labels(reader, model, tokenizer)
    freq = Counter(categories)
    p_cat = np.array(list(freq.values()), dtype=np.float64) / len(categories)
    rng = np.random.default_rng(seed)
    draws = rng.choice(len(p_cat), size=(20000, N_CONTEXTS), p=p_cat)
    random_purity = float(np.mean([np.bincount(d).max() / N_CONTEXTS for d in draws]))
    support, purity, n_used = [], [], 0
    for p in range(model.cfg.n_prototypes):
        ctx = reader.top_contexts(p, N_CONTEXTS)
        if len(ctx) < 5:
            continue
        n_used += 1
        label = set(words(labels.get(p, "")))
        hits, cats = 0, []
        for row, _ in ctx:
            _, doc, pos, ids = token_context(reader, row)
            a, b = word_window(tokenizer, ids, max(0, pos - 6), min(len(ids), pos + 6))
            window = set(words(tokenizer.decode(ids[a:b])))
            hits += bool(label & window)
            cats.append(categories[doc])
        support.append(hits / len(ctx))
        purity.append(Counter(cats).most_common(1)[0][1] / len(cats))
    s = np.array(support)
    return {"prototypes_with_contexts": n_used, "labelled": sum(1 for v in labels.values() if v),
            "label_support": round(float(s.mean()), 4), "label_grounded_share": round(float((s > 0.5).mean()), 4),
            "category_purity": round(float(np.mean(purity)), 4), "category_purity_random": round(random_purity, 4),
            "examples": {str(p): labels.get(p, "") for p in range(0, model.cfg.n_prototypes, max(1, model.cfg.n_prototypes // 12))}}


def measure(run: Path, index: Path) -> dict:
    model, tokenizer, config = ckpt.load_checkpoint(run)
    val_fraction = float(config.get("training", {}).get("train", {}).get("val_fraction", 0.05))
    stream, n_bytes = validation(tokenizer, val_fraction)
    with torch.no_grad():
        ev = evaluate(model, stream, batch_size=16, max_tokens=len(stream) + 1)
    # evaluate() scores whole windows only: bits per byte over the bytes of the tokens it scored
    scored_bytes = n_bytes * ev["val_tokens"] / max(len(stream), 1)
    reader = IndexReader(index)
    categories = document_table(index, ["title"]).column("title").to_pylist()
    return {
        "checkpoint": str(ckpt.resolve(run)), "index": str(index),
        "parameters": sum(p.numel() for p in model.parameters()),
        "model": {k: config["model"][k] for k in ("d_model", "n_layer", "n_prototypes", "n_active", "vocab_size",
                                                 "block_size", "dropout") if k in config["model"]},
        "training_step": config.get("training", {}).get("step"),
        "val_loss": round(ev["val_loss"], 4), "val_ppl": round(ev["val_ppl"], 2), "val_tokens": int(ev["val_tokens"]),
        "val_bits_per_byte": round(ev["val_loss"] * ev["val_tokens"] / (math.log(2) * scored_bytes), 4),
        "R1bar": round(ev["R1bar"], 4), "R2": round(ev["R2"], 4),
        "effective_prototypes": round(ev.get("effective_prototypes", float("nan")), 1),
        "dead_prototypes": ev.get("dead_prototypes"),
        "labels": label_quality(reader, model, tokenizer, categories),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, metavar="NAME=RUN:INDEX")
    ap.add_argument("--out", default="bench/results/demo_model.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    res: dict = {"models": {}}
    for item in args.model:
        name, _, paths = item.partition("=")
        run, _, index = paths.partition(":")
        res["models"][name] = measure(Path(run), Path(index))
    return finish(res, "demo_model.py", argv, args.out)


if __name__ == "__main__":
    main()
