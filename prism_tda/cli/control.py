"""`prism control fit|eval`: sparse prototype controllers on an index's multiple-choice task
(``engine/control.py``)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

log = logging.getLogger("prism")


def _task(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from prism_tda.engine import Attributor
    from prism_tda.engine.control import index_task

    att = Attributor.open(args.index)
    task = index_task(args.index, att.tokenizer, ending_tokens=args.ending_tokens, max_items=args.items,
                      seed=args.seed)
    return att, task, att.model


def _accuracy(model: Any, items: list, controller: Any = None) -> dict[str, Any]:
    import torch

    from prism_tda.engine.control import ChoiceCache, bootstrap

    cache = ChoiceCache.of(model, items)
    with torch.no_grad():
        base = cache.accuracy(cache.scores(model))
        out: dict[str, Any] = {"items": cache.n_items, "chance": 1 / cache.n_choices,
                               "accuracy_base": float(base.mean()), "accuracy_base_ci": bootstrap(base)}
        if controller is not None:
            ctrl = cache.accuracy(cache.scores(model, controller.shift(model, cache)))
            out |= {"accuracy_controller": float(ctrl.mean()), "accuracy_controller_ci": bootstrap(ctrl),
                    "gain_points": float(100 * (ctrl - base).mean()),
                    "gain_points_ci": [100 * x for x in bootstrap(ctrl - base)]}
    return out


def _labels(att: Any, ids: list[int]) -> dict[int, str | None]:
    from prism_tda.engine.catalog import Catalog

    cat = Catalog(att.reader, att.model, att.tokenizer)
    return {i: (cat.prototype(i) or {}).get("label") for i in ids}


def cmd_fit(args: argparse.Namespace) -> int:
    from prism_tda.engine.control import ChoiceCache, fit

    t0 = time.perf_counter()
    att, task, model = _task(args)
    log.info("control: %d training and %d held-out items from %d trained documents", len(task.train),
             len(task.heldout), task.documents)
    ctrl = fit(model, ChoiceCache.of(model, task.train), l1=args.l1, steps=args.steps, lr=args.lr,
               progress=not args.no_progress)
    held = _accuracy(model, task.heldout, ctrl)
    ctrl.meta |= {"index": str(args.index), "task": task.config, "heldout": held}
    ctrl.save(args.out)
    labels = _labels(att, ctrl.prototypes)
    report = {"controller": str(args.out), "prototypes": len(ctrl.prototypes), "heldout": held,
              "weights": [{"proto_id": i, "alpha": round(float(ctrl.alpha[i]), 4), "label": labels.get(i)}
                          for i in ctrl.prototypes[:50]],
              "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from prism_tda.engine.control import Controller

    att, task, model = _task(args)
    ctrl = Controller.load(args.controller, model.head.n_prototypes if model.head is not None else None)
    items = task.heldout if args.split == "heldout" else task.train
    res = _accuracy(model, items, ctrl)
    print(json.dumps({"controller": str(args.controller), "split": args.split, **res},
                     indent=None if args.json else 2))
    return 0


def register(sub: Any) -> None:
    c = sub.add_parser("control", help="sparse prototype controllers: fit one on a task, evaluate it",
                       description="A controller is a strength per prototype (1: untouched), fitted with an L1 "
                                   "penalty on a multiple-choice task built from the index's trained documents (an "
                                   "opening and four endings of the same length, one its own). Apply one with "
                                   "`prism generate --controller` or `/v1/generate`'s `prototype_alphas`.")
    cs = c.add_subparsers(dest="control_command", required=True, metavar="ACTION")

    def task_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--index", required=True, help="index directory (its model and trained documents)")
        p.add_argument("--items", type=int, default=1200, help="questions drawn, 30%% of them held out (default 1200)")
        p.add_argument("--ending-tokens", type=int, default=8, help="tokens of each candidate ending (default 8)")
        p.add_argument("--seed", type=int, default=0, help="the task's draw and split")
        p.add_argument("--json", action="store_true", help="one line of JSON")

    f = cs.add_parser("fit", help="fit a controller on the task's training items and report the held-out ones")
    task_args(f)
    f.add_argument("--out", required=True, help="controller file to write (JSON)")
    f.add_argument("--l1", type=float, default=0.2,
                   help="L1 penalty on alpha - 1, relative to the largest gradient at the start (larger: fewer "
                        "prototypes; a prototype whose gradient stays below this share of it is left at 1)")
    f.add_argument("--steps", type=int, default=150)
    f.add_argument("--lr", type=float, default=0.05)
    f.add_argument("--no-progress", action="store_true")
    f.set_defaults(fn=cmd_fit)

    e = cs.add_parser("eval", help="accuracy of the model with and without a controller")
    task_args(e)
    e.add_argument("--controller", required=True, help="a file written by `prism control fit`")
    e.add_argument("--split", choices=["heldout", "train"], default="heldout")
    e.set_defaults(fn=cmd_eval)
