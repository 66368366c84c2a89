"""The compiled scoring of stored codes (``engine/kernels.py``: ``code_terms``) against the same kernel
at an earlier revision of the repository, in one process on the demo index.

1. **Whole queries**, as ``bench/rerank_forward_ab.py`` asks them (the same prompts, each query once per
   arm per repeat, the arm order alternating): the engine's ``code_terms`` is swapped for the
   baseline's. Per arm the median and p90 of the wall time and of the two stages that run the kernel
   (candidates, shortlist); the paired difference of the per-query medians with a 95% bootstrap
   interval; whether both arms return the same documents in the same order.
2. **The kernel alone**, on every call the current arm made for the first queries (their arguments
   copied): nanoseconds per scored row on one thread, both kernels alternating call by call, and
   whether they write the same activations and terms, bit for bit, with the shard's rows read in
   place and copied out first (``gather``).

    python -m bench.kernel_ab --index runs/demo/index --baseline-rev 09fbc24

The baseline is the file ``prism_tda/engine/kernels.py`` as ``git show <rev>:`` gives it, loaded as a
module of its own; it must take the arguments the current one takes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import prism_tda.engine.reader as reader_mod
from bench._common import add_demo_query_args, demo_queries, finish, interleaved_queries, paired_summary
from prism_tda.engine.kernels import code_terms

STAGES = ("candidates", "shortlist", "total")
OUTS = (17, 18, 19)  # code_terms's output arrays: prototypes, activations, terms


def baseline_kernel(rev: str, where: Path):
    """``code_terms`` of ``prism_tda/engine/kernels.py`` at the git revision ``rev``."""
    root = Path(__file__).resolve().parent.parent
    try:
        src = subprocess.run(["git", "show", f"{rev}:prism_tda/engine/kernels.py"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"--baseline-rev {rev}: no prism_tda/engine/kernels.py there ({e})") from e
    path = where / "kernels_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("kernels_baseline", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.code_terms


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_demo_query_args(ap, "bench/results/kernel_ab.json", repeats=5)
    ap.add_argument("--baseline-rev", required=True, help="git revision whose kernels.py is the baseline")
    ap.add_argument("--kernel-queries", type=int, default=4, help="queries whose kernel calls are timed alone")
    ap.add_argument("--kernel-repeats", type=int, default=20)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = baseline_kernel(args.baseline_rev, Path(tmp))
        kernels = {"baseline": base, "current": code_terms}
        att, specs, opt = demo_queries(args)
        was = reader_mod.code_terms

        def arm(fn):
            def put() -> None:
                reader_mod.code_terms = fn
            return put

        # 2 first: the current kernel's calls on the first queries, their arguments copied
        calls: list[list] = []

        def record(*a):
            calls.append([x.copy() if isinstance(x, np.ndarray) else x for x in a])
            return code_terms(*a)

        try:
            reader_mod.code_terms = record
            for s in specs[: args.kernel_queries]:
                att.attribute(s, opt)
            times, answers = interleaved_queries(att, specs, opt, {k: arm(f) for k, f in kernels.items()},
                                                 args.repeats, STAGES)
        finally:
            reader_mod.code_terms = was
        ab = paired_summary(times, answers, ("wall", *STAGES))
        torch.set_num_threads(1)
        rows = sum(len(c[0]) for c in calls)
        ns = {k: [] for k in kernels}
        same = True
        for c in calls:
            outs = {}
            for gather in (False, True):
                for name, fn in kernels.items():
                    a = list(c)
                    a[-1] = gather
                    for j in OUTS:
                        a[j] = np.zeros_like(c[j])
                    fn(*a)
                    outs[name, gather] = [a[j] for j in OUTS]
            first = next(iter(outs.values()))
            same &= all(np.array_equal(x, y) for v in outs.values() for x, y in zip(first, v, strict=True))
            per = {k: [] for k in kernels}
            for _ in range(args.kernel_repeats):
                for name, fn in kernels.items():
                    t0 = time.perf_counter()
                    fn(*c)
                    per[name].append(time.perf_counter() - t0)
            for k in kernels:
                ns[k].append(1e9 * float(np.median(per[k])))  # per call
        torch.set_num_threads(os.cpu_count() or 1)
    per_row = {k: round(sum(v) / max(rows, 1), 1) for k, v in ns.items()}
    res = {
        "index": args.index, "tokens": att.reader.n_tokens, "baseline_rev": args.baseline_rev,
        "queries": len(specs), "repeats": args.repeats,
        "arms": ab["arms"], "diff_current_minus_baseline": ab["diff"],
        "same_documents_and_order": ab["same_documents_and_order"], "max_score_diff": ab["max_score_diff"],
        "kernel_alone": {"calls": len(calls), "rows": rows, "ns_per_row_one_thread": per_row,
                         "ratio_current_to_baseline": round(per_row["current"] / max(per_row["baseline"], 1e-9), 3),
                         "same_outputs_bitwise": bool(same)},
        "torch_threads": torch.get_num_threads(),
    }
    return finish(res, "kernel_ab.py", argv, args.out)


if __name__ == "__main__":
    main()
