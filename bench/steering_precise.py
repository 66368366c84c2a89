"""Steering under a judge precise enough to show the target: step 6's set of ``bench/steering.py``
(selected by effect, 10 prototypes, 2% of the bank) at graded strengths and under the gate, judged
by the same topic classifier at a 0.1% false-positive threshold, on a fresh report split.

Why: at the strict judge's 1% false-positive rate the most it can show on neutral prompts is a drop
of 0.735 (``steering.json`` ``strict_judge.larger_draw.largest_drop_at_floor``), and step 6's set,
suppressed everywhere, already brings the rate down to that floor (0.0088 against 0.0080). Whether a
set removes the topic (a drop of 0.75 or more) cannot be seen at that resolution.

    python -m bench.steering_precise --index runs/demo/index

1. **The same topic, set and classifier as** ``bench/steering.py`` (read from its results file, the
   classifier refitted by its recipe; the 5-fold cross-validation is checked against the file's).
2. **The precise judge**: the classifier's threshold where ``PRECISE_FP`` (0.1%) of generation-length
   windows of other categories' training documents score above it (3 seeded windows from each of
   8,000 documents the classifier was not fitted on); 6,000 windows of 2,000 further documents check
   that rate. 0.1% was fixed on the tuning prompts before any report generation: the largest of 1%,
   0.3% and 0.1% whose largest measurable drop at the tuning base rate clears the target by 0.1.
   The same windows also give a 1% threshold (the strict judge's rule) for comparison.
3. **Configurations** (``CONFIGS``): the set scaled by alpha 0, 0.25 or 0.5 everywhere, or removed
   only where the context carries it (``gate`` 0.05 or 0.1 over 16 positions, step 14's window).
   **Chosen on the tuning split, by a rule fixed before the first run**: among configurations whose
   tuning contrast perplexity (``steering.py``'s tuning documents) stays within ``TUNE_PPL`` (step 14's
   bound), the one with the largest drop under the precise judge on the tuning prompts
   (``TUNE_PROMPTS``, ``--tune-samples`` samples each, their own seed).
4. **Report on a fresh split**: ``FRESH_PROMPTS`` (50 neutral openings in neither of ``steering.py``'s
   lists), ``--samples`` samples each, a seed no run has used; the base, every configuration and a
   random set of 10 (step 6's control) in the chosen configuration; the precise and the 1% judge;
   perplexity on ``steering.py``'s 400 evaluation documents of other categories. **Primary row: the
   chosen configuration's drop under the precise judge and its perplexity ratio.** Intervals: 95%
   bootstrap over prompts (drops) and over documents (perplexity).

Writes ``bench/results/steering_precise.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import finish, index_documents
from bench.steering import (
    GATE_TUNE_PPL,
    GATE_WINDOW,
    PROMPTS,
    TUNE_PROMPTS,
    TopicClassifier,
    boot_ppl_ratio,
    classifier_documents,
    cross_validate,
    perplexity,
    rate_row,
    sample,
)
from prism_tda.engine import Attributor
from prism_tda.model.tokenizer import eos_id

PRECISE_FP = 0.001
CAL_DOCS, CHECK_DOCS, WINDOWS_PER_DOC = 8000, 2000, 3
TUNE_PPL = GATE_TUNE_PPL
CONFIGS: dict[str, dict] = {
    "alpha_0": {"alpha": 0.0}, "alpha_0.25": {"alpha": 0.25}, "alpha_0.5": {"alpha": 0.5},
    "gate_0.05": {"gate": 0.05}, "gate_0.1": {"gate": 0.1},
}
FRESH_PROMPTS = ["And", "But", "Today is", "In my", "The man", "A little", "Nothing is", "Someday", "If I", "When I",
                 "No man", "The last", "Knowledge", "Fear", "Happiness", "Power", "The trouble", "The future",
                 "The art", "A friend", "Men", "Women", "Children", "Never trust", "To be", "Life", "Death",
                 "The truth", "All men", "Every day", "It was", "Let", "Hope", "Art", "Science", "War", "Peace",
                 "The problem", "Genius", "Success", "Experience", "A wise", "Some people", "Everything", "Nature",
                 "Beauty", "Faith", "Marriage", "The sun", "Music"]
assert not set(FRESH_PROMPTS) & (set(PROMPTS) | set(TUNE_PROMPTS))


def choose(tuning: list[dict], bound: float = TUNE_PPL) -> str | None:
    """The configuration step 3 chooses from its tuning rows (``config``, ``contrast_ppl_ratio`` and, when it was
    generated, ``precise_drop``): the largest positive drop among those within ``bound``, the lower perplexity
    on a tie; None when none qualifies."""
    ok = [e for e in tuning if e["contrast_ppl_ratio"] <= bound and e.get("precise_drop", -math.inf) > 0]
    return max(ok, key=lambda e: (e["precise_drop"], -e["contrast_ppl_ratio"]))["config"] if ok else None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", default="runs/demo/index")
    ap.add_argument("--steering", default="bench/results/steering.json", help="bench/steering.py's results")
    ap.add_argument("--samples", type=int, default=200, help="samples per report prompt")
    ap.add_argument("--tune-samples", type=int, default=150, help="samples per tuning prompt")
    ap.add_argument("--prompts", type=int, default=len(FRESH_PROMPTS))
    ap.add_argument("--ppl-docs", type=int, default=400)
    ap.add_argument("--tune-docs", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0, help="steering.py's seed (its splits)")
    ap.add_argument("--out", default="bench/results/steering_precise.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    st = json.loads(Path(args.steering).read_text())
    torch.manual_seed(args.seed)
    att = Attributor.open(args.index)
    model, tok = att.model, att.tokenizer
    docs = index_documents(args.index, ["doc_id", "external_id", "text", "trained"])
    cat = np.array([e.split("/")[0] for e in docs["external_id"]])
    trained = np.array(docs["trained"], dtype=bool)
    # 1. steering.py's splits and classifier (its steps 1-3, the same seeded draws in the same order)
    rng = np.random.default_rng(args.seed)
    half = rng.random(len(cat)) < 0.5
    topic = cat == st["topic"]
    clf_docs = classifier_documents(rng, topic, trained, half)
    texts = [docs["text"][i] for i in clf_docs]
    y = topic[clf_docs].astype(int)
    cv = cross_validate(texts, y, seed=args.seed)
    for k in ("accuracy", "precision", "recall", "n", "n_topic"):
        if cv[k] != st["classifier"][k]:
            raise SystemExit(f"{args.steering}: classifier.{k} is {st['classifier'][k]}, the refit gives {cv[k]}")
    clf = TopicClassifier().fit(texts, y)
    ids = st["select_effect"]["prototypes"]
    control = st["strict_judge"]["larger_draw"]["selected_control_prototypes"]
    held = np.nonzero(~trained)[0]
    others = [i for i in held if not topic[i]]
    other_ids = [tok.encode(docs["text"][i]).ids for i in others[: args.ppl_docs]]
    tune_docs = [tok.encode(docs["text"][i]).ids for i in others[args.ppl_docs : args.ppl_docs + args.tune_docs]]
    eos = eos_id(tok)

    # 2. the precise judge
    fit = set(clf_docs.tolist())
    wrng = np.random.default_rng(args.seed + 15)
    pool = [int(j) for j in wrng.permutation(np.nonzero(~topic & trained)[0]) if int(j) not in fit]

    def windows(doc_ids: list[int]) -> list[str]:
        out = []
        for i in doc_ids:
            t = tok.encode(docs["text"][i]).ids
            for _ in range(WINDOWS_PER_DOC):
                at = int(wrng.integers(0, max(1, len(t) - args.new_tokens + 1)))
                out.append(tok.decode(t[at : at + args.new_tokens]))
        return out

    cal_p = clf.proba(windows(pool[:CAL_DOCS]))
    check_p = clf.proba(windows(pool[CAL_DOCS : CAL_DOCS + CHECK_DOCS]))
    topic_w = clf.proba(windows([int(j) for j in np.nonzero(topic & trained & half)[0]]))
    judges = {"precise": float(np.quantile(cal_p, 1 - PRECISE_FP)), "one_percent": float(np.quantile(cal_p, 0.99))}
    judge_info = {name: {"threshold": round(t, 4), "calibration_windows": len(cal_p),
                         "false_positive_rate_check_windows": round(float((check_p > t).mean()), 5),
                         "check_windows": len(check_p),
                         "recall_topic_windows": round(float((topic_w > t).mean()), 4)}
                  for name, t in judges.items()}
    print("judges", judge_info, flush=True)

    def judged(gens: list[list[int]]) -> dict[str, np.ndarray]:
        p = clf.proba([tok.decode(g) for g in gens])
        return {name: (p > t).astype(float) for name, t in judges.items()}

    def gen(prompt_ids: list[list[int]], n_s: int, seed: int, suppress: list[int] | None, cfg: dict) -> dict:
        t = time.perf_counter()
        gens = sample(model, prompt_ids, n_s, args.new_tokens, suppress, seed, eos, cfg.get("alpha", 0.0),
                      gate=cfg.get("gate"))
        out = judged(gens)
        print(f"  {len(gens)} generations in {time.perf_counter() - t:.0f} s; rates "
              + ", ".join(f"{k} {v.mean():.4f}" for k, v in out.items()), flush=True)
        return out

    # 3. tuning: the configuration
    tune_ids = [tok.encode(p).ids for p in TUNE_PROMPTS]
    tune_seed = args.seed + 15_485_863
    n_t = args.tune_samples
    print("tuning: base", flush=True)
    tb = gen(tune_ids, n_t, tune_seed, None, {})
    tune_base_ppl = perplexity(model, tune_docs, None)[0]
    tuning = []
    for name, cfg in CONFIGS.items():
        c_ppl = perplexity(model, tune_docs, ids, alpha=cfg.get("alpha", 0.0), gate=cfg.get("gate"))[0] / tune_base_ppl
        entry = {"config": name, "contrast_ppl_ratio": round(c_ppl, 5)}
        if c_ppl <= TUNE_PPL:
            print(f"tuning: {name} (contrast x{c_ppl:.4f})", flush=True)
            on = gen(tune_ids, n_t, tune_seed, ids, cfg)
            entry["precise_drop"] = rate_row(on["precise"], tb["precise"], len(tune_ids), n_t)["topic_rate_drop"]
        tuning.append(entry)
    chosen = choose(tuning)
    print("chosen", chosen, flush=True)

    # 4. the fresh report split
    rep_ids = [tok.encode(p).ids for p in FRESH_PROMPTS[: args.prompts]]
    n_p, n_s = len(rep_ids), args.samples
    rep_seed = args.seed + 32_452_843
    print("report: base", flush=True)
    rb = gen(rep_ids, n_s, rep_seed, None, {})
    base_ppl, base_docs = perplexity(model, other_ids, None)

    def report(suppress: list[int], cfg: dict) -> dict:
        on = gen(rep_ids, n_s, rep_seed, suppress, cfg)
        ppl, per_doc = perplexity(model, other_ids, suppress, alpha=cfg.get("alpha", 0.0), gate=cfg.get("gate"))
        return {**{f"{j}_judge": rate_row(on[j], rb[j], n_p, n_s) for j in judges},
                "other_ppl_ratio": round(ppl / base_ppl, 4), "other_ppl_ratio_ci": boot_ppl_ratio(base_docs, per_doc)}

    rows = {}
    for name, cfg in CONFIGS.items():
        print(f"report: {name}", flush=True)
        rows[name] = report(ids, cfg)
    control_row = None
    if chosen:
        print(f"report: random control, {chosen}", flush=True)
        control_row = report(control, CONFIGS[chosen])
    prim = rows[chosen] if chosen else None
    res = {
        "topic": st["topic"], "set": ids, "set_source": f"{args.steering} select_effect.prototypes (step 6)",
        "share_of_bank": round(len(ids) / model.cfg.n_prototypes, 4),
        "control_prototypes": control, "judges": judge_info, "precise_false_positive_target": PRECISE_FP,
        "configs": CONFIGS, "gate_window": GATE_WINDOW,
        "rule": (f"configuration chosen on the tuning prompts: among those whose tuning contrast perplexity stays within "
                 f"{TUNE_PPL}, the largest drop under the precise judge; report on {n_p} fresh prompts x {n_s} samples"),
        "tuning": {"prompts": len(tune_ids), "samples_per_prompt": n_t,
                   "topic_rate_base": {j: round(float(v.mean()), 4) for j, v in tb.items()}, "configs": tuning,
                   "chosen": chosen},
        "report": {"prompts": n_p, "samples_per_prompt": n_s, "generations": n_p * n_s,
                   "topic_rate_base": {j: round(float(v.mean()), 4) for j, v in rb.items()},
                   "largest_drop_at_floor": {j: round(1 - judge_info[j]["false_positive_rate_check_windows"]
                                                      / max(float(rb[j].mean()), 1e-9), 4) for j in judges},
                   "other_ppl_base": round(base_ppl, 4), "configs": rows, "control_random": control_row},
        "primary": ({"config": chosen, "topic_rate_drop": prim["precise_judge"]["topic_rate_drop"],
                     "topic_rate_drop_ci": prim["precise_judge"]["topic_rate_drop_ci"],
                     "other_ppl_ratio": prim["other_ppl_ratio"], "other_ppl_ratio_ci": prim["other_ppl_ratio_ci"]}
                    if prim else None),
        "targets": {"topic_rate_drop": 0.75, "other_ppl_ratio": 1.02, "share_of_bank": 0.02},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return finish(res, "steering_precise.py", argv, args.out)


if __name__ == "__main__":
    main()
