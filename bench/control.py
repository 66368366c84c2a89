"""Sparse prototype controllers, measured (``engine/control.py``): held-out multiple-choice accuracy of the
model alone, with a controller, and with a controller of the same size on random directions of the final
hidden state.

The task: items from the index's trained documents (an opening and four endings of ``--ending-tokens``
tokens, one its own, three of other documents of the same part), split by document: half to fit, half
held out (``--heldout``). The L1 penalty is chosen on a validation quarter of the fitting items (grid
``--l1``), then the controller is fitted on all fitting items with it and evaluated once on the
held-out items; the random-direction baseline gets as many directions as the controller has
prototypes, the same penalty, steps and learning rate. Intervals: 95% bootstrap over held-out items, paired for the gains.

    python -m bench.control --index runs/demo_idle/index

Writes ``bench/results/control.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench._common import finish
from prism_tda.engine import Attributor
from prism_tda.engine.catalog import Catalog
from prism_tda.engine.control import ChoiceCache, bootstrap, fit, fit_random, index_task, random_scores


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", default="runs/demo_idle/index")
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--heldout", type=float, default=0.5, help="share of the items held out (by document)")
    ap.add_argument("--ending-tokens", type=int, default=8)
    ap.add_argument("--l1", type=float, nargs="+", default=[0.1, 0.2, 0.4],
                    help="L1 penalties to choose from, relative to the largest gradient at the start")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/control.json")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    att = Attributor.open(args.index)
    model = att.model
    K = model.head.n_prototypes
    task = index_task(args.index, att.tokenizer, ending_tokens=args.ending_tokens, max_items=args.items,
                      heldout=args.heldout, seed=args.seed)
    n_val = len(task.train) // 4
    fit_items, val_items = task.train[n_val:], task.train[:n_val]
    c_fit, c_val = ChoiceCache.of(model, fit_items), ChoiceCache.of(model, val_items)
    with torch.no_grad():
        val_base = float(c_val.accuracy(c_val.scores(model)).mean())
    tuning = []
    for l1 in args.l1:
        ctrl = fit(model, c_fit, l1=l1, steps=args.steps, lr=args.lr, progress=True)
        with torch.no_grad():
            acc = float(c_val.accuracy(c_val.scores(model, ctrl.shift(model, c_val))).mean())
        tuning.append({"l1": l1, "prototypes": len(ctrl.prototypes), "val_accuracy": round(acc, 4)})
        print(tuning[-1], flush=True)
    l1 = max(tuning, key=lambda r: (r["val_accuracy"], r["l1"]))["l1"]  # ties: the sparser
    c_train, c_held = ChoiceCache.of(model, task.train), ChoiceCache.of(model, task.heldout)
    t_fit = time.perf_counter()
    ctrl = fit(model, c_train, l1=l1, steps=args.steps, lr=args.lr, progress=True)
    fit_s = time.perf_counter() - t_fit
    n = len(ctrl.prototypes)
    R, w = fit_random(model, c_train, n, l1=l1, steps=args.steps, lr=args.lr, seed=args.seed, progress=True)
    with torch.no_grad():
        base = c_held.accuracy(c_held.scores(model))
        mine = c_held.accuracy(c_held.scores(model, ctrl.shift(model, c_held)))
        rand = c_held.accuracy(random_scores(model, c_held, R, w))
        train_acc = float(c_train.accuracy(c_train.scores(model, ctrl.shift(model, c_train))).mean())
    cat = Catalog(att.reader, model, att.tokenizer)
    res = {
        "index": str(Path(args.index).resolve()), "prototypes_in_bank": K,
        "task": {**task.config, "trained_documents": task.documents, "fit_items": len(task.train),
                 "heldout_items": len(task.heldout), "choices": 4, "chance": 0.25},
        "l1_tuning": {"validation_items": len(val_items), "validation_accuracy_base": round(val_base, 4),
                      "grid": tuning, "chosen": l1},
        "controller_prototypes": n, "controller_share_of_bank": round(n / K, 4),
        "random_directions": int(R.shape[1]), "random_nonzero_weights": int((w != 0).sum()),
        "accuracy_base": round(float(base.mean()), 4), "accuracy_base_ci": bootstrap(base),
        "accuracy_controller": round(float(mine.mean()), 4), "accuracy_controller_ci": bootstrap(mine),
        "accuracy_controller_train": round(train_acc, 4),
        "accuracy_random": round(float(rand.mean()), 4), "accuracy_random_ci": bootstrap(rand),
        "controller_gain_points": round(float(100 * (mine - base).mean()), 2),
        "controller_gain_points_ci": [round(100 * x, 2) for x in bootstrap(mine - base)],
        "random_gain_points": round(float(100 * (rand - base).mean()), 2),
        "random_gain_points_ci": [round(100 * x, 2) for x in bootstrap(rand - base)],
        "controller_minus_random_points_ci": [round(100 * x, 2) for x in bootstrap(mine - rand)],
        "weights": [{"proto_id": i, "alpha": round(float(ctrl.alpha[i]), 4),
                     "label": (cat.prototype(i) or {}).get("label")} for i in ctrl.prototypes[:20]],
        "fit_seconds": round(fit_s, 1), "seconds": round(time.perf_counter() - t0, 1),
    }
    return finish(res, "control.py", argv, args.out, hide=("weights",))


if __name__ == "__main__":
    main()
