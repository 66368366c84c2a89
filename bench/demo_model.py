"""What a user sees of a demo model: its validation perplexity, grounding, and how well its prototypes'
labels describe what they fire on.

For each model (a run or checkpoint directory and an index of the demo corpus built with it):

- ``val_ppl`` and ``val_bits_per_byte``: next-token loss over every validation document of the
  bundled corpus (``train.val_fraction``'s split, which no model trained on), each document tokenised
  by the model's own tokenizer and followed by end-of-text, as training streams them; bits per byte
  compare models whose tokenizers differ;
- ``R1bar``, ``R2`` and prototype usage over the same tokens (``model/metrics.py``);
- the labels (``engine/steering.py: prototype_labels``, as the Prototypes page shows them, built from a
  prototype's top 10 contexts), per prototype with at least 20 indexed top contexts:
  - ``label_support``: the share of its top 10 contexts (the 6 tokens either side of the activating
    token, widened to whole words) that the label describes: the activating token is one of the
    label's quoted tokens, or the window holds one of its words; ``label_grounded_share``: the share
    of prototypes whose label describes most (> half) of their top contexts;
  - ``label_support_heldout`` and ``label_grounded_share_heldout``: the same over its contexts ranked
    11-20, which the label was not built from: whether a label predicts where its prototype fires;
  - ``labels_earlier_rule``: the same for the labels of the earlier rule (c-TF-IDF words of the
    contexts and the signature, no tokens), and ``labels_vs_earlier_rule``: the paired difference per
    prototype with a 95% bootstrap interval;
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
from prism_tda.engine.steering import label_parts, prototype_labels, token_form, word_window, words
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


def label_quality(reader: IndexReader, model, tokenizer, categories: list[str], seed: int = 0,
                  min_share: float = 0.3) -> dict:
    """``min_share`` above 1 names every prototype by the earlier rule (c-TF-IDF words only)."""
    labels = prototype_labels(reader, model, tokenizer, n_contexts=N_CONTEXTS, min_share=min_share)
    freq = Counter(categories)
    p_cat = np.array(list(freq.values()), dtype=np.float64) / len(categories)
    rng = np.random.default_rng(seed)
    draws = rng.choice(len(p_cat), size=(20000, N_CONTEXTS), p=p_cat)
    random_purity = float(np.mean([np.bincount(d).max() / N_CONTEXTS for d in draws]))
    support, heldout, purity, n_used, ids = [], [], [], 0, []
    with_tokens = 0
    for p in range(model.cfg.n_prototypes):
        ctx = reader.top_contexts(p, 2 * N_CONTEXTS)
        if len(ctx) < 2 * N_CONTEXTS:  # the held-out contexts are ranks 11-20
            continue
        n_used += 1
        ids.append(p)
        tokens, label_words = label_parts(labels.get(p, ""))
        with_tokens += bool(tokens)
        hits, cats = [], []
        for row, _ in ctx:
            _, doc, pos, seq = token_context(reader, row)
            a, b = word_window(tokenizer, seq, max(0, pos - 6), min(len(seq), pos + 6))
            window = set(words(tokenizer.decode(seq[a:b])))
            hits.append(token_form(tokenizer.decode([seq[pos]])) in tokens or bool(label_words & window))
            cats.append(categories[doc])
        support.append(np.mean(hits[:N_CONTEXTS]))
        heldout.append(np.mean(hits[N_CONTEXTS:]))
        purity.append(Counter(cats[:N_CONTEXTS]).most_common(1)[0][1] / N_CONTEXTS)
    s, h = np.array(support), np.array(heldout)
    return {"prototypes_with_contexts": n_used, "labelled": sum(1 for v in labels.values() if v),
            "labels_with_tokens": with_tokens,
            "label_support": round(float(s.mean()), 4), "label_grounded_share": round(float((s > 0.5).mean()), 4),
            "label_support_heldout": round(float(h.mean()), 4),
            "label_grounded_share_heldout": round(float((h > 0.5).mean()), 4),
            "category_purity": round(float(np.mean(purity)), 4), "category_purity_random": round(random_purity, 4),
            "per_prototype": {"proto_id": ids, "support": s.round(3).tolist(), "support_heldout": h.round(3).tolist()},
            "examples": {str(p): labels.get(p, "") for p in range(0, model.cfg.n_prototypes, max(1, model.cfg.n_prototypes // 12))}}


def paired(a: dict, b: dict, key: str, draws: int = 2000, seed: int = 0) -> dict:
    """Mean of ``b - a`` over the prototypes both measured, with a 95% bootstrap interval over prototypes."""
    ia = dict(zip(a["per_prototype"]["proto_id"], a["per_prototype"][key], strict=True))
    ib = dict(zip(b["per_prototype"]["proto_id"], b["per_prototype"][key], strict=True))
    common = sorted(set(ia) & set(ib))
    d = np.array([ib[p] - ia[p] for p in common])
    rng = np.random.default_rng(seed)
    boot = d[rng.integers(0, len(d), size=(draws, len(d)))].mean(axis=1)
    return {"mean": round(float(d.mean()), 4), "ci95": [round(float(np.quantile(boot, q)), 4) for q in (0.025, 0.975)],
            "prototypes": len(common)}


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
        "labels_earlier_rule": label_quality(reader, model, tokenizer, categories, min_share=2.0),
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
        m = res["models"][name] = measure(Path(run), Path(index))
        m["labels_vs_earlier_rule"] = {k: paired(m["labels_earlier_rule"], m["labels"], k)
                                       for k in ("support", "support_heldout")}
    return finish(res, "demo_model.py", argv, args.out)


if __name__ == "__main__":
    main()
