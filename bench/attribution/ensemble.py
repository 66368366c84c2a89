"""The checkpoint-ensemble lever on the tuning split (issue: LDS at or above EK-FAC).

The evaluation model of a ``run_eval.py`` work folder keeps one checkpoint. This trains it again with
the same configuration and seed, keeping checkpoints at a third and two thirds of its steps (the
trainer's batches depend only on the seed and the step, so the run is the same one; the final
weights are compared with the evaluated model's and the comparison is reported), indexes the corpus
with each intermediate checkpoint (the index's default settings, as the evaluated index), and scores
every (query, document) pair exactly under each checkpoint with its own prototypes and curvature.

Primary setting, fixed before any number was seen: the mean over the checkpoints at 1/3, 2/3 and
the end of training of each checkpoint's ``cosine_max`` document score (cosines are scale-free, so
a plain mean weighs the checkpoints alike), against the final checkpoint alone at the same
settings, with a paired bootstrap over the tuning split's subsets and queries. Ablations: the last
two checkpoints only; the same mean for ``cosine_top4``, ``cosine_sum`` and ``raw_sum`` (raw scores
standardised per checkpoint and query before the mean, since their scale changes with training).

    python -m bench.attribution.ensemble --work runs/bench_lds_fresh --seed 1

Writes ``bench/results/attribution_ensemble.json``; caches each checkpoint's scores in the work
folder (``ensemble_step_<n>.npz``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import finish, index_complete, index_documents
from bench.attribution.lds_report import interval, splits, top_only
from bench.attribution.levers import Segments, aggregate, corpus_pass, token_scores
from prism_tda.engine import Attributor, QuerySpec

AGGS = ("cosine_max", "cosine_top4", "cosine_sum", "raw_sum")


def retrain(work: Path, at: list[int], steps: int) -> Path:
    """The evaluation model trained again, keeping a checkpoint at each of ``at``."""
    from bench.attribution.run_eval import MODEL
    from prism_tda.cli import build_configs
    from prism_tda.model.train import Trainer

    out = work / "model_ckpts"
    if (out / "latest").exists():
        return out
    every = int(np.gcd.reduce([*at, steps]))
    model_cfg, train_cfg = build_configs("tiny", None, [*MODEL, f"train.max_steps={steps}",
                                                        f"train.ckpt_every={every}", "train.keep_checkpoints=100"])
    Trainer(model_cfg, train_cfg, [str(work / "corpus.jsonl")], out, tokenizer_path=work / "tokenizer.json",
            progress=True).setup().fit()
    return out


def same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def checkpoint_scores(index: Path, queries: list[dict], cache: Path) -> dict[str, np.ndarray]:
    """Every query's document scores under each aggregation, exact, at the index's own settings."""
    if cache.exists():
        z = np.load(cache)
        return {a: z[a] for a in z.files}
    att = Attributor.open(index)
    enc = [att.encode(QuerySpec(q["prompt"], q["completion"])) for q in queries]
    with torch.no_grad():
        ct = corpus_pass(att)
    pre = att.preconditioner()
    raws, I_qs, t_self, _ = token_scores(ct, enc, pre, (), {}, [], match=False)
    seg = Segments(ct.docs, att.reader.n_docs)
    taus = {"q50": float(np.percentile(t_self, 50))}
    per = [aggregate(seg, r, iq, t_self, taus, None) for r, iq in zip(raws, I_qs, strict=True)]
    got = {a: np.stack([p[a] for p in per]).astype(np.float32) for a in AGGS}
    np.savez(cache, **got)
    return got


def standardised(S: np.ndarray) -> np.ndarray:
    """Each query's scores over documents to zero mean and unit deviation."""
    S = S.astype(np.float64)
    return (S - S.mean(1, keepdims=True)) / np.maximum(S.std(1, keepdims=True), 1e-30)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/bench_lds_fresh")
    ap.add_argument("--subsets", type=int, default=48)
    ap.add_argument("--tune-subsets", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1, help="as given to run_eval.py (subset draws)")
    ap.add_argument("--boot", type=int, default=1000)
    ap.add_argument("--out", default="bench/results/attribution_ensemble.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    work = Path(args.work)
    queries = json.loads((work / "queries.json").read_text())
    final = Path((work / "model" / "latest").read_text().strip())
    final = final if final.is_absolute() else work / "model" / final
    steps = int(final.name.split("_")[1])
    at = [steps // 3, 2 * steps // 3]
    t0 = time.perf_counter()
    ck_dir = retrain(work, at, steps)
    train_s = time.perf_counter() - t0
    from prism_tda.indexer.run import build_index

    indexes = {}
    index_s = {}
    for s in at:
        idx = work / f"index_step_{s}"
        if not index_complete(idx):
            t1 = time.perf_counter()
            build_index(ck_dir / f"step_{s:07d}", [str(work / "train.jsonl")], idx, progress=True)
            index_s[s] = round(time.perf_counter() - t1, 1)
        indexes[s] = idx
    indexes[steps] = work / "index"
    ext = index_documents(work / "index", ["external_id"])["external_id"]
    for idx in indexes.values():
        assert index_documents(idx, ["external_id"])["external_id"] == ext, f"{idx}: other documents"
    per_ck = {s: checkpoint_scores(idx, queries, work / f"ensemble_step_{s}.npz") for s, idx in indexes.items()}

    tune, _ = splits(work, queries, len(ext), args.subsets, args.tune_subsets, args.seed)
    draws = tune.draws(args.boot, args.seed + 11)
    base = per_ck[steps]["cosine_max"]
    boot_base = tune.boot(base, draws)

    def row(S: np.ndarray) -> dict:
        out = {}
        for k in (None, 128):
            Sk = top_only(S, k)
            point, b = tune.lds(Sk), tune.boot(Sk, draws)
            out[f"returned_{k or 'all'}"] = {"lds_tune": interval(point, b),
                                             "diff_vs_final_cosine_max": interval(point - tune.lds(base), b - boot_base)}
        return out

    def mean_of(ck: list[int], agg: str) -> np.ndarray:
        mats = [per_ck[s][agg] for s in ck]
        if agg.startswith("raw"):
            mats = [standardised(m) for m in mats]
        return np.mean(mats, axis=0)

    table = {}
    for agg in AGGS:
        table[f"final/{agg}"] = row(per_ck[steps][agg])
        for s in at:
            table[f"step_{s}/{agg}"] = row(per_ck[s][agg])
        table[f"ensemble_3/{agg}"] = row(mean_of([*at, steps], agg))
        table[f"ensemble_2/{agg}"] = row(mean_of([at[1], steps], agg))
    res = {
        "work": str(work), "checkpoints": [*at, steps],
        "retrained_final_equals_evaluated": same_weights(ck_dir / f"step_{steps:07d}", final),
        "train_seconds": round(train_s, 1), "index_seconds": index_s,
        "tune_split": {"subsets": args.tune_subsets, "queries": len(tune.queries)},
        "primary": {"setting": "ensemble_3/cosine_max", **table["ensemble_3/cosine_max"]["returned_all"]},
        "final_cosine_max": table["final/cosine_max"]["returned_all"],
        "table": table,
    }
    return finish(res, "attribution/ensemble.py", argv, args.out)


if __name__ == "__main__":
    main()
